"""Write leases: which threads are between their "may I write?" check and their `weights_loaded` report.

A loader holds a lease while it writes and reports one bucket (`BackboneLifecycle.loading()`). With a locked
lifecycle, the transitions that end or abort loading (`begin_reload`, `finalize_loading`, `refresh_derived`,
`abort_reload`) first wait until no other thread holds one, so a write is either reported before such a
transition or refused after it, never lost in between. An unlocked lifecycle takes none (it is not thread-safe:
nothing would wait for them).
"""

from __future__ import annotations

import threading

__all__ = ["WriteLeases"]


class WriteLeases:
    """Leases per thread (a thread may nest them). Every method is called holding the lifecycle's lock."""

    def __init__(self, lock: threading.RLock, *, locked: bool) -> None:
        self._cond: threading.Condition | None = threading.Condition(lock) if locked else None
        self._writers: dict[int, int] = {}  # thread id -> depth

    def acquire(self) -> int:
        tid = threading.get_ident()
        self._writers[tid] = self._writers.get(tid, 0) + 1
        return tid

    def release(self, tid: int) -> None:
        depth = self._writers[tid] - 1
        if depth:
            self._writers[tid] = depth
        else:
            del self._writers[tid]
        if self._cond is not None:
            self._cond.notify_all()

    def wait_until_idle(self) -> None:
        """Wait until no other thread holds a lease (the caller's own lease never blocks it)."""
        if self._cond is None:
            return
        me = threading.get_ident()
        self._cond.wait_for(lambda: all(t == me for t in self._writers))
