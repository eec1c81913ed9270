"""What a refresh reuses from the last plan: the validated plans of its `alias`, `concat` and `stack` buffers, for
as long as everything those plans read is unchanged, so that a refresh evaluates `per_layer` only for the slices
it writes and validates nothing twice.

A plan of such a buffer reads: the layer modules; every source tensor (ready, in the checkpoint layout); what
`per_layer` returns for every layer (views of the sources: their shapes, dtypes and devices, so where each part
goes); the existing buffer (the layout fits; a backed buffer's sources are the views of their places; an alias
may be re-pointed). The observation of a refresh is all of that which can change without the plan noticing,
read in bulk (`slots.Slots.gather`, `storage.IdentityColumns`, as a pin verification reads): the declaration
object, the ids of the layer modules, each source's storage identity (data_ptr, storage_offset, shape, stride,
dtype, device) and checkpoint spec, and each existing buffer's storage identity. The plans are remembered with the
observation made before they ran, and reused only while a new observation equals it: a replaced parameter, a
`.data =` swap, a resize, a moved or re-registered buffer, another layer module or layer count, a new
declaration: each changes the observation, and the refresh plans afresh.

What a reused plan still does: it evaluates `per_layer` for every slice it writes (the dirty layers; every layer
with `full`) and checks each part against the remembered layout (a part that changed layout or became a temporary
sends the refresh to a fresh plan); an alias is re-pointed at its live source; a backed buffer's verification IS
the observation (a source with its remembered identity is still the view of its place). What it relies on, as
`stack(computed=True)` does: a layer whose sources kept their identity gives the layout its last evaluation
validated (`per_layer` is a function of the layer's sources, as declared). A buffer whose plan made a temporary
(a computing `per_layer`), fell back, or re-made views is planned afresh at every refresh, as are `custom` and
computed buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..storage import IdentityColumns
from ..types import TensorSpec
from .buffer_plan import BufferPlan, Layout, SliceCopy, owned_storages, parts_of, temporaries
from .specs import DerivedSpec, _layers

__all__ = ["Gather", "Look", "PlanMemory", "reusable"]

Gather = Callable[[Sequence[str]], Sequence["torch.Tensor | None"]]
Places = list[list[tuple[SliceCopy, Layout]]]


def reusable(spec: DerivedSpec) -> bool:
    """Whether a plan of this kind of buffer can be remembered (its every input is observable)."""
    return spec.kind == "alias" or (spec.kind in ("concat", "stack") and not spec.computed)


@dataclass(frozen=True)
class _Kept:
    """One remembered buffer plan: the buffer's position in the declaration and its sources in the observation;
    for a per-layer buffer, its source names by layer and where each layer's parts go with the layout each had
    (`(copy without src, (shape, dtype, device))`)."""

    index: int
    first: int
    layer_names: list[tuple[str, ...]]
    places: Places | None
    backed_sources: int


@dataclass(frozen=True)
class _Remembered:
    specs: Sequence[DerivedSpec]
    layer_attrs: list[str]
    layer_ids: list[list[nn.Module]]
    names: list[str]
    checkpoint: list[TensorSpec | None]
    sources: IdentityColumns
    observed: list[int]  # the declaration positions whose existing buffers are observed
    buffers: IdentityColumns
    kept: list[_Kept]


@dataclass
class Look:
    """What a refresh observed before planning: the plans it may reuse (declaration position -> plan), or, when
    it may reuse none, what to remember once it planned afresh."""

    reused: dict[int, BufferPlan]
    names: list[str] | None = None
    firsts: dict[int, int] | None = None
    seen: tuple[Sequence[torch.Tensor | None], list[torch.Tensor | None], list[int], list[list[nn.Module]]] | None \
        = None


class PlanMemory:
    """The last validated plans of a backbone's `alias`, `concat` and `stack` buffers (`DraftBackbone` keeps one;
    `plan_refresh(memory=...)` uses it)."""

    def __init__(self) -> None:
        self._last: _Remembered | None = None

    def forget(self) -> None:
        self._last = None

    def look(self, backbone: nn.Module, specs: Sequence[DerivedSpec], *, gather: Gather,
             tensor_specs: Mapping[str, TensorSpec], dirty: frozenset[str], full: bool, context: Mapping[str, str]
             ) -> Look:
        """Observe every input of the remembered plans; while it equals what they observed, return them (made for
        this refresh's dirty set), else what to remember after planning afresh."""
        m = self._last
        if m is not None and (m.specs is not specs or m.layer_ids != _layer_ids(backbone, m.layer_attrs)):
            m = None
        if m is not None:
            names = m.names
            buffers = [backbone._buffers.get(specs[i].name) for i in m.observed]
            tensors = gather(names)
            if m.sources.same(tensors) and m.buffers.same(buffers) and \
                    list(map(tensor_specs.get, names)) == m.checkpoint:
                reused = _replan(m, backbone, specs, tensors, buffers, dirty, full, context)
                if reused is not None:
                    return Look(reused)
        observed = [i for i, spec in enumerate(specs) if reusable(spec)]
        names, firsts = [], {}
        for i in observed:
            firsts[i] = len(names)
            names += specs[i].source_names(backbone)
        attrs = sorted({specs[i].layers_attr for i in observed if specs[i].kind != "alias"})
        seen = (gather(names), [backbone._buffers.get(specs[i].name) for i in observed], observed,
                _layer_ids(backbone, attrs))
        return Look({}, names, firsts, seen)

    def remember(self, specs: Sequence[DerivedSpec], look: Look, planned: Mapping[int, BufferPlan],
                 tensor_specs: Mapping[str, TensorSpec]) -> None:
        """Keep the fresh plans that can be reused (`planned`: declaration position -> its plan), with what was
        observed before they were made. A buffer not yet built, a source absent: nothing is kept."""
        if look.seen is None or look.names is None or look.firsts is None:
            return
        tensors, buffers, observed, layer_ids = look.seen
        self._last = None
        if any(t is None for t in tensors) or any(b is None or b.is_meta for b in buffers):
            return
        kept = []
        for i in observed:
            spec, bp = specs[i], planned.get(i)
            if bp is None or bp.existing is None or bp.temporaries:
                continue
            if spec.kind == "alias" and bp.mode == "alias":
                kept.append(_Kept(i, look.firsts[i], [], None, 0))
            elif spec.kind != "alias" and bp.places is not None and not (spec.backed and bp.backs):
                per = len(spec.sources)
                names = look.names[look.firsts[i]:look.firsts[i] + per * len(bp.places)]
                kept.append(_Kept(i, look.firsts[i], [tuple(names[k:k + per]) for k in range(0, len(names), per)],
                                  bp.places, bp.backed_sources))
        if kept:
            self._last = _Remembered(
                specs, sorted({specs[i].layers_attr for i in observed if specs[i].kind != "alias"}), layer_ids,
                look.names, list(map(tensor_specs.get, look.names)), IdentityColumns.of(tensors),  # type: ignore[arg-type]
                observed, IdentityColumns.of(buffers), kept)  # type: ignore[arg-type]


def _layer_ids(backbone: nn.Module, attrs: Sequence[str]) -> list[list[nn.Module]]:
    """The modules of each layer list (compared by identity: a replaced layer module is another plan); a
    ModuleList's are read from its table (its `__iter__` is Python code)."""
    out = []
    for attr in attrs:
        layers = _layers(backbone, attr)
        table = getattr(layers, "_modules", None)
        out.append(list(table.values()) if isinstance(table, dict) else list(layers))
    return out


def _replan(m: _Remembered, backbone: nn.Module, specs: Sequence[DerivedSpec], tensors: Sequence[torch.Tensor | None],
            buffers: list[torch.Tensor | None], dirty: frozenset[str], full: bool, context: Mapping[str, str]
            ) -> dict[int, BufferPlan] | None:
    """The remembered plans, for this refresh: an alias re-pointed at its live source, the slices to write of
    each per-layer buffer evaluated (their parts checked against the remembered layout), a backed buffer
    verified. None when a part is not what the remembered plan validated."""
    out: dict[int, BufferPlan] = {}
    existing = dict(zip(m.observed, buffers, strict=True))
    for k in m.kept:
        spec = specs[k.index]
        if k.places is None:
            out[k.index] = BufferPlan(spec, "alias", existing=existing[k.index], new_tensor=tensors[k.first])
            continue
        bp = BufferPlan(spec, "backed", existing=existing[k.index], slices_total=len(k.places),
                        backed_sources=k.backed_sources)
        out[k.index] = bp
        if spec.backed:
            continue
        layers = m.layer_ids[m.layer_attrs.index(spec.layers_attr)]  # the layer modules, as observed
        for i, places in enumerate(k.places):
            if not full and dirty.isdisjoint(k.layer_names[i]):
                continue
            parts = parts_of(spec, i, context, layers[i])
            if len(parts) != len(places) or any(
                    p.shape != shape or p.dtype != dtype or p.device != device
                    for p, (_, (shape, dtype, device)) in zip(parts, places, strict=True)) \
                    or temporaries(parts, lambda: owned_storages(backbone)):
                return None
            bp.copies += [SliceCopy(c.layer, c.start, c.length, p) for p, (c, _) in zip(parts, places, strict=True)]
        bp.mode = "in_place" if bp.copies else "skipped"
    return out
