"""The event schema the auditor and the report read (schema 5), checked on every line before anything uses it.

Every event has `event`, `backbone`, `rank`, `epoch` and `ts`; each kind the tools read declares the type of
every field they read of it (`FIELDS`). A field nothing reads is left alone (a newer writer may add fields); a
declared field of the wrong type, a name longer than `NAME_CAP`, a text longer than `TEXT_CAP`, a list longer
than `LIST_CAP` or a count outside 0..2**63-1 makes the line an input problem, named by file:line.
Nesting deeper than `MAX_DEPTH` is refused before the JSON parser sees the line (`depth_problem`), so no line
can exhaust the parser's recursion.

>>> problem({"event": "layer_ready", "backbone": "d", "rank": 0, "epoch": 0, "ts": "t", "layers": "x"})
"field 'layers': expected a list of at most 256 names, got 'x'"
>>> depth_problem(b'{"a":' * 40 + b'1' + b'}' * 40)
'nested 40 deep (at most 16)'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate
from typing import Any

__all__ = ["COMMON", "FIELDS", "LIST_CAP", "MAX_COUNT", "MAX_DEPTH", "NAME_CAP", "REQUIRED", "RPC_EVENTS", "RPC_ORIGIN",
           "SCHEMA_READ", "TEXT_CAP", "depth_problem", "describe", "problem"]

#: The event schema this auditor reads (`lifecycle.events.SCHEMA_VERSION` of the writer). A line of another
#: version is an input problem: its transitions follow another table or its events another shape (3 added the
#: FINALIZED state, so a schema-2 log's `refresh_derived` from FULLY_LOADED would read as illegal; 4 made
#: `layer_ready` one event per bucket with a list of layers; 5 renamed `finish_loading` to `finalize_loading`). A
#: line without the field is read as this one.
SCHEMA_READ = 5
#: Characters in a name (backbone, layer, buffer, trigger, state, ...) and in a text (a reason, an error) at most:
#: the writer cuts every string at 4096 (`lifecycle.events.STR_CAP`), so anything longer was not written by it.
NAME_CAP = TEXT_CAP = 4096
#: Items in a list field at most (the writer keeps 16 names or 256 records).
LIST_CAP = 256
#: Counts (rank, epoch, seq, sizes) lie in 0 .. MAX_COUNT.
MAX_COUNT = 2**63 - 1
#: Nesting of arrays and objects at most (the writer's deepest event, `refresh`, nests 3 deep).
MAX_DEPTH = 16

#: The `origin` of an event a worker wrote for another process (it arrived over RPC, checked against this schema:
#: lifecycle.vllm.observability.rpc_events), and the only kinds that ever arrive so: the acceptance canary's. A line
#: that claims another origin, or this one for another kind, was not written by reload-lifecycle.
RPC_ORIGIN = "rpc"
RPC_EVENTS = ("acceptance", "acceptance_collapse", "acceptance_recovered")

Check = Callable[[Any], str | None]  # None when the value is fine, else what was expected


def _text(cap: int, what: str) -> Check:
    expected = f"expected {what} (a string of at most {cap} characters)"

    def check(v: Any) -> str | None:
        return None if type(v) is str and len(v) <= cap else expected

    return check


def _count(v: Any) -> str | None:
    return None if type(v) is int and 0 <= v <= MAX_COUNT else "expected a count (an integer from 0 to 2**63-1)"


def _flag(v: Any) -> str | None:
    return None if type(v) is bool else "expected true or false"


def _share(v: Any) -> str | None:
    ok = type(v) in (int, float) and 0 <= v <= 1  # NaN fails both comparisons
    return None if ok else "expected a share (a number from 0 to 1)"


def _share_or_null(v: Any) -> str | None:
    return None if v is None else _share(v)


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


def _record(fields: Mapping[str, Field], required: tuple[str, ...]) -> Check:
    checked = tuple(fields.items())

    def check(v: Any) -> str | None:
        if type(v) is not dict:
            return "expected an object"
        for key in required:
            if key not in v:
                return f"field {key!r} missing"
        return _fields_problem(v, checked)

    return check


NAME = _text(NAME_CAP, "a name")
TEXT = _text(TEXT_CAP, "a text")
NAMES = _list_of(NAME, "names")
TEXTS = _list_of(TEXT, "texts")
TIMESTAMP = _text(64, "an ISO-8601 timestamp")
POINTER = _text(64, "an address")

# A field: (its check, and for the common case a type and a bound tested inline: a str of at most `bound`
# characters, an int from 0 to `bound`, a bool). The inline test is only a fast path: `check` decides.
Field = tuple[Check, type | None, int]
NAME_F: Field = (NAME, str, NAME_CAP)
TEXT_F: Field = (TEXT, str, TEXT_CAP)
COUNT_F: Field = (_count, int, MAX_COUNT)
FLAG_F: Field = (_flag, bool, 0)


def _slow(check: Check) -> Field:
    return (check, None, 0)


#: The fields of one derived buffer in a `refresh` event that the report reads.
BUFFER_FIELDS: dict[str, Field] = {"name": NAME_F, "kind": NAME_F, "mode": NAME_F, "nbytes": COUNT_F,
                                   "data_ptr": _slow(POINTER)}
REQUIRED = ("event", "backbone", "rank", "epoch", "ts")
#: Fields of every event: the required ones (checked first, in this order) and the ones the tools read.
COMMON: dict[str, Field] = {
    "event": NAME_F, "backbone": NAME_F, "rank": COUNT_F, "epoch": COUNT_F, "ts": _slow(TIMESTAMP), "seq": COUNT_F,
    "layers_ready": COUNT_F, "layers_total": COUNT_F, "node": NAME_F, "origin": NAME_F,
}
#: Per event kind the tools read: the fields they read, with their types, and the ones it must have. A field no
#: tool reads is not checked (a newer writer may add fields; `MAX_LINE` and `MAX_DEPTH` bound it all the same).
FIELDS: dict[str, tuple[dict[str, Field], tuple[str, ...]]] = {
    "transition": ({"trigger": NAME_F, "src": NAME_F, "dst": NAME_F, "recoverable": FLAG_F},
                   ("trigger", "src", "dst")),
    "refused": ({"trigger": NAME_F, "src": NAME_F, "error": TEXT_F}, ("trigger", "src")),
    "layer_ready": ({"layers": _slow(NAMES), "layers_more": COUNT_F}, ("layers",)),
    "layers_unchanged": ({"layers": _slow(NAMES), "layers_more": COUNT_F}, ("layers",)),
    "refresh": ({"buffers": _slow(_list_of(_record(BUFFER_FIELDS, ("name",)), "buffer records")),
                 "buffers_more": COUNT_F, "missing": _slow(NAMES), "missing_more": COUNT_F}, ()),
    "weight_version": ({"weight_version": NAME_F}, ("weight_version",)),
    "storage_check": ({"ok": FLAG_F, "action": NAME_F, "problems": _slow(TEXTS), "problems_more": COUNT_F}, ("ok",)),
    # the acceptance canary's (lifecycle.vllm.observability.canary): a serving period's figures, a collapse, a recovery
    "acceptance": ({"period": COUNT_F, "draft_tokens": COUNT_F, "accepted_tokens": COUNT_F,
                    "accepted_share": _slow(_share_or_null), "weight_version": TEXT_F, "push": NAME_F, "final": FLAG_F,
                    "collapsed": FLAG_F}, ("period", "draft_tokens", "accepted_tokens")),
    "acceptance_collapse": ({"period": COUNT_F, "draft_tokens": COUNT_F, "accepted_share": _slow(_share),
                             "previous_period": COUNT_F, "previous_share": _slow(_share),
                             "weight_version": TEXT_F, "previous_weight_version": TEXT_F, "push": NAME_F,
                             "previous_push": NAME_F, "floor": _slow(_share), "healthy": _slow(_share)},
                            ("period", "draft_tokens", "accepted_share", "previous_share")),
    "acceptance_recovered": ({"period": COUNT_F, "accepted_share": _slow(_share), "collapsed_period": COUNT_F,
                              "weight_version": TEXT_F, "push": NAME_F}, ("period", "accepted_share")),
}
_ABSENT = object()
_REQUIRED_FIELDS = tuple((k, COMMON[k]) for k in REQUIRED)
_COMMON_FIELDS = _REQUIRED_FIELDS + tuple((k, f) for k, f in COMMON.items() if k not in REQUIRED)
#: Per kind: every (field, type) to check, the required ones first, as one tuple (the hot path of the auditor).
_CHECKED: dict[str, tuple[tuple[str, Field], ...]] = {
    kind: _COMMON_FIELDS + tuple(declared.items()) for kind, (declared, _) in FIELDS.items()}


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


def _fields_problem(fields: Mapping[str, Any], checked: Iterable[tuple[str, Field]]) -> str | None:
    for key, (check, fast, bound) in checked:
        value = fields.get(key, _ABSENT)
        if value is _ABSENT:
            continue
        kind = type(value)  # the common case inline (this loop runs for every field of every line)
        if kind is fast and (kind is bool or (len(value) <= bound if kind is str else 0 <= value <= bound)):
            continue
        bad = check(value)
        if bad is not None:
            return f"field {key[:60]!r}: {bad}, got {describe(value)}"
    return None


def problem(fields: dict[str, Any]) -> str | None:
    """What is wrong with a decoded line as an event, or None when it is one."""
    version = fields.get("schema", SCHEMA_READ)
    if version != SCHEMA_READ or type(version) is not int:
        return (f"written with event schema {describe(version)}; this auditor reads schema {SCHEMA_READ} (schema 5 "
                "renamed finish_loading to finalize_loading, 4 made layer_ready one event per bucket, 3 added the "
                "FINALIZED state): audit it with the reload-lifecycle release that wrote it")
    for key in REQUIRED:
        if key not in fields:
            bad = _fields_problem(fields, _REQUIRED_FIELDS)  # a bad rank is named before a missing timestamp
            return bad if bad is not None else f"field {key!r} missing"
    kind = fields["event"]
    origin = fields.get("origin")
    if origin is not None and (origin != RPC_ORIGIN or kind not in RPC_EVENTS):
        return (f"field 'origin': {describe(origin)} on a {describe(kind)} event; a worker marks only the acceptance "
                f"canary's events ({', '.join(RPC_EVENTS)}) with origin {RPC_ORIGIN!r}: this line was not written "
                "by reload-lifecycle")
    declared, required = FIELDS.get(kind, (None, ())) if type(kind) is str else (None, ())
    for key in required:
        if key not in fields:
            return _fields_problem(fields, _REQUIRED_FIELDS) or f"field {key!r} missing (a {kind} event has it)"
    return _fields_problem(fields, _CHECKED[kind] if declared is not None else _COMMON_FIELDS)


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
