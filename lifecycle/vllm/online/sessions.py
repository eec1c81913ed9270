"""vLLM's weight-update session, kept in step with the draft's reload epoch, owned by one push (`pushes.py`); the
trainer's `weight_version` in the audit; the plugin's refusals answered as HTTP errors that name them.

vLLM's worker holds one session (`Worker._weight_update_active`, `_weight_update_is_draft`): `_start_weight_update`
refuses while it is open, an exception in `update_weights` closes it, one in `finish_weight_update` does NOT (the
flag stays set and the transfer engine's target stays the draft). The wrappers (worker side):

  Worker._start_weight_update   a start while a DRAFT push is open is refused (409, naming the push, its age and
                                how to take it over) while that push had a call less than
                                `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S` ago (default 60 s); an idle one is
                                taken over: its epoch ends (`reload.epoch.fail`: an exact rollback when nothing was
                                written, else quarantine), the end is audited (`weight_update_session_ended`, outcome
                                `abandoned`), vLLM's session is closed and the new start proceeds, draft or policy.
                                `take_over` (the RPC `lifecycle_take_over_push`) ends a named open push at once. An
                                open POLICY session is vLLM's (its target reload cannot be unwound without leaving a
                                target that mixes two checkpoints): refused, naming it.
  Worker.update_weights         a chunk of another push (`pushes.check_chunk`: its push id) is refused before
                                anything is written, the open push untouched; else the outermost entry of the epoch
                                boundary for a draft chunk (`reload.epoch.entered`): a chunk that raises ends the
                                epoch once there (whatever the transfer engine), the end is audited (outcome
                                `refused`), and the error names what was refused and what it left
  Worker.finish_weight_update   a finish of another push (`pushes.check_finish`) is refused, the open push
                                untouched; else likewise for the finish; vLLM's session is closed too (vLLM leaves it
                                open); a finish that succeeds is audited (outcome `finished`). The plugin's own finish
                                calls carry `lifecycle=` (the trainer's `weight_version`, the outside view's events)
                                and get back, beside vLLM's answer, the draft's serving state: one worker round trip

Each refusal's message begins with `REFUSED` (`CONFLICT` for a call of another push): a refused start or finish is
a `WeightUpdateRefused`; a refused chunk keeps its own class (`CheckpointError`, `ValueError`, ...: what callers
caught before), its message prefixed. The API server process answers them as HTTP errors naming them (`answers.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..compat.patching import write_private
from ..drafts.owners import backbones_in, draft_model_of, drafts_of
from ..drafts.runtime import WORKER
from ..reload.epoch import OUTCOME_QUARANTINED, describe, entered, fail
from ..settings import TAKEOVER_IDLE_ENV, takeover_idle_s  # the setting's record: settings.TAKEOVER_IDLE
from .chunks import running
from .pushes import CONFLICT, REFUSED, Push, WeightUpdateRefused, check_chunk, check_finish, check_label, take_push_id

__all__ = ["CONFLICT", "LIFECYCLE_KW", "REFUSED", "TAKEOVER_IDLE_ENV", "TAKE_OVER_RPC", "Push", "WeightUpdateRefused",
           "note_weight_version", "take_over", "takeover_idle_s", "wrap_finish", "wrap_start", "wrap_update"]

_NEXT = "the next start_draft_weight_update or start_weight_update proceeds"
_QUARANTINED = ("The session is closed: the engine serves the target's tokens without speculation until a complete "
                f"draft push succeeds; {_NEXT}.")
_ROLLED_BACK = (f"Nothing was written: the draft serves its last weights (rolled back exactly). The session is closed; "
                f"{_NEXT}.")
_DETAIL_CAP = 4000
#: The keyword of the plugin's own finish calls: {"weight_version": ..., "events": [...]} (`answers.py`, the outside
#: view); the worker answers {"result": vLLM's, "lifecycle": the serving state} to them.
LIFECYCLE_KW = "lifecycle"
#: The worker RPC that ends an open draft push at once (`take_over`; `online.rpcs`).
TAKE_OVER_RPC = "lifecycle_take_over_push"
_UNATTRIBUTED = ("this push took over {0} and its chunks carry no push_id, so a late chunk of {0} could not be told "
                 "from its own: it had to send every tensor (partial='keep' does not apply to it)")


# ---- worker side ---------------------------------------------------------------------------------------------


def _session(worker: Any) -> Push | None:
    found: Push | None = WORKER.sessions.get(worker)
    return found


def _drafts(worker: Any) -> list[Any]:
    draft = draft_model_of(worker.model_runner)
    return drafts_of(draft) if draft is not None else []


def _audit_end(worker: Any, push: Push | None, outcome: str, reason: str | None = None) -> None:
    if push is None or not push.draft:
        return
    fields = {**push.fields(), "outcome": outcome, "reason": reason}
    for backbone in _drafts(worker):
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


def _end_open(worker: Any, outcome: str, reason: str) -> None:
    """End the open draft push: its epoch (`reload.epoch.fail`), then vLLM's session, audited."""
    draft = draft_model_of(worker.model_runner)
    try:
        if draft is not None:
            fail(draft, reason)  # the take-over's decision: the open epoch ends here
    finally:
        _close(worker, outcome, reason)


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


