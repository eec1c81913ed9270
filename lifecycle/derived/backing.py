"""View-backed derived buffers (`concat(..., backed=True)`, `stack(..., backed=True)`): the sources are views of
the buffer, so weights and buffer are one copy.

The cold build allocates the buffer, copies every part into its place and then re-points each source at that
place (`source.data = view`): the tensor object stays (a `Parameter` keeps its attributes, a module keeps its
slot, a rollback snapshot its original), only its storage becomes the buffer's. From then on a loader's
`copy_` into the source writes the buffer, and a refresh has nothing to copy: it checks that every source is
still the view of its place (`is_view_of`) and reports the buffer `backed`. A source that is not (replaced by
something that allocated a new tensor, or a buffer torn by an interrupted refresh) is copied in and re-pointed;
under captured graphs such a replacement moved a pinned identity, so the refresh is refused before it gets here.

A storage identity (`lifecycle.storage`) of a backed source is its slice's: the buffer's storage, its own
`data_ptr` and `storage_offset`; pinning and drift checks need nothing more. `backing_problem` says why a
declaration cannot be backed (a part that is a slice or a computation, a tensor in two places).

>>> import torch
>>> from torch import nn
>>> from lifecycle.derived import stack, plan_refresh, apply_refresh
>>> from lifecycle.types import TensorSpec
>>> class Toy(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.layers = nn.ModuleList(nn.LayerNorm(3) for _ in range(2))
>>> toy = Toy(); w0 = toy.layers[0].weight
>>> spec = stack("norms", sources=("weight",), per_layer=lambda layer: layer.weight, backed=True)
>>> specs = {n: TensorSpec.of(p) for n, p in toy.named_parameters()}
>>> plan = plan_refresh(toy, [spec], tensor_specs=specs, dirty=frozenset(specs), context={})
>>> report = apply_refresh(toy, plan)
>>> toy.layers[0].weight is w0, is_view_of(w0, toy.norms[0]), report["norms"].backed_sources
(True, True, 2)
>>> with torch.no_grad():
...     _ = w0.fill_(7.0)      # a load writes the weight: the buffer holds it already
>>> toy.norms[0].tolist()
[7.0, 7.0, 7.0]
>>> plan = plan_refresh(toy, [spec], tensor_specs=specs, dirty=frozenset(specs), context={})
>>> report = apply_refresh(toy, plan)
>>> report["norms"].mode, report["norms"].elements_written
('backed', 0)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .buffer_plan import SliceCopy, destination
from .specs import DerivedSpec

__all__ = ["backing_problem", "is_view_of", "repoint", "still_backed"]


def is_view_of(t: torch.Tensor, place: torch.Tensor) -> bool:
    """Whether `t` is exactly the view `place` of a buffer: same storage, same start, shape and strides."""
    return (t.data_ptr() == place.data_ptr() and t.shape == place.shape and t.stride() == place.stride()
            and t.untyped_storage().data_ptr() == place.untyped_storage().data_ptr() and t.dtype == place.dtype)


def still_backed(spec: DerivedSpec, buf: torch.Tensor, c: SliceCopy) -> bool:
    """`is_view_of(c.src, destination(spec, buf, c))` without making the view (a refresh asks it of every part):
    the part starts where its place does, in the buffer's storage, and is contiguous. That is the view: the plan
    checked that the part's shape is its place's, and the buffer is contiguous."""
    t = c.src
    assert t is not None
    if spec.kind == "concat":
        offset = c.start * buf.stride(0)
    else:
        offset = c.layer * buf.stride(0) + (c.start * buf.stride(1) if c.length is not None else 0)
    return (t.data_ptr() == buf.data_ptr() + offset * buf.element_size() and t.is_contiguous()
            and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr())


def backing_problem(spec: DerivedSpec, parts: Sequence[Sequence[torch.Tensor]],
                    sources: Sequence[Sequence[torch.Tensor | None]], layers: Sequence[int] | None = None
                    ) -> str | None:
    """Why these layers' sources cannot be made views of the buffer, or None. `parts[k]`: what `per_layer`
    returned for layer `layers[k]` (default: k); `sources[k]`: that layer's declared source tensors. Every part must
    be one of its layer's sources as a whole (the object itself: a slice or a computation has no slot to
    re-point), and no tensor may take two places."""
    seen: dict[int, int] = {}
    for i, ps, srcs in zip(layers if layers is not None else range(len(parts)), parts, sources, strict=True):
        for k, p in enumerate(ps):
            if not any(p is s for s in srcs):
                return (f"{spec.kind} {spec.name} (backed=True): {spec.layers_attr}.{i}: part {k} is not one of the "
                        f"layer's sources ({', '.join(spec.sources)}) as a whole, so it cannot become a view of the "
                        "buffer (declare per_layer returning the source tensors themselves, or drop backed=True)")
            if id(p) in seen:
                return (f"{spec.kind} {spec.name} (backed=True): {spec.layers_attr}.{i}: part {k} is the tensor of "
                        f"{spec.layers_attr}.{seen[id(p)]} too; one tensor cannot be a view of two places")
            seen[id(p)] = i
    return None


@torch.no_grad()
def repoint(spec: DerivedSpec, buf: torch.Tensor, backs: Sequence[tuple[torch.Tensor, SliceCopy]]) -> None:
    """Make each source a view of its place in `buf` (the object stays; its storage becomes the buffer's)."""
    for source, c in backs:
        source.data = destination(spec, buf, c)
