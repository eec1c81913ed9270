"""The apply phase of a refresh: carry out a validated plan, in place, and check that no storage moved."""

from __future__ import annotations

import time
from typing import cast

import torch
from torch import nn

from ..errors import RefreshInterruptedError, StorageDriftError
from ..storage import StorageIdentity, count_allocations, describe_changes
from ..torch_private import buffer_registration_hooked, non_persistent_buffers, own_buffers, set_grad_mode
from ..types import BufferReport, RefreshReport
from .backing import repoint
from .buffer_plan import BufferPlan, destination, of_a_parameter
from .per_layer import fill_computed
from .plan import RefreshPlan
from .specs import DerivedSpec, _layers, current_buffer

__all__ = ["apply_refresh"]


def apply_refresh(backbone: nn.Module, plan: RefreshPlan) -> RefreshReport:
    """Carry out a validated plan. Cold builds register new non-persistent buffers; everything else is a
    `copy_` into existing storage (each part of a multi-part slice straight into its place), verified afterwards.

    When every in-place write is a plain copy of a checkpoint weight (a parameter or a view of one: no copy reads
    what another writes), every buffer's bookkeeping is done first and the copies last, the smallest buffer's
    first: what the refresh does after its bulk copies, which leave the caches cold, is then only the drift check.
    Otherwise (a computed slice, an `into` writer, a `build` value, a backed buffer re-made views) every buffer is
    written in the declared order, as a writer may read a buffer declared before it.

    Runs without autograd (as under `torch.no_grad()`: a copy from a source that requires grad must not make the
    buffer part of a graph), switched in C: the context manager's Python frames would run cold after the copies."""
    grad = torch.is_grad_enabled()
    try:  # switched inside the try: an interrupt right after the switch must still restore the caller's mode
        set_grad_mode(False)
        return _apply(backbone, plan)
    finally:
        set_grad_mode(grad)


def _apply(backbone: nn.Module, plan: RefreshPlan) -> RefreshReport:
    t0 = time.perf_counter()
    report = RefreshReport()
    before: dict[str, StorageIdentity] = {}
    touched: list[str] = []
    deferred: list[tuple[BufferPlan, list[tuple[torch.Tensor, torch.Tensor]]]] | None = (
        [] if all(map(_plain, plan.buffers)) else None)
    bp = None
    try:
        for bp in plan.buffers:
            if bp.mode in ("cold", "alias") or (bp.mode == "in_place" and deferred is None):
                touched.append(bp.spec.name)
            _apply_one(backbone, bp, report, before, plan.context, deferred)
        if deferred is not None:  # every report is final: its audit record is built while the caches are warm
            report.audit_fields()
        for bp, pairs in sorted(deferred or (), key=lambda d: d[0].existing.nbytes):
            touched.append(bp.spec.name)
            for dst, src in pairs:
                dst.copy_(src)
    except Exception as e:
        assert bp is not None
        raise RefreshInterruptedError(bp.spec.name, touched, e, backbone=plan.context.get("backbone", "?"),
                                      state=plan.context.get("state", "?")) from e

    # `before` names the buffers written in place: registered, so none is None (were one dropped, `matches` raises)
    buffers = cast("dict[str, torch.Tensor]", own_buffers(backbone))
    drift = [line for name, old in before.items() if not old.matches(buf := buffers[name])
             for line in describe_changes(name, old, StorageIdentity.of(buf))]
    if drift:
        raise StorageDriftError(drift, backbone=plan.context.get("backbone", "?"),
                                state=plan.context.get("state", "?"))
    report.duration_ms = (time.perf_counter() - t0) * 1e3
    return report


def _registered(backbone: nn.Module, name: str, t: torch.Tensor) -> bool:
    """Whether `t` is already `name`'s non-persistent buffer (an alias whose source did not move), so that
    registering it again would change nothing: no global buffer-registration hook would see it."""
    return own_buffers(backbone).get(name) is t and name in non_persistent_buffers(backbone) \
        and not buffer_registration_hooked()  # unknown: register as before


def _plain(bp: BufferPlan) -> bool:
    """Whether `bp`'s writes are plain copies of checkpoint weights that may run in any order."""
    if bp.mode != "in_place":
        return bp.cold_layout is None  # a computed stack's cold build computes while writing
    if bp.spec.kind == "custom" or bp.backs:
        return False
    return all(c.src is not None and of_a_parameter(c.src) for c in bp.copies)