def _how_to_take_over(push: Push) -> str:
    return (f"take it over at once (it ends; a late call of its trainer then finds no push open): POST "
            f"/collective_rpc {{\"method\": \"{TAKE_OVER_RPC}\", \"kwargs\": {{\"push\": \"{push.identity}\"}}}} "
            f"(offline: llm.collective_rpc(\"{TAKE_OVER_RPC}\", kwargs={{\"push\": \"{push.identity}\"}})), then start "
            "again")


def _start(original: Callable[..., Any]) -> Callable[..., Any]:
    def _start_weight_update(worker: Any, is_draft: bool = False) -> Any:
        took_over = WORKER.taken_over.get(worker)  # a take-over ended the push before: its trainer may still call
        if worker._weight_update_active:
            what = "start_draft_weight_update" if is_draft else "start_weight_update"
            push = _session(worker)
            now = time.monotonic()
            since = "" if push is None else f" ({push.shown(now)})"
            if not worker._weight_update_is_draft:
                raise WeightUpdateRefused(
                    f"{REFUSED} {what}: a weight update of the TARGET is open{since}. reload-lifecycle ends "
                    "abandoned DRAFT sessions only (the target's reload is vLLM's: ending it half-way would leave a "
                    "target that mixes two checkpoints): call finish_weight_update first")
            minimum = takeover_idle_s()
            if push is not None and now - push.last_call < minimum:
                raise WeightUpdateRefused(
                    f"{REFUSED} {what}: a draft push is open{since}, and {TAKEOVER_IDLE_ENV}={minimum:g} takes an "
                    f"open session over only after {minimum:g} s without a call: finish it, retry in "
                    f"{minimum - (now - push.last_call):.1f} s, or {_how_to_take_over(push)}. Nothing was changed")
            took_over = push.identity if push is not None else "an open draft session"
            idle = "" if push is None else f" ({push.identity}, idle {now - push.last_call:.1f} s)"
            _end_open(worker, "abandoned",
                      f"abandoned: {what} began before finish_weight_update of the open draft session{idle}")
        result = original(worker, is_draft=is_draft)
        WORKER.taken_over.pop(worker, None)
        now = time.monotonic()
        epochs = [b.lifecycle.epoch for b in _drafts(worker)] if is_draft else []
        WORKER.sessions[worker] = Push(draft=is_draft, started=now, last_call=now,
                                       epoch=max(epochs) if epochs else None, took_over=took_over)
        return result

    return _start_weight_update


def take_over(worker: Any, push: object) -> dict[str, Any]:
    """End the open draft push named `push` (its identity, `epoch N`, or its push id) at once, whatever its idle
    time: its epoch ends as an abandoned one does (audited, outcome `taken_over`), vLLM's session is closed, and
    the next start proceeds. Anything else (no draft push open, another one open) is refused, nothing changed."""
    if type(push) is not str:
        raise TypeError(f"{REFUSED} {TAKE_OVER_RPC}: push must be the open push's name (a string such as 'epoch 12', "
                        f"as the refused start named it), got {type(push).__name__}; nothing was changed")
    open_push = _session(worker) if worker._weight_update_active else None
    if open_push is None or not open_push.draft:
        what = "a weight update of the TARGET is open (vLLM's: finish it)" if worker._weight_update_active \
            else "no push is open"
        raise ValueError(f"{REFUSED} {TAKE_OVER_RPC}: {what}; nothing was changed")
    if push not in (open_push.identity, open_push.push_id):
        raise ValueError(f"{REFUSED} {TAKE_OVER_RPC}: the open push is {open_push.shown()}, not {push[:80]!r}; "
                         "nothing was changed")
    ended = open_push.identity
    WORKER.taken_over[worker] = ended  # first: whatever lands below, the next push is told whom it follows
    _end_open(worker, "taken_over", f"taken over: {TAKE_OVER_RPC} ended the open draft session ({ended}, idle "
                                    f"{time.monotonic() - open_push.last_call:.1f} s)")
    return {"taken_over": ended, "push_id": open_push.push_id}


