"""The plan phase of a refresh: validate every derived buffer and decide every write, before anything is written.

One planner per kind of buffer (`_plan_alias` here; `custom.plan_custom`; `per_layer.plan_per_layer` for concat
and stack, `per_layer.plan_computed_stack`) returns the buffer's plan or the problem that refuses the refresh;
`plan_refresh` checks every buffer's sources, runs its planner, and raises with every problem found, or returns
the whole plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..errors import LayersNotReadyError, SourceLayoutError, StorageReallocationError
from ..readiness import layer_of
from ..storage import PinnedStorage, StorageIdentity, describe_changes
from ..types import TensorSpec, dtype_name
from .buffer_plan import BufferPlan, Problem, Request
from .custom import plan_custom
from .per_layer import plan_computed_stack, plan_per_layer
from .reuse import Gather, PlanMemory
from .specs import DerivedSpec, current_buffer, resolve_tensor

__all__ = ["RefreshPlan", "plan_refresh"]

Resolve = Callable[[str], "torch.Tensor | None"]
Planned = BufferPlan | Problem


@dataclass
class RefreshPlan:
    buffers: list[BufferPlan]
    context: dict[str, str]


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
    memory: PlanMemory | None = None,
    gather: Gather | None = None,
    verified: PinnedStorage | None = None,
) -> RefreshPlan:
    """Validate every buffer and decide every write. Raises before anything is written.

    `dirty`: tensors written in this epoch; only slices that read them are rewritten (all when `full`).
    `pinned`: graphs are captured, so an alias may not be re-pointed at a source that moved.
    `allow_realloc`: an explicit cold rebuild (graphs released): existing buffers may be replaced.
    `resolve`: name -> live tensor (default: walk the module tree).
    `memory`: where the plans of `alias`, `concat` and `stack` buffers are kept between refreshes, and reused
    while nothing they read changed (`reuse.py`); None: plan every buffer afresh. `gather`: names -> their live
    tensors in one call (default: `resolve` for each). `verified`: pins verified unchanged just now, read through
    the tensors `gather` reads (the memory's observation need not be compared again where they hold it).
    Raises LayersNotReadyError (a source absent or on META), SourceLayoutError, StorageReallocationError,
    DerivedBuildError (a builder raised).
    """
    sources = _SourceCheck(resolve or partial(resolve_tensor, backbone), tensor_specs)
    look = None
    if memory is not None and not allow_realloc:  # the last refresh's plans, while nothing they read changed
        look = memory.look(backbone, specs, gather=gather or (lambda names: list(map(sources.resolve, names))),
                           tensor_specs=tensor_specs, dirty=dirty, full=full, context=context, verified=verified)
    elif memory is not None:
        memory.forget()
    realloc_problems: list[str] = []
    plans: list[BufferPlan] = []
    planned: dict[int, BufferPlan] = {}
    for i, spec in enumerate(specs):
        if look is not None and i in look.reused:
            plans.append(look.reused[i])
            continue
        existing = None if allow_realloc else current_buffer(backbone, spec.name)
        names = spec.source_names(backbone)
        usable, fallback_reason = sources.check(f"{spec.kind} {spec.name}", names, spec.fallback)
        if fallback_reason:
            plans.append(BufferPlan(spec, "fallback", existing=existing, reason=fallback_reason))
        if not usable:
            continue
        bp = _planner(spec)(Request(backbone, spec, names, existing, sources.resolve, dirty, context, full,
                                    pinned, allow_realloc))
        if isinstance(bp, Problem):
            (sources.layout if bp.kind == "layout" else realloc_problems).append(bp.text)
        else:
            plans.append(bp)
            planned[i] = bp
    if memory is not None and look is not None and not look.reused:
        memory.remember(look, planned, verified)

    ctx = dict(context)
    where = {"backbone": ctx.get("backbone", "?"), "state": ctx.get("state", "?")}
    if sources.not_ready:
        raise LayersNotReadyError("derived-buffer build", sources.not_ready, **where)
    if sources.layout:
        raise SourceLayoutError(sources.layout, **where)
    if realloc_problems:
        raise StorageReallocationError(realloc_problems, **where)
    return RefreshPlan(plans, ctx)


def _planner(spec: DerivedSpec) -> Callable[[Request], Planned]:
    if spec.kind == "alias":
        return _plan_alias
    if spec.kind == "custom":
        return plan_custom
    return plan_computed_stack if spec.computed else plan_per_layer


def _plan_alias(r: Request) -> Planned:
    """The buffer is its source: re-pointed at every refresh, unless graphs captured the old address."""
    target = r.resolve(r.names[0])
    assert target is not None
    if r.pinned and r.existing is not None and r.existing is not target:
        old, new = StorageIdentity.of(r.existing), StorageIdentity.of(target)
        if old != new:
            return Problem("realloc", f"alias {r.spec.name}: its source {r.names[0]} moved, re-pointing would "
                                      "change: " + "; ".join(describe_changes(r.spec.name, old, new)))
    return BufferPlan(r.spec, "alias", existing=r.existing, new_tensor=target)


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