def _build_computed_stack(backbone: nn.Module, bp: BufferPlan, rep: BufferReport, context: dict[str, str]
                          ) -> torch.Tensor:
    """The cold build of a computed stack: the buffer is allocated once and filled slice by slice (never a
    `torch.stack` of L computed temporaries)."""
    assert bp.cold_layout is not None
    spec = bp.spec
    layers = _layers(backbone, spec.layers_attr)
    shape, dtype, device = bp.cold_layout
    buf = torch.empty((len(layers), *shape), dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        _, temps = fill_computed(spec, buf, i, layer, context)
        _count(rep, temps)
    return buf


def _count(rep: BufferReport, storages: list[torch.UntypedStorage]) -> None:
    rep.temporaries += len(storages)
    rep.temporary_bytes += sum(st.nbytes() for st in storages)


def _write_in_place(backbone: nn.Module, bp: BufferPlan, rep: BufferReport, context: dict[str, str],
                    deferred: list[tuple[BufferPlan, list[tuple[torch.Tensor, torch.Tensor]]]] | None) -> None:
    spec: DerivedSpec = bp.spec
    buf = bp.existing
    assert buf is not None
    rep.slices_written = len({c.layer for c in bp.copies}) if spec.kind != "custom" else 0
    if deferred is not None:  # plain copies (`_plain`): their places now, the copies once every buffer is ready
        # `_plain`: every copy has its source (none is a computed slice)
        pairs = cast("list[tuple[torch.Tensor, torch.Tensor]]", [(destination(spec, buf, c), c.src) for c in bp.copies])
        rep.elements_written = sum(dst.numel() for dst, _ in pairs)
        deferred.append((bp, pairs))
        return
    if spec.kind == "custom" and spec.into is not None:
        with count_allocations() as log:  # what the writer allocates on the way, counted exactly
            spec.into(backbone, buf)
        rep.temporaries += log.storages_created
        rep.temporary_bytes += log.bytes_allocated
        rep.elements_written = buf.numel()
    layers = _layers(backbone, spec.layers_attr) if spec.computed else ()
    for c in bp.copies:
        if c.src is None:  # a computed slice: evaluated now, copied, dropped
            n, temps = fill_computed(spec, buf, c.layer, layers[c.layer], context)
            _count(rep, temps)
            rep.elements_written += n
            continue
        dst = destination(spec, buf, c)
        dst.copy_(c.src)
        rep.elements_written += dst.numel()


def _apply_one(backbone: nn.Module, bp: BufferPlan, report: RefreshReport, before: dict[str, StorageIdentity],
               context: dict[str, str],
               deferred: list[tuple[BufferPlan, list[tuple[torch.Tensor, torch.Tensor]]]] | None) -> None:
    spec = bp.spec
    rep = BufferReport(spec.name, spec.kind, bp.mode, slices_total=bp.slices_total, reason=bp.reason,
                       temporaries=bp.temporaries, temporary_bytes=bp.temporary_bytes)
    if bp.mode == "cold" and bp.cold_layout is not None:
        bp.new_tensor = _build_computed_stack(backbone, bp, rep, context)
    if bp.mode in ("cold", "alias"):
        assert bp.new_tensor is not None
        if bp.mode == "cold":
            rep.elements_written = bp.new_tensor.numel()
            rep.slices_written = bp.slices_total
        if not _registered(backbone, spec.name, bp.new_tensor):
            backbone.register_buffer(spec.name, bp.new_tensor, persistent=False)
        if bp.backs:
            repoint(spec, bp.new_tensor, bp.backs)
    elif bp.mode == "in_place":
        assert bp.existing is not None
        before[spec.name] = StorageIdentity.of(bp.existing)
        _write_in_place(backbone, bp, rep, context, deferred)
        if bp.backs:
            repoint(spec, bp.existing, bp.backs)
    rep.backed_sources, rep.rebacked = bp.backed_sources, len(bp.backs)
    live = current_buffer(backbone, spec.name)
    if live is not None:
        rep.nbytes = live.numel() * live.element_size()
        rep.data_ptr = live.data_ptr()
    report.buffers.append(rep)
