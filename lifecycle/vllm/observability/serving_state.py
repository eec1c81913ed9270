"""The worker's side of the metrics and the acceptance canary: one RPC the engine's front process calls
(`frontend.py`) after each weight call and on vLLM's periodic stats tick.

`lifecycle_serving_state(events=None)` writes the canary's audit events it is given through each draft backbone's
lifecycle (so they sit in the backbone's own stream, numbered and attributed to its epoch like every other event)
and answers, in plain data, what the metrics need of each draft backbone here: state, epoch, usable, quarantined,
drafting paused, the steps served without the draft and the bytes reloads wrote, both counted since the process
started. Cheap and bounded: a few fields per backbone; the bytes are summed once per epoch and then only for what
was written since the last call.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ...events import host_name
from ...states import LifecycleState
from ..drafts.families import SHADOW
from ..drafts.owners import VLLMDraftBackbone, backbones_in, draft_model_of
from ..serving.gate import steps_without_draft_total
from .canary import CANARY_EVENTS

__all__ = ["SERVING_RPC", "ServingStateRPC", "failure_class", "finish_report", "serving_state", "written_bytes_total"]

#: The RPC's name (the front process skips it in its own bookkeeping).
SERVING_RPC = "lifecycle_serving_state"
_CLASS = re.compile(r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception))\b")

def written_bytes_total(backbone: VLLMDraftBackbone) -> int:
    """Bytes of the draft's checkpoint tensors that reloads (epoch >= 1) wrote since the process started: what
    each epoch wrote, a failed one included (the shadows, copies of written rows, are not counted)."""
    lc, counted = backbone.lifecycle, backbone.lifecycle_runtime.written
    epoch, names = lc.epoch, lc.readiness.written
    if epoch != counted.epoch:
        counted.epoch, counted.tensors, counted.before, counted.bytes = epoch, 0, counted.before + counted.bytes, 0
    if epoch >= 1 and len(names) != counted.tensors:
        specs = lc.specs
        counted.tensors, counted.bytes = len(names), sum(
            math.prod(specs[n].shape) * specs[n].dtype.itemsize for n in names if n in specs and not n.endswith(SHADOW))
    return counted.before + counted.bytes


def failure_class(reason: str | None) -> str | None:
    """The error class a quarantine reason names ("finalize_layerwise_reload failed: LayersNotReadyError: ...")."""
    m = _CLASS.search(reason or "")
    return m.group(1) if m else None


def _state(backbone: VLLMDraftBackbone) -> dict[str, Any]:
    lc = backbone.lifecycle
    paused = backbone.lifecycle_runtime.drafting_paused_steps
    return {"state": lc.state.value, "epoch": lc.epoch, "usable": lc.usable,
            "quarantined": lc.state is LifecycleState.QUARANTINED, "drafting_paused": paused is not None,
            "steps_without_draft": paused or 0, "steps_without_draft_total": steps_without_draft_total(backbone),
            "written_bytes_total": written_bytes_total(backbone), "quarantine_reason": lc.quarantine_reason,
            "failure": failure_class(lc.quarantine_reason)}


def _checked_events(events: object) -> list[tuple[str, str, dict[str, Any]]]:
    """[(event, level, fields)] as the front process sends them; anything else is refused before one is written."""
    if events is None:
        return []
    if not isinstance(events, Sequence) or isinstance(events, (str, bytes)):
        raise TypeError(f"{SERVING_RPC}: events must be a list of [event, level, fields], got {type(events).__name__}")
    out = []
    for i, item in enumerate(events):
        if not (isinstance(item, Sequence) and len(item) == 3 and item[0] in CANARY_EVENTS
                and item[1] == CANARY_EVENTS[item[0]] and isinstance(item[2], dict)):
            raise ValueError(f"{SERVING_RPC}: events[{i}] must be [event, level, fields] with event one of "
                             f"{', '.join(CANARY_EVENTS)} at its level, got {item!r:.120}; nothing was written")
        out.append((item[0], item[1], item[2]))
    return out


class ServingStateRPC:
    """Mixed into `LifecycleWorkerExtension` (so into vLLM's worker)."""

    vllm_config: Any
    rank: int

    def _lifecycle_backbones(self) -> list[tuple[str, VLLMDraftBackbone]]:
        raise NotImplementedError  # the worker extension's

    def lifecycle_serving_state(self, events: Sequence[Sequence[Any]] | None = None) -> dict[str, Any]:
        """Write the canary's `events` (each `[event, level, fields]`, `fields["engine"]` the data-parallel engine
        it is about) on every draft backbone of this worker's engine, then answer
        `{"rank", "node", "backbones": {backbone: {state, epoch, usable, quarantined, drafting_paused,
        steps_without_draft, steps_without_draft_total, written_bytes_total, quarantine_reason, failure}}}`."""
        drafts = [b for role, b in self._lifecycle_backbones() if role == "draft"]
        return serving_state(self, drafts, events)


def serving_state(worker: Any, drafts: Sequence[VLLMDraftBackbone], events: object = None) -> dict[str, Any]:
    """Write the canary's `events` for this worker's data-parallel engine on each of `drafts`, then answer their
    state (`ServingStateRPC.lifecycle_serving_state`'s answer)."""
    checked = _checked_events(events)
    engine = getattr(getattr(worker.vllm_config, "parallel_config", None), "data_parallel_rank", 0) or 0
    for name, level, fields in checked:
        if fields.get("engine", 0) != engine:
            continue
        for backbone in drafts:
            backbone.lifecycle.audit_event(name, level=level, **fields)
    return {"rank": worker.rank, "node": host_name(), "backbones": {b.lifecycle.name: _state(b) for b in drafts}}


def finish_report(worker: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """What a worker's finish answers the front process (`WorkerRuntime.finish_report`, set at activation): the
    serving state after the finish, the events the call carried written first; one round trip, not a pull."""
    return serving_state(worker, backbones_in(draft_model_of(worker.model_runner)), options.get("events"))
