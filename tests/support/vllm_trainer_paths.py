"""The ways RL trainers write new draft weights into vLLM, each written with vLLM's own functions only (what the
trainer calls), for a live engine's worker (`run_in_worker`, through `collective_rpc`) and for an in-process
draft (`support/vllm_inprocess.py`):

  one_call                    (i)   initialize_layerwise_reload -> one load_weights -> finalize_layerwise_reload
  buckets_later_layers_first  (ii)  the same, one bucket per layer, the last layer first, the rest last
  one_tensor_per_call         (iii) the same, one tensor per load_weights call, shuffled (OpenRLHF)
  plain_load_weights          (iv)  load_weights per bucket, no initialize_layerwise_reload, then
                                    process_weights_after_loading imported from model_loader.utils (older veRL,
                                    vLLM's weight-cache loaders)
  transfer_session            (v)   start_draft_weight_update -> update_weights -> finish_weight_update (SkyRL,
                                    NeMo-RL), with the plugin's safetensors_file transfer engine
  target_reload               (vi)  reload_weights of the TARGET; the draft must stay valid (it writes nothing)

Importing this module needs only the standard library and torch; vLLM is imported by each function.
"""

from __future__ import annotations

import random
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DRAFT_PATHS", "PATHS", "attempt", "buckets", "run_in_worker", "sync_target_in_worker", "write_draft"]

PATHS = ("one_call", "buckets_later_layers_first", "one_tensor_per_call", "plain_load_weights", "transfer_session",
         "target_reload")
#: The paths that write the draft (target_reload does not).
DRAFT_PATHS = PATHS[:-1]

Tensors = list[tuple[str, Any]]


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run `fn`; its value, or the error's type, message and the end of its traceback, as plain data."""
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e)[:2000],
                "trace": traceback.format_exc()[-1500:]}


def read(path: str | Path) -> Tensors:
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    return [item for f in files for item in load_file(str(f)).items()]


def buckets(tensors: Tensors, path: str, seed: int = 0) -> list[Tensors]:
    """How `path` splits a checkpoint into load_weights calls."""
    if path == "one_call":
        return [tensors]
    if path == "one_tensor_per_call":
        shuffled = list(tensors)
        random.Random(seed).shuffle(shuffled)
        return [[t] for t in shuffled]
    by_layer: dict[int, Tensors] = {}
    rest: Tensors = []
    for name, t in tensors:
        m = re.match(r"layers\.(\d+)\.", name)
        (by_layer.setdefault(int(m.group(1)), []) if m else rest).append((name, t))
    order = sorted(by_layer, reverse=path == "buckets_later_layers_first")
    groups = [by_layer[i] for i in order]
    return [*groups, rest] if path == "buckets_later_layers_first" else [rest, *groups]


def write_draft(draft: Any, model_config: Any, tensors: Tensors, path: str, *,
                session: Callable[[], None] | None = None, target_reload: Callable[[], None] | None = None,
                finalize: bool = True) -> int:
    """Write `tensors` into `draft` the way `path` does (`finalize=False`: stop before the call that finishes
    the load, as a trainer that crashed would). Returns the number of load_weights calls."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    if path == "transfer_session":
        assert session is not None, "the transfer session needs a worker (or an in-process transfer engine)"
        session()
        return 1
    if path == "target_reload":
        assert target_reload is not None
        target_reload()
        return 0
    calls = buckets(tensors, path)
    if path == "plain_load_weights":
        for bucket in calls:
            draft.load_weights(bucket)
        if finalize:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(draft, model_config, _device(draft))
        return len(calls)
    initialize_layerwise_reload(draft)
    for bucket in calls:
        draft.load_weights(bucket)
    if finalize:
        finalize_layerwise_reload(draft, model_config)
    return len(calls)


def _device(model: Any) -> Any:
    import torch

    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


# ---- on a live engine: run inside the worker through collective_rpc ------------------------------------------
def run_in_worker(worker: Any, path: str, weights: str, target: str = "", finalize: bool = True,
                  exclude: tuple[str, ...] = ()) -> int:
    """`llm.collective_rpc(run_in_worker, args=(path, weights_dir, target_dir))`: the trainer's calls, in the worker
    (`exclude`: checkpoint name prefixes the trainer does not send)."""
    from lifecycle.vllm.worker import draft_model_of

    draft = draft_model_of(worker.model_runner)
    model_config = worker.vllm_config.speculative_config.draft_model_config

    def session() -> None:
        worker.start_draft_weight_update()
        worker.update_weights({"path": weights})
        worker.finish_weight_update()

    def target_reload() -> None:
        worker.reload_weights(weights_path=target, is_checkpoint_format=True)

    tensors = read(weights) if path in DRAFT_PATHS and path != "transfer_session" else []
    tensors = [(n, t) for n, t in tensors if not n.startswith(exclude)] if exclude else tensors
    return write_draft(draft, model_config, tensors, path, session=session, target_reload=target_reload,
                       finalize=finalize)


def sync_target_in_worker(worker: Any, target: str) -> int:
    """veRL's sync of the TARGET into an engine started with `load_format="dummy"` (whose `reload_weights` vLLM
    refuses: "Model reloading with `dummy` format"): its own load_weights inside vLLM's layerwise reload."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    tensors = read(target)
    model.load_weights(tensors)
    finalize_layerwise_reload(model, worker.vllm_config.model_config)
    return len(tensors)
