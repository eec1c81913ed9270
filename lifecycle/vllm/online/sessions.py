"""vLLM's weight-update session, kept in step with the draft's reload epoch; the trainer's `weight_version` in the
audit; the plugin's refusals answered as HTTP errors that name them.

vLLM's worker holds one session (`Worker._weight_update_active`, `_weight_update_is_draft`): `_start_weight_update`
refuses while it is open, an exception in `update_weights` closes it, one in `finish_weight_update` does NOT (the
flag stays set and the transfer engine's target stays the draft). So a refused draft finish, or a trainer that died
between `/update_weights` and `/finish_weight_update`, left a session that refused every later start, the policy
sync's too, until a restart. The wrappers (worker side):

  Worker._start_weight_update   an open DRAFT session is abandoned: its epoch ends (`epochs.end_failed_epoch`:
                                an exact rollback when nothing was written, else quarantine), the end is audited
                                (`weight_update_session_ended`, outcome `abandoned`), vLLM's session is closed and
                                the new start proceeds, draft or policy. Unless it had a call less than
                                `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S` seconds ago (default 0: always): then
                                the start is refused, naming the open session, and nothing changes. An open
                                POLICY session is vLLM's (its target reload cannot be unwound without leaving a
                                target that mixes two checkpoints): refused, naming it.
  Worker.update_weights         a draft chunk that raises: the epoch ends (whatever the transfer engine), the end
                                is audited (outcome `refused`), and the error names what was refused
  Worker.finish_weight_update   a draft finish that raises: the epoch ends, vLLM's session is closed, audited
                                (outcome `refused`), the error names what was refused; a finish that succeeds
                                is audited (outcome `finished`)

Each refusal's message begins with `REFUSED`: a refused start or finish is a `WeightUpdateRefused`; a refused
chunk keeps its own class (`CheckpointError`, `ValueError`, ...: what callers caught before), its message
prefixed. In the API server process (the RL
routes call `AsyncLLM`) the wrappers of `AsyncLLM.start_weight_update`, `start_draft_weight_update`,
`update_weights` and `finish_weight_update` find that prefix in vLLM's wrapped error (it crosses two processes as
a string) and answer `GracefulHTTPError` with the plugin's message alone: 409 for a refused start, 422 for a refused
chunk or finish. vLLM's own handler answers it on the same connection (a raw exception reaches Starlette's
ServerErrorMiddleware, and uvicorn then closes the keep-alive connection under the trainer's next request).

`weight_version`: vLLM sets it in the engine core only after a successful finish, and never tells the workers.
The finish wrappers (`AsyncLLM`, and `LLM`'s for the offline path) send it first, through the worker RPC
`lifecycle_note_weight_version` (when the engine runs `LifecycleWorkerExtension`); a draft session then audits
`weight_version` in its epoch, and its `weight_update_session_ended` carries it.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ..compat.patching import write_private
from ..drafts.owners import backbones_in, draft_model_of
from ..reload.epochs import describe, end_failed_epoch
from ..settings import TAKEOVER_IDLE_ENV, takeover_idle_s  # the setting's record: settings.TAKEOVER_IDLE

__all__ = ["REFUSED", "TAKEOVER_IDLE_ENV", "WeightUpdateRefused", "note_weight_version",
           "takeover_idle_s"]

#: The start of every refusal message: the API server process finds it in vLLM's wrapped error.
REFUSED = "reload-lifecycle refused"
_NEXT = "the next start_draft_weight_update or start_weight_update proceeds"
_QUARANTINED = ("The session is closed: the engine serves the target's tokens without speculation until a complete "
                f"draft push succeeds; {_NEXT}.")
_ROLLED_BACK = (f"Nothing was written: the draft serves its last weights (rolled back exactly). The session is closed; "
                f"{_NEXT}.")
_DETAIL_CAP = 4000
_SESSION = "_lifecycle_session"  # the worker's attribute holding the open session's `Session`
_WORKER = "vllm.v1.worker.gpu_worker"
_ASYNC_LLM = "vllm.v1.engine.async_llm"
_OFFLINE = "vllm.entrypoints.rl.offline"
_EXTENSION = "lifecycle.vllm.worker.LifecycleWorkerExtension"


class WeightUpdateRefused(RuntimeError):
    """A weight-update call the plugin refused or ended; the message names what and says what state it left."""


@dataclass
class Session:
    """What the plugin keeps of the worker's open weight-update session (for the takeover rule and the audit)."""

    draft: bool
    started: float
    last_call: float
    chunks: int = 0
    weight_version: str | None = None

    def timing(self, now: float) -> dict[str, Any]:
        return {"chunks": self.chunks, "open_s": round(now - self.started, 3),
                "idle_s": round(now - self.last_call, 3), "weight_version": self.weight_version}


