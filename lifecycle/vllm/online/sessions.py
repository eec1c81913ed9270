"""vLLM's weight-update session, kept in step with the draft's reload epoch; the trainer's `weight_version` in the
audit; the plugin's refusals answered as HTTP errors that name them.

vLLM's worker holds one session (`Worker._weight_update_active`, `_weight_update_is_draft`): `_start_weight_update`
refuses while it is open, an exception in `update_weights` closes it, one in `finish_weight_update` does NOT (the
flag stays set and the transfer engine's target stays the draft). So a refused draft finish, or a trainer that died
between `/update_weights` and `/finish_weight_update`, left a session that refused every later start, the policy
sync's too, until a restart. The wrappers (worker side):

  Worker._start_weight_update   an open DRAFT session is abandoned: its epoch ends (`reload.epoch.fail`: an
                                exact rollback when nothing was written, else quarantine), the end is audited
                                (`weight_update_session_ended`, outcome `abandoned`), vLLM's session is closed and
                                the new start proceeds, draft or policy. Unless it had a call less than
                                `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S` seconds ago (default 0: always): then
                                the start is refused, naming the open session, and nothing changes. An open
                                POLICY session is vLLM's (its target reload cannot be unwound without leaving a
                                target that mixes two checkpoints): refused, naming it.
  Worker.update_weights         the outermost entry of the epoch boundary for a draft chunk (`reload.epoch.entered`):
                                a chunk that raises ends the epoch once there (whatever the transfer engine), the
                                end is audited (outcome `refused`), and the error names what was refused and what
                                it left (the boundary's outcome)
  Worker.finish_weight_update   likewise for the finish; vLLM's session is closed too (vLLM leaves it open); a
                                finish that succeeds is audited (outcome `finished`). The plugin's own finish calls
                                carry `lifecycle=` (the trainer's `weight_version`, the outside view's events) and
                                get back, beside vLLM's answer, the draft's serving state: one worker round trip

Each refusal's message begins with `REFUSED`: a refused start or finish is a `WeightUpdateRefused`; a refused
chunk keeps its own class (`CheckpointError`, `ValueError`, ...: what callers caught before), its message prefixed.
The API server process answers them as HTTP errors naming them (`answers.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..compat.patching import write_private
from ..drafts.owners import backbones_in, draft_model_of
from ..drafts.runtime import WORKER
from ..reload.epoch import OUTCOME_QUARANTINED, describe, entered, fail
from ..settings import TAKEOVER_IDLE_ENV, takeover_idle_s  # the setting's record: settings.TAKEOVER_IDLE

__all__ = ["LIFECYCLE_KW", "REFUSED", "TAKEOVER_IDLE_ENV", "Session", "WeightUpdateRefused", "note_weight_version",
           "takeover_idle_s", "wrap_finish", "wrap_start", "wrap_update"]

#: The start of every refusal message: the API server process finds it in vLLM's wrapped error.
REFUSED = "reload-lifecycle refused"
_NEXT = "the next start_draft_weight_update or start_weight_update proceeds"
_QUARANTINED = ("The session is closed: the engine serves the target's tokens without speculation until a complete "
                f"draft push succeeds; {_NEXT}.")
_ROLLED_BACK = (f"Nothing was written: the draft serves its last weights (rolled back exactly). The session is closed; "
                f"{_NEXT}.")
_DETAIL_CAP = 4000
#: The keyword of the plugin's own finish calls: {"weight_version": ..., "events": [...]} (`answers.py`, the outside
#: view); the worker answers {"result": vLLM's, "lifecycle": the serving state} to them.
LIFECYCLE_KW = "lifecycle"


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
    found: Session | None = WORKER.sessions.get(worker)
    return found


def _audit_end(worker: Any, session: Session | None, outcome: str, reason: str | None = None) -> None:
    if session is None or not session.draft:
        return
    fields = {**session.timing(time.monotonic()), "outcome": outcome, "reason": reason}
    for backbone in backbones_in(draft_model_of(worker.model_runner)):
        backbone.lifecycle.audit_event("weight_update_session_ended", level="info" if outcome == "finished"
                                       else "warning", **fields)


def _close(worker: Any, outcome: str, reason: str) -> None:
    """Audit the draft session's end and close vLLM's session as its own successful finish does."""
    try:
        _audit_end(worker, _session(worker), outcome, reason)
    finally:
        WORKER.sessions.pop(worker, None)
        if worker._weight_update_active:
            worker.weight_transfer_engine.reset_weight_update_target()
            write_private("Worker._weight_update_active", worker, False)


def _left(draft: Any) -> str:
    """What an ended draft session left, for the trainer's message."""
    drafts = backbones_in(draft) if draft is not None else []
    if drafts and all(b.lifecycle.usable for b in drafts) \
            and all(b.lifecycle_runtime.last_outcome != OUTCOME_QUARANTINED for b in drafts):
        return _ROLLED_BACK
    return _QUARANTINED


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
            reason = f"abandoned: {what} began before finish_weight_update of the open draft session"
            draft = draft_model_of(worker.model_runner)
            try:
                if draft is not None:
                    fail(draft, reason)  # the take-over's decision: the open epoch ends here
            finally:
                _close(worker, "abandoned", reason)
        result = original(worker, is_draft=is_draft)
        now = time.monotonic()
        WORKER.sessions[worker] = Session(draft=is_draft, started=now, last_call=now)
        return result

    return _start_weight_update


def _update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_weights(worker: Any, *args: Any, **kwargs: Any) -> Any:
        session = _session(worker) if worker._weight_update_active else None
        draft = draft_model_of(worker.model_runner) if session is not None and session.draft else None
        try:
            with entered(draft, "update_weights"):  # a chunk that fails ends the epoch there, once
                result = original(worker, *args, **kwargs)
        except BaseException as e:
            if session is None or not session.draft or worker._weight_update_active:
                raise
            _close(worker, "refused", f"update_weights failed: {describe(e)}")  # vLLM closed its session
            left = _left(draft)
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
        options = kwargs.pop(LIFECYCLE_KW, None)  # the plugin's own call: the version, the outside view's events
        session = _session(worker) if worker._weight_update_active else None
        was_draft = worker._weight_update_active and worker._weight_update_is_draft
        if isinstance(options, dict):
            note_weight_version(worker, options.get("weight_version"))
        draft = draft_model_of(worker.model_runner) if was_draft else None
        try:
            with entered(draft, "finish_weight_update"):
                result = original(worker, *args, **kwargs)
        except BaseException as e:
            if not (was_draft and worker._weight_update_active):
                raise
            _close(worker, "refused", f"finish_weight_update failed: {describe(e)}")
            if not isinstance(e, Exception):
                raise
            raise WeightUpdateRefused(f"{REFUSED} the draft weight update: {_detail(e)}\n{_left(draft)}") from e
        _audit_end(worker, session, "finished")
        WORKER.sessions.pop(worker, None)
        if options is None:
            return result
        report = WORKER.finish_report(worker, options) if WORKER.finish_report is not None else None
        return {"result": result, LIFECYCLE_KW: report}

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


#: the makers the registry names (`compat/registry.py`)
wrap_start, wrap_update, wrap_finish = _start, _update, _finish
