"""Reading one audit log, one line at a time: a file, or `-` (stdin); `inputs.iter_events` reads several as one stream.

Nothing reads a whole file: each input is read line by line (a line longer than `MAX_LINE` bytes is skipped and
reported, not buffered). Several inputs are merged by timestamp, holding one pending line per input and at most
`OPEN_FILES` files open at once (an input whose turn comes while it is closed is reopened where it stopped), so
thousands of rank files merge under a low open-file limit. A line is checked before it is decoded (`schema.
depth_problem`) and after (`schema.problem`: the fields every event has, and the types of each kind's fields);
a line that is not a valid event is an `InputProblem` naming the file and line number, and the stream goes on. An
input whose first line holds a NUL byte (no JSON line does; a checkpoint's first bytes, its header's length, do) is
not read past it: one problem says it is binary (a checkpoint given by mistake), not one per line of it.

>>> import io
>>> lines = io.BytesIO(b'{"event":"hook_run","backbone":"d","rank":0,"epoch":0,"ts":"2026-01-01T00:00:00.000001Z"}\\n'
...                    b'{"event": oops\\n')
>>> [type(x).__name__ for x in read_stream(lines, "log.jsonl")]
['LogEvent', 'InputProblem']
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, BinaryIO

from .schema import depth_problem, problem

__all__ = ["HELD_LINE", "LOG_PATTERNS", "MAX_LINE", "NOT_TEXT", "OPEN_FILES", "SNIFF", "STDIN", "InputProblem", "Item",
           "LogEvent", "parse_line", "parse_ts", "read_input", "read_stream"]

#: A line longer than this (bytes) is reported as unreadable and skipped without being held in memory.
MAX_LINE = 1 << 20
#: Input files open at once, at most, while several are merged (fewer under a low open-file limit).
OPEN_FILES = 64
#: While inputs are merged, a pending line longer than this is not held parsed: only its timestamp and where it
#: starts, and it is read again when its turn comes (memory: inputs x HELD_LINE, whatever the lines).
HELD_LINE = 4096
#: In a directory, files whose names look like audit logs (rotated logs `audit.jsonl.1` included: `rotation`).
LOG_PATTERNS = ("*.jsonl", "*.jsonl.*", "*.ndjson", "*.log")
STDIN = "-"
#: Bytes of an input's first line looked at for a NUL (`NOT_TEXT`), peeked before the line is read.
SNIFF = 4096
#: The input problem of an input that is binary: JSON lines never hold a NUL byte.
NOT_TEXT = ("not a text file (a NUL byte at its start: a checkpoint or other binary file, not a JSON-lines audit log); "
            "the rest of it was not read")


@dataclass(frozen=True, slots=True)
class LogEvent:
    """One parsed event and where it came from."""

    source: str
    line: int
    fields: dict[str, Any]
    ts: float  # seconds since the epoch, UTC
    origin: str = ""  # the rotated set the file belongs to (`rotation`): one writer's input, its files in turn

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def writer(self) -> str:
        """The input one writer feeds: the file, or the rotated set it is a file of."""
        return self.origin or self.source


@dataclass(frozen=True, slots=True)
class InputProblem:
    """An input that could not be read, or one line of it (`line` set) that is not a valid event."""

    source: str
    line: int | None
    message: str

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.line is not None else self.source


Item = LogEvent | InputProblem


_MINUTES: dict[str, float] = {}  # "YYYY-MM-DDTHH:MM" -> UTC seconds, for the fixed-width fast path
_SECONDS = re.compile(r"[0-5][0-9]\.[0-9]{6}Z")  # what the fast path reads with float(): [0-9] is ASCII only


def parse_ts(value: Any) -> float | None:
    """An ISO-8601 timestamp as UTC seconds (a timestamp without an offset is taken as UTC); None if invalid.

    >>> parse_ts("1970-01-01T00:01:02.500000Z"), parse_ts("1970-01-01T01:01:02+01:00"), parse_ts("soon")
    (62.5, 62.0, None)
    """
    if type(value) is not str:
        return None
    # schema 2: %Y-%m-%dT%H:%M:%S.%fZ, the seconds read by float() only if they are ASCII 00-59 (`_SECONDS`: float
    # took 99, -9, +9, " 9", Arabic-Indic digits); anything else goes to the full parser, which refuses it
    if len(value) == 27 and value[16] == ":" and _SECONDS.fullmatch(value, 17) is not None:
        minute = _MINUTES.get(value[:16])
        if minute is None:
            whole = _parse_iso(value[:16] + ":00+00:00")
            if whole is None:
                return None
            if len(_MINUTES) > 4096:
                _MINUTES.clear()
            minute = _MINUTES[value[:16]] = whole
        try:
            return minute + float(value[17:26])
        except ValueError:
            return None
    return _parse_iso(value)


def _parse_iso(value: str) -> float | None:
    text = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


_decode = json.JSONDecoder().decode


def parse_line(raw: bytes | str, source: str, line: int, origin: str = "") -> Item:
    """One JSON line as a `LogEvent`, or the reason it is not one."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    deep = depth_problem(data)
    if deep is not None:
        return InputProblem(source, line, f"not an event: {deep}")
    try:
        fields = _decode(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        return InputProblem(source, line, f"not JSON ({e.__class__.__name__}: {str(e)[:80]})")
    if type(fields) is not dict:
        return InputProblem(source, line, f"not a JSON object but {type(fields).__name__}")
    bad = problem(fields)
    if bad is not None:
        return InputProblem(source, line, f"not a valid event: {bad}")
    ts = parse_ts(fields["ts"])
    if ts is None:
        return InputProblem(source, line, f"not a valid event: field 'ts' is not ISO-8601: {fields['ts']!r:.60}")
    return LogEvent(source, line, fields, ts, origin)


def _next_line(fh: BinaryIO, max_line: int) -> tuple[int, bytes | None] | None:
    """(bytes consumed, the line) of the next line; the line is None when it is longer than `max_line` (skipped
    unread, one chunk at a time); None at the end of the input."""
    raw = fh.readline(max_line)
    if not raw:
        return None
    if len(raw) == max_line and not raw.endswith(b"\n"):
        consumed = len(raw)
        while True:
            more = fh.readline(max_line)
            consumed += len(more)
            if not more or more.endswith(b"\n"):
                return consumed, None
    return len(raw), raw


def _item(raw: bytes | None, source: str, number: int, max_line: int, origin: str = "") -> Item | None:
    if raw is None:
        return InputProblem(source, number, f"line longer than {max_line} bytes: skipped")
    return parse_line(raw, source, number, origin) if raw.strip() else None  # blank lines are skipped


def _head(fh: BinaryIO) -> bytes | None:
    """The input's first `SNIFF` bytes, peeked before anything is read (None where the stream cannot peek)."""
    peek = getattr(fh, "peek", None)
    return peek(SNIFF)[:SNIFF] if peek is not None else None


def _binary(head: bytes | None, first_line: bytes | None) -> bool:
    """A NUL byte in the input's first line (as peeked, or as read where it could not be): no JSON line holds one."""
    start = head if head is not None else (first_line or b"")
    return b"\0" in start[:SNIFF].split(b"\n", 1)[0]


def read_stream(fh: BinaryIO, source: str, *, max_line: int = MAX_LINE) -> Iterator[Item]:
    """Every line of one binary stream, parsed. Blank lines are skipped; a binary input is one `NOT_TEXT`."""
    head = _head(fh)
    number = 0
    while (got := _next_line(fh, max_line)) is not None:
        number += 1
        if number == 1 and _binary(head, got[1]):
            yield InputProblem(source, 1, NOT_TEXT)
            return
        item = _item(got[1], source, number, max_line)
        if item is not None:
            yield item


def read_input(name: str, *, max_line: int = MAX_LINE) -> Iterator[Item]:
    """One input: a file, or `-` for stdin. An input that cannot be opened is one `InputProblem`."""
    if name == STDIN:
        yield from read_stream(sys.stdin.buffer, "<stdin>", max_line=max_line)
        return
    try:
        fh = open(name, "rb")  # noqa: SIM115 - closed in finally; the generator may be abandoned mid-file
    except OSError as e:
        yield InputProblem(name, None, f"cannot open: {e.strerror or e}")
        return
    try:
        yield from read_stream(fh, name, max_line=max_line)
    except OSError as e:
        yield InputProblem(name, None, f"read failed: {e.strerror or e}")
    finally:
        fh.close()