# ---- worker side ---------------------------------------------------------------------------------------------


def _session(worker: Any) -> Session | None:
    found: Session | None = worker.__dict__.get(_SESSION)
    return found


def _audit_end(worker: Any, session: Session | None, outcome: str, reason: str | None = None) -> None:
    if session is None or not session.draft:
        return
    fields = {**session.timing(time.monotonic()), "outcome": outcome, "reason": reason}
    for backbone in backbones_in(draft_model_of(worker.model_runner)):
        backbone.lifecycle.audit_event("weight_update_session_ended", level="info" if outcome == "finished"
                                       else "warning", **fields)


def _end_draft_session(worker: Any, outcome: str, reason: str) -> str:
    """End the draft's epoch (a no-op when the plugin already did), audit, close vLLM's session as its own
    successful finish does. Returns what that left, for the trainer's message."""
    draft = draft_model_of(worker.model_runner)
    try:
        if draft is not None:
            end_failed_epoch(draft, reason)
        _audit_end(worker, _session(worker), outcome, reason)
    finally:
        worker.__dict__.pop(_SESSION, None)
        if worker._weight_update_active:
            worker.weight_transfer_engine.reset_weight_update_target()
            write_private("Worker._weight_update_active", worker, False)
    serving = all(b.lifecycle.usable for b in backbones_in(draft)) if draft is not None else False
    return _ROLLED_BACK if serving else _QUARANTINED


