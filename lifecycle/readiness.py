"""Which tensors of which layer are loaded (or still META), per reload epoch.

Per-tensor work is set operations done in C: the name -> layer map and each layer's names are built once, a
bucket that is one layer (or part of one) is checked and recorded with two set operations, and a per-layer
counter says when a layer completes. The machine only hears about layer completions, never about single tensors.
Two concerns beside the counts have their own modules, fed from here: which tensors are dirty since the last
refresh (`dirty.DirtySinceRefresh`) and which layers must be written in full (`full_writes.FullWrites`).

>>> r = LayerReadiness(["layers.0.w", "layers.0.b", "norm.weight"])
>>> r.mark_loaded(["layers.0.w"]), r.mark_loaded(["layers.0.b"])
([], ['layers.0'])
>>> r.missing()
{'norm': ('norm.weight',)}
>>> r.mark_loaded(["layers.0.w", "oops"])
Traceback (most recent call last):
...
lifecycle.readiness.UnknownNames: ['oops']
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet

from .dirty import DirtySinceRefresh
from .full_writes import FullWrites

__all__ = ["LayerReadiness", "UnknownNames", "layer_of"]

_LAYER_PREFIX = re.compile(r"^(.*?\blayers\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: `layers.N` for decoder layers (with any prefix before it), else the
    owning module's path (`fc.weight` -> `fc`, `norm.weight` -> `norm`), `<root>` for top-level tensors."""
    m = _LAYER_PREFIX.match(name)
    if m:
        return m.group(1)
    module, _, _ = name.rpartition(".")
    return module or "<root>"


