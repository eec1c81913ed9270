"""Writing audit events as JSON lines: the file sink, the line it writes, and the count of events lost.

A line is a JSON object encoded by one `json.JSONEncoder` (the standard library's C encoder underneath), with a
fixed-width UTC timestamp (`TS_FORMAT`, its second formatted once) and the schema version (`SCHEMA_VERSION`).

The sink never changes what the lifecycle does: a write that fails (a full disk, a closed or no longer writable
descriptor) is counted (`sink_failures()`, and a `sink_failures` field on the events each lifecycle keeps),
reported once on stderr, and the event goes on. `lifecycle.events` routes events here and counts its own lost
output (a console stream that went away) in the same count.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "TS_FORMAT",
    "AuditSinkError",
    "JsonLinesSink",
    "add_schema_version",
    "add_timestamp",
    "encode_string",
    "sink_failures",
    "timestamp",
    "timestamps",
]

#: Version of the event schema (the `schema` field). 2: `seq`, fixed-width timestamps, `_more`/`_truncated` counts;
#: 3: the FINALIZED state (the finish ends there, refresh_derived starts there; hooks run inside the finish);
#: 4: one `layer_ready` event per bucket, listing the layers it completed (`layers`, `layers_more`, `tensors`), and
#: no `transition` event for a bucket that leaves PARTIALLY_LOADED as it is; 5: the finishing trigger is named as the
#: method that fires it, `finalize_loading` (was `finish_loading`).
SCHEMA_VERSION = 5
#: UTC, always with microseconds: fixed width, so timestamps of one log also sort as strings.
TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


class AuditSinkError(OSError):
    """The audit log could not be opened (`events.configure_audit`); the previous configuration stays in force."""


# ---- the line -----------------------------------------------------------------------------------------------------

#: What `json.dumps(..., default=str, separators=(",", ":"))` writes, made once (`json.dumps` with options makes an
#: encoder per call). Records are flat, bounded and acyclic: no circular-reference check.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str, check_circular=False)
_encode = _ENCODER.encode


#: How every written line ends, after its timestamp.
_LINE_END = f'","schema":{SCHEMA_VERSION}}}\n'


def encode_string(value: str) -> str:
    """A string as the JSON encoder writes it (ensure_ascii: quoted, escaped, non-ASCII as \\uXXXX escapes): for a
    holder that formats its events' lines itself (`events.emit_held_lines`), and encodes each name once.

    >>> encode_string("layers.0"), encode_string("é") == '"\\\\u00e9"'
    ('"layers.0"', True)
    """
    return _ENCODER.encode(value)


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
    stderr, and never raised.

    `max_bytes`: before a write would take the file past it, the file is renamed `<name>.<n>` (n one more than the
    highest there: the lowest is the oldest) and a new one is begun; a write (one line, or a held batch of up to
    64) is never split, and a file holds at least one. The auditor reads such a set in order and names a file
    missing from it (`lifecycle.audit.rotation`). A rotation that fails is reported once and writing goes on in the
    same file, unrotated."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = self._open()
            self._size = os.fstat(self._fd).st_size
        except OSError as e:
            shown = str(self.path) if len(str(self.path)) <= 200 else f"{str(self.path)[:200]}..."
            raise AuditSinkError(e.errno, f"cannot open the audit log {shown}: {e.strerror or e}") from e
        self.max_bytes = max_bytes
        self.rotations = 0
        self._next_number = 0  # the number the next rotated file gets (0: not looked up yet)
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

    def write_held(self, records: Sequence[Mapping[str, Any]], times_ns: Sequence[int], level: str, node: str
                   ) -> None:
        """Write records a lifecycle held back (per-bucket events, `events.hold_events`), each with the time it was
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

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _rotate(self) -> None:
        """The file full: renamed to the next number, a new one begun (under the lock)."""
        try:
            if not self._next_number:
                prefix = self.path.name + "."
                self._next_number = 1 + max((int(f.name[len(prefix):]) for f in self.path.parent.iterdir()
                                             if f.name.startswith(prefix) and f.name[len(prefix):].isdigit()),
                                            default=0)
            os.rename(self.path, self.path.with_name(f"{self.path.name}.{self._next_number}"))
            fd = self._open()
        except OSError as e:
            self.max_bytes = None  # writing goes on in this file; said once
            _say(f"audit sink {self.path}: rotating it failed ({type(e).__name__}: {e}); it grows unrotated")
            return
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd, self._size, self._torn = fd, 0, False
        self._next_number += 1
        self.rotations += 1

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self.closed:
                self._failed(ValueError("the sink was closed"), data.count(b"\n"))
                return
            if self.max_bytes is not None and self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
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
            finally:
                self._size += len(data) - left

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