def _detail(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= _DETAIL_CAP else text[:_DETAIL_CAP - 3] + "..."


def _start(original: Callable[..., Any]) -> Callable[..., Any]:
    def _start_weight_update(worker: Any, is_draft: bool = False) -> Any:
        if worker._weight_update_active:
            what = "start_draft_weight_update" if is_draft else "start_weight_update"
            session = _session(worker)
            now = time.monotonic()
            since = "" if session is None else (
                f" (opened {now - session.started:.1f} s ago, {session.chunks} update_weights chunk(s), its last "
                f"call {now - session.last_call:.1f} s ago)")
            if not worker._weight_update_is_draft:
                raise WeightUpdateRefused(
                    f"{REFUSED} {what}: a weight update of the TARGET is open{since}. reload-lifecycle ends "
                    "abandoned DRAFT sessions only (the target's reload is vLLM's: ending it half-way would leave a "
                    "target that mixes two checkpoints): call finish_weight_update first")
            minimum = takeover_idle_s()
            if session is not None and now - session.last_call < minimum:
                raise WeightUpdateRefused(
                    f"{REFUSED} {what}: a draft weight update is open{since}, and {TAKEOVER_IDLE_ENV}={minimum:g} "
                    f"takes an open session over only after {minimum:g} s without a call: finish it, or retry in "
                    f"{minimum - (now - session.last_call):.1f} s. Nothing was changed")
            _end_draft_session(worker, "abandoned",
                               f"abandoned: {what} began before finish_weight_update of the open draft session")
        result = original(worker, is_draft=is_draft)
        now = time.monotonic()
        worker.__dict__[_SESSION] = Session(draft=is_draft, started=now, last_call=now)
        return result

    return _start_weight_update


def _update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_weights(worker: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session(worker) if worker._weight_update_active else None
        try:
            result = original(worker, *args, **kwargs)
        except BaseException as e:
            if session is None or not session.draft or worker._weight_update_active:
                raise
            # vLLM closed its session; end the epoch too, whichever transfer engine ran the chunk
            left = _end_draft_session(worker, "refused", f"update_weights failed: {describe(e)}")
            if not isinstance(e, Exception):
                raise
            message = f"{REFUSED} the draft's update_weights chunk: {_detail(e)}\n{left}"
            if type(e).__str__ is BaseException.__str__:
                # the caller keeps the class it caught before (vLLM closed this session itself); only the message
                # says what was refused and what it left, for the trainer and the API process's 422
                e.args = (message,)
                raise
            raise WeightUpdateRefused(message) from e
        if session is not None:
            session.chunks += 1
            session.last_call = time.monotonic()
        return result

    return update_weights


def _finish(original: Callable[..., Any]) -> Callable[..., Any]:
    def finish_weight_update(worker: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session(worker) if worker._weight_update_active else None
        was_draft = worker._weight_update_active and worker._weight_update_is_draft
        try:
            result = original(worker, *args, **kwargs)
        except BaseException as e:
            if not (was_draft and worker._weight_update_active):
                raise
            left = _end_draft_session(worker, "refused", f"finish_weight_update failed: {describe(e)}")
            if not isinstance(e, Exception):
                raise
            raise WeightUpdateRefused(f"{REFUSED} the draft weight update: {_detail(e)}\n{left}") from e
        _audit_end(worker, session, "finished")
        worker.__dict__.pop(_SESSION, None)
        return result

    return finish_weight_update


def note_weight_version(worker: Any, weight_version: str | None) -> None:
    """The trainer's `weight_version` of the session about to finish: kept for its end, and audited in the
    draft's epoch (`weight_version` event) when it is a draft session. Nothing happens without an open session
    (vLLM's finish then refuses on its own)."""
    if weight_version is not None and type(weight_version) is not str:
        raise TypeError(f"lifecycle_note_weight_version: weight_version must be a string or None, got "
                        f"{type(weight_version).__name__}")
    session = _session(worker) if worker._weight_update_active else None
    if session is None:
        return
    session.weight_version = weight_version
    if session.draft and weight_version is not None:
        for backbone in backbones_in(draft_model_of(worker.model_runner)):
            backbone.lifecycle.audit_event("weight_version", weight_version=weight_version)


# ---- the API server process, and the offline `LLM` --------------------------------------------------------------


def runs_lifecycle_rpcs(vllm_config: Any) -> bool:
    """Whether the engine's workers have the lifecycle RPCs (`worker_extension_cls` is, or subclasses, ours)."""
    name = getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", "") or ""
    if not name:
        return False
    if name == _EXTENSION:
        return True
    module, _, qualname = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError, ValueError):
        return False
    return callable(getattr(cls, "lifecycle_note_weight_version", None))


def _answer_refusal(e: Exception, status: HTTPStatus) -> Exception | None:
    """The plugin's refusal inside vLLM's wrapped error ("Call to collective_rpc method failed: Worker failed with
    error '<message>', please check the stack trace above ..."), as the HTTP error vLLM answers; None otherwise."""
    message = str(e)
    at = message.find(REFUSED)
    if at < 0:
        return None
    from vllm.exceptions import GracefulHTTPError

    inner = message[at:]
    end = inner.rfind("', please check")
    return GracefulHTTPError(inner[:end] if end > 0 else inner, status)  # type: ignore[no-any-return]  # vLLM's class


def _answered(status: HTTPStatus) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        async def call(engine: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await original(engine, *args, **kwargs)
            except Exception as e:
                answer = _answer_refusal(e, status)
                if answer is None:
                    raise
                raise answer from e

        return call

    return make


def _async_finish(original: Callable[..., Any]) -> Callable[..., Any]:
    async def finish_weight_update(engine: Any, weight_version: str | None = None) -> Any:
        if weight_version is not None and runs_lifecycle_rpcs(engine.vllm_config):
            await engine.collective_rpc("lifecycle_note_weight_version", args=(weight_version,))
        try:
            return await original(engine, weight_version)
        except Exception as e:
            answer = _answer_refusal(e, HTTPStatus.UNPROCESSABLE_ENTITY)
            if answer is None:
                raise
            raise answer from e

    return finish_weight_update


def _offline_finish(original: Callable[..., Any]) -> Callable[..., Any]:
    def finish_weight_update(llm: Any, weight_version: str | None = None) -> Any:
        if weight_version is not None and runs_lifecycle_rpcs(llm.llm_engine.vllm_config):
            llm.llm_engine.collective_rpc("lifecycle_note_weight_version", args=(weight_version,))
        return original(llm, weight_version)

    return finish_weight_update


#: the makers the registry names (`compat/registry.py`)
wrap_start, wrap_update, wrap_finish = _start, _update, _finish
answer_conflict = _answered(HTTPStatus.CONFLICT)
answer_unprocessable = _answered(HTTPStatus.UNPROCESSABLE_ENTITY)
wrap_async_finish, wrap_offline_finish = _async_finish, _offline_finish
