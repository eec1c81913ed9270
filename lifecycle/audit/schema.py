"""The event schema the auditor and the report read (schema 2), checked on every line before anything uses it.

Every event has `event`, `backbone`, `rank`, `epoch` and `ts`; each kind the tools read declares the type of
each of its fields (`FIELDS`), and any `<field>_more` or `<field>_truncated` count is a count. A field the
schema does not know is not read by anything and is left alone (a newer writer may add fields); a known field
of the wrong type, a name longer than `NAME_CAP`, a text longer than `TEXT_CAP`, a list longer than `LIST_CAP`,
a count outside 0..2**63-1 or a number that is not finite makes the line an input problem, named by file:line.
Nesting deeper than `MAX_DEPTH` is refused before the JSON parser sees the line (`depth_problem`), so no line
can exhaust the parser's recursion.

>>> problem({"event": "layer_ready", "backbone": "d", "rank": 0, "epoch": 0, "ts": "t", "layer": ["x"]})
"field 'layer': expected a name (a string of at most 4096 characters), got a list of 1 item(s)"
>>> depth_problem(b'{"a":' * 40 + b'1' + b'}' * 40)
'nested 40 deep (at most 16)'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import Any

__all__ = ["FIELDS", "LIST_CAP", "MAX_COUNT", "MAX_DEPTH", "NAME_CAP", "REQUIRED", "TEXT_CAP", "depth_problem",
           "describe", "problem"]

#: Characters in a name (backbone, layer, buffer, trigger, state, ...) and in a text (a reason, an error) at most:
#: the writer cuts every string at 4096 (`lifecycle.events.STR_CAP`), so anything longer was not written by it.
NAME_CAP = TEXT_CAP = 4096
#: Items in a list field at most (the writer keeps 16 names or 256 records).
LIST_CAP = 256
#: Counts (rank, epoch, seq, sizes) lie in 0 .. MAX_COUNT.
MAX_COUNT = 2**63 - 1
#: Nesting of arrays and objects at most (the writer's deepest event, `refresh`, nests 3 deep).
MAX_DEPTH = 16

Check = Callable[[Any], str | None]  # None when the value is fine, else what was expected


def _text(cap: int, what: str) -> Check:
    expected = f"expected {what} (a string of at most {cap} characters)"

    def check(v: Any) -> str | None:
        return None if type(v) is str and len(v) <= cap else expected

    return check


def _count(v: Any) -> str | None:
    return None if type(v) is int and 0 <= v <= MAX_COUNT else "expected a count (an integer from 0 to 2**63-1)"


def _number(v: Any) -> str | None:
    ok = (type(v) is int and abs(v) <= MAX_COUNT) or (type(v) is float and math.isfinite(v))
    return None if ok else "expected a finite number"


def _flag(v: Any) -> str | None:
    return None if type(v) is bool else "expected true or false"


def _flag_or_count(v: Any) -> str | None:
    return None if type(v) is bool or _count(v) is None else "expected true, false or a count"


def _list_of(item: Check, what: str) -> Check:
    def check(v: Any) -> str | None:
        if type(v) is not list or len(v) > LIST_CAP:
            return f"expected a list of at most {LIST_CAP} {what}"
        for i, x in enumerate(v):
            bad = item(x)
            if bad is not None:
                return f"item {i}: {bad}, got {describe(x)}"
        return None

    return check


def _record(fields: Mapping[str, Check], required: tuple[str, ...]) -> Check:
    def check(v: Any) -> str | None:
        if type(v) is not dict:
            return "expected an object"
        for key in required:
            if key not in v:
                return f"field {key!r} missing"
        return _fields_problem(v, fields)

    return check


NAME = _text(NAME_CAP, "a name")
TEXT = _text(TEXT_CAP, "a text")
NAMES = _list_of(NAME, "names")
TEXTS = _list_of(TEXT, "texts")
TIMESTAMP = _text(64, "an ISO-8601 timestamp")
POINTER = _text(64, "an address")

#: The fields of one derived buffer in a `refresh` event.
BUFFER_FIELDS: dict[str, Check] = {
    "name": NAME, "kind": NAME, "mode": NAME, "nbytes": _count, "data_ptr": POINTER,
    "elements_written": _count, "slices_written": _count, "slices_total": _count, "reason": TEXT,
}

#: Fields every event has (`REQUIRED`) or may have.
COMMON: dict[str, Check] = {
    "event": NAME, "backbone": NAME, "rank": _count, "epoch": _count, "ts": TIMESTAMP, "seq": _count,
    "schema": _count, "level": NAME, "layers_ready": _count, "layers_total": _count, "duration_ms": _number,
}
REQUIRED = ("event", "backbone", "rank", "epoch", "ts")

_READINESS: dict[str, Check] = {"missing": NAMES}
#: Per event kind: its fields and their types, and the ones it must have.
FIELDS: dict[str, tuple[dict[str, Check], tuple[str, ...]]] = {
    "transition": ({
        "trigger": NAME, "src": NAME, "dst": NAME, "pinned": _flag_or_count, "from_state": NAME, "tensors": _count,
        "unchanged": _count, "keep_untouched": _flag, "reason": TEXT, "rolled_back": _flag, "restored": _count,
        "recoverable": _flag, "recovery_blocker": TEXT, "rollback_error": TEXT, **_READINESS,
    }, ("trigger", "src", "dst")),
    "refused": ({"trigger": NAME, "src": NAME, "error": TEXT, "reason": TEXT, **_READINESS}, ("trigger", "src")),
    "layer_ready": ({"layer": NAME}, ("layer",)),
    "layers_unchanged": ({"layers": NAMES}, ("layers",)),
    "refresh": ({
        "buffers": _list_of(_record(BUFFER_FIELDS, ("name",)), "buffer records"), "elements_written": _count,
        "bytes_allocated": _count, **_READINESS,
    }, ()),
    "storage_check": ({"action": NAME, "checked": _count, "ok": _flag, "problems": TEXTS}, ("ok",)),
    "hook_run": ({"hook": NAME, "phase": NAME}, ()),
    "hook_failed": ({"hook": NAME, "phase": NAME, "error": TEXT}, ()),
    "session": ({
        "phase": NAME, "rollback": _flag, "finite_check": _flag, "ok": _flag, "checked": _count, "error": TEXT,
        "reason": TEXT, "touched": _count, "snapshot_bytes": _count, "elements_written": _count, "outcome": NAME,
        "recoverable": _flag,
    }, ("phase",)),
    "loader_bucket": ({"bucket": _count, "buckets": _count, "tensors": _count, "nbytes": _count,
                       "layers_completed": NAMES}, ()),
}


def describe(value: Any) -> str:
    """A value for a message, never longer than a line: its type, and for short scalars the value itself."""
    kind = type(value)
    if kind is str:
        return f"a string of {len(value):,} characters" if len(value) > 40 else f"{value!r}"
    if kind is bool or value is None:
        return str(value).lower() if value is not None else "null"
    if kind is int:
        return f"an integer of {value.bit_length()} bits" if value.bit_length() > 64 else str(value)
    if kind is float:
        return repr(value)
    if kind is list:
        return f"a list of {len(value):,} item(s)"
    if kind is dict:
        return "an object"
    return kind.__name__


def _fields_problem(fields: Mapping[str, Any], declared: Mapping[str, Check]) -> str | None:
    for key, value in fields.items():
        check = declared.get(key) or COMMON.get(key)
        if check is None and key.endswith(("_more", "_truncated")):
            check = _count
        if check is not None:
            bad = check(value)
            if bad is not None:
                return f"field {key[:60]!r}: {bad}, got {describe(value)}"
    return None


def problem(fields: dict[str, Any]) -> str | None:
    """What is wrong with a decoded line as an event, or None when it is one."""
    for key in REQUIRED:  # in this order: a bad rank is named before a missing timestamp
        if key not in fields:
            return f"field {key!r} missing"
        bad = COMMON[key](fields[key])
        if bad is not None:
            return f"field {key!r}: {bad}, got {describe(fields[key])}"
    declared, required = FIELDS.get(fields["event"], ({}, ()))
    for key in required:
        if key not in fields:
            return f"field {key!r} missing (a {fields['event']} event has it)"
    return _fields_problem(fields, declared)


_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def depth_problem(raw: bytes) -> str | None:
    """Whether a raw line nests arrays and objects deeper than `MAX_DEPTH`, brackets inside strings not counted.
    Linear in the line (escaped backslashes and quotes are dropped, then every quote delimits a string), and
    only done when the line holds more brackets than `MAX_DEPTH` at all. On a line whose quotes do not pair up
    the count can only be short of what a parser would reach before it fails on the open string."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return None
    outside = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    depth = max(accumulate(map(_STEP.__getitem__, brackets)), default=0)
    return f"nested {depth} deep (at most {MAX_DEPTH})" if depth > MAX_DEPTH else None
