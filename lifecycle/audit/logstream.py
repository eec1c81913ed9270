"""Reading audit logs as one stream of events: files, directories of files, or `-` (stdin), one line at a time.

Nothing reads a whole file: each input is read line by line (a line longer than `MAX_LINE` bytes is skipped and
reported, not buffered), and several inputs are merged by timestamp with `heapq.merge`, which holds one pending
line per input. A line that is not a JSON object with the fields every event has is an `InputProblem` naming
the file and line number; the stream goes on with the next line.

>>> import io
>>> lines = io.BytesIO(b'{"event":"hook_run","backbone":"d","rank":0,"epoch":0,"ts":"2026-01-01T00:00:00.000001Z"}\\n'
...                    b'{"event": oops\\n')
>>> [type(x).__name__ for x in read_stream(lines, "log.jsonl")]
['LogEvent', 'InputProblem']
"""

from __future__ import annotations

import heapq
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["LOG_PATTERNS", "MAX_LINE", "STDIN", "InputProblem", "Item", "LogEvent", "expand_inputs", "iter_events",
           "parse_line", "parse_ts", "read_input", "read_stream"]

#: A line longer than this (bytes) is reported as unreadable and skipped without being held in memory.
MAX_LINE = 1 << 20
#: In a directory, files whose names look like audit logs (rotated logs `audit.jsonl.1` included).
LOG_PATTERNS = ("*.jsonl", "*.jsonl.*", "*.ndjson", "*.log")
STDIN = "-"
REQUIRED: tuple[tuple[str, type], ...] = (("event", str), ("backbone", str), ("rank", int), ("epoch", int))


@dataclass(frozen=True, slots=True)
class LogEvent:
    """One parsed event and where it came from."""

    source: str
    line: int
    fields: dict[str, Any]
    ts: float  # seconds since the epoch, UTC

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


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


def parse_ts(value: Any) -> float | None:
    """An ISO-8601 timestamp as UTC seconds (a timestamp without an offset is taken as UTC); None if invalid.

    >>> parse_ts("1970-01-01T00:01:02.500000Z"), parse_ts("1970-01-01T01:01:02+01:00"), parse_ts("soon")
    (62.5, 62.0, None)
    """
    if type(value) is not str:
        return None
    if len(value) == 27 and value[26] == "Z" and value[19] == ".":  # schema 2: %Y-%m-%dT%H:%M:%S.%fZ
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


def parse_line(raw: bytes | str, source: str, line: int) -> Item:
    """One JSON line as a `LogEvent`, or the reason it is not one."""
    try:
        fields = _decode(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError) as e:
        return InputProblem(source, line, f"not JSON ({e.__class__.__name__}: {str(e)[:80]})")
    if type(fields) is not dict:
        return InputProblem(source, line, f"not a JSON object but {type(fields).__name__}")
    for key, kind in REQUIRED:
        value = fields.get(key)
        if type(value) is not kind:  # exact: a bool is not a rank
            return InputProblem(source, line, f"field {key!r} missing or not {kind.__name__}: {value!r:.60}")
    ts = parse_ts(fields.get("ts"))
    if ts is None:
        return InputProblem(source, line, f"field 'ts' missing or not ISO-8601: {fields.get('ts')!r:.60}")
    return LogEvent(source, line, fields, ts)


def _raw_lines(fh: BinaryIO, max_line: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) for each line; None for a line longer than `max_line`, which is skipped unread."""
    number = 0
    while True:
        raw = fh.readline(max_line)
        if not raw:
            return
        number += 1
        if len(raw) == max_line and not raw.endswith(b"\n"):
            while True:  # skip the rest of the overlong line, one chunk at a time
                more = fh.readline(max_line)
                if not more or more.endswith(b"\n"):
                    break
            yield number, None
            continue
        yield number, raw


def read_stream(fh: BinaryIO, source: str, *, max_line: int = MAX_LINE) -> Iterator[Item]:
    """Every line of one binary stream, parsed. Blank lines are skipped."""
    for number, raw in _raw_lines(fh, max_line):
        if raw is None:
            yield InputProblem(source, number, f"line longer than {max_line} bytes: skipped")
        elif raw.strip():
            yield parse_line(raw, source, number)


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


def expand_inputs(paths: Sequence[str | Path]) -> tuple[list[str], list[InputProblem]]:
    """Files as given; a directory as its log files (`LOG_PATTERNS`, recursively, sorted); `-` as stdin."""
    files: list[str] = []
    problems: list[InputProblem] = []
    for p in paths:
        name = str(p)
        if name == STDIN:
            files.append(STDIN)
            continue
        path = Path(name)
        if path.is_dir():
            found = sorted({str(f) for pattern in LOG_PATTERNS for f in path.rglob(pattern) if f.is_file()})
            if not found:
                problems.append(InputProblem(name, None, f"directory holds no log files ({', '.join(LOG_PATTERNS)})"))
            files.extend(found)
        elif path.exists() and not path.is_file():
            problems.append(InputProblem(name, None, "not a regular file"))
        else:
            files.append(name)  # a missing file is reported when it is opened, in order
    return files, problems


def _keyed(items: Iterable[Item]) -> Iterator[tuple[float, Item]]:
    """Merge keys: an event's timestamp; an unreadable line takes the previous good timestamp of its input."""
    last = float("-inf")
    for item in items:
        if isinstance(item, LogEvent):
            last = item.ts
        yield last, item


def iter_events(paths: Sequence[str | Path], *, max_line: int = MAX_LINE) -> Iterator[Item]:
    """Every event of every input, merged by timestamp across inputs (each input's own order is kept, so an
    input whose timestamps go backwards stays as written, for the auditor to see), with every input problem
    in its place."""
    files, problems = expand_inputs(paths)
    yield from problems
    streams = [_keyed(read_input(f, max_line=max_line)) for f in files]
    if len(streams) == 1:
        for _, item in streams[0]:
            yield item
        return
    for _, item in heapq.merge(*streams, key=lambda pair: pair[0]):
        yield item
