"""The lifecycle states and the transition table: the single source of truth.

The machine (`machine.py`), the diagram (`diagram.py`), the tests and the docs all read `TRANSITIONS`;
nothing else spells out which trigger may fire from which state.

>>> from lifecycle.states import LifecycleState, allowed_sources
>>> [s.value for s in allowed_sources("capture_graphs")]
['DERIVED_REFRESHED']
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cache


class LifecycleState(str, Enum):
    META = "META"
    PARTIALLY_LOADED = "PARTIALLY_LOADED"
    FULLY_LOADED = "FULLY_LOADED"
    DERIVED_REFRESHED = "DERIVED_REFRESHED"
    GRAPH_CAPTURED = "GRAPH_CAPTURED"
    QUARANTINED = "QUARANTINED"

    def __str__(self) -> str:
        return self.value


S = LifecycleState


@dataclass(frozen=True)
class Transition:
    """One row of the table. `condition` names a predicate on the lifecycle that picks this row among
    several rows of the same trigger (first match wins); `guards` name checks that raise with the full
    reason and so refuse the trigger, leaving the state unchanged."""

    trigger: str
    sources: tuple[LifecycleState, ...]
    dest: LifecycleState
    condition: str | None = None
    guards: tuple[str, ...] = ()
    doc: str = ""


TRANSITIONS: tuple[Transition, ...] = (
    Transition(
        "weights_loaded", (S.META, S.PARTIALLY_LOADED, S.FULLY_LOADED), S.FULLY_LOADED,
        condition="all_layers_ready",
        doc="a bucket of tensors arrived and every layer is now ready",
    ),
    Transition(
        "weights_loaded", (S.META, S.PARTIALLY_LOADED), S.PARTIALLY_LOADED,
        doc="a bucket of tensors arrived; some layer still misses tensors",
    ),
    Transition(
        "begin_reload",
        (S.FULLY_LOADED, S.DERIVED_REFRESHED, S.GRAPH_CAPTURED, S.QUARANTINED), S.PARTIALLY_LOADED,
        doc="a new reload epoch starts; storage stays pinned if graphs were captured",
    ),
    Transition(
        "finish_loading", (S.PARTIALLY_LOADED, S.FULLY_LOADED), S.FULLY_LOADED,
        guards=("require_all_layers_ready",),
        doc="the loader is done; every layer must be ready (LayersNotReadyError otherwise)",
    ),
    Transition(
        "refresh_derived", (S.FULLY_LOADED,), S.DERIVED_REFRESHED,
        guards=("require_all_layers_ready", "require_pinned_unchanged"),
        doc="derived buffers were built (cold) or refreshed in place, all validated (and, under captured "
            "graphs, every pinned identity checked) before any write",
    ),
    Transition(
        "graphs_verified", (S.DERIVED_REFRESHED,), S.GRAPH_CAPTURED,
        guards=("require_pinned", "require_pinned_unchanged"),
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
        "abort_reload", (S.PARTIALLY_LOADED, S.FULLY_LOADED), S.QUARANTINED,
        doc="a load failed or was aborted: derived buffers keep their last good values; forward use is refused",
    ),
    Transition(
        "recover", (S.QUARANTINED,), S.GRAPH_CAPTURED,
        condition="has_pinned_graphs",
        guards=("require_recoverable", "require_pinned_unchanged"),
        doc="the aborted reload was rolled back exactly and graphs are still captured: the last good derived "
            "buffers match the restored weights again, at the pinned addresses",
    ),
    Transition(
        "recover", (S.QUARANTINED,), S.DERIVED_REFRESHED,
        guards=("require_recoverable", "require_pinned_unchanged"),
        doc="the aborted reload was rolled back exactly: the last good derived buffers match the restored weights",
    ),
)

INITIAL_STATE = S.META
TRIGGERS: tuple[str, ...] = tuple(dict.fromkeys(t.trigger for t in TRANSITIONS))


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


def possible_destinations(trigger: str, source: LifecycleState) -> tuple[LifecycleState, ...]:
    """The states `trigger` can lead to from `source` (several when rows carry conditions)."""
    return tuple(dict.fromkeys(t.dest for t in TRANSITIONS if t.trigger == trigger and source in t.sources))


def guards_of(trigger: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(g for t in TRANSITIONS if t.trigger == trigger for g in t.guards))
