"""Reading a backbone's tracked tensors in bulk: the live tensor of many names at once, in C, exactly as the
backbone's `live_tensor` reads each (its parameter table first, then its buffer table; a name without a slot is
looked up in the module tree).

A pin verification reads every graph-visible tensor twice per refresh, and a refresh's plan reads the sources of
its per-layer buffers; after the copies of a refresh the caches are cold, so the fewer objects a pass touches the
faster it is. `Slots.gather` compiles a list of names once (owning modules and attribute names as parallel
lists, split by the table each name was found in) and reads it with `map`: a slot found in its parameter table is
the answer, a slot found in its buffer table is the answer once no parameter of that name shadows it; anything
else (a name without a slot, a tensor that left the table it was compiled for) is read one by one by `live`.

>>> from torch import nn
>>> m = nn.Linear(2, 3)
>>> slots = Slots({"weight": (m, "weight"), "bias": (m, "bias")}, lambda name: None)
>>> names = ["bias", "weight"]
>>> [t is m.bias for t in slots.gather(names)], slots.gather(names)[1] is m.weight
([True, False], True)
>>> del m.bias; m.register_buffer("bias", torch.zeros(3))     # moved from the parameters to the buffers
>>> slots.gather(names)[0] is m.bias
True
>>> view = slots.view()                                        # what a pin verification reads: lazy, live
>>> sorted(view), view["weight"] is m.weight, view.get("nothing") is None
(['bias', 'weight'], True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from operator import is_, is_not, itemgetter

import torch
from torch import nn

from .torch_private import BUFFERS_OF, PARAMETERS_OF, own_parameters, own_tensor

__all__ = ["LiveSlots", "Slots"]

Tensor = torch.Tensor
_IS_NONE = partial(is_, None)
_NOT_NONE = partial(is_not, None)


@dataclass(frozen=True)
class _Compiled:
    """One list of names as parallel columns: those found in a parameter table, those found in a buffer table,
    and `order`, the position of each name in `params + buffers` (None: a name without a slot, read one by one)."""

    names: Sequence[str]
    p_modules: list[nn.Module]
    p_leaves: list[str]
    b_modules: list[nn.Module]
    b_leaves: list[str]
    order: Callable[[list[Tensor | None]], tuple[Tensor | None, ...]] | None


class Slots:
    """name -> (owning module, attribute) of every tracked tensor, read one by one (`live`) or in bulk
    (`gather`). `fallback` finds a name without a slot. `changed()` must be called when the slot map changes."""

    def __init__(self, table: dict[str, tuple[nn.Module, str]], fallback: Callable[[str], Tensor | None]) -> None:
        self.table = table
        self._fallback = fallback
        self._compiled: dict[int, _Compiled] = {}

    def changed(self) -> None:
        self._compiled = {}

    def live(self, name: str) -> Tensor | None:
        slot = self.table.get(name)
        if slot is None:
            return self._fallback(name)
        mod, leaf = slot
        return own_tensor(mod, leaf)

    def _compile(self, names: Sequence[str]) -> _Compiled:
        got = self._compiled.get(id(names))
        if got is not None and got.names is names:
            return got
        p: list[tuple[nn.Module, str]] = []
        b: list[tuple[nn.Module, str]] = []
        where: list[int] = []
        for name in names:
            slot = self.table.get(name)
            if slot is None:
                break
            mod, leaf = slot
            column = p if own_parameters(mod).get(leaf) is not None else b
            column.append(slot)
            where.append(len(p) - 1 if column is p else -len(b))
        order = None
        if len(where) == len(names) and names:
            positions = [i if i >= 0 else len(p) - i - 1 for i in where]
            pick = itemgetter(*positions)
            order = pick if len(positions) > 1 else (lambda xs: (pick(xs),))
        got = _Compiled(names, [m for m, _ in p], [leaf for _, leaf in p], [m for m, _ in b], [leaf for _, leaf in b],
                        order)
        if len(self._compiled) > 16:  # names lists come and go (a new snapshot, a new plan): keep a few
            self._compiled = {}
        self._compiled[id(names)] = got
        return got

    def gather(self, names: Sequence[str], unslotted: Callable[[str], Tensor | None] | None = None
               ) -> tuple[Tensor | None, ...]:
        """`tuple(map(self.live, names))`, read in C. A name without a slot is read by `unslotted` (default: the
        fallback `live` uses). `names` is compiled once per list object: pass the same list (not a copy) each
        time."""
        c = self._compile(names)
        if c.order is not None:
            params: list[Tensor | None] = list(map(dict.get, map(PARAMETERS_OF, c.p_modules), c.p_leaves))
            if not any(map(_IS_NONE, params)) and not any(
                    map(_NOT_NONE, map(dict.get, map(PARAMETERS_OF, c.b_modules), c.b_leaves))):
                params += map(dict.get, map(BUFFERS_OF, c.b_modules), c.b_leaves)
                return c.order(params)
        if unslotted is None:
            return tuple(map(self.live, names))
        return tuple(self.live(n) if n in self.table else unslotted(n) for n in names)

    def view(self) -> LiveSlots:
        return LiveSlots(self)


class LiveSlots(Mapping[str, "Tensor | None"]):
    """Every slot's live tensor, read when asked: a mapping for whoever reads a few names or iterates, and
    `tensors_at(names)` for a pin verification that reads them all."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots

    def __getitem__(self, name: str) -> Tensor | None:
        if name not in self._slots.table:
            raise KeyError(name)
        return self._slots.live(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots.table)

    def __len__(self) -> int:
        return len(self._slots.table)

    def tensors_at(self, names: Sequence[str]) -> tuple[Tensor | None, ...]:
        """The live tensor of each of `names` (None for a name without a slot, as `get` says)."""
        return self._slots.gather(names, _no_tensor)


def _no_tensor(name: str) -> None:
    return None
