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

Whatever a hook writes of the tracked tensors (the checkpoint's) is found by reading all of them before and after
the hooks run (a cold load of 2,000 tensors: about 6 ms). A hook that says which tracked tensors it may write
(`writes=`: names or `*` patterns; `()` for none, as when it only makes buffers the checkpoint does not hold) has
only those read; one hook that does not say makes the run read them all. `lifecycle.testing.undeclared_hook_writes`
checks a declaration against what the hook does.

>>> class N:
...     @post_load_hook(Phase.COLD_LOAD, writes=())
...     def init_tables(self): return "tables"
...     @post_load_hook(Phase.RELOAD, writes=["layers.*.mlp.down_proj.weight"])
...     def rescale(self): return "scaled"
>>> may_write(collect_hooks(N, Phase.COLD_LOAD), ["layers.0.mlp.down_proj.weight", "norm.weight"])
[]
>>> may_write(collect_hooks(N), ["layers.0.mlp.down_proj.weight", "norm.weight"])
['layers.0.mlp.down_proj.weight']
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatchcase
from functools import lru_cache
from operator import attrgetter
from typing import Any, TypeVar, cast

import torch

__all__ = ["Hook", "Phase", "collect_hooks", "may_write", "post_load_hook", "run_hooks", "unmatched_writes"]

F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "__lifecycle_phases__"
_WRITES = "__lifecycle_writes__"


class Phase(str, Enum):
    COLD_LOAD = "cold_load"
    RELOAD = "reload"

    def __str__(self) -> str:
        return self.value


def post_load_hook(*phases: Phase | str, writes: Iterable[str] | None = None) -> Callable[[F], F]:
    """Mark a backbone method as a post-load hook for the given phases (at least one, explicitly). `writes`: the
    tracked tensors it may write (names or `*` patterns, `()` for none); None (the default): any of them."""
    if not phases:
        raise ValueError("post_load_hook needs at least one phase: Phase.COLD_LOAD and/or Phase.RELOAD")
    chosen = frozenset(Phase(p) for p in phases)
    declared = declared_writes(writes)

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, chosen)
        setattr(fn, _WRITES, declared)
        return fn

    return mark


def declared_writes(writes: Iterable[str] | None) -> tuple[str, ...] | None:
    """`writes` as a hook keeps it; a bare string (its letters would be patterns) or a non-string is refused."""
    if writes is None:
        return None
    if isinstance(writes, (str, bytes)):
        raise TypeError(f"writes={writes!r}: give a list of tensor names or patterns (writes=[{writes!r}]), "
                        "not one string")
    out: tuple[object, ...] = tuple(writes)  # typed as str; a caller's list may hold anything
    bad = [w for w in out if not (isinstance(w, str) and w)]
    if bad:
        raise TypeError(f"writes: every entry must be a tensor name or pattern (a non-empty string), got {bad!r}")
    return cast("tuple[str, ...]", out)


@dataclass(frozen=True)
class Hook:
    name: str
    phases: frozenset[Phase]
    fn: Callable[..., Any]
    #: the tracked tensors it may write (names or `*` patterns); None: any of them (all are read around it)
    writes: tuple[str, ...] | None = None


def may_write(hooks: Iterable[Hook], names: Iterable[str]) -> list[str]:
    """Those of `names` (the tracked tensors, in their order) that `hooks` may write: every one when a hook did not
    declare what it writes."""
    patterns: set[str] = set()
    for hook in hooks:
        if hook.writes is None:
            return list(names)
        patterns.update(hook.writes)
    return list(_matching(frozenset(patterns), tuple(names))) if patterns else []


@lru_cache(maxsize=32)
def _matching(patterns: frozenset[str], names: tuple[str, ...]) -> tuple[str, ...]:
    exact = {p for p in patterns if not any(c in p for c in "*?[")}
    globs = [p for p in patterns if p not in exact]
    return tuple(n for n in names if n in exact or any(fnmatchcase(n, g) for g in globs))


