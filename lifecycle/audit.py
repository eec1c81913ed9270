"""Audit events: one structlog record per trigger, refusal, refresh and storage check.

>>> import structlog
>>> with structlog.testing.capture_logs() as logs:
...     emit("transition", backbone="draft", rank=0, epoch=1, trigger="begin_reload",
...          src="GRAPH_CAPTURED", dst="PARTIALLY_LOADED")
>>> logs[0]["event"], logs[0]["dst"]
('transition', 'PARTIALLY_LOADED')

In production `configure_audit(json_path=...)` writes JSON lines (UTC ISO-8601 timestamps, a schema version)
and, optionally, readable lines to the terminal. Events carry names, counts, shapes and addresses, never
tensor values; lists (missing tensors) are capped with a count of what was left out.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog

SCHEMA_VERSION = 1
LOGGER_NAME = "reload_lifecycle"
#: At most this many names in a list field; the rest are counted in `<field>_more`.
LIST_CAP = 16

_logger = structlog.get_logger(LOGGER_NAME)


def capped(items: Iterable[str], cap: int = LIST_CAP) -> tuple[list[str], int]:
    items = list(items)
    return items[:cap], max(0, len(items) - cap)


def emit(event: str, *, level: str = "info", **fields: Any) -> None:
    """Send one audit event. Goes through structlog's global configuration, so `capture_logs()` sees it."""
    getattr(_logger, level)(event, **fields)


# ---- processors (plain functions / small callables, structlog style) -----------------------------------------


def add_schema_version(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event_dict.setdefault("schema", SCHEMA_VERSION)
    return event_dict


class JsonLinesSink:
    """Processor that appends the event as one JSON line to a file and passes it on unchanged."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = self.path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def __call__(self, _logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        line = json.dumps(event_dict, default=str, separators=(",", ":"))
        with self._lock:
            self._fh.write(line + "\n")
        return event_dict

    def close(self) -> None:
        self._fh.close()


def _drop(_logger: Any, _name: str, _event_dict: MutableMapping[str, Any]) -> str:
    raise structlog.DropEvent


_active_sink: JsonLinesSink | None = None


def configure_audit(json_path: str | Path | None = None, *, console: bool = True, level: str = "info",
                    stream: TextIO | None = None) -> JsonLinesSink | None:
    """Configure structlog for audit output: JSON lines to `json_path` (if given) and readable lines to
    `stream` (stderr by default) if `console`. Returns the file sink (close it, or call again, to flush)."""
    global _active_sink
    if _active_sink is not None:
        _active_sink.close()
        _active_sink = None
    processors: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
        add_schema_version,
    ]
    if json_path is not None:
        _active_sink = JsonLinesSink(json_path)
        processors.append(_active_sink)
    out = stream or sys.stderr
    processors.append(structlog.dev.ConsoleRenderer(colors=out.isatty()) if console else _drop)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    return _active_sink


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines audit log back (the demo and tests use it; the auditor streams instead)."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
