"""Write leases: which threads are between their "may I write?" check and their `weights_loaded` report, and what
each may have written that it has not reported yet.

A loader holds a lease while it writes and reports (`BackboneLifecycle.loading()`). With a locked lifecycle, the
transitions that end or abort loading (`begin_reload`, `finalize_loading`, `refresh_derived`, `abort_reload`) first
wait until no other thread holds one, so a write is either reported before such a transition or refused after it,
never lost in between. An unlocked lifecycle is not thread-safe: it keeps the leases too, and refuses a second
thread (a lease, or one of those transitions) while another holds one, before anything is written.

A writer names what it is about to write (`unreported`) before its first write, and drops the names once it has
reported them; names still there when its lease ends were possibly written and never reported (an interrupt, any
`BaseException`, landed in between): the lifecycle then marks them written part way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["WriteLeases"]


class WriteLeases:
    """Leases per thread (a thread may nest them). Every method is called holding the lifecycle's lock."""

    def __init__(self, lock: threading.RLock, *, locked: bool) -> None:
        self._cond: threading.Condition | None = threading.Condition(lock) if locked else None
        self._writers: dict[int, int] = {}  # thread id -> depth
        #: lease token (the thread id) -> the buckets of names its write may change and has not reported yet
        self.unreported: dict[int, Sequence[Sequence[str]]] = {}

    def acquire(self) -> int:
        tid = threading.get_ident()
        self._writers[tid] = self._writers.get(tid, 0) + 1
        return tid

    def release(self, tid: int) -> Sequence[Sequence[str]] | None:
        """End one lease of `tid`; returns what its write left unreported when that was its last (None: nothing)."""
        depth = self._writers[tid] - 1
        left = None
        if depth:
            self._writers[tid] = depth
        else:
            del self._writers[tid]
            left = self.unreported.pop(tid, None)
        if self._cond is not None:
            self._cond.notify_all()
        return left

    def others(self) -> list[int]:
        """The other threads that hold a lease now."""
        if not self._writers:
            return []
        me = threading.get_ident()
        return [t for t in self._writers if t != me]

    def wait_until_idle(self) -> None:
        """Wait until no other thread holds a lease (the caller's own lease never blocks it); a locked lifecycle's
        only (an unlocked one refuses instead: `LoadTracking._quiesce`)."""
        if self._cond is None:
            return
        me = threading.get_ident()
        self._cond.wait_for(lambda: all(t == me for t in self._writers))
