"""The k-way merge of several audit inputs by timestamp (`inputs.iter_events`): one pending line per input, at most
`OPEN_FILES` files open at once (fewer under a low open-file limit; an input whose turn comes while it is closed is
reopened where it stopped), a pending line longer than `HELD_LINE` held as where it starts, read again in its turn.
"""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from .logstream import (
    HELD_LINE,
    NOT_TEXT,
    OPEN_FILES,
    STDIN,
    InputProblem,
    Item,
    LogEvent,
    _binary,
    _head,
    _item,
    _next_line,
)

__all__ = ["Merge"]


def _open_files_limit() -> int:
    """`OPEN_FILES`, or fewer when the process may open few files (leaving most of its allowance to the rest)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return OPEN_FILES
    if soft == resource.RLIM_INFINITY:
        return OPEN_FILES
    return max(1, min(OPEN_FILES, (soft - 16) // 4))


@dataclass(slots=True)
class _Source:
    """One input being merged: where its next line starts, its line count, its last good timestamp; `origin`: the
    rotated set it is a file of."""

    name: str
    index: int
    origin: str = ""
    offset: int = 0
    number: int = 0
    last_ts: float = float("-inf")
    done: bool = False


@dataclass(frozen=True, slots=True)
class _Deferred:
    """A pending line too long to hold parsed: read again when its turn comes."""

    start: int
    number: int


class Merge:
    """The k-way merge by timestamp over inputs, with at most `_open_files_limit()` files open (least recently
    read closed first) and one pending item per input. At one timestamp, the input given first goes first (the
    files of a rotated set are given oldest first)."""

    def __init__(self, files: Sequence[str], max_line: int, origins: Mapping[str, str] | None = None) -> None:
        self.sources = [_Source(name, i, (origins or {}).get(name, "")) for i, name in enumerate(files)]
        self.max_line = max_line
        self.limit = _open_files_limit()
        self.handles: OrderedDict[int, BinaryIO] = OrderedDict()

    def items(self) -> Iterator[Item]:
        heap: list[tuple[float, int, Item | _Deferred]] = []
        try:
            for src in self.sources:
                self._push(heap, src)
            while heap:
                _, index, pending = heap[0]
                src = self.sources[index]
                item = self._reread(src, pending) if isinstance(pending, _Deferred) else pending
                heapq.heappop(heap)
                yield item
                self._push(heap, src)
        finally:
            for fh in self.handles.values():
                if fh is not sys.stdin.buffer:
                    fh.close()

    def _push(self, heap: list[tuple[float, int, Item | _Deferred]], src: _Source) -> None:
        nxt = self._advance(src)
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], src.index, nxt[1]))

    def _handle(self, src: _Source) -> BinaryIO:
        fh = self.handles.get(src.index)
        if fh is not None:
            self.handles.move_to_end(src.index)
            return fh
        if src.name == STDIN:  # cannot be reopened: stays open, outside the limit
            fh = self.handles[src.index] = sys.stdin.buffer
            return fh
        open_files = [i for i, h in self.handles.items() if h is not sys.stdin.buffer]
        for i in open_files[:max(0, len(open_files) - self.limit + 1)]:
            self.handles.pop(i).close()
        fh = open(src.name, "rb")  # noqa: SIM115 - kept in self.handles, closed on eviction or at the end
        if src.offset:
            fh.seek(src.offset)
        self.handles[src.index] = fh
        return fh

    def _end(self, src: _Source) -> None:
        src.done = True
        fh = self.handles.pop(src.index, None)
        if fh is not None and fh is not sys.stdin.buffer:
            fh.close()

    def _advance(self, src: _Source) -> tuple[float, Item | _Deferred] | None:
        """The input's next item with its merge key (its timestamp, or the last good one), or None at its end."""
        shown = "<stdin>" if src.name == STDIN else src.name
        while not src.done:
            start = src.offset
            try:
                fh = self._handle(src)
                head = _head(fh) if start == 0 else None
                got = _next_line(fh, self.max_line)
            except OSError as e:
                what = "cannot open" if start == 0 else ("cannot reopen" if src.index not in self.handles
                                                         else "read failed")
                self._end(src)
                return src.last_ts, InputProblem(shown, None, f"{what}: {e.strerror or e}")
            if got is None:
                self._end(src)
                return None
            consumed, raw = got
            src.offset += consumed
            src.number += 1
            if src.number == 1 and _binary(head, raw):
                self._end(src)
                return src.last_ts, InputProblem(shown, 1, NOT_TEXT)
            item = _item(raw, shown, src.number, self.max_line, src.origin)
            if item is None:
                continue
            if isinstance(item, LogEvent):
                src.last_ts = item.ts
                if consumed > HELD_LINE and src.name != STDIN:
                    return item.ts, _Deferred(start, src.number)
            return src.last_ts, item
        return None

    def _reread(self, src: _Source, pending: _Deferred) -> Item:
        shown = src.name
        try:
            fh = self._handle(src)
            fh.seek(pending.start)
            got = _next_line(fh, self.max_line)
        except OSError as e:
            self._end(src)
            return InputProblem(shown, None, f"read failed: {e.strerror or e}")
        if got is None or got[1] is None or pending.start + got[0] != src.offset:
            self._end(src)
            return InputProblem(shown, pending.number, "the file changed while it was read")
        item = _item(got[1], shown, pending.number, self.max_line, src.origin)
        return item if item is not None else InputProblem(shown, pending.number, "the file changed while it was read")
