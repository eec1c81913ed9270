"""Planning `concat` and `stack` buffers: one slice per layer, each a view of the layer's sources or its parts
(separate K and V weights) laid out one after the other; a refresh copies only the slices whose sources were
written, each part straight into its place. `stack(..., computed=True)` slices are computed, so they are
evaluated one at a time and only where written.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from ..types import dtype_name
from .backing import backing_problem, still_backed
from .buffer_plan import (
    BufferPlan,
    Layout,
    Problem,
    Request,
    SliceCopy,
    built,
    layer_copies,
    owned_storages,
    parts_of,
    rebuild_problem,
    temporaries,
    write_parts,
)
from .specs import DerivedSpec, _layers

__all__ = ["fill_computed", "plan_computed_stack", "plan_per_layer"]

Planned = BufferPlan | Problem


def _slice_layout(spec: DerivedSpec, parts: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], str]:
    """(the shape of a layer's slice made of `parts`, "" or what is inconsistent among them)."""
    first = parts[0]
    if len(parts) == 1:
        return tuple(first.shape), ""
    axis = spec.dim if spec.kind == "concat" else 0
    if first.dim() == 0:
        return (), "parts cannot be 0-dim"
    axis %= first.dim()
    shapes = [tuple(p.shape) for p in parts]
    if len({(s[:axis], s[axis + 1:]) for s in shapes}) > 1 or len({p.dtype for p in parts}) > 1 \
            or len({p.device for p in parts}) > 1:
        return (), (f"parts disagree beyond dim {axis}: shapes {shapes}, dtypes "
                    f"{sorted({dtype_name(p.dtype) for p in parts})}, devices {sorted({str(p.device) for p in parts})}")
    joined = list(shapes[0])
    joined[axis] = sum(s[axis] for s in shapes)
    return tuple(joined), ""


def plan_per_layer(r: Request) -> Planned:
    """concat / stack: evaluate every layer's slice (views: cheap), check one layout, copy the dirty slices."""
    spec = r.spec
    layers = _layers(r.backbone, spec.layers_attr)
    parts = [parts_of(spec, i, r.context, layer) for i, layer in enumerate(layers)]
    if not parts:
        return Problem("layout", f"{spec.kind} {spec.name}: {spec.layers_attr} has no layers, nothing to {spec.kind}")
    shapes, bad = [], []
    for i, ps in enumerate(parts):
        shape, problem = _slice_layout(spec, ps)
        shapes.append(shape)
        if problem:
            bad.append(f"{spec.layers_attr}.{i}: {problem}")
    if bad:
        return Problem("layout", f"{spec.kind} {spec.name}: " + "; ".join(bad))
    firsts = [ps[0] for ps in parts]
    if spec.kind == "concat" and not all(shapes):
        return Problem("layout", f"concat {spec.name}: a 0-dim slice cannot be concatenated")
    dim = spec.dim % len(shapes[0]) if spec.kind == "concat" else 0
    if len({p.dtype for p in firsts}) > 1 or len({p.device for p in firsts}) > 1 \
            or (spec.kind == "stack" and len(set(shapes)) > 1) \
            or (spec.kind == "concat" and len({sh[:dim] + sh[dim + 1:] for sh in shapes}) > 1):
        return Problem("layout", f"{spec.kind} {spec.name}: per-layer slices disagree: shapes {sorted(set(shapes))}, "
                                 f"dtypes {sorted({dtype_name(p.dtype) for p in firsts})}, devices "
                                 f"{sorted({str(p.device) for p in firsts})}")
    if spec.kind == "stack":
        lengths = [1] * len(parts)
        new_shape = (len(parts), *shapes[0])
    else:
        lengths = [sh[dim] for sh in shapes]
        new_shape = tuple(sum(lengths) if d == dim else n for d, n in enumerate(shapes[0]))
    layout: Layout = (new_shape, firsts[0].dtype, firsts[0].device)
    bp = BufferPlan(spec, "cold", slices_total=len(parts))
    starts = [0, *accumulate(lengths)][:-1] if spec.kind == "concat" else [0] * len(parts)
    if spec.backed:
        bp.backed_sources = sum(map(len, parts))
    bp.count(temporaries([p for ps in parts for p in ps], lambda: owned_storages(r.backbone)))
    if r.existing is None:  # allocated once; every part copied into its place (no torch.cat of slices)
        if spec.backed and (problem_text := _backing_problem(r, parts, range(len(parts)))):
            return Problem("layout", problem_text)

        def assemble(_: None) -> torch.Tensor:
            buf = torch.empty(new_shape, dtype=layout[1], device=layout[2])
            for i, ps in enumerate(parts):
                write_parts(spec, buf, i, starts[i], ps)
            return buf

        bp.new_tensor = built(spec, spec.kind, r.context, assemble, None)
        if spec.backed:  # every source becomes a view of its place once the buffer is registered
            bp.backs = [(p, c) for i, ps in enumerate(parts)
                        for c, p in zip(layer_copies(spec, i, starts[i], ps), ps, strict=True)]
        return bp
    misfit = rebuild_problem(spec, layout, r.existing)
    if misfit:
        return misfit
    bp.existing = r.existing
    copies = [layer_copies(spec, i, starts[i], ps) for i, ps in enumerate(parts)]
    bp.places = [[(SliceCopy(c.layer, c.start, c.length, None), (tuple(c.src.shape), c.src.dtype, c.src.device))
                  for c in cs if c.src is not None] for cs in copies]
    if spec.backed:  # nothing to copy where a source is the view of its place: only verified
        for cs, ps in zip(copies, parts, strict=True):
            for c, p in zip(cs, ps, strict=True):  # a copy per part
                if not still_backed(spec, r.existing, c):  # replaced: copy in, view again
                    bp.copies.append(c)
                    bp.backs.append((p, c))
        if bp.backs and (problem_text := _backing_problem(r, parts, sorted({c.layer for _, c in bp.backs}))):
            return Problem("layout", problem_text)
        bp.mode = "in_place" if bp.copies else "backed"
        return bp
    for i, cs in enumerate(copies):
        if r.full or r.layer_dirty(i):
            bp.copies.extend(cs)
    bp.mode = "in_place" if bp.copies else "skipped"
    return bp


def _backing_problem(r: Request, parts: Sequence[Sequence[torch.Tensor]], layers: Sequence[int]) -> str | None:
    """`backing.backing_problem` for the layers whose sources are (re)made views: the cold build's every layer, a
    refresh's replaced ones."""
    spec = r.spec
    return backing_problem(spec, [parts[i] for i in layers],
                           [[r.resolve(f"{spec.layers_attr}.{i}.{s}") for s in spec.sources] for i in layers],
                           list(layers))


def plan_computed_stack(r: Request) -> Planned:
    """A `stack(..., computed=True)`: evaluate only the slices that will be written, one at a time, and keep
    their layout, not their values (the apply phase computes each again right before its copy)."""
    spec, existing = r.spec, r.existing
    layers = _layers(r.backbone, spec.layers_attr)
    n = len(layers)
    bp = BufferPlan(spec, "cold", existing=existing, slices_total=n)
    written = [i for i in range(n) if existing is None or r.full or r.layer_dirty(i)]
    layouts: dict[Layout, list[int]] = {}
    for i in written:
        parts = parts_of(spec, i, r.context, layers[i])
        shape, problem = _slice_layout(spec, parts)
        if problem:
            return Problem("layout", f"stack {spec.name}: {spec.layers_attr}.{i}: {problem}")
        layouts.setdefault((shape, parts[0].dtype, parts[0].device), []).append(i)
        bp.count(temporaries(parts, lambda: owned_storages(r.backbone)))
        del parts  # slice-sized temporaries
    if len(layouts) > 1:
        return Problem("layout", f"stack {spec.name}: computed per-layer slices disagree: "
                                 + "; ".join(f"layers {ix}: {sh} {dtype_name(dt)} on {dev}"
                                             for (sh, dt, dev), ix in layouts.items()))
    if existing is None:
        ((layout, _),) = layouts.items()
        bp.cold_layout = layout
        return bp
    if layouts:
        (((shape, dt, dev), _),) = layouts.items()
        misfit = rebuild_problem(spec, ((n, *shape), dt, dev), existing)
        if misfit:
            return misfit
    bp.copies = [SliceCopy(i, 0, None, None) for i in written]
    bp.mode = "in_place" if bp.copies else "skipped"
    return bp


def fill_computed(spec: DerivedSpec, buf: torch.Tensor, i: int, layer: torch.nn.Module, context: dict[str, str]
                  ) -> tuple[int, list[torch.UntypedStorage]]:
    """Compute layer `i`'s slice of a computed stack and copy it into `buf[i]`: (elements written, the
    temporaries it made). Used by the cold build and by every in-place refresh."""
    parts = parts_of(spec, i, context, layer)
    return write_parts(spec, buf, i, 0, parts), temporaries(parts, set)