def _without_push_id(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """The chunk's arguments with the push id taken out of `update_info` (vLLM's engines refuse an unknown key)."""
    try:
        if args:
            info, push_id = take_push_id(args[0])
            return (info, *args[1:]), kwargs, push_id
        if "update_info" in kwargs:
            info, push_id = take_push_id(kwargs["update_info"])
            return args, {**kwargs, "update_info": info}, push_id
    except (TypeError, ValueError) as e:
        raise type(e)(f"{REFUSED} update_weights: {e}") from None
    return args, kwargs, None


def _update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_weights(worker: Any, *args: Any, **kwargs: Any) -> Any:
        push = _session(worker) if worker._weight_update_active else None
        args, kwargs, push_id = _without_push_id(args, kwargs)
        if push is not None:
            check_chunk(push, push_id)  # a chunk of another push: refused, the open push untouched
        draft = draft_model_of(worker.model_runner) if push is not None and push.draft else None
        try:
            # a chunk that fails ends the epoch there, once; the chunk's tensors are checked against the push's
            with entered(draft, "update_weights"), running(push if draft is not None else None):
                result = original(worker, *args, **kwargs)
        except BaseException as e:
            if push is None or not push.draft or worker._weight_update_active:
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
        if push is not None:
            push.chunks += 1
            push.last_call = time.monotonic()
        return result

    return update_weights


def _finish(original: Callable[..., Any]) -> Callable[..., Any]:
    def finish_weight_update(worker: Any, *args: Any, **kwargs: Any) -> Any:
        options = kwargs.pop(LIFECYCLE_KW, None)  # the plugin's own call: the version, the outside view's events
        push = _session(worker) if worker._weight_update_active else None
        was_draft = worker._weight_update_active and worker._weight_update_is_draft
        version = options.get("weight_version") if isinstance(options, dict) else None
        try:
            check_label(version, "weight_version")
        except (TypeError, ValueError) as e:
            raise WeightUpdateRefused(f"{REFUSED} finish_weight_update: {e}") from None
        if push is not None:
            check_finish(push, version)  # a finish of another push: refused, the open push untouched
        note_weight_version(worker, version)
        draft = draft_model_of(worker.model_runner) if was_draft else None
        unattributed = push is not None and push.draft and push.took_over is not None and push.push_id is None
        if unattributed:
            for backbone in _drafts(worker):
                backbone.lifecycle_runtime.reload_partial = "refuse"
        try:
            with entered(draft, "finish_weight_update"):
                result = original(worker, *args, **kwargs)
        except BaseException as e:
            if not (was_draft and worker._weight_update_active):
                raise
            _close(worker, "refused", f"finish_weight_update failed: {describe(e)}")
            if not isinstance(e, Exception):
                raise
            why = f" ({_UNATTRIBUTED.format(push.took_over)})" if unattributed and push is not None else ""
            raise WeightUpdateRefused(f"{REFUSED} the draft weight update: {_detail(e)}{why}\n{_left(draft)}") from e
        _audit_end(worker, push, "finished")
        WORKER.sessions.pop(worker, None)
        if push is not None and push.draft:  # the push the draft serves now carries the trainer's version
            for backbone in _drafts(worker):
                if backbone.lifecycle_runtime.serving_epoch == push.epoch:
                    backbone.lifecycle_runtime.serving_version = version
        if options is None:
            return result
        report = WORKER.finish_report(worker, options) if WORKER.finish_report is not None else None
        return {"result": result, LIFECYCLE_KW: report}

    return finish_weight_update


def note_weight_version(worker: Any, weight_version: str | None) -> None:
    """The trainer's `weight_version` of the session about to finish: kept for its end, and audited in the
    draft's epoch (`weight_version` event, with the push's identity) when it is a draft session. Nothing happens
    without an open session (vLLM's finish then refuses on its own)."""
    check_label(weight_version, "lifecycle_note_weight_version: weight_version")
    push = _session(worker) if worker._weight_update_active else None
    if push is None:
        return
    push.weight_version = weight_version
    if push.draft and weight_version is not None:
        for backbone in _drafts(worker):
            backbone.lifecycle.audit_event("weight_version", weight_version=weight_version, push=push.identity)


#: the makers the registry names (`compat/registry.py`)
wrap_start, wrap_update, wrap_finish = _start, _update, _finish
