"""Which tensors of which layer are loaded (or still META), per reload epoch.

Per-tensor work is a couple of dict operations: the name -> layer map is built once, and a per-layer counter
says when a layer completes. The machine only hears about layer completions, never about single tensors.

>>> r = LayerReadiness(["layers.0.w", "layers.0.b", "norm.weight"])
>>> r.mark_loaded(["layers.0.w"]), r.mark_loaded(["layers.0.b"])
([], ['layers.0'])
>>> r.missing()
{'norm': ('norm.weight',)}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

__all__ = ["LayerReadiness", "layer_of"]

_LAYER_PREFIX = re.compile(r"^(.*?\blayers\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: `layers.N` for decoder layers (with any prefix before it), else the
    owning module's path (`fc.weight` -> `fc`, `norm.weight` -> `norm`), `<root>` for top-level tensors."""
    m = _LAYER_PREFIX.match(name)
    if m:
        return m.group(1)
    module, _, _ = name.rpartition(".")
    return module or "<root>"


class LayerReadiness:
    """Readiness bookkeeping for one backbone. Not thread-safe by itself: the lifecycle serialises calls."""

    def __init__(self, names: Iterable[str], layer_key: Callable[[str], str] = layer_of) -> None:
        self.layer_of_name: dict[str, str] = {n: layer_key(n) for n in names}
        tensors: dict[str, list[str]] = {}
        for name, layer in self.layer_of_name.items():
            tensors.setdefault(layer, []).append(name)
        self.tensors_of_layer: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in tensors.items()}
        self.epoch = 0
        self._loaded_epoch: dict[str, int] = dict.fromkeys(self.layer_of_name, -1)
        self._count: dict[str, int] = dict.fromkeys(self.tensors_of_layer, 0)
        self._complete = 0
        # names written since the last successful refresh (dirty) vs declared unchanged (ready, not dirty).
        # Kept across epochs: an epoch that ends without a refresh (aborted, or a second begin_reload) leaves
        # its writes to be propagated by the next refresh; `clear_dirty` is called once a refresh succeeded.
        self._dirty: set[str] = set()
        # of the tensors loaded in this epoch, those only declared unchanged (the rest were written: no per-tensor
        # set on the hot path); writes that failed part way in this epoch and were not redone
        self._unchanged: set[str] = set()
        self._failed: set[str] = set()
        self._closed = False  # the epoch ended (close_epoch ran): nothing more is written in it
        # layers an earlier epoch left partly written (it ended with some of their tensors written and not all, or
        # a write failed part way): they mix two checkpoints, so only a complete write of them ends this; nothing
        # may declare them unchanged (`unchanged_refusals`)
        self.partly_written: set[str] = set()

    # ---- epochs -------------------------------------------------------------------------------------------
    def new_epoch(self) -> int:
        self.close_epoch()
        self.epoch += 1
        self._closed = False
        self._count = dict.fromkeys(self.tensors_of_layer, 0)
        self._complete = 0
        return self.epoch

    def close_epoch(self, restored: Iterable[str] = ()) -> list[str]:
        """The epoch ends without its refresh (an abort, or a new epoch): every layer it wrote part of (some
        tensors and not all, or a write that failed part way), except writes `restored` by a rollback, is now
        partly written. Returns the layers newly so."""
        if self._closed:  # an abort closed it already; the next begin_reload closes it again
            return []
        self._closed = True
        restored = frozenset(restored)
        sizes, count, loaded, epoch = self.tensors_of_layer, self._count, self._loaded_epoch, self.epoch
        new = {self.layer_of_name[n] for n in self._failed - restored}
        if self._complete < len(sizes):  # only an incomplete layer can be written in part
            for layer, names in sizes.items():
                if 0 < count[layer] < len(names) and layer not in new and any(
                        loaded[n] == epoch and n not in self._unchanged and n not in restored for n in names):
                    new.add(layer)
        new -= self.partly_written
        self.partly_written.update(new)
        self._unchanged = set()
        self._failed = set()
        return sorted(new)

    def forget(self, names: Iterable[str]) -> None:
        """Stop tracking `names` (optional tensors the first load did not have): the counts are rebuilt from
        what is loaded in this epoch, and a layer left with no tensors is no layer."""
        gone = set(names) & self.layer_of_name.keys()
        if not gone:
            return
        for name in gone:
            del self.layer_of_name[name], self._loaded_epoch[name]
        self._dirty -= gone
        self._unchanged -= gone
        self._failed -= gone
        tensors: dict[str, list[str]] = {}
        for name, layer in self.layer_of_name.items():
            tensors.setdefault(layer, []).append(name)
        self.tensors_of_layer = {k: tuple(v) for k, v in tensors.items()}
        self._count = {layer: sum(self._loaded_epoch[n] == self.epoch for n in ns)
                       for layer, ns in self.tensors_of_layer.items()}
        self._complete = sum(c == len(self.tensors_of_layer[la]) for la, c in self._count.items())
        self.partly_written &= self.tensors_of_layer.keys()

    # ---- hot path -----------------------------------------------------------------------------------------
    def unknown(self, names: Iterable[str]) -> list[str]:
        known = self.layer_of_name
        return [n for n in names if n not in known]

    def mark_loaded(self, names: Iterable[str]) -> list[str]:
        """Record tensors written in this epoch (duplicates are fine). Returns the layers that just completed.
        Names must be known (check with `unknown` first)."""
        return self._mark(names, dirty=True)

    def mark_unchanged(self, names: Iterable[str]) -> list[str]:
        """Declare tensors restored unchanged in this epoch: they count as ready but not dirty."""
        return self._mark(names, dirty=False)

    def unmark(self, names: Iterable[str]) -> None:
        """Undo `mark_unchanged(names)` of tensors that were not loaded in this epoch before it (a refused
        finish puts back what it declared)."""
        loaded, count, sizes = self._loaded_epoch, self._count, self.tensors_of_layer
        for name in names:
            if loaded[name] != self.epoch:
                continue
            loaded[name] = -1
            self._unchanged.discard(name)
            layer = self.layer_of_name[name]
            if count[layer] == len(sizes[layer]):
                self._complete -= 1
            count[layer] -= 1

    def _mark(self, names: Iterable[str], *, dirty: bool) -> list[str]:
        epoch, loaded, count, sizes = self.epoch, self._loaded_epoch, self._count, self.tensors_of_layer
        failed, unchanged = self._failed, self._unchanged
        completed: list[str] = []
        for name in names:
            if dirty:
                self._dirty.add(name)
                if failed:
                    failed.discard(name)  # written again, in full
            if loaded[name] == epoch:
                if dirty and unchanged:
                    unchanged.discard(name)  # declared unchanged, then written after all
                continue
            if not dirty:
                unchanged.add(name)
            loaded[name] = epoch
            layer = self.layer_of_name[name]
            count[layer] += 1
            if count[layer] == len(sizes[layer]):
                completed.append(layer)
        self._complete += len(completed)
        if self.partly_written and completed:
            self.partly_written.difference_update(completed)  # written in full (nothing may declare them unchanged)
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
        return [layer for layer, c in self._count.items() if c == 0]

    def unchanged_refusals(self, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """Layer -> why its tensors among `names` may not be declared unchanged: the layer is partly written by
        an earlier epoch, or a write of the tensor failed part way in this one. Empty: all may be."""
        out: dict[str, list[str]] = {}
        if not self.partly_written and not self._failed:
            return {}
        for name in names:
            layer = self.layer_of_name[name]
            if layer in self.partly_written:
                out.setdefault(layer, []).append(f"{name} (layer partly written by a reload that was aborted or "
                                                  "abandoned: write every tensor of it)")
            elif name in self._failed:
                out.setdefault(layer, []).append(f"{name} (a write of it failed part way: send it again)")
        return {k: tuple(v) for k, v in out.items()}

    def is_loaded(self, name: str) -> bool:
        return self._loaded_epoch[name] == self.epoch

    def missing(self, is_meta: Callable[[str], bool] | None = None, names: Iterable[str] | None = None
                ) -> dict[str, tuple[str, ...]]:
        """Layer -> tensors not loaded in this epoch or on META (whatever events said). Empty when ready.
        With `names`, only those tensors are checked."""
        out: dict[str, list[str]] = {}
        candidates = self.layer_of_name if names is None else list(names)
        loaded, epoch, layer_of_name = self._loaded_epoch, self.epoch, self.layer_of_name  # locals: per tensor
        for name in candidates:
            if loaded[name] != epoch:
                out.setdefault(layer_of_name[name], []).append(name)
            elif is_meta is not None and is_meta(name):
                out.setdefault(layer_of_name[name], []).append(f"{name} (META)")
        wanted = candidates if names is None or not self._failed else set(candidates)
        for name in self._failed:  # counted loaded before a later write of it failed part way
            if loaded[name] == epoch and name in wanted:
                out.setdefault(layer_of_name[name], []).append(f"{name} (a write of it failed part way)")
        return {k: tuple(v) for k, v in out.items()}

    def dirty_tensors(self) -> frozenset[str]:
        """Tensors written since the last successful refresh (this epoch or an earlier one that ended without
        a refresh): what a selective refresh must propagate."""
        return frozenset(self._dirty)

    def clear_dirty(self) -> None:
        """A refresh propagated every dirty tensor into the derived buffers."""
        self._dirty = set()

    def mark_dirty(self, names: Iterable[str]) -> None:
        """Tensors possibly written (a write that failed part way) but not loaded: the next refresh rewrites
        what reads them, and they are missing until written again in full (sent again); if the epoch ends first,
        their layers are partly written."""
        names = list(names)
        self._dirty.update(names)
        self._failed.update(names)

    def restore_dirty(self, names: Iterable[str]) -> None:
        """Set the dirty set back to `names` (after a rollback restored every write since it was taken)."""
        self._dirty = set(names)

    def dirty_layers(self) -> list[str]:
        seen = {self.layer_of_name[n] for n in self._dirty}
        return [layer for layer in self.tensors_of_layer if layer in seen]
