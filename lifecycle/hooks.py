"""Post-load hooks with an explicit phase opt-in.

A cold load runs the hooks that opted into `cold_load`; a reload runs only those that opted into `reload`.
A one-time weight conversion (repacking, transposing, scaling in place) opts into `cold_load` alone, so it can
never be replayed on weights that were already converted.

>>> class M:
...     @post_load_hook(Phase.COLD_LOAD)
...     def init_tables(self): return "tables"
...     @post_load_hook(Phase.COLD_LOAD, Phase.RELOAD)
...     def recompute_scales(self): return "scales"
>>> [h.name for h in collect_hooks(M, Phase.RELOAD)]
['recompute_scales']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

__all__ = ["Hook", "Phase", "collect_hooks", "post_load_hook"]

F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "__lifecycle_phases__"


class Phase(str, Enum):
    COLD_LOAD = "cold_load"
    RELOAD = "reload"

    def __str__(self) -> str:
        return self.value


def post_load_hook(*phases: Phase | str) -> Callable[[F], F]:
    """Mark a backbone method as a post-load hook for the given phases (at least one, explicitly)."""
    if not phases:
        raise ValueError("post_load_hook needs at least one phase: Phase.COLD_LOAD and/or Phase.RELOAD")
    chosen = frozenset(Phase(p) for p in phases)

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, chosen)
        return fn

    return mark


@dataclass(frozen=True)
class Hook:
    name: str
    phases: frozenset[Phase]
    fn: Callable[..., Any]


def collect_hooks(cls: type, phase: Phase | None = None) -> list[Hook]:
    """Hooks declared on `cls` and its bases (base-class hooks first), optionally only those for `phase`.
    A subclass overriding a hook method replaces it, phases included."""
    seen: dict[str, Hook] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            phases = getattr(attr, _ATTR, None)
            if phases is not None:
                seen.pop(name, None)
                seen[name] = Hook(name, phases, attr)
            elif name in seen:
                del seen[name]  # overridden by a method that did not opt in
    hooks = list(seen.values())
    return [h for h in hooks if phase is None or phase in h.phases]
