"""The worker RPCs of the reload side (`ReloadRPCs`); `lifecycle.vllm.worker.LifecycleWorkerExtension` mixes them
with the observability RPC into the class trainers name.

RPCs for trainers: pass `worker_extension_cls="lifecycle.vllm.worker.LifecycleWorkerExtension"` to `LLM(...)` and
call them with `llm.collective_rpc("lifecycle_states")` (one answer per worker rank). Every answer is plain data
(it crosses process boundaries): no tensors. Every answer says which worker gave it, so the answers of several
nodes can be told apart and merged: a list answer's items each carry `rank` and `node` (the host name); a
per-backbone answer is `{"rank": r, "node": host, "backbones": {backbone: ...}}`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from ...errors import MESSAGE_ITEMS_CAP
from ...events import host_name
from ...storage import StorageIdentity
from ...torch_private import own_buffers
from ...types import capped
from ..drafts.owners import VLLMDraftBackbone, backbones_in, draft_model_of
from ..reload.epoch import entered
from ..reload.payload import feed, plan_payload
from ..settings import PartialPolicy, check_partial

__all__ = ["ReloadRPCs", "draft_model_of"]


class ReloadRPCs:
    """Mixed into vLLM's worker class (through `lifecycle.vllm.worker.LifecycleWorkerExtension`); `self` is the
    worker."""

    # what the worker this is mixed into has (vLLM's `WorkerBase`): declared for the type checker only
    model_runner: Any
    rank: int
    vllm_config: Any

    # ---- discovery ----------------------------------------------------------------------------------------
    def _lifecycle_models(self) -> dict[str, Any]:
        runner = self.model_runner
        models = {"target": runner.get_model()}
        draft = draft_model_of(runner)
        if draft is not None:
            models["draft"] = draft
        return models

    def _lifecycle_backbones(self) -> list[tuple[str, VLLMDraftBackbone]]:
        return [(role, b) for role, model in self._lifecycle_models().items() for b in backbones_in(model)]

    def _lifecycle_worker(self) -> dict[str, Any]:
        """Which worker answers: its global rank (vLLM's `WorkerBase.rank`) and its node's host name."""
        return {"rank": self.rank, "node": host_name()}

    # ---- RPCs ---------------------------------------------------------------------------------------------
    def lifecycle_states(self) -> list[dict[str, Any]]:
        """State, epoch, readiness, pinning and derived-buffer identities of every lifecycle backbone here."""
        out = []
        node = host_name()
        for role, b in self._lifecycle_backbones():
            lc = b.lifecycle
            derived = {}
            for name in b.derived_buffer_names():
                t = own_buffers(b).get(name)
                derived[name] = None if t is None else StorageIdentity.of(t).as_log()
            out.append({
                "role": role, "backbone": lc.name, "rank": lc.rank, "node": node, "state": lc.state.value,
                "epoch": lc.epoch,
                "layers_ready": lc.readiness.layers_ready, "layers_total": lc.readiness.layers_total,
                "pinned": len(lc.pinned) if lc.pinned else 0, "quarantine_reason": lc.quarantine_reason,
                "fallbacks": b.derived_fallbacks, "derived": derived,
            })
        return out

    def lifecycle_events(self, last: int = 100) -> list[dict[str, Any]]:
        """The last `last` audit events of every backbone here (each carries backbone, rank and epoch, bounded as
        written; once an audit write failed in this process, `sink_failures` says how many have)."""
        if type(last) is not int or last < 0:
            raise ValueError(f"lifecycle_events: last must be an int >= 0, got {last!r:.80}")
        events: list[dict[str, Any]] = []
        node = host_name()
        for _, b in self._lifecycle_backbones():
            kept = b.lifecycle.recent_events
            events.extend({**e, "node": node} for e in list(kept)[len(kept) - min(last, len(kept)):])
        return events

    def _lifecycle_per_backbone(self, backbones: dict[str, Any]) -> dict[str, Any]:
        return {**self._lifecycle_worker(), "backbones": backbones}

    def lifecycle_pin(self) -> dict[str, Any]:
        """Pin the storage identity of every draft tensor now (what `capture_graphs` does): later reloads must
        keep every pinned address or refuse. On CUDA, call it after vLLM captured its graphs.
        {"rank", "node", "backbones": {backbone: tensors pinned}}."""
        pinned = {b.lifecycle.name: b.capture_graphs() for _, b in self._lifecycle_backbones()
                  if b.lifecycle.can("capture_graphs")}
        return self._lifecycle_per_backbone(pinned)

    def lifecycle_verify(self) -> dict[str, Any]:
        """Check every pinned identity against the live tensors. {"rank", "node", "backbones": {backbone: {"ok",
        "checked", "problems", "problems_more"}}}."""
        out: dict[str, Any] = {}
        for _, b in self._lifecycle_backbones():
            problems = b.lifecycle.pinned_changes()
            shown, more = capped(problems, MESSAGE_ITEMS_CAP)
            out[b.lifecycle.name] = {"ok": not problems, "checked": len(b.lifecycle.pinned or ()),
                                     "problems": shown, "problems_more": more}
        return self._lifecycle_per_backbone(out)

    def lifecycle_derived_digests(self) -> dict[str, Any]:
        """sha256 of every derived buffer's bytes: compare two engines bit for bit without moving tensors.
        {"rank", "node", "backbones": {backbone: {buffer: sha256}}}."""
        out: dict[str, Any] = {}
        for _, b in self._lifecycle_backbones():
            digests = {}
            for name in b.derived_buffer_names():
                t = own_buffers(b).get(name)
                digests[name] = "none" if t is None else hashlib.sha256(
                    t.detach().contiguous().cpu().view(-1).view(dtype=_byte_dtype()).numpy().tobytes()).hexdigest()
            out[b.lifecycle.name] = digests
        return self._lifecycle_per_backbone(out)

    def lifecycle_note_weight_version(self, weight_version: str | None) -> dict[str, Any]:
        """The trainer's `weight_version` of the weight-update session about to finish (the plugin's finish
        wrappers send it first: vLLM tells the workers nothing of it); audited in the draft's reload epoch.
        {"rank", "node", "weight_version"}."""
        from .sessions import note_weight_version

        note_weight_version(self, weight_version)
        return {**self._lifecycle_worker(), "weight_version": weight_version}

    def lifecycle_take_over_push(self, push: str) -> dict[str, Any]:
        """End the open draft push named `push` at once (its name as a refused start gives it, `epoch N`, or its
        push id), whatever its idle time: it ends as an abandoned push does (audited `weight_update_session_ended`,
        outcome `taken_over`) and the next start proceeds. Refused, nothing changed, when no draft push is open or
        another one is. {"rank", "node", "taken_over", "push_id"}."""
        from .sessions import take_over

        return {**self._lifecycle_worker(), **take_over(self, push)}

    def reload_draft_weights(self, weights_path: str, bucket_size: int | None = None, shuffle: bool = False,
                             seed: int = 0, exclude_prefixes: Iterable[str] = (),
                             partial: PartialPolicy | None = None) -> dict[str, Any]:
        """Reload the draft from a safetensors file or folder through vLLM's layerwise reload, in buckets of
        `bucket_size` tensors (None: a layer per bucket, each other tensor alone), optionally shuffled, leaving
        out names that start with one of `exclude_prefixes`. `partial`: what tensors the payload does not send
        do, 'refuse' (quarantine) or 'keep' (they keep their last values); None: the engine's
        `RELOAD_LIFECYCLE_PARTIAL`. vLLM 0.32's `reload_weights` reloads only the target.

        Every argument and the checkpoint's headers are checked before the draft is touched, and the payload
        against the draft from the headers alone (`expected.check_payload`: names, sizes), before any data is
        read (an error then changes nothing). A failure after that ends the reload epoch
        (`lifecycle.vllm.reload.epoch`): rolled back exactly when nothing was written yet, else the draft is
        quarantined and the engine serves without it; the error is raised either way, and the same call,
        corrected, works without a restart."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        draft = self._lifecycle_models().get("draft")
        if draft is None:
            raise RuntimeError("this engine has no draft model (speculative_config is not set)")
        policy = check_partial(partial)
        payload = plan_payload(weights_path, bucket_size=bucket_size, shuffle=shuffle, seed=seed,
                               exclude_prefixes=exclude_prefixes, model=draft)  # checked against the draft
        config = self.vllm_config.speculative_config.draft_model_config
        with entered(draft, "reload_draft_weights"):  # a failure from here on ends the epoch, once
            initialize_layerwise_reload(draft)  # the model is touched from here on
            for backbone in backbones_in(draft):
                backbone.lifecycle_runtime.reload_partial = policy
            feed(draft, payload)
            finalize_layerwise_reload(draft, config)
        return {"tensors": payload.tensors, "buckets": len(payload.buckets), "partial": policy,
                **self._lifecycle_worker()}


def _byte_dtype() -> Any:
    import torch

    return torch.uint8
