"""Audit events: one structlog record per trigger, refusal, refresh and storage check.

>>> import structlog
>>> with structlog.testing.capture_logs() as logs:
...     emit("transition", backbone="draft", rank=0, epoch=1, trigger="begin_reload",
...          src="GRAPH_CAPTURED", dst="PARTIALLY_LOADED")
>>> logs[0]["event"], logs[0]["dst"]
('transition', 'PARTIALLY_LOADED')

In production `configure_audit(json_path=...)` writes JSON lines (UTC ISO-8601 timestamps, a schema version,
the `node` that wrote them: the host name, so logs of several machines merge) and, optionally, readable lines
to the terminal. Events carry names, counts, shapes and addresses, never
tensor values; lists (missing tensors) are capped with a count of what was left out.

The audit logger is this module's own: a structlog bound logger with its own processor chain, built by
`configure_audit`. Nothing here calls `structlog.configure`, so a host application's structlog configuration
and its events are left alone, and its events never reach the audit files. While `structlog.testing.capture_logs()`
is active (it swaps structlog's global chain for a capturing one), audit events go to that capture instead, as
they would through the global chain. Until `configure_audit` is called, events are only kept in memory (each
lifecycle's `recent_events`).

Every event is bounded before it is written or kept: at most `LIST_CAP` items in a list of names (the rest
counted in `<field>_more`), at most `STR_CAP` characters in a string (the cut counted in `<field>_truncated`),
an integer of more than `INT_BITS_CAP` bits as its size, and a tensor that slipped into a field as its
description, never its values:

>>> import torch
>>> ev = bound_event(None, "info", {"names": [f"t{i}" for i in range(20)], "reason": "x" * 5000,
...                                 "oops": torch.ones(3), "huge": 10 ** 5000})
>>> len(ev["names"]), ev["names_more"], len(ev["reason"]), ev["reason_truncated"], ev["oops"], ev["huge"]
(16, 4, 4096, 904, '<tensor shape=(3,) dtype=torch.float32 device=cpu>', '<int of 16610 bits>')

The sink never changes what the lifecycle does: a write that fails (a full disk, a closed or no longer
writable descriptor, a console stream that went away) is counted (`sink_failures()`, and a `sink_failures`
field on the events each lifecycle keeps), reported once on stderr, and the event goes on; `emit` never raises.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import json.encoder
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.testing import LogCapture

__all__ = [
    "INT_BITS_CAP",
    "LEVELS",
    "LIST_CAP",
    "LOGGER_NAME",
    "RECORDS_CAP",
    "SCHEMA_VERSION",
    "STR_CAP",
    "TS_FORMAT",
    "AuditSinkError",
    "JsonLinesSink",
    "add_schema_version",
    "bound_event",
    "bound_fields",
    "configure_audit",
    "emit",
    "emit_held",
    "emit_held_lines",
    "emit_record",
    "enabled",
    "encode_string",
    "flush_holders",
    "hold_events",
    "host_name",
    "read_events",
    "register_holder",
    "sink_failures",
    "timestamp",
    "timestamps",
]

#: Version of the event schema (the `schema` field). 2: `seq`, fixed-width timestamps, `_more`/`_truncated` counts;
#: 3: the FINALIZED state (finish_loading ends there, refresh_derived starts there; hooks run inside finish_loading);
#: 4: one `layer_ready` event per bucket, listing the layers it completed (`layers`, `layers_more`, `tensors`), and
#: no `transition` event for a bucket that leaves PARTIALLY_LOADED as it is.
SCHEMA_VERSION = 4
#: The audit logger's name (its events carry no logger name: the chain is its own, see the module doc).
LOGGER_NAME = "reload_lifecycle"
#: At most this many names in a list field; the rest are counted in `<field>_more`.
LIST_CAP = 16
#: At most this many records (dicts) in a list field, such as the per-buffer records of a `refresh` event, and
#: at most this many keys in a mapping field.
RECORDS_CAP = 256
#: At most this many characters in a string field; the number cut is `<field>_truncated`.
STR_CAP = 4096
#: An integer wider than this is written as `<int of N bits>` (Python refuses to print one of over 4,300 digits).
INT_BITS_CAP = 64
#: Nesting deeper than this (lists in dicts in lists ...) is written as a description.
DEPTH_CAP = 4
#: UTC, always with microseconds: fixed width, so timestamps of one log also sort as strings.
TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
#: The levels `configure_audit` and `emit` accept, lowest first.
LEVELS = ("debug", "info", "warning", "error", "critical")
_LEVEL_NUMBERS = {name: logging.getLevelNamesMapping()[name.upper()] for name in LEVELS}


class AuditSinkError(OSError):
    """The audit log could not be opened (`configure_audit`); the previous configuration stays in force."""


# ---- bounding -----------------------------------------------------------------------------------------------------


def _describe_tensor(value: Any) -> str | None:
    """A tensor (or anything tensor-like from torch/numpy) as its description; None for anything else."""
    module = type(value).__module__
    if not module.startswith(("torch", "numpy")) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return None
    device = getattr(value, "device", "cpu")
    return f"<tensor shape={tuple(value.shape)} dtype={value.dtype} device={device}>"


def _bound_value(key: str, value: Any, out: MutableMapping[str, Any], depth: int = 0) -> Any:
    kind = type(value)
    if kind is int:
        return value if value.bit_length() <= INT_BITS_CAP else f"<int of {value.bit_length()} bits>"
    if kind is bool or kind is float or value is None:
        return value
    if kind is str:
        if len(value) > STR_CAP:
            out[f"{key}_truncated"] = len(value) - STR_CAP
            return value[:STR_CAP]
        return value
    if isinstance(value, (dict, list, tuple)) and depth >= DEPTH_CAP:
        return f"<{kind.__name__} nested deeper than {DEPTH_CAP}>"
    if isinstance(value, dict):
        inner: dict[str, Any] = {}
        items = list(value.items())
        if len(items) > RECORDS_CAP:
            out[f"{key}_more"] = out.get(f"{key}_more", 0) + len(items) - RECORDS_CAP
            items = items[:RECORDS_CAP]
        for k, v in items:
            inner[k] = _bound_value(str(k), v, inner, depth + 1)
        return inner
    if isinstance(value, (list, tuple)):
        records = any(isinstance(v, dict) for v in value)
        cap = RECORDS_CAP if records else LIST_CAP
        if len(value) > cap:
            out[f"{key}_more"] = out.get(f"{key}_more", 0) + len(value) - cap
            value = value[:cap]
        items: list[Any] = []
        for v in value:
            holder: dict[str, Any] = {}
            items.append(_bound_value(key, v, holder, depth + 1))
        return items
    if isinstance(value, (bool, int, float, str)):  # a subclass (an enum, a numpy scalar): its plain value
        plain = next(t for t in (bool, int, float, str) if isinstance(value, t))
        return _bound_value(key, plain.__str__(value) if plain is str else plain(value), out, depth)
    described = _describe_tensor(value)
    if described is not None:
        return described
    return _bound_value(key, str(value), out, depth)


def bound_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A bounded copy of an event's fields (see the module doc); what is written and what lifecycles keep."""
    out = dict(fields)
    bound_event(None, "", out)
    return out