class UnknownNames(KeyError):
    """`mark_loaded` was given names the backbone does not have (`.names`); nothing was recorded."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self.names = names


class LayerReadiness:
    """Readiness bookkeeping for one backbone. Not thread-safe by itself: the lifecycle serialises calls.

    In an epoch a tensor is loaded when it was written (`_written`) or declared unchanged (`_unchanged`); the
    two sets are disjoint. Dirty (written since the last successful refresh) is kept by `dirty` from this epoch's
    writes and the earlier epochs'; the layers owed a full write by `full_writes`."""

    def __init__(self, names: Iterable[str], layer_key: Callable[[str], str] = layer_of) -> None:
        self.layer_of_name: dict[str, str] = {n: layer_key(n) for n in names}
        self._index_layers()
        self.epoch = 0
        self._written: set[str] = set()  # written in this epoch
        self._unchanged: set[str] = set()  # declared unchanged in this epoch (and not written since)
        self._left: dict[str, int] = dict(self._size)  # per layer: tensors not loaded yet in this epoch
        self._complete = 0
        # written since the last successful refresh, kept across epochs: an epoch that ends without a refresh
        # (aborted, or a second begin_reload) leaves its writes to the next refresh
        self.dirty = DirtySinceRefresh()
        # writes that failed part way in this epoch and were not redone
        self._failed: set[str] = set()
        self._closed = False  # the epoch ended (close_epoch ran): nothing more is written in it
        # layers that must be written in full before anything of them may be kept (`unchanged_refusals`)
        self.full_writes = FullWrites()
        self._owed_full_write = self.full_writes.layers  # the same set object for the backbone's life
        self._plain = True  # nothing declared unchanged, no failed write, no refresh in this epoch: the fast path

    def _index_layers(self) -> None:
        """The per-layer tables, from `layer_of_name` (at creation, and when `forget` stops tracking names)."""
        tensors: dict[str, list[str]] = {}
        for name, layer in self.layer_of_name.items():
            tensors.setdefault(layer, []).append(name)
        self.tensors_of_layer: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in tensors.items()}
        self._names_of_layer: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in tensors.items()}
        # name -> its layer and that layer's names: `mark_loaded` reads a bucket's first name in one lookup
        self._member_of = {n: (la, self._names_of_layer[la]) for n, la in self.layer_of_name.items()}
        self._size: dict[str, int] = {k: len(v) for k, v in tensors.items()}

    def _note_plain(self) -> None:
        """Recompute `_plain` after a change to what it summarises (off the hot path)."""
        self._plain = not (self._unchanged or self._failed or self.dirty.absorbed)

    @property
    def partly_written(self) -> set[str]:
        """Layers an earlier epoch left partly written (it ended with some of their tensors written and not all,
        or a write failed part way: they mix two checkpoints), and layers holding values no checkpoint gave
        (`require_full_write`): only a complete write of one ends this (`full_writes.FullWrites`)."""
        return self.full_writes.layers

    @property
    def full_write_reasons(self) -> dict[str, str]:
        """Layer -> why it must be written in full, for the layers `require_full_write` put in."""
        return self.full_writes.reasons

    # ---- epochs -------------------------------------------------------------------------------------------
    def new_epoch(self) -> int:
        self.close_epoch()
        self.dirty.epoch_ended(self._written, len(self.layer_of_name))  # a new set follows: this one stays as is
        self.epoch += 1
        self._closed = False
        self._written = set()
        self._unchanged = set()
        self._left = dict(self._size)
        self._complete = 0
        self._note_plain()
        return self.epoch

    def close_epoch(self, restored: Iterable[str] = (), *, every_written: bool = False) -> list[str]:
        """The epoch ends without its refresh (an abort, or a new epoch): every layer it wrote part of (some
        tensors and not all, or a write that failed part way), except writes `restored` by a rollback, is now
        partly written; with `every_written` (a rollback stopped part way), every layer it wrote anything of.
        Returns the layers newly so."""
        if self._closed:  # an abort closed it already; the next begin_reload closes it again
            return []
        self._closed = True
        if every_written:
            new = {self.layer_of_name[n] for n in self._written | self._failed}
            self._failed = set()
            self._note_plain()
            return self.full_writes.mark_partly_written(new)
        if not self._failed and self._complete == len(self._size):  # every layer complete: none written in part
            return []
        restored = frozenset(restored)
        sizes, left, written = self._size, self._left, self._written
        new = {self.layer_of_name[n] for n in self._failed - restored}
        if self._complete < len(sizes):  # only an incomplete layer can be written in part
            for layer, names in self.tensors_of_layer.items():
                if 0 < left[layer] < sizes[layer] and layer not in new and any(
                        n in written and n not in restored for n in names):
                    new.add(layer)
        self._failed = set()
        self._note_plain()
        return self.full_writes.mark_partly_written(new)

    def require_full_write(self, layers: Iterable[str], why: str) -> None:
        """`layers` hold values no checkpoint gave (`why` says where they came from): until a load writes every
        tensor of one, nothing of it may be declared unchanged (refused naming `why`), as for a partly written
        layer."""
        for layer in layers:
            if layer not in self.tensors_of_layer:
                raise UnknownNames([layer])
            self.full_writes.require([layer], why)

    def full_write_reason(self, layer: str) -> str:
        """Why `layer` (one of `partly_written`) must be written in full before anything of it may be kept."""
        return self.full_writes.reason(layer)

    def forget(self, names: Iterable[str]) -> None:
        """Stop tracking `names` (optional tensors the first load did not have): the counts are rebuilt from
        what is loaded in this epoch, and a layer left with no tensors is no layer. Off the hot path; the sets a
        reload's origin may hold (`dirty_parts`) are replaced, never changed."""
        gone = set(names) & self.layer_of_name.keys()
        if not gone:
            return
        for name in gone:
            del self.layer_of_name[name]
        self._written = self._written - gone
        self._unchanged -= gone
        self._failed -= gone
        self.dirty.forget(gone)
        self._index_layers()
        loaded = self._written | self._unchanged
        self._left = {k: sum(n not in loaded for n in v) for k, v in self.tensors_of_layer.items()}
        self._complete = sum(not left for left in self._left.values())
        self.full_writes.keep_only(self.tensors_of_layer)
        self._note_plain()

    # ---- hot path -----------------------------------------------------------------------------------------
    def unknown(self, names: Iterable[str]) -> list[str]:
        known = self.layer_of_name
        return [n for n in names if n not in known]

    def mark_loaded(self, names: Sequence[str]) -> list[str]:
        """Record tensors written in this epoch (duplicates are fine). Returns the layers that just completed.
        Raises `UnknownNames` (recording nothing) for names this backbone does not have."""
        if not names:
            return []
        member = self._member_of.get(names[0])
        # the common case in C: names of one layer (a superset check: also known), nothing unusual in the epoch
        # (`_plain`); duplicates and names written before are fine: the count goes down by what the set grew by
        if member is None or not self._plain or not member[1].issuperset(names):
            return self._mark_written(names)
        layer = member[0]
        written = self._written
        before = len(written)
        written.update(names)
        added = len(written) - before
        if not added:
            return []
        left_of = self._left
        left = left_of[layer] = left_of[layer] - added
        if left:
            return []
        self._complete += 1
        owed = self._owed_full_write
        if owed:
            owed.discard(layer)  # written in full (nothing may declare it unchanged)
        return [layer]

    def fresh_layers(self, layers: Sequence[str]) -> bool:
        """Whether `mark_layers_written` may take each of `layers` (distinct): nothing of any was loaded in this
        epoch, and nothing unusual happened in it (no declaration, failed write or refresh)."""
        left, size = self._left, self._size
        return self._plain and len(set(layers)) == len(layers) and all(left[la] == size[la] for la in layers)

    def mark_layers_written(self, layers: Sequence[str]) -> int:
        """Every tensor of each of `layers` was written (layers `fresh_layers` vouched for): counted per layer,
        without reading a name, and the names join the written set (when that completes every layer, the set of
        every name in one copy of the name table: no name object is read, the table keeps each hash). Returns
        how many layers were ready before."""
        ready_before = self._complete
        left = self._left
        for layer in layers:
            left[layer] = 0
        self._complete += len(layers)
        partly = self.full_writes.layers
        if partly:
            partly.difference_update(layers)
        if self._complete == len(self._size) and not self._unchanged:
            self._written = set(self.layer_of_name)
        else:
            written, names_of = self._written, self._names_of_layer
            for layer in layers:
                written |= names_of[layer]
        return ready_before

    def _mark_written(self, names: Sequence[str]) -> list[str]:
        completed = self._mark(names, dirty=True)
        if self._failed:
            self._failed.difference_update(names)  # written again, in full
        if self.dirty.absorbed:  # written after a refresh of this epoch absorbed its writes: dirty again
            self.dirty.add(names)
        self._note_plain()
        return completed

    def unknown_free(self, names: Sequence[str]) -> Sequence[str]:
        """`names` if all are known; else raise `UnknownNames` listing those that are not."""
        unknown = self.unknown(names)
        if unknown:
            raise UnknownNames(unknown)
        return names

    def mark_unchanged(self, names: Iterable[str]) -> list[str]:
        """Declare tensors restored unchanged in this epoch: they count as ready but not dirty. Names written
        in this epoch stay written."""
        return self._mark(list(names), dirty=False)

    def unmark(self, names: Iterable[str]) -> None:
        """Undo `mark_unchanged(names)` of tensors that were not loaded in this epoch before it (a refused
        finish puts back what it declared)."""
        left, unchanged = self._left, self._unchanged
        for name in names:
            if name not in unchanged:
                continue
            unchanged.discard(name)
            layer = self.layer_of_name[name]
            if not left[layer]:
                self._complete -= 1
            left[layer] += 1
        self._note_plain()

    def _mark(self, names: Sequence[str], *, dirty: bool) -> list[str]:
        """The general case: any names, any layers, written (`dirty`) or declared unchanged."""
        self.unknown_free(names)
        written, unchanged, left = self._written, self._unchanged, self._left
        layer_of_name = self.layer_of_name
        completed: list[str] = []
        for name in names:
            if name in written:
                continue
            if name in unchanged:
                if dirty:  # declared unchanged, then written after all: counted already
                    unchanged.discard(name)
                    written.add(name)
                continue
            (written if dirty else unchanged).add(name)
            layer = layer_of_name[name]
            left[layer] -= 1
            if not left[layer]:
                completed.append(layer)
        self._complete += len(completed)
        partly = self.full_writes.layers
        if partly and completed:
            partly.difference_update(completed)  # written in full (nothing may declare them unchanged)
        self._note_plain()
        return completed

    # ---- queries ------------------------------------------------------------------------------------------
    @property
    def layers_total(self) -> int:
        return len(self.tensors_of_layer)

    @property
    def layers_ready(self) -> int:
        """Layers whose every tensor was loaded or restored in this epoch (META is checked by `missing`)."""
        return self._complete

    def counts_complete(self) -> bool:
        return self._complete == len(self.tensors_of_layer)

    def untouched_layers(self) -> list[str]:
        """Layers that received nothing in this epoch."""
        sizes = self._size
        return [layer for layer, n in self._left.items() if n == sizes[layer]]

    def unchanged_refusals(self, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """Layer -> why its tensors among `names` may not be declared unchanged: the layer is partly written by
        an earlier epoch, or a write of the tensor failed part way in this one. Empty: all may be."""
        out: dict[str, list[str]] = {}
        partly = self.full_writes.layers
        if not partly and not self._failed:
            return {}
        for name in names:
            layer = self.layer_of_name[name]
            if layer in partly:
                out.setdefault(layer, []).append(f"{name} ({self.full_write_reason(layer)}: write every tensor "
                                                  "of it)")
            elif name in self._failed:
                out.setdefault(layer, []).append(f"{name} (a write of it failed part way: send it again)")
        return {k: tuple(v) for k, v in out.items()}

    @property
    def written(self) -> AbstractSet[str]:
        """The tensors written in this epoch (not those declared unchanged); the set itself, not a copy: read it."""
        return self._written

    def is_loaded(self, name: str) -> bool:
        if name not in self.layer_of_name:
            raise KeyError(name)
        return name in self._written or name in self._unchanged

    def missing(self, is_meta: Callable[[str], bool] | None = None, names: Iterable[str] | None = None
                ) -> dict[str, tuple[str, ...]]:
        """Layer -> tensors not loaded in this epoch or on META (whatever events said). Empty when ready.
        With `names`, only those tensors are checked."""
        if names is None and is_meta is None and not self._failed and self.counts_complete():
            return {}  # every tensor counted and none on META: nothing to look at one by one
        out: dict[str, list[str]] = {}
        candidates = self.layer_of_name if names is None else list(names)
        written, unchanged, layer_of_name = self._written, self._unchanged, self.layer_of_name  # locals: per tensor
        for name in candidates:
            if name not in written and name not in unchanged:
                out.setdefault(layer_of_name[name], []).append(name)
            elif is_meta is not None and is_meta(name):
                out.setdefault(layer_of_name[name], []).append(f"{name} (META)")
        wanted = candidates if names is None or not self._failed else set(candidates)
        for name in self._failed:  # counted loaded before a later write of it failed part way
            if (name in written or name in unchanged) and name in wanted:
                out.setdefault(layer_of_name[name], []).append(f"{name} (a write of it failed part way)")
        return {k: tuple(v) for k, v in out.items()}

    # ---- dirty since the last refresh (`dirty.DirtySinceRefresh`, fed this epoch's writes) ----------------------
    def dirty_parts(self) -> tuple[AbstractSet[str], ...]:
        """The dirty set as parts whose union it is, none of which changes again (`DirtySinceRefresh.parts`): what
        a reload's origin keeps, at no cost per tensor. Call it just before `new_epoch`."""
        return self.dirty.parts(self._written)

    def dirty_tensors(self) -> frozenset[str]:
        """Tensors written since the last successful refresh (this epoch or an earlier one that ended without
        a refresh): what a selective refresh must propagate."""
        return self.dirty.tensors(self._written)

    def clear_dirty(self) -> None:
        """A refresh propagated every dirty tensor into the derived buffers."""
        self.dirty.refreshed()
        self._plain = False

    def mark_dirty(self, names: Iterable[str]) -> None:
        """Tensors possibly written (a write that failed part way) but not loaded: the next refresh rewrites
        what reads them, and they are missing until written again in full (sent again); if the epoch ends first,
        their layers are partly written."""
        names = list(names)
        self.dirty.add(names)
        self._failed.update(names)
        self._note_plain()

    def mark_changed(self, names: Iterable[str]) -> None:
        """Tensors changed without a load (a post-load hook wrote them): dirty, and as loaded as they were."""
        self.dirty.add(names)

    def restore_dirty(self, names: Iterable[str]) -> None:
        """Set the dirty set back to `names` (after a rollback restored every write since it was taken)."""
        self.dirty.restored(names)
        self._plain = False

    def dirty_layers(self) -> list[str]:
        seen = {self.layer_of_name[n] for n in self.dirty_tensors()}
        return [layer for layer in self.tensors_of_layer if layer in seen]
