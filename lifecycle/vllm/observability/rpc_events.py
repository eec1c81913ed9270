"""Audit events that arrive over RPC (`lifecycle_serving_state(events=...)`, a finish's `lifecycle=` options): checked
against the audit schema before one is written, and marked with their origin.

The acceptance canary runs in the engine's front process; its events are written by the workers' lifecycles (so
they sit in the draft's own stream, numbered and in its epoch), and reach them over RPC, the same path vLLM's
unauthenticated dev route `/collective_rpc` gives any caller. Nothing unvalidated reaches the audit: an event is
written only when

- it is one of the canary's kinds (`lifecycle.audit.schema.RPC_EVENTS`) at its level;
- its fields are plain JSON (strings, finite numbers, booleans, null, lists, objects) of bounded size and depth, none
  of them one the writer sets (`event`, `backbone`, `rank`, `epoch`, `seq`, `ts`, `node`, `level`, `schema`,
  `origin`: a caller cannot move an event into another stream or epoch, or fill a gap in `seq`);
- the line it becomes passes the auditor's own check (`schema.problem`).

Anything else refuses the whole call (ValueError naming the event and what was wrong), before any event of it is
written. Each event written carries `origin: "rpc"`: the auditor lists its warnings as reported over RPC, and
refuses a line that claims that origin for any other kind (`docs/audit.md`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ...audit.schema import COMMON, LIST_CAP, MAX_DEPTH, NAME_CAP, RPC_EVENTS, RPC_ORIGIN, TEXT_CAP, problem
from .canary import CANARY_EVENTS

__all__ = ["RESERVED", "checked_events"]

#: Fields the writer sets: never taken from a caller.
RESERVED = frozenset(COMMON) | {"level", "schema", "origin"}
#: Fields of one event at most (the canary's have about 20).
_FIELDS_CAP = 64
#: Nesting of a field's value at most (the canary's deepest: a list of counts); the line stays far from MAX_DEPTH.
_VALUE_DEPTH = 4
assert set(CANARY_EVENTS) == set(RPC_EVENTS) and _VALUE_DEPTH < MAX_DEPTH


def _value_problem(value: Any, depth: int = 0) -> str | None:
    kind = type(value)
    if value is None or kind is bool or kind is int:
        return None
    if kind is float:
        return None if math.isfinite(value) else "a number that is not finite"
    if kind is str:
        return None if len(value) <= TEXT_CAP else f"a string of {len(value):,} characters (at most {TEXT_CAP})"
    if depth >= _VALUE_DEPTH:
        return f"nested deeper than {_VALUE_DEPTH}"
    if kind is list:
        if len(value) > LIST_CAP:
            return f"a list of {len(value):,} items (at most {LIST_CAP})"
        return next((f"item {i}: {bad}" for i, v in enumerate(value) if (bad := _value_problem(v, depth + 1))), None)
    if kind is dict:
        if len(value) > LIST_CAP:
            return f"an object of {len(value):,} fields (at most {LIST_CAP})"
        for k, v in value.items():
            if type(k) is not str or len(k) > NAME_CAP:
                return "an object whose keys are not names"
            if (bad := _value_problem(v, depth + 1)) is not None:
                return f"{k[:60]!r}: {bad}"
        return None
    return f"a {kind.__name__}, not a JSON value"


def _event_problem(name: Any, level: Any, fields: Any) -> str | None:
    if name not in RPC_EVENTS:
        return f"event must be one of {', '.join(RPC_EVENTS)}"
    if level != CANARY_EVENTS[name]:
        return f"a {name} event is written at level {CANARY_EVENTS[name]!r}, got {level!r:.40}"
    if type(fields) is not dict:
        return f"fields must be an object, got {type(fields).__name__}"
    if len(fields) > _FIELDS_CAP:
        return f"{len(fields)} fields (at most {_FIELDS_CAP})"
    for key, value in fields.items():
        if type(key) is not str or len(key) > NAME_CAP:
            return "a field name that is not a name"
        if key in RESERVED:
            return f"field {key!r} is the writer's, never a caller's"
        if (bad := _value_problem(value)) is not None:
            return f"field {key[:60]!r}: {bad}"
    # the line as the writer makes it (placeholders for what it sets), through the auditor's own check
    line = {"event": name, "backbone": "b", "rank": 0, "epoch": 0, "ts": "2000-01-01T00:00:00.000000Z", "seq": 1,
            **fields, "origin": RPC_ORIGIN}
    return problem(line)


def checked_events(events: object, what: str) -> list[tuple[str, str, dict[str, Any]]]:
    """[(event, level, fields)] from `events` (a list of `[event, level, fields]`), each checked as the module doc
    says; the first problem refuses them all (ValueError, TypeError), nothing written. `what` names the call."""
    if events is None:
        return []
    if not isinstance(events, Sequence) or isinstance(events, (str, bytes)):
        raise TypeError(f"{what}: events must be a list of [event, level, fields], got {type(events).__name__}")
    if len(events) > LIST_CAP:
        raise ValueError(f"{what}: {len(events):,} events (at most {LIST_CAP}); nothing was written")
    out = []
    for i, item in enumerate(events):
        if not (isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) == 3):
            raise ValueError(f"{what}: events[{i}] must be [event, level, fields], got {type(item).__name__}; "
                             "nothing was written")
        name, level, fields = item
        bad = _event_problem(name, level, fields)
        if bad is not None:
            raise ValueError(f"{what}: events[{i}] ({str(name)[:40]!r}) refused: {bad}; nothing was written")
        assert isinstance(fields, Mapping)
        out.append((str(name), str(level), {**fields, "origin": RPC_ORIGIN}))
    return out
