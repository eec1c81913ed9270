"""How one trigger of the table is fired: the `transitions` machine built from `states.TRANSITIONS`, with the
guards and conditions of `guards.py` and what they read, the trigger's effect, the follow-ups the table declares,
and one numbered audit event either way.

A fire runs the row's guards, then the effect (a refresh, a pin), then changes the state; a guard or an effect
that raises leaves the state as it was, and the refusal is itself an audit event (`event_trail.AuditTrail`).
`TableMachine` holds everything a guard or a condition reads (`guards.GuardedMachine`), so it can fire every row
of the table by itself; `BackboneLifecycle` (`machine.py`) builds on it and says what each trigger does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from transitions import Machine, MachineError
from transitions.extensions import LockedMachine

from . import events
from .errors import IllegalTransitionError, LayersNotReadyError
from .event_trail import AuditTrail
from .guards import CONDITIONS, GUARDS, MAY_BE_MET
from .readiness import LayerReadiness
from .states import (
    ALLOWED_TRIGGERS,
    FOLLOW_UPS,
    INITIAL_STATE,
    ROWS_FROM,
    TRANSITIONS,
    LifecycleState,
    Transition,
    allowed_sources,
)
from .types import capped

if TYPE_CHECKING:
    import torch

    from .storage import PinnedStorage

__all__ = ["MetaScan", "PinnedTensors", "Resolver", "TableMachine"]

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)
#: Finds the live tensor for a name (None when absent).
Resolver = Callable[[str], "torch.Tensor | None"]
#: What captured graphs read (derived buffers and parameters), for pinning.
PinnedTensors = Callable[[], Mapping[str, "torch.Tensor | None"]]
#: The names of every checkpoint tensor that is absent or on META now, in one pass.
MetaScan = Callable[[], "set[str]"]


class _Model:
    """What `transitions` binds to: it holds `state` and the trigger methods, nothing else."""

    state: LifecycleState
    # bound by `transitions` on the model: annotated, not assigned (it skips a name the model already has)
    trigger: Callable[..., bool]


class TableMachine(AuditTrail):
    """The table's state machine for one backbone, with what its guards and conditions read: the readiness of the
    epoch against the live tensors (`missing`, `missing_by_counts`), the pinned storage identities
    (`pinned_changes`) and whether a recovery would be right (`recovery_blocker`).

    `locked`: built for several writer threads (`LockedMachine`, entered with this machine's own lock: one lock for
    the triggers and the machine). `resolve`, `pinned_tensors`, `meta_scan`: see `BackboneLifecycle`."""

    def __init__(self, name: str, rank: int, readiness: LayerReadiness, *, locked: bool, recent_events: int,
                 resolve: Resolver | None = None, pinned_tensors: PinnedTensors | None = None,
                 meta_scan: MetaScan | None = None) -> None:
        super().__init__(name, rank, readiness, holds_events=not locked, recent_events=recent_events)
        self.pinned: PinnedStorage | None = None
        #: the pins the running trigger's pin guard verified unchanged (its effect may rely on them), else None
        self.verified_pins: PinnedStorage | None = None
        #: why `recover` would be wrong now (None: it would not), decided when a reload is aborted
        self.recovery_blocker: str | None = "no reload was aborted"
        self._resolve = resolve
        self._pinned_tensors = pinned_tensors
        self._meta_scan = meta_scan
        # whether a tensor counted loaded in this epoch may be on META: False while every one was written by the
        # loader's own copy (`weights_loaded(..., materialized=True)`: `write_tensor` leaves no placeholder), so
        # the FULLY_LOADED condition and the finish guard need no scan of the live tensors (`missing_by_counts`);
        # any other report, declaration or failed write sets it until the next epoch, and so does a finish: once
        # other code has run, the refresh (which builds from the weights) scans again
        self._meta_possible = False
        # the one lock of the lifecycle: every trigger holds it, and a locked machine enters it too (re-entrant).
        # An unlocked lifecycle is not thread-safe (a plain Machine, leases never wait); the lock is there anyway:
        # an uncontended RLock costs less per call than a null context manager
        self._lock = threading.RLock()
        self._locked = locked
        self._model = _Model()
        table: dict[str, Any] = dict(
            model=self._model, states=LifecycleState, initial=INITIAL_STATE,
            transitions=[self._machine_row(t) for t in TRANSITIONS], auto_transitions=False, send_event=True)
        # transitions' stubs want a context manager whose `__enter__` returns None; an RLock's returns True
        lock = cast("AbstractContextManager[None]", self._lock)
        self._machine = LockedMachine(**table, machine_context=[lock]) if locked else Machine(**table)

    def _machine_row(self, t: Transition) -> dict[str, Any]:
        """One row for `transitions`: its guards (then the trigger's effect) run before the state changes; its
        condition picks it among the trigger's rows. Both are looked up in `guards.py` by enum member."""
        row: dict[str, Any] = {
            "trigger": t.trigger,
            "source": list(t.sources),
            "dest": t.dest,
            "before": [*(self._guard_callback(GUARDS[g]) for g in t.guards), _run_effect],
        }
        if t.condition is not None:
            check = CONDITIONS[t.condition]
            row["conditions"] = [lambda _event: check(self)]
        return row

    def _guard_callback(self, guard: Callable[..., None]) -> Callable[[Any], None]:
        return lambda event: guard(self, event.event.name)

    @property
    def state(self) -> LifecycleState:
        return self._model.state

    @property
    def locked(self) -> bool:
        """Built for several writer threads (`LockedMachine`, write leases that triggers wait for)."""
        return self._locked

    def can(self, trigger: str) -> bool:
        """Whether the table allows `trigger` from the current state (its guards may still refuse it)."""
        return trigger in ALLOWED_TRIGGERS[self._model.state]

    def bind(self, *, resolve: Resolver | None = None, pinned_tensors: PinnedTensors | None = None,
             meta_scan: MetaScan | None = None) -> None:
        if resolve is not None:
            self._resolve = resolve
        if pinned_tensors is not None:
            self._pinned_tensors = pinned_tensors
        if meta_scan is not None:
            self._meta_scan = meta_scan

    # ---- what the guards and conditions read -------------------------------------------------------------------
    def _is_meta(self, name: str) -> bool:
        if self._resolve is None:
            return False
        t = self._resolve(name)
        return t is None or t.is_meta

    def missing_by_counts(self) -> dict[str, tuple[str, ...]]:
        """`missing()` for `Guard`/`Condition.ALL_LAYERS_READY`: while every tensor of the epoch was materialised
        by the loader's own copy and the load is not finished, the counts say it and no live tensor is scanned
        (the scan costs about 0.5 us per tensor once the loader's copies have gone through the caches): the
        FULLY_LOADED condition at the last bucket and the finish guard. Any other writer, a declaration, a
        failed write, or a finished load (other code has run since) makes it scan: the refresh, which builds the
        derived buffers from the weights, scans after every finish."""
        if self._meta_possible:
            return self.missing()
        return self.readiness.missing(None)

    def missing(self, names: Iterable[str] | None = None) -> dict[str, tuple[str, ...]]:
        """Layer -> tensors not loaded in this epoch or still on META. Empty when every layer is ready."""
        if names is None and self._meta_scan is not None:
            bad = self._meta_scan()  # one pass over the live tensors
            return self.readiness.missing(bad.__contains__ if bad else None)
        resolve = self._resolve
        if resolve is None:
            return self.readiness.missing(None, names)

        def is_meta(name: str) -> bool:  # per tensor: one call into the resolver, no attribute lookups
            t = resolve(name)
            return t is None or t.is_meta

        return self.readiness.missing(is_meta, names)

    def pinned_changes(self) -> list[str]:
        if self.pinned is None or self._pinned_tensors is None:
            return []
        return self.pinned.changes(self._pinned_tensors())

    # ---- firing -----------------------------------------------------------------------------------------------
    @overload
    def _fire(self, trigger: str, effect: Callable[[], T], **log: Any) -> T: ...

    @overload
    def _fire(self, trigger: str, effect: None = None, **log: Any) -> None: ...

    def _fire(self, trigger: str, effect: Callable[[], T] | None = None, **log: Any) -> T | None:
        """Fire `trigger`: guards, then `effect`, then the state change; one audit event either way."""
        src = self.state
        t0 = time.perf_counter()
        effect_call: dict[str, Any] = {"effect": effect}  # `_run_effect` runs it and puts its "result" here
        try:
            if not self.can(trigger):
                raise IllegalTransitionError(trigger, backbone=self.name, state=src.value,
                                             allowed_from=[s.value for s in allowed_sources(trigger)])
            self.verified_pins = None  # set by this trigger's own pin guard only: code run since may move storage
            try:
                fired = self._model.trigger(trigger, effect_call=effect_call)
            except MachineError as e:  # the table check above should make this unreachable
                raise IllegalTransitionError(trigger, backbone=self.name, state=src.value,
                                             allowed_from=[s.value for s in allowed_sources(trigger)]) from e
            finally:
                self.verified_pins = None
            if not fired:
                raise IllegalTransitionError(trigger, backbone=self.name, state=src.value,
                                             allowed_from=["(no row's condition was met)"])
        except BaseException as e:  # refusals, failures and interrupts alike: audited, state unchanged
            self.record_refusal(trigger, e, duration_ms=_ms(t0))
            _clear_machine_frames(e.__traceback__.tb_next if e.__traceback__ is not None else None)
            raise
        self._audit("transition", trigger=trigger, src=src.value, dst=self.state.value, duration_ms=_ms(t0),
                    **self._readiness_fields(), **log)
        return effect_call.get("result")

    def _fire_follow_ups(self, trigger: str, **log: Any) -> None:
        """Fire what the table declares to follow `trigger` (`FOLLOW_UPS`): each follow-up with a row from the
        state reached whose condition is met (a refresh under captured graphs goes on to `graphs_verified`)."""
        for follow_up in FOLLOW_UPS.get(trigger, ()):
            if any(t.condition is None or CONDITIONS[t.condition](self)
                   for t in ROWS_FROM[follow_up][self._model.state]):
                self._fire(follow_up, **log)

    def _bucket_moves(self, trigger: str, completed: bool) -> bool:
        """Whether a bucket reported now is a step of the lifecycle (fire `trigger`) or bookkeeping only. It is
        bookkeeping when it completed no layer and the state is already one of the trigger's destinations, or
        when the row the machine would pick is a per-bucket row back to the current state
        (`Transition.per_bucket`). Rows are picked with each condition's cheap test (`guards.MAY_BE_MET`): a row
        whose condition may be met is taken to be the one, so the full check (a META scan) runs only when the
        machine really fires."""
        state = self._model.state
        rows = ROWS_FROM[trigger][state]
        if not completed:
            return all(t.dest is not state for t in rows)  # the first report after META
        for t in rows:
            if t.condition is None or MAY_BE_MET[t.condition](self):
                return not t.per_bucket or t.dest is not state
        return True

    def _require_allowed_audited(self, trigger: str) -> None:
        """Refuse (audited) before any bookkeeping when the table does not allow `trigger` now."""
        if not self.can(trigger):
            self._fire(trigger)  # raises IllegalTransitionError and records the refusal

    def _refuse_untabled(self, trigger: str, hint: str) -> None:
        """Refuse (audited) a trigger the table does not allow now, with `hint` saying what to do instead."""
        raise self.record_refusal(trigger, IllegalTransitionError(
            trigger, backbone=self.name, state=self.state.value,
            allowed_from=[s.value for s in allowed_sources(trigger)], hint=hint))

    def record_refusal(self, trigger: str, error: E, **fields: Any) -> E:
        """Audit a refusal: the machine's own, and those decided outside it (the loader's checks of names,
        shapes, files). A refusal for unready layers names the missing tensors (capped). Returns `error`, to be
        raised as the expression (`raise lc.record_refusal(...)`, see `errors`: no local keeps it)."""
        self._audit("refused", trigger=trigger, src=self.state.value, error=type(error).__name__,
                    reason=getattr(error, "reason", str(error)), **fields, **self._readiness_fields(),
                    **_missing_fields(error))
        return error


def _run_effect(event: Any) -> None:
    effect_call = event.kwargs.get("effect_call")
    if effect_call is not None and effect_call.get("effect") is not None:
        effect_call["result"] = effect_call["effect"]()


def _clear_machine_frames(tb: TracebackType | None) -> None:
    """Clear the locals of the machine's frames in a traceback below `_fire`: `transitions`' own and this module's
    callbacks. `transitions` keeps the error in the event data they hold (`event_data.error`): a cycle that holds
    every frame of the traceback, the callers' too (the backbone and its weights), until the cyclic collector runs
    (see `errors`). Those frames are done; file and line stay in the traceback, and the guard's or effect's own
    frames keep their locals."""
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module == __name__ or module.startswith("transitions."):
            tb.tb_frame.clear()
        tb = tb.tb_next


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def _missing_fields(e: BaseException) -> dict[str, Any]:
    if not isinstance(e, LayersNotReadyError):
        return {}
    shown, more = capped((n for names in e.missing.values() for n in names), events.LIST_CAP)
    return {"missing": shown, "missing_more": more}