_INT_BOUND = 2 ** INT_BITS_CAP  # |value| < this: at most INT_BITS_CAP bits


def bound_event(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Processor: bounded size, no tensor values (see the module doc)."""
    slow = None
    for key, value in event_dict.items():  # the common values decided inline: this runs for every event
        kind = type(value)
        if (kind is str and len(value) <= STR_CAP) or kind is bool or kind is float or value is None \
                or (kind is int and -_INT_BOUND < value < _INT_BOUND):
            continue
        if slow is None:
            slow = []
        slow.append(key)
    if slow is None:
        return event_dict
    extra: dict[str, Any] = {}
    for key in slow:
        event_dict[key] = _bound_value(key, event_dict[key], extra)
    for key, value in extra.items():  # a count the caller already gave is added to, not replaced
        given = event_dict.get(key, 0)
        event_dict[key] = value + given if key.endswith("_more") and type(given) is int else value
    return event_dict


def add_schema_version(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event_dict.setdefault("schema", SCHEMA_VERSION)
    return event_dict


#: The last whole second formatted: when it starts (ns) and its date and time up to the decimal point. Replaced
#: whole: safe across threads. At first a start far ahead of any time: the first call formats its second.
_second: tuple[int, str] = (1 << 80, "")


#: "000" to "999": a timestamp's microseconds as two lookups (a third of the time of a zero-padded format).
_THREE_DIGITS = tuple(f"{i:03d}" for i in range(1000))


def _format_second(now_ns: int) -> tuple[int, str]:
    global _second
    sec = now_ns // 1_000_000_000
    _second = (sec * 1_000_000_000, time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(sec)))
    return _second


def timestamp(now_ns: int | None = None) -> str:
    """Now (or `now_ns`, from `time.time_ns()`), UTC, in `TS_FORMAT` (`2026-01-01T12:00:00.000001Z`, always
    with microseconds). The date and time of the second are formatted once per second; an event adds only the
    microseconds.

    >>> import datetime, re
    >>> bool(re.fullmatch(r"\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{6}Z", timestamp()))
    True
    """
    if now_ns is None:
        now_ns = time.time_ns()
    start, day = _second
    us = (now_ns - start) // 1000
    if not 0 <= us < 1_000_000:
        start, day = _format_second(now_ns)
        us = (now_ns - start) // 1000
    return f"{day}{_THREE_DIGITS[us // 1000]}{_THREE_DIGITS[us % 1000]}Z"


def timestamps(times_ns: Iterable[int]) -> list[str]:
    """`timestamp(t)` for each of `times_ns` (a holder's batch of events, in one call)."""
    out = []
    start, day = _second
    digits = _THREE_DIGITS
    for now_ns in times_ns:
        us = (now_ns - start) // 1000
        if not 0 <= us < 1_000_000:
            start, day = _format_second(now_ns)
            us = (now_ns - start) // 1000
        out.append(f"{day}{digits[us // 1000]}{digits[us % 1000]}Z")
    return out


def add_timestamp(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Processor: `ts`, as `timestamp()` (what structlog's TimeStamper writes with `TS_FORMAT`, in a tenth of the
    time)."""
    event_dict["ts"] = timestamp()
    return event_dict


# ---- failures -----------------------------------------------------------------------------------------------------

_failures_lock = threading.Lock()
_failures = 0


def sink_failures() -> int:
    """How many audit events could not be written in this process (by any sink, since it started)."""
    return _failures


def _count_failure(what: str, error: BaseException, first: bool, lines: int = 1) -> None:
    """Count lost events (one write of `lines` events); on the first failure of a sink, say so once on stderr."""
    global _failures
    with _failures_lock:
        _failures += lines
    if first:
        _say(f"audit {what}: {type(error).__name__}: {error}; the lifecycle goes on, and this and later lost "
             "events are counted (lifecycle.events.sink_failures(), the `sink_failures` field of recent events)")


def _say(message: str) -> None:
    with contextlib.suppress(Exception):  # stderr itself may be gone: the count stays
        print(f"reload-lifecycle: {message}", file=sys.stderr, flush=True)


# ---- the JSON-lines sink ------------------------------------------------------------------------------------------


class JsonLinesSink:
    """Processor that appends the event as one JSON line to a file and passes it on unchanged.

    One `write(2)` per line on a descriptor opened with O_APPEND: nothing is buffered, so a failed write loses
    that line only (and a line torn by a partial write is ended before the next one, so the auditor names it
    and reads on). A failure is counted (`failures`, and the process-wide `sink_failures()`), reported once on
    stderr, and never raised."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            shown = str(self.path) if len(str(self.path)) <= 200 else f"{str(self.path)[:200]}..."
            raise AuditSinkError(e.errno, f"cannot open the audit log {shown}: {e.strerror or e}") from e
        self._lock = threading.Lock()
        self._torn = False
        self.closed = False
        self.failures = 0
        # what comes before an event's fields (`{"node":...,`) and after them up to its timestamp, for the last
        # node and level written: encoded once, not per line
        self._frame: tuple[str, str, str, str] | None = None

    def __call__(self, _logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        try:
            data = (_encode(event_dict) + "\n").encode()
        except (TypeError, ValueError) as e:
            self._failed(e)
        else:
            self._write(data)
        return event_dict

    def write_record(self, record: Mapping[str, Any], level: str, node: str) -> None:
        """Write a bounded record as the processor chain would (`node` first, as the chain binds it; `level`,
        `ts`, `schema` added after its fields, in that order), without the chain: the route of a JSON file alone
        takes this path."""
        line = self._line(record, level, node, None)
        if line is not None:
            self._write(line.encode())

    def write_held(self, records: list[Mapping[str, Any]], times_ns: list[int], level: str, node: str) -> None:
        """Write records a lifecycle held back (per-bucket events, `hold_events`), each with the time it was
        made, as `write_record` would, in one `write(2)`: a failure loses these lines only."""
        lines = [line for record, now_ns in zip(records, times_ns, strict=True)
                 if (line := self._line(record, level, node, now_ns)) is not None]
        if lines:
            self._write("".join(lines).encode())

    def write_held_lines(self, lines: Callable[[str, str, str], str], level: str, node: str) -> None:
        """Write held events that format their lines themselves, in one `write(2)`: `lines(head, middle, end)`
        returns, for each event, `head + fields + middle + timestamp(its time) + end`, where `fields` is the
        inside of the JSON object `_encode` writes for its record (`"event":"layer_ready",...`): the lines
        `write_held` writes for those records, without a record to build or encode per event."""
        _, _, head, middle = self._frame_for(level, node)
        text = lines(head, middle, _LINE_END)
        if text:
            self._write(text.encode())

    def _frame_for(self, level: str, node: str) -> tuple[str, str, str, str]:
        """(node, level, what comes before a record's fields, what comes after them up to the timestamp)."""
        frame = self._frame
        if frame is None or frame[0] != node or frame[1] != level:
            frame = self._frame = (node, level, f'{{"node":{_encode(node)},', f',"level":"{level}","ts":"')
        return frame

    def _line(self, record: Mapping[str, Any], level: str, node: str, now_ns: int | None) -> str | None:
        """One JSON line for `record` (None, counted as lost, when it cannot be encoded)."""
        try:
            if "level" in record or "ts" in record or "schema" in record or "node" in record or not record:
                # never from a lifecycle: the fields merged as the chain merges them
                return _encode({"node": node, **record, "level": level, "ts": timestamp(now_ns),
                                "schema": record.get("schema", SCHEMA_VERSION)}) + "\n"
            line = _encode(record)
        except (TypeError, ValueError) as e:
            self._failed(e)
            return None
        # node before and the three fields after the encoded object's own: the same line as encoding the dict
        _, _, head, middle = self._frame_for(level, node)
        return f"{head}{line[1:-1]}{middle}{timestamp(now_ns)}{_LINE_END}"

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self.closed:
                self._failed(ValueError("the sink was closed"), data.count(b"\n"))
                return
            if self._torn:
                data = b"\n" + data
            left = len(data)
            try:
                left -= os.write(self._fd, data)  # one call writes the line, nearly always
                if left:
                    view = memoryview(data)[len(data) - left:]
                    while view:
                        view = view[os.write(self._fd, view):]
                        left = len(view)
                self._torn = False
            except OSError as e:
                self._torn = self._torn or left < len(data)  # a line cut part way: the next starts on a new line
                self._failed(e, data.count(b"\n", len(data) - left))  # the lines not written to their end

    def _failed(self, error: BaseException, lines: int = 1) -> None:
        first = self.failures == 0
        self.failures += lines
        _count_failure(f"sink {self.path}", error, first=first, lines=lines)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(OSError):  # already closed behind our back: nothing left to release
                os.close(self._fd)


#: What `json.dumps(..., default=str, separators=(",", ":"))` writes. The C encoder is made once (`JSONEncoder.
#: encode` makes a new one per call: half the cost of a small event); records are flat, bounded and acyclic, so no
#: circular-reference markers. Without the C accelerator, the Python encoder.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
_C_ENCODER = (json.encoder.c_make_encoder(None, str, json.encoder.encode_basestring_ascii, None, ":", ",", False,
                                          False, True) if json.encoder.c_make_encoder is not None else None)


#: How every written line ends, after its timestamp.
_LINE_END = f'","schema":{SCHEMA_VERSION}}}\n'
#: A string as the JSON encoder writes it (ensure_ascii: quoted, escaped, non-ASCII as \uXXXX escapes): for a
#: holder that formats its events' lines itself (`emit_held_lines`).
encode_string = json.encoder.encode_basestring_ascii


def _encode(record: Mapping[str, Any]) -> str:
    if _C_ENCODER is None:
        return _ENCODER.encode(record)
    return "".join(_C_ENCODER(record, 0))


def _drop(_logger: Any, _name: str, _event_dict: MutableMapping[str, Any]) -> str:
    raise structlog.DropEvent


# ---- configuration ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Route:
    """Where events go now: replaced whole by `configure_audit`, read once per event (no lock on the hot path)."""

    logger: Any | None  # None: nothing to write (events are bounded and kept by each lifecycle only)
    sink: JsonLinesSink | None
    level: int
    failed_once: list[bool]  # a failure outside the sink (the console) was reported already
    json_only: bool = False  # a JSON file and no console: records go straight to the sink (`write_record`)
    node: str = ""  # what every written event carries as `node` (the chain binds it; `write_record` is told)


_route = _Route(None, None, _LEVEL_NUMBERS["info"], [False])
_configure_lock = threading.Lock()


def _level_number(level: Any, who: str, *, any_case: bool = False) -> int:
    """The number of a level name (`any_case`: as a user may spell it, `INFO`); else a ValueError naming `who`."""
    number = _LEVEL_NUMBERS.get(level.lower() if any_case else level) if isinstance(level, str) else None
    if number is None:
        raise ValueError(f"{who}: level must be one of {', '.join(LEVELS)}, got {level!r:.80}")
    return number


def configure_audit(json_path: str | os.PathLike[str] | None = None, *, console: bool = True, level: str = "info",
                    stream: TextIO | None = None, node: str | None = None) -> JsonLinesSink | None:
    """Route audit events: JSON lines to `json_path` (if given) and readable lines to `stream` (stderr by
    default) if `console`; events below `level` are not written. Every written event carries `node`, the
    machine that wrote it (default: this host's name), so the logs of several nodes can be merged. Returns the
    file sink (close it, or call again, to release the file). Configures only the audit logger, never
    structlog's process-wide defaults.

    The new route is built whole before it replaces the old one: a `json_path` that cannot be opened raises
    `AuditSinkError` (naming the path) and leaves the previous route in force; the previous sink is closed
    afterwards, and a failure to close it (a broken file) does not stop the switch."""
    global _route
    number = _level_number(level, "configure_audit", any_case=True)
    flush_holders()  # events held for the route in force go to it, not to the next one
    if json_path is not None and not isinstance(json_path, (str, os.PathLike)):
        raise TypeError(f"configure_audit: json_path must be a str or a path, got {type(json_path).__name__}")
    if not isinstance(console, bool):
        raise TypeError(f"configure_audit: console must be True or False, got {console!r:.80}")
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(f"configure_audit: stream must be a text stream with write(), got {type(stream).__name__}")
    if node is not None and (not isinstance(node, str) or not node or len(node) > STR_CAP):
        raise ValueError(f"configure_audit: node must be a non-empty name of at most {STR_CAP} characters, "
                         f"got {node!r:.80}")
    node_name = node or host_name()
    with _configure_lock:
        sink = JsonLinesSink(json_path) if json_path is not None else None  # may raise: nothing changed yet
        logger = None
        if sink is not None or console:
            out = stream if stream is not None else sys.stderr
            processors: list[Any] = [
                structlog.processors.add_log_level,
                add_timestamp,
                add_schema_version,
            ]
            if sink is not None:
                processors.append(sink)
            processors.append(structlog.dev.ConsoleRenderer(colors=_isatty(out)) if console else _drop)
            logger = structlog.make_filtering_bound_logger(number)(
                structlog.PrintLogger(out), processors=processors, context={"node": node_name})
        old, _route = _route, _Route(logger, sink, number, [False], json_only=sink is not None and not console,
                                     node=node_name)
    if old.sink is not None:
        try:
            old.sink.close()
        except Exception as e:  # the new route is in force; a broken old file must not undo that
            _say(f"closing the previous audit sink {old.sink.path} failed ({type(e).__name__}: {e}); "
                 "the new route is in force")
    return sink


def host_name() -> str:
    """This machine's name as audit events carry it (`node`)."""
    return socket.gethostname() or "localhost"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


# ---- emitting -----------------------------------------------------------------------------------------------------


try:  # the object `structlog.get_config()` copies its answer from: read directly, it costs no dict per event
    from structlog._config import _CONFIG as _STRUCTLOG_CONFIG
except ImportError:  # pragma: no cover (another structlog layout: the public call, slower)
    _STRUCTLOG_CONFIG = None


def _capture_chain() -> list[Any] | None:
    """structlog's global processors while `structlog.testing.capture_logs()` is active (it ends them with a
    `LogCapture`), else None. Asked at every event: read from structlog's configuration object when it has the
    attribute `get_config()` reads, else through `get_config()`."""
    processors = getattr(_STRUCTLOG_CONFIG, "default_processors", None)
    if processors is None:
        processors = structlog.get_config()["processors"]
    return processors if processors and type(processors[-1]) is LogCapture else None


def _goes_somewhere(number: int) -> bool:
    return number >= _route.level and (_route.logger is not None or _capture_chain() is not None)


def enabled(level: str = "info") -> bool:
    """Whether an event at `level` would go anywhere now (a file, the console, a `capture_logs` block): ask
    before building an event that nobody keeps (the loader's per-bucket debug event)."""
    return _goes_somewhere(_level_number(level, "enabled"))


#: Per-bucket events may be held back and written in batches (`hold_events`): at most this many ...
HOLD_MAX = 64
#: ... or this old (ns): a trainer's slow stream still shows its layers within a fraction of a second.
HOLD_NS = 200_000_000
_holders: weakref.WeakSet[Any] = weakref.WeakSet()


#: `hold_events()` answers: write each event now; hold and write in batches; hold, nothing to write.
HOLD_NONE, HOLD_WRITE, HOLD_KEEP = 0, 1, 2


def hold_events() -> int:
    """Whether a lifecycle may hold its per-bucket events now: `HOLD_WRITE` when the route is a JSON file alone
    (write them in batches), `HOLD_KEEP` when nothing is written (events kept in memory only: build them only
    when asked for), `HOLD_NONE` otherwise (a console, a `capture_logs` block). A holder registers with
    `register_holder`; everything it holds is written before its next other event, when it is asked for its
    events, before `configure_audit` switches the route, and at exit."""
    route = _route
    processors = getattr(_STRUCTLOG_CONFIG, "default_processors", None)  # `_capture_chain`, inline: per bucket
    if processors is None:
        processors = structlog.get_config()["processors"]
    if processors and type(processors[-1]) is LogCapture:
        return HOLD_NONE
    return HOLD_WRITE if route.json_only else HOLD_KEEP if route.logger is None else HOLD_NONE


def register_holder(holder: Any) -> None:
    """`holder.flush_events()` is called before the route changes and at exit (held weakly)."""
    _holders.add(holder)


def flush_holders() -> None:
    for holder in list(_holders):
        with contextlib.suppress(Exception):  # a broken holder must not stop the others, or the exit
            holder.flush_events()


atexit.register(flush_holders)


def emit_held(records: list[Mapping[str, Any]], times_ns: list[int], level: str = "info") -> None:
    """Send records held back (bounded already), each with the time it was made: one write to a JSON file
    alone; through `emit_record` (stamped now) on any other route the holder did not expect. Never raises."""
    route = _route
    if _LEVEL_NUMBERS[level] < route.level:
        return
    capture = _capture_chain()
    if capture is None and route.logger is None:
        return  # audit off: the holder keeps them, nothing is written
    if capture is not None or not route.json_only:
        for record in records:
            emit_record(record, level)  # the console, or a capture_logs block
        return
    try:
        route.sink.write_held(records, times_ns, level, route.node)  # type: ignore[union-attr]
    except Exception as e:  # as in emit_record: an output failure must not reach the lifecycle
        _output_failed(route, e)


def emit_held_lines(lines: Callable[[str, str, str], str], level: str = "info") -> bool:
    """Send records held back that format their own lines (`JsonLinesSink.write_held_lines`), when the route is a
    JSON file alone (written if `level` is): True. On any other route nothing is sent and the answer is False:
    the holder sends the records themselves (`emit_held`). Never raises for a failed write."""
    route = _route
    if not route.json_only or _capture_chain() is not None:
        return False
    if _LEVEL_NUMBERS[level] >= route.level:
        try:
            route.sink.write_held_lines(lines, level, route.node)  # type: ignore[union-attr]
        except Exception as e:  # as in emit_record: an output failure must not reach the lifecycle
            _output_failed(route, e)
    return True


def emit(event: str, *, level: str = "info", **fields: Any) -> None:
    """Send one audit event (bounded first). Never raises for a failed write (see the module doc)."""
    if _goes_somewhere(_level_number(level, "emit")):
        emit_record(bound_fields({"event": event, **fields}), level)


def emit_record(record: Mapping[str, Any], level: str = "info") -> None:
    """Send an event whose fields are bounded already (`bound_fields`; `record["event"]` names it): what a
    lifecycle does after keeping the same record in its `recent_events`. Never raises for a failed write.

    A JSON file alone (the production route) is written directly by its sink (`JsonLinesSink.write_record`):
    the same line the processor chain writes, without structlog's per-call work. The console route goes through
    the chain (structlog's ConsoleRenderer); a `capture_logs` block gets the record through its own chain."""
    route = _route
    if _LEVEL_NUMBERS[level] < route.level:
        return
    capture = _capture_chain()
    if capture is None and route.logger is None:
        return
    try:
        if capture is not None:
            event_dict: Any = dict(record)
            for processor in capture:
                event_dict = processor(None, level, event_dict)
        elif route.json_only:
            route.sink.write_record(record, level, route.node)  # type: ignore[union-attr]
        else:
            getattr(route.logger, level)(**record)
    except structlog.DropEvent:
        pass
    except Exception as e:  # a renderer or stream failure must not reach the lifecycle
        _output_failed(route, e)


def _output_failed(route: _Route, error: BaseException) -> None:
    """Count an event lost outside the sink's own writes; say so on stderr once per route."""
    first = not route.failed_once[0]
    route.failed_once[0] = True
    _count_failure("output", error, first)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines audit log back (the demo and tests use it; the auditor streams instead)."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
