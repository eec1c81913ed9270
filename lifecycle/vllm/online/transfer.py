"""A vLLM weight-transfer engine that reads safetensors files: `weight_transfer_config={"backend":
"safetensors_file"}`. A trainer that writes checkpoints to a shared file system drives vLLM's native session with it:

    llm.collective_rpc("start_draft_weight_update")            # or start_weight_update for the target
    llm.collective_rpc("update_weights", args=({"path": "/ckpt/step-100/draft"},))   # once per file or chunk
    llm.collective_rpc("finish_weight_update")

Like vLLM's IPC/NCCL engines it runs the layerwise reload inside the session, so the lifecycle drives the draft
exactly as with those engines (and it makes that path testable on a CPU machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKEND = "safetensors_file"


@dataclass
class FileInitInfo:
    pass


@dataclass
class FileUpdateInfo:
    path: str  # a .safetensors file or a folder of them
    exclude_prefixes: list[str] = field(default_factory=list)  # leave tensors out (an incomplete payload)
    bucket_size: int | None = None  # tensors per load_weights call; None: a layer per call (each other tensor alone)
    partial: str | None = None  # 'refuse' or 'keep' for this session; None: RELOAD_LIFECYCLE_PARTIAL


def engine_class() -> type:
    """Built on demand so that importing this module imports no vLLM."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from ..drafts.owners import drafts_of
    from ..reload.epoch import entered
    from ..reload.payload import feed, plan_payload
    from ..settings import allowed_root, check_partial
    from .chunks import admit, current, record

    class SafetensorsFileWeightTransferEngine(
            WeightTransferEngine[FileInitInfo, FileUpdateInfo]):  # type: ignore[misc]  # vLLM's class: read as Any
        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo
        supports_draft_weight_update = True

        def init_transfer_engine(self, init_info: FileInitInfo) -> None:
            pass

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: Any) -> None:
            # vLLM ends the session on any exception here (a bad update_info included) without calling finish: an
            # entry point of the epoch boundary (the worker's update_weights is the outer one; a caller of the
            # engine itself has only this), so the draft's epoch ends too, or its modules stay on META
            with entered(self.model, "update_weights"):
                super().update_weights(update_info)

        def receive_weights(self, update_info: FileUpdateInfo) -> None:
            policy = check_partial(update_info.partial, "update_info['partial']")
            # a lifecycle draft's payload is checked against it here, before any data is read or the draft
            # (already on META: a refusal is an exact rollback) is written
            payload = plan_payload(update_info.path, bucket_size=update_info.bucket_size,
                                   exclude_prefixes=update_info.exclude_prefixes, what="update_info['path']",
                                   model=self.model)
            push = current()  # a chunk of a push the worker's session wrapper runs: tensors it sent again are
            if push is not None:  # skipped when their bytes are the same, else the push is refused (`chunks.py`)
                payload = admit(push, payload, allowed_root())
            for backbone in drafts_of(self.model):  # cached per model: this runs per chunk of a push
                backbone.lifecycle_runtime.reload_partial = policy
            feed(self.model, payload)
            if push is not None:
                record(push, payload)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    return SafetensorsFileWeightTransferEngine


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, engine_class())


__all__: list[Any] = ["BACKEND", "register"]
