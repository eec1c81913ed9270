"""The checks the transition table names: one function per `Guard` and per `Condition` of `states.py`.

The machine binds a row's guards and condition through `GUARDS` and `CONDITIONS`, explicit mappings from the
enum members (complete: checked at import), so a name in the table is a function here, never a method looked up
by its string. A guard raises with the full reason before the state or any buffer changes; a condition picks one
row among several rows of the same trigger. `recovery_verdict` is what `Guard.RECOVERABLE` reads: decided at
abort time, from what the aborted reload wrote and what its rollback restored.

Every check takes the machine as a `GuardedMachine`: what a guard or a condition reads, and nothing else. The
machine that fires the rows (`firing.TableMachine`) is one by itself; this module never imports it, so the
machine can import the checks.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .errors import IllegalTransitionError, LayersNotReadyError, LifecycleError, RecoveryError, StorageDriftError
from .events import LIST_CAP
from .states import TRANSITIONS, Condition, Guard, LifecycleState, allowed_sources
from .types import capped

if TYPE_CHECKING:
    from .readiness import LayerReadiness
    from .storage import PinnedStorage

__all__ = ["CONDITIONS", "GUARDS", "MAY_BE_MET", "GuardedMachine", "ReloadOrigin", "guards_of_row",
           "recovery_verdict", "refusal"]


class GuardedMachine(Protocol):
    """What the guards and conditions read of the machine whose rows they check (`firing.TableMachine`)."""

    name: str
    readiness: LayerReadiness
    pinned: PinnedStorage | None
    verified_pins: PinnedStorage | None
    recovery_blocker: str | None

    @property
    def state(self) -> LifecycleState: ...

    def can(self, trigger: str) -> bool: ...

    def missing_by_counts(self) -> dict[str, tuple[str, ...]]: ...

    def pinned_changes(self) -> list[str]: ...

    def audit_event(self, event: str, *, level: str = "info", **fields: Any) -> None: ...


# ---- conditions ----------------------------------------------------------------------------------------------
def all_layers_ready(lc: GuardedMachine) -> bool:
    return lc.readiness.counts_complete() and not lc.missing_by_counts()


def has_pinned_graphs(lc: GuardedMachine) -> bool:
    return lc.pinned is not None


# ---- guards --------------------------------------------------------------------------------------------------
# Each takes (the lifecycle, the trigger or action, audit=): `audit=False` checks quietly (`refusal`, the
# `recoverable` answers), without the storage_check event.
def require_all_layers_ready(lc: GuardedMachine, action: str, *, audit: bool = True) -> None:
    missing = lc.missing_by_counts()
    if missing:
        raise LayersNotReadyError(action, missing, backbone=lc.name, state=lc.state.value)


def require_pinned(lc: GuardedMachine, action: str, *, audit: bool = True) -> None:
    if lc.pinned is None:
        raise IllegalTransitionError(action, backbone=lc.name, state=lc.state.value,
                                     allowed_from=[f"{s} with graphs captured" for s in allowed_sources(action)])


def require_pinned_unchanged(lc: GuardedMachine, action: str, *, audit: bool = True) -> None:
    if lc.pinned is None:
        return
    problems = lc.pinned_changes()
    if audit:
        shown, more = capped(problems, LIST_CAP)
        lc.audit_event("storage_check", action=action, checked=len(lc.pinned), ok=not problems, problems=shown,
                       problems_more=more)
    if problems:
        raise StorageDriftError(problems, backbone=lc.name, state=lc.state.value)
    lc.verified_pins = lc.pinned  # for the trigger's effect (a refresh's plan); `_fire` clears it around each trigger


def require_recoverable(lc: GuardedMachine, action: str, *, audit: bool = True) -> None:
    if lc.recovery_blocker is not None:
        raise RecoveryError(f"{action} refused: {lc.recovery_blocker}; reload instead (begin_reload, load, "
                            "finalize_loading, refresh_derived_buffers)", backbone=lc.name, state=lc.state.value)


GUARDS: dict[Guard, Callable[..., None]] = {  # (the lifecycle, the trigger or action, audit=) -> None or raise
    Guard.ALL_LAYERS_READY: require_all_layers_ready,
    Guard.PINNED: require_pinned,
    Guard.PINNED_UNCHANGED: require_pinned_unchanged,
    Guard.RECOVERABLE: require_recoverable,
}
CONDITIONS: dict[Condition, Callable[[GuardedMachine], bool]] = {
    Condition.ALL_LAYERS_READY: all_layers_ready,
    Condition.HAS_PINNED_GRAPHS: has_pinned_graphs,
}
#: A cheap test that is False only when the condition is surely not met (the per-bucket path asks it to know,
#: without the full check, whether a report would leave the state as it is): all layers counted, graphs pinned.
MAY_BE_MET: dict[Condition, Callable[[GuardedMachine], bool]] = {
    Condition.ALL_LAYERS_READY: lambda lc: lc.readiness.counts_complete(),
    Condition.HAS_PINNED_GRAPHS: has_pinned_graphs,
}
# a name the table may use has no check
if set(GUARDS) != set(Guard) or set(CONDITIONS) != set(Condition) or set(MAY_BE_MET) != set(Condition):
    raise ImportError(f"guards.py lacks a check for {sorted({*Guard, *Condition} - {*GUARDS, *CONDITIONS})}")


def guards_of_row(lc: GuardedMachine, trigger: str) -> tuple[Guard, ...]:
    """The guards of the row `trigger` would fire from the current state (the first whose condition is met, as
    the machine picks it); () when no row would."""
    for t in TRANSITIONS:
        if t.trigger == trigger and lc.state in t.sources and (t.condition is None or CONDITIONS[t.condition](lc)):
            return t.guards
    return ()


def refusal(lc: GuardedMachine, trigger: str) -> LifecycleError | None:
    """The error `trigger` would raise now, or None when it would succeed: what the table allows from this state,
    then the guards of the row that would fire, checked quietly (nothing is audited or changed). A trigger's
    effect (a refresh's plan) is not run: its own refusals are not foreseen."""
    if not lc.can(trigger):
        return IllegalTransitionError(trigger, backbone=lc.name, state=lc.state.value,
                                      allowed_from=[s.value for s in allowed_sources(trigger)])
    for guard in guards_of_row(lc, trigger):
        try:
            GUARDS[guard](lc, trigger, audit=False)
        except LifecycleError as e:
            return e
    return None


# ---- what `Guard.RECOVERABLE` reads ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReloadOrigin:
    """Recorded at `begin_reload`: whether the derived buffers matched the weights then, and the dirty set, kept as
    the readiness's parts (sets never changed again: `LayerReadiness.dirty_parts`), so that beginning an epoch costs
    nothing per tensor; `dirty` joins them when an abort asks."""

    current: bool = False
    dirty_parts: tuple[AbstractSet[str], ...] = ()

    @property
    def dirty(self) -> frozenset[str]:
        return frozenset().union(*self.dirty_parts)


def recovery_verdict(origin: ReloadOrigin, dirty_now: frozenset[str], restored: frozenset[str] | None,
                     rollback_error: str | None, torn: frozenset[str]) -> str | None:
    """Why `recover` would be wrong after this abort; None when the last good derived buffers match the weights
    again (the reload began with current buffers and its rollback undid every write, none torn)."""
    if not origin.current:
        return ("this load did not start from refreshed derived buffers (a cold load, or a reload begun from "
                "a state whose derived buffers were stale), so there is nothing to return to")
    if rollback_error is not None:
        return f"the rollback is incomplete ({rollback_error})"
    if restored is None:
        return "the aborted reload was not rolled back: the weights may hold part of it"
    outside = sorted(dirty_now - origin.dirty - restored)
    if outside:
        shown, more = capped(outside, LIST_CAP)
        return (f"{len(outside)} tensor(s) were written outside the rollback snapshot: {', '.join(shown)}"
                + (f" ... and {more} more" if more else ""))
    if torn:
        return f"derived buffer(s) {', '.join(sorted(torn))} were interrupted mid-write"
    return None
