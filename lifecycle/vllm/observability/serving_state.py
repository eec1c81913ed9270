"""The worker's side of the metrics and the acceptance canary: one RPC the engine's front process calls
(`frontend.py`) after each weight call and on vLLM's periodic stats tick.

`lifecycle_serving_state(events=None)` writes the canary's audit events it is given through each draft backbone's
lifecycle (so they sit in the backbone's own stream, numbered and attributed to its epoch like every other event;
checked against the audit schema first and marked `origin: "rpc"`, `rpc_events.py`)
and answers, in plain data, what the metrics need of each draft backbone here: state, epoch, usable, quarantined,
drafting paused, the steps served without the draft and the bytes reloads wrote, both counted since the process
started. Cheap and bounded: a few fields per backbone; the bytes are summed once per epoch and then only for what
was written since the last call.

With each call the front process also hands the current serving period, as the final `acceptance` event it will
become (`at_stop`): the worker keeps the latest (checked like the events) and writes it when it stops
(`wrap_shutdown`, vLLM's `Worker.shutdown`, or at exit) unless the period ended first, so the period being served
when the server stops is in the audit, with its figures as of the last call (vLLM's stats tick pulls every
`VLLM_LOG_STATS_INTERVAL`, 10 s).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ...events import host_name
from ...states import LifecycleState
from ..drafts.families import SHADOW
from ..drafts.owners import VLLMDraftBackbone, backbones_in, draft_model_of
from ..drafts.runtime import WORKER
from ..online.pushes import push_name
from ..serving.gate import steps_without_draft_total
from .rpc_events import checked_events

__all__ = ["SERVING_RPC", "ServingStateRPC", "failure_class", "finish_report", "serving_state", "wrap_shutdown",
           "write_at_stop", "written_bytes_total"]

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


def _state(backbone: VLLMDraftBackbone, open_push: str | None) -> dict[str, Any]:
    lc, runtime = backbone.lifecycle, backbone.lifecycle_runtime
    paused = runtime.drafting_paused_steps
    return {"state": lc.state.value, "epoch": lc.epoch, "usable": lc.usable,
            # which push the draft serves, by the plugin's own name (a trainer may send no weight_version)
            "serving_push": push_name(runtime.serving_epoch), "serving_weight_version": runtime.serving_version,
            "open_push": open_push,
            "quarantined": lc.state is LifecycleState.QUARANTINED, "drafting_paused": paused is not None,
            "steps_without_draft": paused or 0, "steps_without_draft_total": steps_without_draft_total(backbone),
            "written_bytes_total": written_bytes_total(backbone), "quarantine_reason": lc.quarantine_reason,
            "failure": failure_class(lc.quarantine_reason)}


class ServingStateRPC:
    """Mixed into `LifecycleWorkerExtension` (so into vLLM's worker)."""

    vllm_config: Any
    rank: int

    def _lifecycle_backbones(self) -> list[tuple[str, VLLMDraftBackbone]]:
        raise NotImplementedError  # the worker extension's

    def lifecycle_serving_state(self, events: Sequence[Sequence[Any]] | None = None,
                                at_stop: Sequence[Sequence[Any]] | None = None) -> dict[str, Any]:
        """Write the canary's `events` (each `[event, level, fields]`, `fields["engine"]` the data-parallel engine
        it is about) on every draft backbone of this worker's engine, keep `at_stop` (the current period, written
        if the worker stops first), then answer
        `{"rank", "node", "backbones": {backbone: {state, epoch, usable, serving_push, serving_weight_version,
        open_push, quarantined, drafting_paused, steps_without_draft, steps_without_draft_total,
        written_bytes_total, quarantine_reason, failure}}}`: `serving_push` names the push whose weights the draft
        serves (`epoch N`, the reload epoch that last finished; 0 the cold load), `open_push` the push in progress."""
        drafts = [b for role, b in self._lifecycle_backbones() if role == "draft"]
        return serving_state(self, drafts, events, at_stop)


def serving_state(worker: Any, drafts: Sequence[VLLMDraftBackbone], events: object = None,
                  at_stop: object = None) -> dict[str, Any]:
    """Write the canary's `events` for this worker's data-parallel engine on each of `drafts`, keep `at_stop`,
    then answer their state (`ServingStateRPC.lifecycle_serving_state`'s answer)."""
    checked = checked_events(events, SERVING_RPC)  # validated against the audit schema, marked origin="rpc"
    kept = checked_events(at_stop, f"{SERVING_RPC} at_stop")
    if any(name != "acceptance" for name, _, _ in kept):
        raise ValueError(f"{SERVING_RPC}: at_stop holds acceptance events only; nothing was written")
    engine = getattr(getattr(worker.vllm_config, "parallel_config", None), "data_parallel_rank", 0) or 0
    ended = set()
    for name, level, fields in checked:
        if fields.get("engine", 0) != engine:
            continue
        for backbone in drafts:
            backbone.lifecycle.audit_event(name, level=level, **fields)
        if name == "acceptance" and fields.get("final"):
            ended.add(fields.get("period"))
    for backbone in drafts:
        runtime = backbone.lifecycle_runtime
        if at_stop is not None:
            runtime.at_stop = [e for e in kept if e[2].get("engine", 0) == engine]
        runtime.at_stop = [e for e in runtime.at_stop if e[2].get("period") not in ended]  # its final event came
        if runtime.at_stop:
            _write_at_exit()
    push = WORKER.sessions.get(worker) if getattr(worker, "_weight_update_active", False) else None
    open_push = push.identity if push is not None else None
    return {"rank": worker.rank, "node": host_name(),
            "backbones": {b.lifecycle.name: _state(b, open_push) for b in drafts}}


def finish_report(worker: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """What a worker's finish answers the front process (`WorkerRuntime.finish_report`, set at activation): the
    serving state after the finish, the events the call carried written first; one round trip, not a pull."""
    return serving_state(worker, backbones_in(draft_model_of(worker.model_runner)), options.get("events"),
                         options.get("at_stop"))


def write_at_stop(drafts: Iterable[VLLMDraftBackbone] | None = None) -> None:
    """Write the serving period the front process handed last (`at_stop`) on each of `drafts` (default: every live
    draft), once: each draft only its own engine's period."""
    for backbone in list(WORKER.drafts) if drafts is None else list(drafts):
        runtime = backbone.lifecycle_runtime
        events, runtime.at_stop = runtime.at_stop, []
        for name, level, fields in events:
            backbone.lifecycle.audit_event(name, level=level, **fields)


_AT_EXIT: list[bool] = []


def _write_at_exit() -> None:
    """At exit too (a worker that never runs vLLM's shutdown: an offline engine in the caller's process); once."""
    if not _AT_EXIT:
        _AT_EXIT.append(True)
        atexit.register(write_at_stop)  # after the audit's own exit flush is registered: runs before it


def wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `Worker.shutdown` (a stopping server, a SIGTERM): the serving period is written first."""
    def shutdown(worker: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):  # the audit must never stop vLLM's shutdown
            draft = draft_model_of(worker.model_runner)
            write_at_stop(backbones_in(draft) if draft is not None else [])
        return original(worker, *args, **kwargs)

    return shutdown
