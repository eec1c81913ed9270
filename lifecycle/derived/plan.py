"""The plan phase of a refresh: validate every derived buffer and decide every write, before anything is written."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

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
from ..types import TensorSpec
from .specs import DerivedSpec, _layers, current_buffer, resolve_tensor

T = TypeVar("T")


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
    cold_layout: tuple[tuple[int, ...], torch.dtype, torch.device] | None = None
    reason: str = ""


@dataclass
class RefreshPlan:
    buffers: list[_BufferPlan]
    context: dict[str, str]


def _fmt_layout(t: torch.Tensor | StorageIdentity) -> str:
    ident = t if isinstance(t, StorageIdentity) else StorageIdentity.of(t)
    return f"shape {ident.shape} stride {ident.stride} {_dtype(ident.dtype)} on {ident.device}"


@dataclass
class _SourceCheck:
    """Sorts what is wrong with sources: not ready (absent or META) vs not in the builder's layout."""

    resolve: Callable[[str], torch.Tensor | None]
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
                self.not_ready.setdefault(layer_of(name), []).append(f"{name} ({'absent' if t is None else 'META'})")
                ready = False
                continue
            spec = self.tensor_specs.get(name)
            if spec is not None and (tuple(t.shape) != spec.shape or t.dtype != spec.dtype):
                wrong.append(f"{name}: source has layout {tuple(t.shape)} {_dtype(t.dtype)} but the builder "
                             f"expects the checkpoint layout {spec.shape} {_dtype(spec.dtype)} "
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


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


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
    resolve: Callable[[str], torch.Tensor | None] | None = None,
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

        if spec.kind == "alias":
            target = sources.resolve(names[0])
            assert target is not None
            if pinned and existing is not None and existing is not target:
                old, new = StorageIdentity.of(existing), StorageIdentity.of(target)
                if old != new:
                    realloc_problems.append(
                        f"alias {spec.name}: its source {names[0]} moved, re-pointing would change: "
                        + "; ".join(describe_changes(spec.name, old, new)))
                    continue
            plans.append(_BufferPlan(spec, "alias", existing=existing, new_tensor=target))
            continue

        if spec.kind == "custom":
            live = current_buffer(backbone, spec.name)
            if not names and live is not None:
                # a constant: no refresh rewrites it. An explicit rebuild (graphs released) replaces it only when
                # its layout changed (a reconfigured backbone); otherwise the built value is dropped.
                value = spec.build(backbone) if allow_realloc and spec.build is not None else live
                if _same_layout(value, live):
                    plans.append(_BufferPlan(spec, "skipped", existing=live))
                else:
                    plans.append(_BufferPlan(spec, "cold", new_tensor=value.detach().clone().contiguous()))
                continue
            if existing is not None and not full and not any(n in dirty for n in names):
                plans.append(_BufferPlan(spec, "skipped", existing=existing))
                continue
            assert spec.build is not None
            if existing is not None and spec.into is not None:
                problem = _dry_run_into(spec, backbone, existing)
                if problem:
                    realloc_problems.append(problem)
                else:
                    plans.append(_BufferPlan(spec, "in_place", existing=existing))
                continue
            value = _built(spec, "build", context, spec.build, backbone)
            if existing is None:
                plans.append(_BufferPlan(spec, "cold", new_tensor=value.detach().clone().contiguous()))
            elif not _same_layout(value, existing):
                realloc_problems.append(
                    f"{spec.name}: new value {_fmt_layout(value)} differs from the existing buffer "
                    f"{_fmt_layout(existing)}")
            else:
                plans.append(_BufferPlan(spec, "in_place", existing=existing, copies=[(0, 0, value)]))
            continue

        assert spec.per_layer is not None
        layers = _layers(backbone, spec.layers_attr)
        if spec.computed:
            problem = _plan_computed_stack(spec, layers, existing, dirty, full, plans, context)
            if problem:
                (sources.layout if problem[0] == "layout" else realloc_problems).append(problem[1])
            continue

        # concat / stack: one slice per layer
        slices = [_built(spec, f"per_layer for {spec.layers_attr}.{i}", context, spec.per_layer, layer)
                  for i, layer in enumerate(layers)]
        shapes = {tuple(s.shape) for s in slices}
        dtypes = {s.dtype for s in slices}
        if len(dtypes) > 1 or len({s.device for s in slices}) > 1 or (spec.kind == "stack" and len(shapes) > 1) or (
            spec.kind == "concat" and len({sh[:spec.dim] + sh[spec.dim + 1:] for sh in shapes}) > 1
        ):
            sources.layout.append(f"{spec.kind} {spec.name}: per-layer slices disagree: shapes "
                                   f"{sorted(shapes)}, dtypes {sorted(map(_dtype, dtypes))}, devices "
                                   f"{sorted({str(s.device) for s in slices})}")
            continue
        if spec.kind == "stack":
            lengths = [1] * len(slices)
            new_shape = (len(slices), *slices[0].shape)
            dim = 0
        else:
            dim = spec.dim
            lengths = [s.shape[dim] for s in slices]
            new_shape = tuple(sum(lengths) if d == dim else n for d, n in enumerate(slices[0].shape))
        if existing is None:
            join = torch.stack if spec.kind == "stack" else partial(torch.cat, dim=dim)
            built = _built(spec, spec.kind, context, join, slices)
            plans.append(_BufferPlan(spec, "cold", new_tensor=built.contiguous(), slices_total=len(slices)))
            continue
        if (new_shape != tuple(existing.shape) or slices[0].dtype != existing.dtype
                or slices[0].device != existing.device or not existing.is_contiguous()):
            realloc_problems.append(
                f"{spec.name}: a rebuild would have shape {new_shape} {_dtype(slices[0].dtype)} on "
                f"{slices[0].device}, the existing buffer is {_fmt_layout(existing)}")
            continue
        copies = []
        start = 0
        for i, (src, length) in enumerate(zip(slices, lengths, strict=True)):
            if full or any(f"{spec.layers_attr}.{i}.{s}" in dirty for s in spec.sources):
                copies.append((start, length, src))
            start += length
        plans.append(_BufferPlan(spec, "in_place" if copies else "skipped", existing=existing, copies=copies,
                                 slices_total=len(slices)))

    ctx = dict(context)
    if sources.not_ready:
        raise LayersNotReadyError("derived-buffer build", sources.not_ready, backbone=ctx.get("backbone", "?"),
                                  state=ctx.get("state", "?"))
    if sources.layout:
        raise SourceLayoutError(sources.layout, backbone=ctx.get("backbone", "?"), state=ctx.get("state", "?"))
    if realloc_problems:
        raise StorageReallocationError(realloc_problems, backbone=ctx.get("backbone", "?"),
                                       state=ctx.get("state", "?"))
    return RefreshPlan(plans, ctx)


def _plan_computed_stack(spec: DerivedSpec, layers: Sequence[nn.Module], existing: torch.Tensor | None,
                         dirty: frozenset[str], full: bool, plans: list[_BufferPlan],
                         context: Mapping[str, str]) -> tuple[str, str] | None:
    """Plan a `stack(..., computed=True)`: evaluate only the slices that will be written, one at a time, and keep
    their layout, not their values. Returns ("layout" | "realloc", problem) or None (a plan was appended)."""
    assert spec.per_layer is not None
    n = len(layers)
    written = [i for i in range(n) if existing is None or full
               or any(f"{spec.layers_attr}.{i}.{s}" in dirty for s in spec.sources)]
    layouts: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[int]] = {}
    for i in written:
        value = _built(spec, f"per_layer for {spec.layers_attr}.{i}", context, spec.per_layer, layers[i])
        layouts.setdefault((tuple(value.shape), value.dtype, value.device), []).append(i)
        del value  # a slice-sized temporary; the apply phase computes it again right before its copy
    if len(layouts) > 1:
        return "layout", (f"stack {spec.name}: computed per-layer slices disagree: "
                          + "; ".join(f"layers {ix}: {sh} {_dtype(dt)} on {dev}"
                                      for (sh, dt, dev), ix in layouts.items()))
    if existing is None:
        ((layout, _),) = layouts.items()
        plans.append(_BufferPlan(spec, "cold", cold_layout=layout, slices_total=n))
        return None
    if layouts:
        (((shape, dt, dev), _),) = layouts.items()
        if ((n, *shape) != tuple(existing.shape) or dt != existing.dtype or dev != existing.device
                or not existing.is_contiguous()):
            return "realloc", (f"{spec.name}: a rebuild would have shape {(n, *shape)} {_dtype(dt)} on {dev}, "
                               f"the existing buffer is {_fmt_layout(existing)}")
    copies: list[tuple[int, int, torch.Tensor | None]] = [(i, 1, None) for i in written]
    plans.append(_BufferPlan(spec, "in_place" if copies else "skipped", existing=existing, copies=copies,
                             slices_total=n))
    return None
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
            layout = f"shape {tuple(result.shape)} {_dtype(result.dtype)} on {result.device}"
    how = "resizes" if result is out else "returns a new tensor instead of writing into"
    return f"{spec.name}: its in-place writer {how} the buffer: new value {layout}, the existing buffer is " \
           f"{_fmt_layout(existing)}"
