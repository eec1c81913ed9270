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

Under captured graphs the refresh's own guard has just verified every pinned identity (`verified`, the pins it
checked, read through the slots this observation reads): when the remembered observation equals those pins, name
for name (decided once, when the plans are remembered), their verification is this one, and the two identity
passes are not made again (17 us of a tiny draft's 318 us refresh).

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

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from ..storage import IdentityColumns, PinnedStorage, StorageIdentity
from ..torch_private import own_buffers, own_children
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
    """One remembered buffer plan: the buffer's position in the declaration and its first source in the
    observation; for a per-layer buffer, its source names by layer and where each layer's parts go with the layout
    each had (`(copy without src, (shape, dtype, device))`)."""

    index: int
    observed: int  # its position among the observed buffers
    first: int
    layer_names: list[tuple[str, ...]]
    places: Places | None
    backed_sources: int


@dataclass
class Look:
    """What a refresh observed before planning, every reusable buffer's inputs (`observed`: their declaration
    positions, `firsts`: where each one's sources start in `names`), and the plans it may reuse (declaration
    position -> plan): all of them while the observation equals the remembered one, else none."""

    specs: Sequence[DerivedSpec]
    observed: list[int]
    firsts: dict[int, int]
    names: list[str]
    layer_attrs: list[str]
    layer_modules: list[list[nn.Module]]
    checkpoint: list[TensorSpec | None]
    sources: Sequence[torch.Tensor | None]
    buffers: list[torch.Tensor | None]
    reused: dict[int, BufferPlan] = field(default_factory=dict)


@dataclass(frozen=True)
class _Remembered:
    """The last plans kept, with the observation made before they were made: its identities as compact columns,
    its tensors not kept (`look.sources` and `look.buffers` empty)."""

    look: Look
    sources: IdentityColumns
    buffers: IdentityColumns
    kept: list[_Kept]
    pinned_by: PinnedStorage | None = None  # pins holding exactly these identities (`_held_by`)
    checked: PinnedStorage | None = None  # the pins last compared with them (re-captured graphs: compared again)


class PlanMemory:
    """The last validated plans of a backbone's `alias`, `concat` and `stack` buffers (`DraftBackbone` keeps one;
    `plan_refresh(memory=...)` uses it)."""

    def __init__(self) -> None:
        self._last: _Remembered | None = None

    def forget(self) -> None:
        self._last = None

    def look(self, backbone: nn.Module, specs: Sequence[DerivedSpec], *, gather: Gather,
             tensor_specs: Mapping[str, TensorSpec], dirty: frozenset[str], full: bool, context: Mapping[str, str],
             verified: PinnedStorage | None = None) -> Look:
        """Observe every input of the remembered plans; while it equals what they observed, the look carries them
        (made for this refresh's dirty set); else it carries what to remember after planning afresh. `verified`:
        pins verified unchanged just now, through the slots `gather` reads (module doc)."""
        m = self._last
        buffers = own_buffers(backbone)
        if m is not None and m.look.specs is specs:  # same declaration: same names while the layers are the same
            was = m.look
            now = Look(specs, was.observed, was.firsts, was.names, was.layer_attrs,
                       _layer_modules(backbone, was.layer_attrs), list(map(tensor_specs.get, was.names)),
                       gather(was.names), [buffers.get(specs[i].name) for i in was.observed])
            held = verified is not None and m.pinned_by is verified
            if now.layer_modules == was.layer_modules and now.checkpoint == was.checkpoint \
                    and (held or (m.sources.same(now.sources) and m.buffers.same(now.buffers))):
                if verified is not None and m.checked is not verified:  # graphs captured since it was remembered
                    m = self._last = dataclasses.replace(
                        m, pinned_by=verified if _held_by(verified, now) else None, checked=verified)
                reused = _replan(m, backbone, specs, now, dirty, full, context)
                if reused is not None:
                    now.reused = reused
                    return now
        observed = [i for i, spec in enumerate(specs) if reusable(spec)]
        names: list[str] = []
        firsts = {}
        for i in observed:
            firsts[i] = len(names)
            names += specs[i].source_names(backbone)
        attrs = sorted({specs[i].layers_attr for i in observed if specs[i].kind != "alias"})
        return Look(specs, observed, firsts, names, attrs, _layer_modules(backbone, attrs),
                    list(map(tensor_specs.get, names)), gather(names),
                    [buffers.get(specs[i].name) for i in observed])

    def remember(self, look: Look, planned: Mapping[int, BufferPlan], verified: PinnedStorage | None = None) -> None:
        """Keep the fresh plans that can be reused (`planned`: declaration position -> its plan), with what `look`
        observed before they were made (and `verified`, the pins just verified, when they hold exactly that). A
        buffer not yet built, a source absent: nothing is kept."""
        self._last = None
        if any(t is None for t in look.sources) or any(b is None or b.is_meta for b in look.buffers):
            return
        kept = []
        for at, i in enumerate(look.observed):
            spec, bp = look.specs[i], planned.get(i)
            if bp is None or bp.existing is None or bp.temporaries:
                continue
            first = look.firsts[i]
            if spec.kind == "alias" and bp.mode == "alias":
                kept.append(_Kept(i, at, first, [], None, 0))
            elif spec.kind != "alias" and bp.places is not None and not (spec.backed and bp.backs):
                per = len(spec.sources)
                names = look.names[first:first + per * len(bp.places)]
                kept.append(_Kept(i, at, first, [tuple(names[k:k + per]) for k in range(0, len(names), per)],
                                  bp.places, bp.backed_sources))
        if kept:  # the identities as columns, and no tensor held: a replaced source or buffer is freed as before
            sources = cast("Sequence[torch.Tensor]", look.sources)  # no None among them: returned above
            buffers = cast("list[torch.Tensor]", look.buffers)
            pins = verified if verified is not None and _held_by(verified, look) else None
            self._last = _Remembered(dataclasses.replace(look, sources=(), buffers=[]),
                                     IdentityColumns.of(sources), IdentityColumns.of(buffers), kept, pins, verified)


def _held_by(pins: PinnedStorage, look: Look) -> bool:
    """Whether `pins` hold the identity of every tensor `look` observed under its name (sources by checkpoint
    name, buffers by their own): while they verify unchanged, so does the observation."""
    names = [*look.names, *(look.specs[i].name for i in look.observed)]
    tensors = [*look.sources, *look.buffers]
    known = pins.identities
    return all(n in known and t is not None and known[n] == StorageIdentity.of(t)
               for n, t in zip(names, tensors, strict=True))


def _layer_modules(backbone: nn.Module, attrs: Sequence[str]) -> list[list[nn.Module]]:
    """The modules of each layer list (compared by identity: a replaced layer module is another plan); a
    ModuleList's are read from its table (its `__iter__` is Python code)."""
    out = []
    for attr in attrs:
        layers = _layers(backbone, attr)
        if isinstance(layers, nn.Module):  # a ModuleList's slots: modules (a None slot, compared as one)
            out.append(cast("list[nn.Module]", list(own_children(layers).values())))
        else:
            out.append(list(layers))
    return out


def _replan(m: _Remembered, backbone: nn.Module, specs: Sequence[DerivedSpec], now: Look, dirty: frozenset[str],
            full: bool, context: Mapping[str, str]) -> dict[int, BufferPlan] | None:
    """The remembered plans, for this refresh: an alias re-pointed at its live source, the slices to write of
    each per-layer buffer evaluated (their parts checked against the remembered layout), a backed buffer
    verified. None when a part is not what the remembered plan validated."""
    out: dict[int, BufferPlan] = {}
    walked: list[set[int]] = []

    def owned() -> set[int]:  # walked once per refresh, and only if needed (a closure: `functools.cache` costs more)
        if not walked:
            walked.append(owned_storages(backbone))
        return walked[0]

    for k in m.kept:
        spec, existing = specs[k.index], now.buffers[k.observed]
        if k.places is None:
            out[k.index] = BufferPlan(spec, "alias", existing=existing, new_tensor=now.sources[k.first])
            continue
        bp = BufferPlan(spec, "backed", existing=existing, slices_total=len(k.places), backed_sources=k.backed_sources)
        out[k.index] = bp
        if spec.backed:
            continue
        layers = now.layer_modules[now.layer_attrs.index(spec.layers_attr)]
        copies = bp.copies
        for i, places in enumerate(k.places):
            if not full and dirty.isdisjoint(k.layer_names[i]):
                continue
            parts = parts_of(spec, i, context, layers[i])
            if len(parts) != len(places):
                return None
            for p, (c, (shape, dtype, device)) in zip(parts, places, strict=True):
                if p.shape != shape or p.dtype != dtype or p.device != device:
                    return None  # not what the remembered plan validated: plan afresh
                copies.append(SliceCopy(c.layer, c.start, c.length, p))
            if temporaries(parts, owned):  # a computed part (not a view of a source): plan afresh
                return None
        bp.mode = "in_place" if copies else "skipped"
    return out
