"""Which push a weight call belongs to, as the engine's front process books it for the metrics (`front_view`).

A push is a start (`start_draft_weight_update`, `start_weight_update`) and its chunks and finish, or one reload
call (`reload_draft_weights`, `reload_weights`); it is counted once, when it ends: finished (`ok`), refused by any of
its calls (`refused`), or ended by the next start (`abandoned`). A chunk or finish that comes while no push is open
is no push: vLLM refuses it ("start_weight_update must be called before ..."), and it is counted apart
(`stray_calls_total{call}`), never as a push of some kind.

With one API server the front process sees every call. With several (`vllm serve --api-server-count N`), a
trainer's calls may land on different servers (a new connection per call is spread by the kernel), so the open push
is kept where every server reads it: a small JSON file in vLLM's multiprocess metrics folder
(`PROMETHEUS_MULTIPROC_DIR`, private to the server, removed with it), written by rename (a reader sees the old record
or the new, never half). Times are `time.monotonic()`: one clock for every process of the machine. A server that
sees a push begin or end there that it did not book itself tells its acceptance canary (`FrontendView.sync`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .metrics import KINDS, STRAY_CALLS, metrics

__all__ = ["Call", "PushBook", "PushRecord"]

_FILE = "reload_lifecycle_push.json"


@dataclass
class Call:
    """One worker call being booked: its push's kind ("" when no push is open), step and the push's start."""

    kind: str
    step: str  # start, update, finish, once, other
    started: float
    method: str = ""
    seq: int = 0  # the push's number in the book (0: none)


@dataclass(frozen=True)
class PushRecord:
    """The latest push: open while `outcome` is None."""

    seq: int
    kind: str
    started: float
    outcome: str | None = None


class PushBook:
    """The push in progress of one engine client, in memory, or in the shared file with several API servers."""

    def __init__(self, shared_dir: str | None = None) -> None:
        self.path = Path(shared_dir) / _FILE if shared_dir else None
        self._record: PushRecord | None = None  # in memory; with a file, the last one read or written
        self._stamp: tuple[int, int, int] | None = None  # the file's (inode, mtime_ns, size) when last read

    @property
    def shared(self) -> bool:
        return self.path is not None

    def latest(self) -> PushRecord | None:
        """The latest push record (re-read only when the file changed: a stat per call)."""
        if self.path is None:
            return self._record
        try:
            st = os.stat(self.path)
        except OSError:
            return self._record
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                raw: Any = json.loads(self.path.read_text(encoding="utf-8"))
                if raw["kind"] in KINDS and raw["outcome"] in (None, "ok", "refused", "abandoned"):
                    self._record = PushRecord(int(raw["seq"]), raw["kind"], float(raw["started"]), raw["outcome"])
        return self._record

    def open_push(self) -> PushRecord | None:
        r = self.latest()
        return r if r is not None and r.outcome is None else None

    def _write(self, record: PushRecord) -> None:
        self._record = record
        if self.path is None:
            return
        tmp = self.path.with_name(f".{_FILE}.{os.getpid()}")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(vars(record)), encoding="utf-8")
            os.replace(tmp, self.path)
            st = os.stat(self.path)
            self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)

    # ---- booking -------------------------------------------------------------------------------------------------
    def begin(self, method: str, kind: str, step: str, now: float) -> Call:
        """A push call begins: a start or a reload call ends the open push (abandoned) first; a start opens one; a
        chunk or finish belongs to the open push, if any."""
        if step in ("start", "once"):
            stale = self.open_push()
            if stale is not None:  # the last push never finished: this one ends it
                self._count(stale.kind, "abandoned", stale.started, now)
                self._write(PushRecord(stale.seq, stale.kind, stale.started, "abandoned"))
            latest = self.latest()
            seq = (latest.seq if latest is not None else 0) + 1
            self._write(PushRecord(seq, kind, now))
            return Call(kind, step, now, method, seq)
        push = self.open_push()
        if push is None:
            return Call("", step, now, method)
        return Call(push.kind, step, push.started, method, push.seq)

    def end(self, call: Call, error: BaseException | None, now: float) -> str | None:
        """Book the call's end: the push's outcome when it ended the push ("stray" for a call of no push), None
        when the push goes on."""
        if error is None and call.step in ("start", "update"):
            return None  # mid-push: nothing to learn yet
        if not call.kind:
            if error is None:
                return None  # it belonged to a push this process cannot see (the book was unreadable)
            if call.method in STRAY_CALLS:
                metrics().stray_calls.labels(call.method).inc()
            return "stray"
        outcome = "ok" if error is None else "refused"
        self._count(call.kind, outcome, call.started, now)
        latest = self.latest()
        if latest is not None and latest.seq == call.seq and latest.outcome is None:
            self._write(PushRecord(call.seq, call.kind, call.started, outcome))
        return outcome

    @staticmethod
    def _count(kind: str, outcome: str, started: float, now: float) -> None:
        m = metrics()
        m.pushes.labels(kind, outcome).inc()
        m.push_seconds.labels(kind, outcome).observe(max(0.0, now - started))
