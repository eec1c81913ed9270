"""Which tensors were written since the last successful refresh (dirty): what a selective refresh must propagate.

No per-tensor set is kept on the hot path. The dirty set is the union of a small base set (writes after a refresh
in the same epoch, writes that failed part way, what a rollback put back), the write sets of earlier epochs that
ended without a refresh (kept whole: an epoch's end costs nothing per tensor) and the current epoch's write set,
which `LayerReadiness` owns and passes in, unless a refresh (or an exact rollback) in this epoch absorbed it.

>>> d = DirtySinceRefresh()
>>> sorted(d.tensors({"a"})), d.epoch_ended({"a"}, tracked=3), sorted(d.tensors({"b"}))
(['a'], None, ['a', 'b'])
>>> d.refreshed(), sorted(d.tensors({"b"}))
(None, [])
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet

__all__ = ["DirtySinceRefresh"]

#: Past this many ended epochs without a refresh, their write sets are folded into one (memory stays bounded).
EPOCHS_KEPT = 4


class DirtySinceRefresh:
    """The dirty set of one backbone, given each time the current epoch's write set (see the module doc). Not
    thread-safe by itself: the lifecycle serialises calls."""

    def __init__(self) -> None:
        self.base: set[str] = set()
        #: the write sets of ended epochs not refreshed yet, never changed again (a new epoch gets a new set)
        self.epochs: list[AbstractSet[str]] = []
        #: a refresh or an exact rollback in the current epoch set the dirty set: its writes before are not dirty
        self.absorbed = False

    def epoch_ended(self, written: AbstractSet[str], tracked: int) -> None:
        """The current epoch, whose writes are `written` (`tracked`: how many tensors there are), ended without a
        refresh: its writes stay dirty for the next refresh, and the next epoch starts unabsorbed."""
        if not self.absorbed and written:
            if len(written) == tracked:  # every tensor: the earlier parts are within it
                self.epochs = [written]
                self.base = set()
            else:
                self.epochs.append(written)  # a new set follows: this one is never written again
                if len(self.epochs) > EPOCHS_KEPT:
                    self.epochs = [frozenset().union(*self.epochs)]
        self.absorbed = False

    def parts(self, written: AbstractSet[str]) -> tuple[AbstractSet[str], ...]:
        """The dirty set as parts whose union it is, none of which changes again (a copy of the small base set, and
        the write sets of ended epochs and of the current one, which the next epoch replaces rather than changes):
        what a reload's origin keeps, at no cost per tensor."""
        current = () if self.absorbed or not written else (written,)
        return (frozenset(self.base), *self.epochs, *current)

    def tensors(self, written: AbstractSet[str]) -> frozenset[str]:
        """Every dirty tensor, the current epoch's writes being `written`."""
        parts = [*self.epochs, *(() if self.absorbed else (written,))]
        return frozenset(self.base.union(*parts))

    def add(self, names: Iterable[str]) -> None:
        """Tensors dirty whatever the epoch's write set says: written after a refresh absorbed it, or possibly
        written by a write that failed part way."""
        self.base.update(names)

    def refreshed(self) -> None:
        """A refresh propagated every dirty tensor into the derived buffers."""
        self.base = set()
        self.epochs = []
        self.absorbed = True

    def restored(self, names: Iterable[str]) -> None:
        """The dirty set is `names` again (a rollback restored every write since it was taken)."""
        self.base = set(names)
        self.epochs = []
        self.absorbed = True

    def forget(self, gone: AbstractSet[str]) -> None:
        """Stop tracking `gone`; the ended epochs' sets are replaced, never changed (a reload's origin holds some)."""
        self.base -= gone
        self.epochs = [frozenset(part - gone) for part in self.epochs]
