"""What the replay checks, read from the transition table: the check behind each guard and condition, the rows
(trigger, src, dst) and what each needs, and the violations the auditor names.

Every member of `Guard` and `Condition` maps to the `Check` the replay makes from a log; a member (or a row's
guard or condition) the maps do not know fails this module's import, so the table cannot grow a rule that the
auditor silently ignores. Follow-up rows (`Transition.follows`) need nothing of their own: the machine logs them
as ordinary transitions, checked like any other row.

>>> from lifecycle.states import LifecycleState as S
>>> sorted(c.name for c in ROW_CHECKS[("recover", S.QUARANTINED.value, S.GRAPH_CAPTURED.value)])
['PINNED', 'RECOVERABLE', 'STORAGE']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from types import MappingProxyType

from ..states import INITIAL_STATE, TRANSITIONS, Condition, Guard, LifecycleState, Transition, allowed_sources

__all__ = [
    "ABORT",
    "BEGIN",
    "CAPTURE",
    "CONDITION_CHECKS",
    "FINISH",
    "GUARD_CHECKS",
    "INITIAL",
    "LOADING_STATES",
    "REFRESH",
    "REFRESH_STATES",
    "RELEASE",
    "REPLAYED_TRIGGERS",
    "ROW_CHECKS",
    "STATE_NAMES",
    "VIOLATION_KINDS",
    "WARNING_KINDS",
    "WEIGHTS",
    "WEIGHTS_STATES",
    "Check",
    "checks_of",
    "unknown_table_names",
]


class Check(Enum):
    """What the replay checks when a row that carries a guard or condition fires."""

    READY = "every layer ready"  # by the epoch's layer_ready/layers_unchanged events, and by the event's own count
    PINNED = "graphs captured"  # a capture_graphs not released since
    RECOVERABLE = "an exact rollback"  # the last abort_reload said recoverable=true; one recover uses it up
    STORAGE = "pinned storage unchanged"  # not at the transition: refresh and storage_check events carry the proof


GUARD_CHECKS: Mapping[Guard, Check] = MappingProxyType({
    Guard.ALL_LAYERS_READY: Check.READY,
    Guard.PINNED: Check.PINNED,
    Guard.PINNED_UNCHANGED: Check.STORAGE,
    Guard.RECOVERABLE: Check.RECOVERABLE,
})
CONDITION_CHECKS: Mapping[Condition, Check] = MappingProxyType({
    Condition.ALL_LAYERS_READY: Check.READY,
    Condition.HAS_PINNED_GRAPHS: Check.PINNED,
})

# Triggers whose effect beyond the state the replay replays (a new epoch, pinning, unpinning, the abort's verdict),
# and those that emit the events it checks (refresh; layer_ready and layers_unchanged; the end of loading).
BEGIN, CAPTURE, RELEASE, ABORT = "begin_reload", "capture_graphs", "release_graphs", "abort_reload"
REFRESH, WEIGHTS, FINISH = "refresh_derived", "weights_loaded", "finalize_loading"
REPLAYED_TRIGGERS = (BEGIN, CAPTURE, RELEASE, ABORT, REFRESH, WEIGHTS, FINISH)


def _name(member: str) -> str:
    return member.value if isinstance(member, Enum) else member


def unknown_table_names(transitions: Iterable[Transition] = TRANSITIONS, *, guards: Iterable[str] = tuple(Guard),
                        conditions: Iterable[str] = tuple(Condition)) -> list[str]:
    """Guards, conditions and replayed triggers the replay does not understand (must be empty)."""
    transitions = tuple(transitions)
    triggers = {t.trigger for t in transitions}
    out = [f"guard {_name(g)}" for g in guards if g not in GUARD_CHECKS]
    out += [f"condition {_name(c)}" for c in conditions if c not in CONDITION_CHECKS]
    out += [f"guard {_name(g)}" for t in transitions for g in t.guards if g not in GUARD_CHECKS]
    out += [f"condition {_name(t.condition)}" for t in transitions
            if t.condition is not None and t.condition not in CONDITION_CHECKS]
    out += [f"trigger {name}" for name in REPLAYED_TRIGGERS if name not in triggers]
    return sorted(set(out))


if unknown_table_names():  # pragma: no cover - a table change the auditor must learn about
    raise ImportError(f"lifecycle.audit does not know {unknown_table_names()} of the transition table")


def checks_of(row: Transition) -> frozenset[Check]:
    """The checks one row of the table needs from the replay."""
    checks = {GUARD_CHECKS[g] for g in row.guards}
    if row.condition is not None:
        checks.add(CONDITION_CHECKS[row.condition])
    return frozenset(checks)


def _row_checks() -> dict[tuple[str, str, str], frozenset[Check]]:
    rows: dict[tuple[str, str, str], frozenset[Check]] = {}
    for t in TRANSITIONS:
        for s in t.sources:
            rows.setdefault((t.trigger, s.value, t.dest.value), checks_of(t))
    return rows


#: (trigger, src, dst) -> the checks of the first row of the table that has it. The replay works on state names.
ROW_CHECKS: Mapping[tuple[str, str, str], frozenset[Check]] = MappingProxyType(_row_checks())

STATE_NAMES: Mapping[str, LifecycleState] = MappingProxyType({s.value: s for s in LifecycleState})
INITIAL = INITIAL_STATE.value
#: States in which a load is still going on (`finalize_loading` may fire); the events that only the trigger emitting
#: them may explain must come in a state that allows it.
LOADING_STATES = frozenset(s.value for s in allowed_sources(FINISH))
WEIGHTS_STATES = frozenset(s.value for s in allowed_sources(WEIGHTS))
REFRESH_STATES = frozenset(s.value for s in allowed_sources(REFRESH))


def _rows_needing(check: Check) -> list[str]:
    """The rows that need `check`, for people: `trigger` when every row of it does, else `trigger -> DEST`."""
    names: dict[str, None] = {}
    for t in TRANSITIONS:
        if check in checks_of(t):
            every = all(check in checks_of(u) for u in TRANSITIONS if u.trigger == t.trigger)
            names[t.trigger if every else f"{t.trigger} -> {t.dest.value}"] = None
    return list(names)


def _or(names: Iterable[str]) -> str:
    *head, last = names
    return f"{', '.join(head)} or {last}" if head else last


#: Every violation the auditor names, and what it means (the rows and states named come from the table).
VIOLATION_KINDS: dict[str, str] = {
    "illegal_transition": "src -> dst is not a row of the transition table for that trigger (or an unknown trigger "
                          f"or state, or {_or(_rows_needing(Check.PINNED))} without captured graphs, or "
                          f"{_or(_rows_needing(Check.RECOVERABLE))} after an abort that was not rolled "
                          "back exactly)",
    "state_mismatch": "an event's src is not the state the replay says the backbone was in",
    "event_out_of_state": "a refresh, layer_ready or layers_unchanged event while the replayed state does not allow "
                          f"the trigger that emits it ({REFRESH}, {WEIGHTS})",
    "not_ready": f"a trigger that needs every layer ready ({', '.join(_rows_needing(Check.READY))}) fired while "
                 "the replayed readiness had layers missing; or a refresh event with missing tensors",
    "storage_drift": "a pinned storage identity changed: a derived buffer's data_ptr in a refresh under captured "
                     f"graphs differs from the one recorded at {CAPTURE}, or a storage_check with ok=false",
    "ends_mid_reload": "the log ends (or the lifecycle restarts) while a reload is still loading: last state "
                       f"{_or(s.value for s in allowed_sources(FINISH))} in epoch > 0",
    "epoch_disagreement": "ranks of one backbone end at different epochs",
    "epoch_jump": f"the epoch changed other than by {BEGIN} raising it by one",
    "out_of_order": "within one rank/backbone: a timestamp going backwards, an epoch decreasing, or a sequence "
                    "number repeated or going back",
    "missing_events": "a gap in the sequence numbers (`seq`) of one rank/backbone: lines were deleted or lost",
}

_RESTART_STATES = _or(s.value for s in allowed_sources(BEGIN) if s.value in LOADING_STATES)
#: What the auditor reports without calling it a violation (counted and listed; the exit status is not changed).
WARNING_KINDS: dict[str, str] = {
    "abandoned_epoch": f"a reload epoch was loaded but the next {BEGIN} came before it was refreshed or aborted: "
                       f"a restarted push ({BEGIN} from {_RESTART_STATES} is a row of the table); the dirty set keeps "
                       "the abandoned epoch's writes, so the next refresh still rewrites what they touched",
    "acceptance_collapse": "after a push the draft's accepted share of draft tokens fell to the floor over enough "
                           "draft tokens while the serving period before it was clearly above it (the acceptance "
                           "canary, lifecycle.vllm.observability.canary): the push most likely broke the draft "
                           "(wrong or corrupt checkpoint, a draft for another target); outputs stay the target's, "
                           "only slower",
}
