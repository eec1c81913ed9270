"""The plan phase of a refresh: validate every derived buffer and decide every write, before anything is written.

One planner per kind of buffer (`_plan_alias`, `_plan_custom`, `_plan_per_layer` for concat and stack,
`_plan_computed_stack`) returns the buffer's plan or the problem that refuses the refresh; `plan_refresh` checks
every buffer's sources, runs its planner, and raises with every problem found, or returns the whole plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode  # the dry-run engine torch.compile uses

from ..errors import (
    DerivedBuildError,
    LayersNotReadyError,
    LifecycleError,
    SourceLayoutError,
    StorageReallocationError,
)
from ..readiness import layer_of
from ..storage import StorageIdentity, describe_changes
from ..types import TensorSpec, dtype_name
from .specs import DerivedSpec, _layers, current_buffer, resolve_tensor

__all__ = ["RefreshPlan", "plan_refresh"]

T = TypeVar("T")
Resolve = Callable[[str], "torch.Tensor | None"]
Layout = tuple[tuple[int, ...], torch.dtype, torch.device]


@dataclass
class _BufferPlan:
    spec: DerivedSpec
    mode: str
    existing: torch.Tensor | None = None
    new_tensor: torch.Tensor | None = None  # cold build result or alias target
    # (start, length, src) along dim; src None: a computed stack slice, evaluated at apply time
    copies: list[tuple[int, int, torch.Tensor | None]] = field(default_factory=list)
    slices_total: int = 0
    # a computed stack's cold build: (slice shape, dtype, device); the buffer is allocated once, filled per slice
    cold_layout: Layout | None = None
    reason: str = ""


@dataclass
class RefreshPlan:
    buffers: list[_BufferPlan]
    context: dict[str, str]


@dataclass(frozen=True)
class _Problem:
    """Why a buffer refuses the refresh: its new layout is inconsistent ("layout": SourceLayoutError) or would not
    fit the existing storage ("realloc": StorageReallocationError)."""

    kind: Literal["layout", "realloc"]
    text: str


@dataclass(frozen=True)
class _Request:
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


Planned = _BufferPlan | _Problem


def plan_refresh(
    backbone: nn.Module,
    specs: Sequence[DerivedSpec],
    *,
    tensor_specs: Mapping[str, TensorSpec],
    dirty: frozenset[str],
    context: Mapping[str, str],
    full: bool = False,
    pinned: bool = False,
    allow_realloc: bool = False,
    resolve: Resolve | None = None,
) -> RefreshPlan:
    """Validate every buffer and decide every write. Raises before anything is written.

    `dirty`: tensors written in this epoch; only slices that read them are rewritten (all when `full`).
    `pinned`: graphs are captured, so an alias may not be re-pointed at a source that moved.
    `allow_realloc`: an explicit cold rebuild (graphs released): existing buffers may be replaced.
    `resolve`: name -> live tensor (default: walk the module tree).
    Raises LayersNotReadyError (a source absent or on META), SourceLayoutError, StorageReallocationError.
    """
    sources = _SourceCheck(resolve or partial(resolve_tensor, backbone), tensor_specs)
    realloc_problems: list[str] = []
    plans: list[_BufferPlan] = []
    for spec in specs:
        existing = None if allow_realloc else current_buffer(backbone, spec.name)
        names = spec.source_names(backbone)
        usable, fallback_reason = sources.check(f"{spec.kind} {spec.name}", names, spec.fallback)
        if fallback_reason:
            plans.append(_BufferPlan(spec, "fallback", existing=existing, reason=fallback_reason))
        if not usable:
            continue
        planned = _planner(spec)(_Request(backbone, spec, names, existing, sources.resolve, dirty, context, full,
                                          pinned, allow_realloc))
        if isinstance(planned, _Problem):
            (sources.layout if planned.kind == "layout" else realloc_problems).append(planned.text)
        else:
            plans.append(planned)

    ctx = dict(context)
    where = {"backbone": ctx.get("backbone", "?"), "state": ctx.get("state", "?")}
    if sources.not_ready:
        raise LayersNotReadyError("derived-buffer build", sources.not_ready, **where)
    if sources.layout:
        raise SourceLayoutError(sources.layout, **where)
    if realloc_problems:
        raise StorageReallocationError(realloc_problems, **where)
    return RefreshPlan(plans, ctx)


def _planner(spec: DerivedSpec) -> Callable[[_Request], Planned]:
    if spec.kind == "alias":
        return _plan_alias
    if spec.kind == "custom":
        return _plan_custom
    return _plan_computed_stack if spec.computed else _plan_per_layer


# ---- the planners, one per kind ------------------------------------------------------------------------------
def _plan_alias(r: _Request) -> Planned:
    """The buffer is its source: re-pointed at every refresh, unless graphs captured the old address."""
    target = r.resolve(r.names[0])
    assert target is not None
    if r.pinned and r.existing is not None and r.existing is not target:
        old, new = StorageIdentity.of(r.existing), StorageIdentity.of(target)
        if old != new:
            return _Problem("realloc", f"alias {r.spec.name}: its source {r.names[0]} moved, re-pointing would "
                                       "change: " + "; ".join(describe_changes(r.spec.name, old, new)))
    return _BufferPlan(r.spec, "alias", existing=r.existing, new_tensor=target)


def _plan_custom(r: _Request) -> Planned:
    """Built by `build`; refreshed only when a dependency was written, in place by `into` when given (dry-run
    first), else by copying a new `build` result of the same layout."""
    spec, existing = r.spec, r.existing
    live = current_buffer(r.backbone, spec.name)
    if not r.names and live is not None:
        return _plan_constant(r, live)
    if existing is not None and not r.full and not any(n in r.dirty for n in r.names):
        return _BufferPlan(spec, "skipped", existing=existing)
    assert spec.build is not None
    if existing is not None and spec.into is not None:
        problem = _dry_run_into(spec, r.backbone, existing)
        return _Problem("realloc", problem) if problem else _BufferPlan(spec, "in_place", existing=existing)
    value = _built(spec, "build", r.context, spec.build, r.backbone)
    if existing is None:
        return _BufferPlan(spec, "cold", new_tensor=value.detach().clone().contiguous())
    if not _same_layout(value, existing):
        return _Problem("realloc", f"{spec.name}: new value {_fmt_layout(value)} differs from the existing buffer "
                                   f"{_fmt_layout(existing)}")
    return _BufferPlan(spec, "in_place", existing=existing, copies=[(0, 0, value)])


def _plan_constant(r: _Request, live: torch.Tensor) -> Planned:
    """A custom buffer without dependencies: no refresh rewrites it. An explicit rebuild (graphs released)
    replaces it only when its layout changed (a reconfigured backbone); otherwise the built value is dropped."""
    spec = r.spec
    value = spec.build(r.backbone) if r.allow_realloc and spec.build is not None else live
    if _same_layout(value, live):
        return _BufferPlan(spec, "skipped", existing=live)
    return _BufferPlan(spec, "cold", new_tensor=value.detach().clone().contiguous())


def _plan_per_layer(r: _Request) -> Planned:
    """concat / stack: one slice per layer (views: cheap to evaluate); a refresh copies the dirty slices."""
    spec = r.spec
    assert spec.per_layer is not None
    layers = _layers(r.backbone, spec.layers_attr)
    slices = [_built(spec, f"per_layer for {spec.layers_attr}.{i}", r.context, spec.per_layer, layer)
              for i, layer in enumerate(layers)]
    shapes = {tuple(s.shape) for s in slices}
    dtypes = {s.dtype for s in slices}
    if len(dtypes) > 1 or len({s.device for s in slices}) > 1 or (spec.kind == "stack" and len(shapes) > 1) or (
        spec.kind == "concat" and len({sh[:spec.dim] + sh[spec.dim + 1:] for sh in shapes}) > 1
    ):
        return _Problem("layout", f"{spec.kind} {spec.name}: per-layer slices disagree: shapes {sorted(shapes)}, "
                                  f"dtypes {sorted(map(dtype_name, dtypes))}, devices "
                                  f"{sorted({str(s.device) for s in slices})}")
    if spec.kind == "stack":
        dim, lengths, new_shape = 0, [1] * len(slices), (len(slices), *slices[0].shape)
    else:
        dim, lengths = spec.dim, [s.shape[spec.dim] for s in slices]
        new_shape = tuple(sum(lengths) if d == dim else n for d, n in enumerate(slices[0].shape))
    if r.existing is None:
        join = torch.stack if spec.kind == "stack" else partial(torch.cat, dim=dim)
        built = _built(spec, spec.kind, r.context, join, slices)
        return _BufferPlan(spec, "cold", new_tensor=built.contiguous(), slices_total=len(slices))
    problem = _rebuild_problem(spec, (new_shape, slices[0].dtype, slices[0].device), r.existing)
    if problem:
        return problem
    copies = []
    start = 0
    for i, (src, length) in enumerate(zip(slices, lengths, strict=True)):
        if r.full or r.layer_dirty(i):
            copies.append((start, length, src))
        start += length
    return _BufferPlan(spec, "in_place" if copies else "skipped", existing=r.existing, copies=copies,
                       slices_total=len(slices))


def _plan_computed_stack(r: _Request) -> Planned:
    """A `stack(..., computed=True)`: evaluate only the slices that will be written, one at a time, and keep
    their layout, not their values (the apply phase computes each again right before its copy)."""
    spec, existing = r.spec, r.existing
    assert spec.per_layer is not None
    layers = _layers(r.backbone, spec.layers_attr)
    n = len(layers)
    written = [i for i in range(n) if existing is None or r.full or r.layer_dirty(i)]
    layouts: dict[Layout, list[int]] = {}
    for i in written:
        value = _built(spec, f"per_layer for {spec.layers_attr}.{i}", r.context, spec.per_layer, layers[i])
        layouts.setdefault((tuple(value.shape), value.dtype, value.device), []).append(i)
        del value  # a slice-sized temporary
    if len(layouts) > 1:
        return _Problem("layout", f"stack {spec.name}: computed per-layer slices disagree: "
                                  + "; ".join(f"layers {ix}: {sh} {dtype_name(dt)} on {dev}"
                                              for (sh, dt, dev), ix in layouts.items()))
    if existing is None:
        ((layout, _),) = layouts.items()
        return _BufferPlan(spec, "cold", cold_layout=layout, slices_total=n)
    if layouts:
        (((shape, dt, dev), _),) = layouts.items()
        problem = _rebuild_problem(spec, ((n, *shape), dt, dev), existing)
        if problem:
            return problem
    copies: list[tuple[int, int, torch.Tensor | None]] = [(i, 1, None) for i in written]
    return _BufferPlan(spec, "in_place" if copies else "skipped", existing=existing, copies=copies,
                       slices_total=n)


# ---- shared checks -------------------------------------------------------------------------------------------
@dataclass
class _SourceCheck:
    """Sorts what is wrong with sources: not ready (absent or META) vs not in the builder's layout."""

    resolve: Resolve
    tensor_specs: Mapping[str, TensorSpec]
    not_ready: dict[str, list[str]] = field(default_factory=dict)
    layout: list[str] = field(default_factory=list)

    def check(self, label: str, names: Sequence[str], fallback: str | None) -> tuple[bool, str]:
        """(usable, fallback reason). Unready sources are recorded and never routed to a fallback."""
        wrong = []
        ready = True
        for name in names:
            t = self.resolve(name)
            if t is None or t.is_meta:
                self.not_ready.setdefault(layer_of(name), []).append(
                    f"{name} (absent)" if t is None else f"{name} (META)")
                ready = False
                continue
            spec = self.tensor_specs.get(name)
            if spec is not None and (tuple(t.shape) != spec.shape or t.dtype != spec.dtype):
                wrong.append(f"{name}: source has layout {tuple(t.shape)} {dtype_name(t.dtype)} but the builder "
                             f"expects the checkpoint layout {spec.shape} {dtype_name(spec.dtype)} "
                             "(emptied or packed by post-processing?)")
        if not ready:
            return False, ""
        if wrong and not fallback:
            self.layout.extend(f"{label} <- {w}" for w in wrong)
            return False, ""
        return not wrong, "; ".join(wrong)


