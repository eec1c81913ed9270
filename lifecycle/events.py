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

Every event passes `bound_event` before it is written: at most `LIST_CAP` items in a list of names (the rest
counted in `<field>_more`), at most `STR_CAP` characters in a string (the cut counted in `<field>_truncated`),
and a tensor that slipped into a field is written as its description, never its values:

>>> import torch
>>> ev = bound_event(None, "info", {"names": [f"t{i}" for i in range(20)], "reason": "x" * 5000,
...                                 "oops": torch.ones(3)})
>>> len(ev["names"]), ev["names_more"], len(ev["reason"]), ev["reason_truncated"], ev["oops"]
(16, 4, 4096, 904, '<tensor shape=(3,) dtype=torch.float32 device=cpu>')
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog

__all__ = [
    "LIST_CAP",
    "LOGGER_NAME",
    "RECORDS_CAP",
    "SCHEMA_VERSION",
    "STR_CAP",
    "TS_FORMAT",
    "JsonLinesSink",
    "add_schema_version",
    "bound_event",
    "configure_audit",
    "emit",
    "read_events",
]

#: Version of the event schema (the `schema` field). 2: `seq`, fixed-width timestamps, `_more`/`_truncated` counts.
SCHEMA_VERSION = 2
LOGGER_NAME = "reload_lifecycle"
#: At most this many names in a list field; the rest are counted in `<field>_more`.
LIST_CAP = 16
#: At most this many records (dicts) in a list field, such as the per-buffer records of a `refresh` event.
RECORDS_CAP = 256
#: At most this many characters in a string field; the number cut is `<field>_truncated`.
STR_CAP = 4096
#: UTC, always with microseconds: fixed width, so timestamps of one log also sort as strings.
TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"

_logger = structlog.get_logger(LOGGER_NAME)


def emit(event: str, *, level: str = "info", **fields: Any) -> None:
    """Send one audit event. Goes through structlog's global configuration, so `capture_logs()` sees it."""
    getattr(_logger, level)(event, **fields)


# ---- processors (plain functions / small callables, structlog style) -----------------------------------------


def add_schema_version(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event_dict.setdefault("schema", SCHEMA_VERSION)
    return event_dict


def _describe_tensor(value: Any) -> str | None:
    """A tensor (or anything tensor-like from torch/numpy) as its description; None for anything else."""
    module = type(value).__module__
    if not module.startswith(("torch", "numpy")) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return None
    device = getattr(value, "device", "cpu")
    return f"<tensor shape={tuple(value.shape)} dtype={value.dtype} device={device}>"


def _bound_value(key: str, value: Any, out: MutableMapping[str, Any]) -> Any:
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, str):
        if len(value) > STR_CAP:
            out[f"{key}_truncated"] = len(value) - STR_CAP
            return value[:STR_CAP]
        return value
    if isinstance(value, dict):
        inner: dict[str, Any] = {}
        for k, v in value.items():
            inner[k] = _bound_value(k, v, inner)
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
            items.append(_bound_value(key, v, holder))
        return items
    described = _describe_tensor(value)
    if described is not None:
        return described
    return _bound_value(key, str(value), out)


def bound_event(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Processor: bounded size, no tensor values (see the module doc)."""
    extra: dict[str, Any] = {}
    for key in list(event_dict):
        value = event_dict[key]
        if type(value) in (int, bool, float) or value is None:
            continue
        event_dict[key] = _bound_value(key, value, extra)
    for key, value in extra.items():  # a count the caller already gave is added to, not replaced
        event_dict[key] = value + event_dict.get(key, 0) if key.endswith("_more") else value
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
        structlog.processors.TimeStamper(fmt=TS_FORMAT, utc=True, key="ts"),
        add_schema_version,
        bound_event,
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
