"""Audit events: one structlog record per trigger, refusal, refresh and storage check, and where they go.

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

Every event is bounded before it is written or kept (`lifecycle.event_bounds`: lists, strings, integers and
nesting capped with counts of what was cut, never tensor values) and written as JSON lines by
`lifecycle.event_sink`. Writing never changes what the lifecycle does: a write that fails (a full disk, a closed
descriptor, a console stream that went away) is counted (`sink_failures()`, and a `sink_failures` field on the
events each lifecycle keeps), reported once on stderr, and the event goes on; `emit` never raises. This module
re-exports the names of both, so `lifecycle.events` stays the one place to import the audit API from.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.testing import LogCapture

from .event_bounds import DEPTH_CAP as DEPTH_CAP
from .event_bounds import INT_BITS_CAP, LIST_CAP, RECORDS_CAP, STR_CAP, bound_event, bound_fields
from .event_sink import (
    SCHEMA_VERSION,
    TS_FORMAT,
    AuditSinkError,
    JsonLinesSink,
    _count_failure,
    _say,
    add_schema_version,
    add_timestamp,
    encode_string,
    sink_failures,
    timestamp,
    timestamps,
)

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
    "route_sink",
    "sink_failures",
    "timestamp",
    "timestamps",
]

#: The audit logger's name (its events carry no logger name: the chain is its own, see the module doc).
LOGGER_NAME = "reload_lifecycle"
#: The levels `configure_audit` and `emit` accept, lowest first.
LEVELS = ("debug", "info", "warning", "error", "critical")
# named one by one: `logging.getLevelNamesMapping` is new in Python 3.11 (tests/core/test_python310.py)
_LEVEL_NUMBERS = dict(zip(LEVELS, (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL),
                          strict=True))


# ---- configuration ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Route:
    """Where events go now: replaced whole by `configure_audit`, read once per event (no lock on the hot path)."""

    logger: Any | None  # None: nothing to write (events are bounded and kept by each lifecycle only)
    sink: JsonLinesSink | None
    level: int
    failed_once: list[bool]  # a failure outside the sink (the console) was reported already
    json_sink: JsonLinesSink | None = None  # `sink` when it is the only output: records go straight to it
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
                    stream: TextIO | None = None, node: str | None = None, max_bytes: int | None = None
                    ) -> JsonLinesSink | None:
    """Route audit events: JSON lines to `json_path` (if given) and readable lines to `stream` (stderr by
    default) if `console`; events below `level` are not written. Every written event carries `node`, the
    machine that wrote it (default: this host's name), so the logs of several nodes can be merged. `max_bytes`:
    the JSON file is rotated by size (`JsonLinesSink`; None: never). Returns the
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
    if node is not None and not _is_node_name(node):
        raise ValueError(f"configure_audit: node must be a non-empty name of at most {STR_CAP} characters, "
                         f"got {node!r:.80}")
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
        raise ValueError(f"configure_audit: max_bytes must be a positive int or None, got {max_bytes!r:.80}")
    node_name = node or host_name()
    with _configure_lock:
        sink = JsonLinesSink(json_path, max_bytes) if json_path is not None else None  # may raise: nothing changed
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
            # a class of structlog's BoundLoggerBase (logger, processors, context), typed as the protocol it meets
            bound_logger: Callable[..., Any] = structlog.make_filtering_bound_logger(number)
            logger = bound_logger(structlog.PrintLogger(out), processors=processors, context={"node": node_name})
        old, _route = _route, _Route(logger, sink, number, [False], json_sink=None if console else sink,
                                     node=node_name)
    if old.sink is not None:
        try:
            old.sink.close()
        except Exception as e:  # the new route is in force; a broken old file must not undo that
            _say(f"closing the previous audit sink {old.sink.path} failed ({type(e).__name__}: {e}); "
                 "the new route is in force")
    return sink


def _is_node_name(node: object) -> bool:
    """Whether `node` (as a caller gave it: of any type) is a name `configure_audit` takes."""
    return isinstance(node, str) and 0 < len(node) <= STR_CAP


def _drop(_logger: Any, _name: str, _event_dict: MutableMapping[str, Any]) -> str:
    raise structlog.DropEvent


def host_name() -> str:
    """This machine's name as audit events carry it (`node`)."""
    return socket.gethostname() or "localhost"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


# ---- emitting -----------------------------------------------------------------------------------------------------


def _capture_chain() -> list[Any] | None:
    """structlog's global processors while `structlog.testing.capture_logs()` is active (it configures structlog
    with processors that end in a `LogCapture`), else None. Asked at every event, through structlog's public API:
    `is_configured()` first (False while structlog runs on its built-in defaults, which capture nothing: one
    attribute read), then `get_config()`."""
    if not structlog.is_configured():
        return None
    processors = structlog.get_config()["processors"]
    return processors if processors and type(processors[-1]) is LogCapture else None


def _goes_somewhere(number: int) -> bool:
    return number >= _route.level and (_route.logger is not None or _capture_chain() is not None)


def route_sink() -> JsonLinesSink | None:
    """The JSON-lines file events go to now, or None (a console, memory, a `capture_logs` block)."""
    return _route.sink


def enabled(level: str = "info") -> bool:
    """Whether an event at `level` would go anywhere now (a file, the console, a `capture_logs` block): ask
    before building an event that nobody keeps (the loader's per-bucket debug event)."""
    return _goes_somewhere(_level_number(level, "enabled"))


#: Per-bucket events may be held back and written in batches (`hold_events`): at most this many ...
HOLD_MAX = 64
#: ... or this old (ns), checked when the next one is held: a trainer's slow stream shows its layers within a
#: fraction of a second of the next bucket (and every other event of the lifecycle writes the held ones first).
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
    if _capture_chain() is not None:
        return HOLD_NONE
    return HOLD_WRITE if route.json_sink is not None else HOLD_KEEP if route.logger is None else HOLD_NONE


def register_holder(holder: Any) -> None:
    """`holder.flush_events()` is called before the route changes and at exit (held weakly)."""
    _holders.add(holder)


def flush_holders() -> None:
    for holder in list(_holders):
        with contextlib.suppress(Exception):  # a broken holder must not stop the others, or the exit
            holder.flush_events()


atexit.register(flush_holders)


def emit_held(records: Sequence[Mapping[str, Any]], times_ns: Sequence[int], level: str = "info") -> None:
    """Send records held back (bounded already), each with the time it was made: one write to a JSON file
    alone; through `emit_record` (stamped now) on any other route the holder did not expect. Never raises."""
    route = _route
    if _LEVEL_NUMBERS[level] < route.level:
        return
    capture = _capture_chain()
    if capture is None and route.logger is None:
        return  # audit off: the holder keeps them, nothing is written
    sink = route.json_sink
    if capture is not None or sink is None:
        for record in records:
            emit_record(record, level)  # the console, or a capture_logs block
        return
    try:
        sink.write_held(records, times_ns, level, route.node)
    except Exception as e:  # as in emit_record: an output failure must not reach the lifecycle
        _output_failed(route, e)


def emit_held_lines(lines: Callable[[str, str, str], str], level: str = "info") -> bool:
    """Send records held back that format their own lines (`JsonLinesSink.write_held_lines`), when the route is a
    JSON file alone (written if `level` is): True. On any other route nothing is sent and the answer is False:
    the holder sends the records themselves (`emit_held`). Never raises for a failed write."""
    route = _route
    sink = route.json_sink
    if sink is None or _capture_chain() is not None:
        return False
    if _LEVEL_NUMBERS[level] >= route.level:
        try:
            sink.write_held_lines(lines, level, route.node)
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
        elif (sink := route.json_sink) is not None:
            sink.write_record(record, level, route.node)
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
