"""How the plugin changes vLLM: every change is a record of `registry.py`, applied here and nowhere else.

A record says what is changed (`kind`), where (`module`, `target`), by what (`wrapper`: "module:function" under
`lifecycle.vllm`, a maker that takes vLLM's original and returns its replacement), why, and since which vLLM
release series. Wrappers are named by string so that the records sit at the bottom of the vLLM layer, readable by
everything above it (the capability check, the generated docs, the code that applies a per-instance record)
without importing the layers the wrappers live in.

- `apply(records)` installs the function and method wrappers of `records`: it resolves every target and every
  wrapper first and raises `UnsupportedVLLMError` naming each one that is missing, before anything is patched; a
  second call changes nothing (each wrapper is marked and keeps its original).
- `wrap_instance(key, obj, make)`, `swap_class(key, obj, cls)` and `write_private(key, obj, value)` apply the records
  that act on one object (a layer's quant method, the draft's inner model, vLLM's worker): each refuses a key the
  registry does not declare, and an attribute the object does not have, so no change of vLLM's objects goes
  undeclared and none silently creates a new attribute after vLLM renamed the old one; `set_flag(key, obj, value)`
  sets a flag vLLM reads with a default (the capability check requires vLLM's module to mention it).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import UnsupportedVLLMError
from .records import SWAPS_CLASS, WRAPS, WRAPS_INSTANCE, WRITES, Patch
from .registry import PATCHES

__all__ = ["MARK", "ORIGINAL", "Wrapper", "apply", "is_wrapped", "original_of", "resolve_wrapper", "set_flag",
           "swap_class", "wrap_instance", "write_private"]

#: A wrapper maker: vLLM's original in, its replacement out.
Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
_PACKAGE = "lifecycle.vllm"
#: Set on every installed wrapper (True), and the original it wraps.
MARK = "__reload_lifecycle_wrapped__"
ORIGINAL = "__wrapped_original__"

def resolve_wrapper(name: str) -> Wrapper:
    """The maker a record names ("reload.hooks:initialize" -> lifecycle.vllm.reload.hooks.initialize)."""
    module, _, function = name.partition(":")
    maker: Wrapper = getattr(importlib.import_module(f"{_PACKAGE}.{module}"), function)
    return maker


def _owner(patch: Patch) -> tuple[Any, str, Any]:
    """(the object holding the target, its last name, the target itself), or LookupError saying what is missing."""
    try:
        owner: Any = importlib.import_module(patch.module)
    except ImportError as e:
        raise LookupError(f"module not importable ({type(e).__name__}: {e})") from None
    *path, name = patch.target.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise LookupError(f"{part} not found")
    original = getattr(owner, name, None)
    if original is None:
        raise LookupError(f"{name} not found")
    return owner, name, original


def is_wrapped(fn: Any) -> bool:
    return bool(getattr(fn, MARK, False))


def original_of(fn: Any) -> Any:
    """What an installed wrapper wraps (`fn` itself when it is not one)."""
    return getattr(fn, ORIGINAL, fn)


def apply(records: Iterable[Patch]) -> list[str]:
    """Install the wrappers of every WRAPS record; returns the targets changed now. Every target and wrapper is
    resolved before anything is patched: a miss raises `UnsupportedVLLMError` naming each (and nothing changes)."""
    planned: list[tuple[Patch, Any, str, Any, Wrapper]] = []
    misses: list[str] = []
    for patch in records:
        if patch.kind != WRAPS:
            continue
        try:
            owner, name, original = _owner(patch)
        except LookupError as e:
            misses.append(f"{patch.where}: {e} (wrapped by {patch.user}: {patch.why})")
            continue
        planned.append((patch, owner, name, original, resolve_wrapper(patch.wrapper)))
    if misses:
        lines = "\n".join(f"  - {m}" for m in misses)
        raise UnsupportedVLLMError(f"reload-lifecycle's vLLM plugin cannot patch this vLLM: {len(misses)} name(s) "
                                   f"it wraps are missing:\n{lines}\nNothing was patched.")
    changed = []
    for patch, owner, name, original, make in planned:
        if is_wrapped(original):
            continue
        wrapper = functools.wraps(original)(make(original))
        setattr(wrapper, MARK, True)
        setattr(wrapper, ORIGINAL, original)
        setattr(owner, name, wrapper)
        changed.append(patch.where)
    return changed


@functools.cache  # the registry is a tuple: a lookup per write of every push need not scan it
def _declared(key: str, kind: str) -> Patch:
    for patch in PATCHES:
        if patch.key == key and patch.kind == kind:
            return patch
    raise KeyError(f"reload-lifecycle: no {kind!r} record {key!r} in lifecycle/vllm/compat/registry.py: declare "
                   "the change there before making it")


def wrap_instance(key: str, obj: Any, make: Wrapper) -> None:
    """Replace `obj`'s method named by record `key` (a WRAPS_INSTANCE record) with `make(current)` on `obj` only;
    the current one is the object's own earlier replacement, else its class's method as it is when called."""
    patch = _declared(key, WRAPS_INSTANCE)
    attr = patch.target.rpartition(".")[2]
    if getattr(obj, attr, None) is None:
        raise AttributeError(f"{type(obj).__name__} has no {attr} ({patch.where}: {patch.why})")
    own = obj.__dict__.get(attr)
    if own is None and isinstance(getattr(type(obj), attr, None), property):
        own = getattr(obj, attr)  # a property's value (vLLM's parameters keep their loader behind one), bound now

    def current(*args: Any, **kwargs: Any) -> Any:
        if own is not None:
            return own(*args, **kwargs)
        return getattr(type(obj), attr)(obj, *args, **kwargs)

    # the replacement shows the replaced one's signature: vLLM binds a weight loader's arguments by it to buffer a
    # load and replay it (`layerwise.online_process_loader`)
    wrapper = functools.wraps(getattr(obj, attr))(make(current))
    setattr(wrapper, MARK, True)
    setattr(obj, attr, wrapper)


def swap_class(key: str, obj: Any, cls: type) -> None:
    """Give `obj` the class `cls`, a subclass of its own (a SWAPS_CLASS record)."""
    patch = _declared(key, SWAPS_CLASS)
    if not issubclass(cls, type(obj)):
        raise TypeError(f"{patch.where}: {cls.__name__} is not a subclass of {type(obj).__name__}")
    obj.__class__ = cls


def set_flag(key: str, obj: Any, value: Any) -> None:
    """Set an attribute that vLLM reads with a default (`getattr(layer, "_cpu_skip_gemm_dispatch", False)`), so
    the object need not have it (a WRITES record whose owner is no class: the capability check requires vLLM's
    module to mention the name, so a rename upstream refuses the activation instead of setting a dead flag)."""
    setattr(obj, _attribute(key), value)


def write_private(key: str, obj: Any, value: Any) -> None:
    """Set the private attribute of vLLM's object named by record `key` (a WRITES record): only one vLLM has."""
    attr = _attribute(key)
    if not hasattr(obj, attr):
        patch = _declared(key, WRITES)
        raise AttributeError(f"{type(obj).__name__} has no {attr}: vLLM moved it ({patch.where}: {patch.why})")
    setattr(obj, attr, value)


@functools.cache
def _attribute(key: str) -> str:
    """The attribute a WRITES record names, made once and interned: a name split off afresh for every write (each
    push writes vLLM's reload records) stayed alive in the objects' attribute dictionaries, a few dozen bytes per
    object, which the soak benchmark counts as growth."""
    return sys.intern(_declared(key, WRITES).target.rpartition(".")[2])