def unmatched_writes(hooks: Iterable[Hook], names: Iterable[str]) -> dict[str, list[str]]:
    """Hook name -> the entries of its `writes` that match none of `names` (a typo, or a tensor the checkpoint does
    not hold: a buffer a hook makes needs no declaration)."""
    names = tuple(names)
    out = {}
    for hook in hooks:
        bad = [w for w in hook.writes or () if not _matching(frozenset((w,)), names)]
        if bad:
            out[hook.name] = bad
    return out


def collect_hooks(cls: type, phase: Phase | None = None) -> list[Hook]:
    """Hooks declared on `cls` and its bases (base-class hooks first), optionally only those for `phase`.
    A subclass overriding a hook method replaces it, phases included."""
    seen: dict[str, Hook] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            phases = getattr(attr, _ATTR, None)
            if phases is not None:
                seen.pop(name, None)
                seen[name] = Hook(name, phases, attr, getattr(attr, _WRITES, None))
            elif name in seen:
                del seen[name]  # overridden by a method that did not opt in
    hooks = list(seen.values())
    return [h for h in hooks if phase is None or phase in h.phases]


#: (phase, hook name, hook function) -> the epoch it completed in
Done = dict[tuple[str, str, Callable[..., Any]], int]


def _signature(t: Any) -> tuple[int, int, int] | None:
    """What changes when a tensor is written in place (its version counter) or replaced (its object, its address)."""
    if t is None:
        return None
    try:
        version = t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        version = -1
    return id(t), version, 0 if t.is_meta else t.data_ptr()


_VERSION = attrgetter("_version")


def _signatures(tensors: Sequence[Any]) -> list[Any]:
    """`_signature` of each of `tensors`, the common case (every one a tensor with a version counter) read in C
    with `map`: a cold load reads every tracked tensor twice around its hooks. A META tensor's `data_ptr` is 0, as
    `_signature` says. Anything else (a None, an inference tensor) takes the per-tensor path."""
    try:
        return list(zip(map(id, tensors), map(_VERSION, tensors), map(torch.Tensor.data_ptr, tensors), strict=True))
    except (RuntimeError, TypeError, AttributeError):
        return list(map(_signature, tensors))


def run_hooks(backbone: Any, hooks: Iterable[Hook], phase: Phase, epoch: int, done: Done,
              audit: Callable[..., None], tracked: Callable[[Sequence[Hook]], tuple[Sequence[str], Sequence[Any]]],
              changed: Callable[[list[str]], None]) -> list[str]:
    """Run the hooks that have not completed yet (`done`): a `cold_load` hook once ever, a `reload` hook once per
    epoch. A hook that raises (or is interrupted) stops the run (audited); the hooks before it stay completed.
    Whatever the hooks wrote of the `tracked` tensors (`tracked(hooks)`: the names and live tensors of those the
    hooks to run may write, in one order; found by each one's version counter, object and address, before and
    after) goes to `changed`, also when a hook stopped part way: a hook may scale, convert or replace a weight in
    place, and what reads it must then be refreshed. Returns the names of the hooks that ran."""
    def pending(hook: Hook) -> bool:
        key = (phase.value, hook.name, hook.fn)
        return not (key in done and (phase is Phase.COLD_LOAD or done[key] == epoch))

    todo = [h for h in hooks if pending(h)]
    if not todo:
        return []
    names, tensors = tracked(todo)
    before = _signatures(tensors) if names else []  # hooks that declared they write no tracked tensor: no read
    ran = []
    try:
        for hook in todo:
            if not pending(hook):  # the same hook listed twice
                continue
            t0 = time.perf_counter()
            try:
                hook.fn(backbone)
            except BaseException as e:
                audit("hook_failed", hook=hook.name, phase=phase.value, error=repr(e))
                raise
            done[(phase.value, hook.name, hook.fn)] = epoch
            audit("hook_run", hook=hook.name, phase=phase.value,
                  duration_ms=round((time.perf_counter() - t0) * 1e3, 3))
            ran.append(hook.name)
    finally:
        if names:
            now_names, now_tensors = tracked(todo)
            now = dict(zip(now_names, _signatures(now_tensors), strict=True)) if now_names != names else None
            after = _signatures(now_tensors) if now is None else [now.get(name) for name in names]
            written = [name for name, was, sig in zip(names, before, after, strict=True) if was != sig]
            if written:
                changed(written)
    return ran