def _built(spec: DerivedSpec, step: str, context: Mapping[str, str], fn: Callable[[T], torch.Tensor], arg: T
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


def _rebuild_problem(spec: DerivedSpec, layout: Layout, existing: torch.Tensor) -> _Problem | None:
    """None when a buffer of `layout` fits the existing storage exactly (so slices can be copied in place)."""
    shape, dt, dev = layout
    if shape == tuple(existing.shape) and dt == existing.dtype and dev == existing.device \
            and existing.is_contiguous():
        return None
    return _Problem("realloc", f"{spec.name}: a rebuild would have shape {shape} {dtype_name(dt)} on {dev}, the "
                               f"existing buffer is {_fmt_layout(existing)}")


def _fmt_layout(t: torch.Tensor | StorageIdentity) -> str:
    ident = t if isinstance(t, StorageIdentity) else StorageIdentity.of(t)
    return f"shape {ident.shape} stride {ident.stride} {dtype_name(ident.dtype)} on {ident.device}"


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (tuple(a.shape), a.dtype, a.device) == (tuple(b.shape), b.dtype, b.device)


def _dry_run_into(spec: DerivedSpec, backbone: nn.Module, existing: torch.Tensor) -> str:
    """Run a custom buffer's `into` writer on a fake copy of the buffer: "" when the value fits in place,
    otherwise the problem (new vs existing layout). Fake tensors carry no data: nothing is read or written."""
    assert spec.into is not None
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # an out= op resizing the fake output warns; the check below reports it
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            out = mode.from_tensor(existing)
            result = spec.into(backbone, out)
            if result is out and tuple(out.shape) == tuple(existing.shape):
                return ""
            layout = f"shape {tuple(result.shape)} {dtype_name(result.dtype)} on {result.device}"
    how = "resizes" if result is out else "returns a new tensor instead of writing into"
    return f"{spec.name}: its in-place writer {how} the buffer: new value {layout}, the existing buffer is " \
           f"{_fmt_layout(existing)}"
