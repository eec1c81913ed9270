"""What a refresh plans for one derived buffer (`BufferPlan`: its mode, the copies to make, the temporaries its
builders created), what a planner reads (`Request`), and the checks every planner shares.

A copy's destination is a slice of the buffer (`SliceCopy`): along the concat dim for a `concat`, inside one
layer's slice for a `stack`, the whole buffer for a `custom`. A layer whose `per_layer` returns several parts
(separate K and V weights) gets one copy per part, each straight into its place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from torch import nn

from ..errors import DerivedBuildError, LifecycleError
from ..storage import StorageIdentity
from ..types import dtype_name
from .specs import DerivedSpec

__all__ = ["BufferPlan", "Layout", "Problem", "Request", "SliceCopy", "built", "destination", "fmt_layout",
           "layer_copies", "of_a_parameter", "owned_storages", "parts_of", "rebuild_problem", "same_layout",
           "temporaries", "write_parts"]

T = TypeVar("T")
Resolve = Callable[[str], "torch.Tensor | None"]
Layout = tuple[tuple[int, ...], torch.dtype, torch.device]


class SliceCopy(NamedTuple):
    """One copy into the buffer: `layer`'s part (or whole slice) at `start` for `length` elements of the join
    axis (the concat dim, or a stack slice's first dim); `length` None: the layer's whole slice (a custom: the
    whole buffer). `src` None: a computed stack slice, evaluated at apply time."""

    layer: int
    start: int
    length: int | None
    src: torch.Tensor | None


@dataclass
class BufferPlan:
    spec: DerivedSpec
    mode: str
    existing: torch.Tensor | None = None
    new_tensor: torch.Tensor | None = None  # cold build result or alias target
    copies: list[SliceCopy] = field(default_factory=list)
    slices_total: int = 0
    # a computed stack's cold build: (slice shape, dtype, device); the buffer is allocated once, filled per slice
    cold_layout: Layout | None = None
    reason: str = ""
    # storages the plan's builders created that are not buffers (per_layer results that are no views of the
    # backbone's tensors, a custom build's value): how many, and their bytes
    temporaries: int = 0
    temporary_bytes: int = 0
    # a backed buffer (`backing.py`): the sources to make views of their places once the copies are done, and how
    # many sources the buffer backs in all
    backs: list[tuple[torch.Tensor, SliceCopy]] = field(default_factory=list)
    backed_sources: int = 0
    # a per-layer plan of an existing buffer: where each layer's parts go (copies without src) and the layout each
    # part had, what a later refresh may reuse (`reuse.py`)
    places: list[list[tuple[SliceCopy, Layout]]] | None = None

    def count(self, storages: Iterable[torch.UntypedStorage]) -> None:
        for st in storages:
            self.temporaries += 1
            self.temporary_bytes += st.nbytes()


@dataclass(frozen=True)
class Problem:
    """Why a buffer refuses the refresh: its new layout is inconsistent ("layout": SourceLayoutError) or would not
    fit the existing storage ("realloc": StorageReallocationError)."""

    kind: Literal["layout", "realloc"]
    text: str


@dataclass(frozen=True)
class Request:
    """What a planner reads: one buffer, its sources (checked ready), its existing storage (None: a cold build or
    an explicit rebuild), and the refresh's options."""

    backbone: nn.Module
    spec: DerivedSpec
    names: list[str]
    existing: torch.Tensor | None
    resolve: Resolve
    dirty: frozenset[str]
    context: Mapping[str, str]
    full: bool
    pinned: bool
    allow_realloc: bool

    def layer_dirty(self, i: int) -> bool:
        """Whether layer `i`'s slice reads a tensor written since the last refresh."""
        return any(f"{self.spec.layers_attr}.{i}.{s}" in self.dirty for s in self.spec.sources)


# ---- running builders ----------------------------------------------------------------------------------------
def built(spec: DerivedSpec, step: str, context: Mapping[str, str], fn: Callable[[T], object], arg: T
          ) -> torch.Tensor:
    """Run one builder step of the plan; an exception in it becomes a DerivedBuildError naming the buffer and
    the step (nothing was written: builders only run in the plan)."""
    try:
        out = fn(arg)
    except LifecycleError:
        raise
    except Exception as e:
        raise DerivedBuildError(spec.name, step, e, backbone=context.get("backbone", "?"),
                                state=context.get("state", "?")) from e
    if not isinstance(out, torch.Tensor):
        raise DerivedBuildError(spec.name, step, TypeError(f"returned {type(out).__name__}, not a tensor"),
                                backbone=context.get("backbone", "?"), state=context.get("state", "?"))
    return out


def owned_storages(backbone: nn.Module) -> set[int]:
    """The storages of the backbone's tensors (what a view of a source shares)."""
    return {t.untyped_storage().data_ptr() for t in (*backbone.parameters(), *backbone.buffers()) if not t.is_meta}


def parts_of(spec: DerivedSpec, i: int, context: Mapping[str, str], layer: nn.Module) -> list[torch.Tensor]:
    """A layer's slice as a list of parts (one when `per_layer` returns a tensor)."""
    assert spec.per_layer is not None
    try:
        out = spec.per_layer(layer)
    except LifecycleError:
        raise
    except Exception as e:
        raise DerivedBuildError(spec.name, f"per_layer for {spec.layers_attr}.{i}", e,
                                backbone=context.get("backbone", "?"), state=context.get("state", "?")) from e
    # what the user's function returned, checked here: every part a tensor before it is returned
    parts: list[Any] = (
        [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (list, tuple)) else [out])
    if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        what = "no parts" if not parts else ", ".join(type(p).__name__ for p in parts)
        raise DerivedBuildError(spec.name, f"per_layer for {spec.layers_attr}.{i}",
                                TypeError(f"returned {what}, not a tensor or a sequence of tensors"),
                                backbone=context.get("backbone", "?"), state=context.get("state", "?"))
    return parts


def of_a_parameter(p: torch.Tensor) -> bool:
    """Whether `p` is a parameter or a view of one (`type` first: `isinstance` of a Parameter runs Python)."""
    return type(p) is nn.Parameter or type(p._base) is nn.Parameter or isinstance(p, nn.Parameter) \
        or isinstance(p._base, nn.Parameter)


def temporaries(parts: Sequence[torch.Tensor], owned: Callable[[], set[int]]) -> list[torch.UntypedStorage]:
    """The distinct storages among `parts` that are not the backbone's (a computed result, not a view of a
    source): what a builder allocated. `owned()` gives the backbone's storages, asked only when needed."""
    out: dict[int, torch.UntypedStorage] = {}
    mine: set[int] | None = None
    for p in parts:
        if of_a_parameter(p):
            continue  # a parameter or a view of one: the common case, decided without touching storages
        st = p.untyped_storage()
        ptr = st.data_ptr()
        if mine is None:
            mine = owned()
        if ptr not in mine:
            out.setdefault(ptr, st)
    return list(out.values())


# ---- where parts go ------------------------------------------------------------------------------------------
def destination(spec: DerivedSpec, buf: torch.Tensor, c: SliceCopy) -> torch.Tensor:
    """The view of `buf` that copy `c` writes."""
    if spec.kind == "concat":
        assert c.length is not None
        return buf.narrow(spec.dim, c.start, c.length)
    if spec.kind == "stack":
        sl = buf[c.layer]
        return sl if c.length is None else sl.narrow(0, c.start, c.length)
    return buf


def layer_copies(spec: DerivedSpec, i: int, start: int, parts: Sequence[torch.Tensor], keep_src: bool = True
                 ) -> list[SliceCopy]:
    """The copies that put layer `i`'s parts in place: from `start` along the concat dim (a concat), from 0 in
    the layer's slice (a stack; one part is the whole slice)."""
    if spec.kind == "stack" and len(parts) == 1:
        return [SliceCopy(i, 0, None, parts[0] if keep_src else None)]
    axis = spec.dim if spec.kind == "concat" else 0
    out, at = [], start if spec.kind == "concat" else 0
    for p in parts:
        n = p.shape[axis]
        out.append(SliceCopy(i, at, n, p if keep_src else None))
        at += n
    return out


def write_parts(spec: DerivedSpec, buf: torch.Tensor, i: int, start: int, parts: Sequence[torch.Tensor]) -> int:
    """Copy layer `i`'s parts into their places in `buf`; returns the elements written."""
    n = 0
    for c, part in zip(layer_copies(spec, i, start, parts), parts, strict=True):  # a copy per part, in order
        dst = destination(spec, buf, c)
        dst.copy_(part)
        n += dst.numel()
    return n


# ---- layouts -------------------------------------------------------------------------------------------------
def rebuild_problem(spec: DerivedSpec, layout: Layout, existing: torch.Tensor) -> Problem | None:
    """None when a buffer of `layout` fits the existing storage exactly (so slices can be copied in place)."""
    shape, dt, dev = layout
    if shape == tuple(existing.shape) and dt == existing.dtype and dev == existing.device \
            and existing.is_contiguous():
        return None
    return Problem("realloc", f"{spec.name}: a rebuild would have shape {shape} {dtype_name(dt)} on {dev}, the "
                              f"existing buffer is {fmt_layout(existing)}")


def fmt_layout(t: torch.Tensor | StorageIdentity) -> str:
    ident = t if isinstance(t, StorageIdentity) else StorageIdentity.of(t)
    return f"shape {ident.shape} stride {ident.stride} {dtype_name(ident.dtype)} on {ident.device}"


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (tuple(a.shape), a.dtype, a.device) == (tuple(b.shape), b.dtype, b.device)
