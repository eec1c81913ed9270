"""The lifecycle states and the transition table: the single source of truth.

The machine (`machine.py`), the auditor and report (`lifecycle.audit`), the diagrams, the tests and the docs all
read `TRANSITIONS` and the declarations beside it (`Guard`, `Condition`, `USABLE_STATES`, follow-ups); nothing
else spells out which trigger may fire from which state, and no other module spells a state name as a string.

>>> from lifecycle.states import LifecycleState, allowed_sources
>>> [s.value for s in allowed_sources("capture_graphs")]
['DERIVED_REFRESHED']
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cache

__all__ = [
    "ALLOWED_TRIGGERS",
    "FOLLOW_UPS",
    "INITIAL_STATE",
    "QUARANTINE_STATE",
    "ROWS_FROM",
    "TRANSITIONS",
    "TRIGGERS",
    "USABLE_STATES",
    "Condition",
    "Guard",
    "LifecycleState",
    "Transition",
    "allowed_sources",
    "allowed_triggers",
    "guards_of",
    "possible_destinations",
    "rows_from",
]


class LifecycleState(str, Enum):
    META = "META"
    PARTIALLY_LOADED = "PARTIALLY_LOADED"
    FULLY_LOADED = "FULLY_LOADED"
    FINALIZED = "FINALIZED"
    DERIVED_REFRESHED = "DERIVED_REFRESHED"
    GRAPH_CAPTURED = "GRAPH_CAPTURED"
    QUARANTINED = "QUARANTINED"

    def __str__(self) -> str:
        return self.value


S = LifecycleState


class Condition(str, Enum):
    """Predicates that pick one row among several rows of the same trigger (first match wins)."""

    ALL_LAYERS_READY = "all_layers_ready"  # every tracked tensor of every layer was loaded and is off META (the
    # loader's own copy says so for what it wrote: `BackboneLifecycle.missing_by_counts`)
    HAS_PINNED_GRAPHS = "has_pinned_graphs"  # graphs were captured: storage identities are pinned

    def __str__(self) -> str:
        return self.value


class Guard(str, Enum):
    """Checks that refuse a trigger by raising with the full reason, before the state or any buffer changes."""

    ALL_LAYERS_READY = "require_all_layers_ready"  # LayersNotReadyError naming every missing tensor
    PINNED = "require_pinned"  # IllegalTransitionError unless graphs are captured
    PINNED_UNCHANGED = "require_pinned_unchanged"  # StorageDriftError naming each moved address (old -> new)
    RECOVERABLE = "require_recoverable"  # RecoveryError unless the aborted reload was rolled back exactly

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Transition:
    """One row of the table. `condition` picks this row among several rows of the same trigger (first match
    wins); `guards` refuse the trigger with the full reason, leaving the state unchanged. `follows`: the row is
    fired by the machine itself right after that trigger succeeded, when its sources include the state reached
    and its condition is met (a follow-up, never called directly). `per_bucket`: the row fires once per bucket of
    tensors, many times an epoch: bookkeeping of the load, not a step of the lifecycle (the report does not draw it
    as a timeline mark). A per-bucket row that would leave the state as it is (PARTIALLY_LOADED ->
    PARTIALLY_LOADED) is bookkeeping only: the machine is not triggered and no `transition` event is written (the
    bucket's `layer_ready` event says what changed); the row stays, so a log that shows it is still legal."""

    trigger: str
    sources: tuple[LifecycleState, ...]
    dest: LifecycleState
    condition: Condition | None = None
    guards: tuple[Guard, ...] = ()
    follows: str | None = None
    doc: str = ""
    per_bucket: bool = False


TRANSITIONS: tuple[Transition, ...] = (
    Transition(
        "weights_loaded", (S.META, S.PARTIALLY_LOADED, S.FULLY_LOADED), S.FULLY_LOADED,
        condition=Condition.ALL_LAYERS_READY, per_bucket=True,
        doc="a bucket of tensors arrived and every layer is now ready",
    ),
    Transition(
        "weights_loaded", (S.META, S.PARTIALLY_LOADED), S.PARTIALLY_LOADED,
        per_bucket=True, doc="a bucket of tensors arrived; some layer still misses tensors",
    ),
    Transition(
        "begin_reload",
        (S.FULLY_LOADED, S.FINALIZED, S.DERIVED_REFRESHED, S.GRAPH_CAPTURED, S.QUARANTINED), S.PARTIALLY_LOADED,
        doc="a new reload epoch starts; storage stays pinned if graphs were captured",
    ),
    Transition(
        "finalize_loading", (S.PARTIALLY_LOADED, S.FULLY_LOADED, S.FINALIZED), S.FINALIZED,
        guards=(Guard.ALL_LAYERS_READY,),
        doc="the loader is done; every layer must be ready (LayersNotReadyError otherwise), then the hooks of the "
            "epoch's phase run, each at most once per epoch (a hook that raises refuses the finish)",
    ),
    Transition(
        "refresh_derived", (S.FINALIZED,), S.DERIVED_REFRESHED,
        guards=(Guard.ALL_LAYERS_READY, Guard.PINNED_UNCHANGED),
        doc="derived buffers were built (cold) or refreshed in place, all validated (and, under captured "
            "graphs, every pinned identity checked) before any write",
    ),
    Transition(
        "graphs_verified", (S.DERIVED_REFRESHED,), S.GRAPH_CAPTURED,
        condition=Condition.HAS_PINNED_GRAPHS, guards=(Guard.PINNED, Guard.PINNED_UNCHANGED),
        follows="refresh_derived",
        doc="after a refresh under captured graphs, every pinned storage identity was verified unchanged",
    ),
    Transition(
        "capture_graphs", (S.DERIVED_REFRESHED,), S.GRAPH_CAPTURED,
        doc="graphs captured: the storage identity of every derived buffer and parameter is pinned",
    ),
    Transition(
        "release_graphs", (S.GRAPH_CAPTURED,), S.DERIVED_REFRESHED,
        doc="graphs released: storage is unpinned",
    ),
    Transition(
        "abort_reload", (S.PARTIALLY_LOADED, S.FULLY_LOADED, S.FINALIZED), S.QUARANTINED,
        doc="a load failed or was aborted: derived buffers keep their last good values; forward use is refused",
    ),
    Transition(
        "recover", (S.QUARANTINED,), S.GRAPH_CAPTURED,
        condition=Condition.HAS_PINNED_GRAPHS,
        guards=(Guard.RECOVERABLE, Guard.PINNED_UNCHANGED),
        doc="the aborted reload was rolled back exactly and graphs are still captured: the last good derived "
            "buffers match the restored weights again, at the pinned addresses",
    ),
    Transition(
        "recover", (S.QUARANTINED,), S.DERIVED_REFRESHED,
        guards=(Guard.RECOVERABLE, Guard.PINNED_UNCHANGED),
        doc="the aborted reload was rolled back exactly: the last good derived buffers match the restored weights",
    ),
)

INITIAL_STATE = S.META
TRIGGERS: tuple[str, ...] = tuple(dict.fromkeys(t.trigger for t in TRANSITIONS))

#: States whose derived buffers match the weights: the fused path may run (everything else refuses it).
USABLE_STATES: frozenset[LifecycleState] = frozenset({S.DERIVED_REFRESHED, S.GRAPH_CAPTURED})
#: The state a failed or aborted load leaves: forward use refused until a reload or `recover`.
QUARANTINE_STATE = S.QUARANTINED

#: trigger -> the follow-up triggers the machine fires itself after it (rows declared with `follows=`).
FOLLOW_UPS: dict[str, tuple[str, ...]] = {}
for _t in TRANSITIONS:
    if _t.follows is not None:
        FOLLOW_UPS.setdefault(_t.follows, ())
        if _t.trigger not in FOLLOW_UPS[_t.follows]:
            FOLLOW_UPS[_t.follows] += (_t.trigger,)


@cache
def allowed_sources(trigger: str) -> tuple[LifecycleState, ...]:
    """Every state from which `trigger` may fire, in declaration order."""
    if trigger not in TRIGGERS:
        raise KeyError(f"unknown trigger {trigger!r}; known: {', '.join(TRIGGERS)}")
    seen: dict[LifecycleState, None] = {}
    for t in TRANSITIONS:
        if t.trigger == trigger:
            seen.update(dict.fromkeys(t.sources))
    return tuple(seen)


@cache
def allowed_triggers(state: LifecycleState) -> frozenset[str]:
    """Every trigger that may fire from `state`."""
    return frozenset(t.trigger for t in TRANSITIONS if state in t.sources)


@cache
def possible_destinations(trigger: str, source: LifecycleState) -> tuple[LifecycleState, ...]:
    """The states `trigger` can lead to from `source` (several when rows carry conditions)."""
    return tuple(dict.fromkeys(t.dest for t in TRANSITIONS if t.trigger == trigger and source in t.sources))


def rows_from(trigger: str, source: LifecycleState) -> tuple[Transition, ...]:
    """The rows of `trigger` that may fire from `source`, in declaration order (the machine takes the first whose
    condition is met)."""
    return ROWS_FROM[trigger][source]


#: trigger -> state -> the rows of the trigger from that state, in declaration order; and state -> the triggers it
#: allows: plain dicts, for the per-bucket path (a lookup, not a call).
ROWS_FROM: dict[str, dict[LifecycleState, tuple[Transition, ...]]] = {
    trigger: {s: tuple(t for t in TRANSITIONS if t.trigger == trigger and s in t.sources) for s in LifecycleState}
    for trigger in TRIGGERS}
ALLOWED_TRIGGERS: dict[LifecycleState, frozenset[str]] = {
    s: frozenset(t.trigger for t in TRANSITIONS if s in t.sources) for s in LifecycleState}


def guards_of(trigger: str) -> tuple[Guard, ...]:
    return tuple(dict.fromkeys(g for t in TRANSITIONS if t.trigger == trigger for g in t.guards))
