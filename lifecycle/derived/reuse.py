"""What a refresh reuses from the last plan of a `concat` or `stack` buffer: the layout that plan validated, for as
long as everything it read is unchanged, so that a refresh evaluates `per_layer` only for the slices it writes.

A plan of a per-layer buffer reads: the layer modules, every source tensor (ready, in the checkpoint layout), what
`per_layer` returns for every layer (views of the sources: their shapes, dtypes, devices, so where each part goes),
and the existing buffer (the layout fits; for a backed buffer, every source is the view of its place). The
`Observation` is all of that which can change without the plan noticing: the ids of the layer modules, each
source's storage identity (data_ptr, storage_offset, shape, stride, dtype, device; read with one C-level `map` per
field, as a pin verification reads them) and checkpoint spec, and the buffer's storage identity. A plan is
remembered with the observation made before it ran, and reused only while a new observation equals it: a replaced
parameter, a `.data =` swap, a resize, a moved or re-registered buffer, another layer module or layer count, a
new declaration object: each changes the observation, and the next refresh plans afresh.

What a reused plan still does: it evaluates `per_layer` for every slice it writes (the dirty layers, every layer
with `full`) and checks each part against the remembered layout (a part that changed layout or became a
temporary sends the refresh to a fresh plan); a backed buffer's verification IS the observation (a source with
its remembered identity is still the view of its place). What it relies on, as `stack(computed=True)` does: a
layer whose sources kept their identity gives the layout its last evaluation validated (`per_layer` is a function
of the layer's sources, as declared). Only plans without temporaries are remembered (a computing `per_layer` is
evaluated for every layer at every refresh, as before).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..storage import StorageIdentity
from ..types import TensorSpec
from .buffer_plan import BufferPlan, Layout, SliceCopy, owned_storages, parts_of, temporaries
from .specs import DerivedSpec, _layers

__all__ = ["Observation", "PlanMemory", "Remembered", "observe", "recall", "remember"]

Resolve = Callable[[str], "torch.Tensor | None"]
_READERS: tuple[Callable[[torch.Tensor], object], ...] = (
    torch.Tensor.data_ptr, torch.Tensor.storage_offset, lambda t: t.shape, torch.Tensor.stride,
    lambda t: t.dtype, lambda t: t.device)


@dataclass(frozen=True)
class Observation:
    """Everything a per-layer buffer's plan read that may change behind its back (compared with `==`)."""

    spec: DerivedSpec
    layers: list[int]
    checkpoint: list[TensorSpec | None]
    sources: list[list[object]]
    buffer: StorageIdentity

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Observation) and self.spec is other.spec and self.layers == other.layers
                and self.buffer == other.buffer and self.sources == other.sources
                and self.checkpoint == other.checkpoint)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Remembered:
    """A validated plan of one buffer: what it observed, its source names by layer, and where each layer's parts
    go with the layout each part had (`(copy without src, (shape, dtype, device))`)."""

    seen: Observation
    names: list[str]
    layer_names: list[tuple[str, ...]]
    places: list[list[tuple[SliceCopy, Layout]]]
    backed_sources: int


#: buffer name -> its remembered plan; one per backbone (`DraftBackbone` keeps it)
PlanMemory = dict[str, Remembered]


def observe(backbone: nn.Module, spec: DerivedSpec, existing: torch.Tensor, resolve: Resolve,
            tensor_specs: Mapping[str, TensorSpec], names: Sequence[str]) -> Observation | None:
    """The observation of `spec`'s inputs now; None when a source is absent or has no storage (a fresh plan says
    what is wrong)."""
    live = list(map(resolve, names))
    try:
        sources = [list(map(read, live)) for read in _READERS]
    except (AttributeError, TypeError, RuntimeError):
        return None
    return Observation(spec, list(map(id, _layers(backbone, spec.layers_attr))), list(map(tensor_specs.get, names)),
                       sources, StorageIdentity.of(existing))


def source_names(memory: PlanMemory, backbone: nn.Module, spec: DerivedSpec) -> list[str]:
    """`spec.source_names(backbone)`, from the remembered plan while the layer count is the same."""
    m = memory.get(spec.name)
    if m is not None and m.seen.spec is spec and len(m.layer_names) == len(_layers(backbone, spec.layers_attr)):
        return m.names
    return spec.source_names(backbone)


def recall(memory: PlanMemory, spec: DerivedSpec, seen: Observation | None, *, backbone: nn.Module,
           existing: torch.Tensor, dirty: frozenset[str], full: bool, context: Mapping[str, str]
           ) -> BufferPlan | None:
    """The plan of `spec` from its remembered one when `seen` equals what that plan observed, else None. Only the
    slices to write are evaluated (their parts checked against the remembered layout); a backed buffer evaluates
    none: every source kept the identity of its place."""
    m = memory.get(spec.name)
    if m is None or seen is None or m.seen != seen:
        return None
    bp = BufferPlan(spec, "backed", existing=existing, slices_total=len(m.places), backed_sources=m.backed_sources)
    if spec.backed:
        return bp
    layers = _layers(backbone, spec.layers_attr)
    for i, places in enumerate(m.places):
        if not (full or not dirty.isdisjoint(m.layer_names[i])):
            continue
        parts = parts_of(spec, i, context, layers[i])
        if len(parts) != len(places) or any(
                p.shape != shape or p.dtype != dtype or p.device != device
                for p, (_, (shape, dtype, device)) in zip(parts, places)) \
                or temporaries(parts, lambda: owned_storages(backbone)):
            return None  # not what the remembered plan validated: plan afresh
        bp.copies.extend(SliceCopy(c.layer, c.start, c.length, p) for p, (c, _) in zip(parts, places))
    bp.mode = "in_place" if bp.copies else "skipped"
    return bp


def remember(memory: PlanMemory, spec: DerivedSpec, seen: Observation | None, names: list[str],
             planned: BufferPlan | None) -> None:
    """Keep `planned` (a fresh plan of an existing buffer, made after `seen` was observed) for the next refresh,
    when it is reusable: it validated every layer, copied nothing into a backed buffer, and made no temporary.
    Anything else forgets the buffer's remembered plan."""
    if (seen is None or planned is None or planned.places is None or planned.temporaries
            or (spec.backed and planned.backs)):
        memory.pop(spec.name, None)
        return
    per = len(spec.sources)
    memory[spec.name] = Remembered(seen, names, [tuple(names[i * per:(i + 1) * per]) for i in range(len(planned.places))],
                                   planned.places, planned.backed_sources)
