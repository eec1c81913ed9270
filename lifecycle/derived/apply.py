"""The apply phase of a refresh: carry out a validated plan, in place, and check that no storage moved."""

from __future__ import annotations

import time

import torch
from torch import nn

from ..errors import RefreshInterruptedError, StorageDriftError
from ..storage import StorageIdentity, describe_changes
from ..types import BufferReport, RefreshReport
from .plan import RefreshPlan, _BufferPlan
from .specs import DerivedSpec, _layers, current_buffer

__all__ = ["apply_refresh"]


@torch.no_grad()
def apply_refresh(backbone: nn.Module, plan: RefreshPlan) -> RefreshReport:
    """Carry out a validated plan. Cold builds register new non-persistent buffers; everything else is a
    `copy_` into existing storage, verified afterwards."""
    t0 = time.perf_counter()
    report = RefreshReport()
    before: dict[str, StorageIdentity] = {}
    touched: list[str] = []
    for bp in plan.buffers:
        if bp.mode in ("cold", "alias", "in_place"):
            touched.append(bp.spec.name)
        try:
            _apply_one(backbone, bp, report, before)
        except Exception as e:
            raise RefreshInterruptedError(bp.spec.name, touched, e, backbone=plan.context.get("backbone", "?"),
                                          state=plan.context.get("state", "?")) from e

    drift = [
        line
        for name, old in before.items()
        for line in describe_changes(name, old, StorageIdentity.of(backbone._buffers[name]))  # type: ignore[arg-type]
    ]
    if drift:
        raise StorageDriftError(drift, backbone=plan.context.get("backbone", "?"),
                                state=plan.context.get("state", "?"))
    report.duration_ms = (time.perf_counter() - t0) * 1e3
    return report


def _build_computed_stack(backbone: nn.Module, spec: DerivedSpec,
                          layout: tuple[tuple[int, ...], torch.dtype, torch.device]) -> torch.Tensor:
    """The cold build of a computed stack: the buffer is allocated once and filled slice by slice (never a
    `torch.stack` of L computed temporaries)."""
    assert spec.per_layer is not None
    layers = _layers(backbone, spec.layers_attr)
    shape, dtype, device = layout
    buf = torch.empty((len(layers), *shape), dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        buf[i].copy_(spec.per_layer(layer))
    return buf


def _apply_one(backbone: nn.Module, bp: _BufferPlan, report: RefreshReport,
               before: dict[str, StorageIdentity]) -> None:
    spec = bp.spec
    rep = BufferReport(spec.name, spec.kind, bp.mode, slices_total=bp.slices_total, reason=bp.reason)
    if bp.mode == "cold" and bp.cold_layout is not None:
        bp.new_tensor = _build_computed_stack(backbone, spec, bp.cold_layout)
    if bp.mode in ("cold", "alias"):
        assert bp.new_tensor is not None
        if bp.mode == "cold":
            rep.elements_written = bp.new_tensor.numel()
            rep.slices_written = bp.slices_total
        backbone.register_buffer(spec.name, bp.new_tensor, persistent=False)
    elif bp.mode == "in_place":
        buf = bp.existing
        assert buf is not None
        before[spec.name] = StorageIdentity.of(buf)
        layers = _layers(backbone, spec.layers_attr) if spec.computed else ()
        if spec.kind == "custom" and spec.into is not None:
            spec.into(backbone, buf)
            rep.elements_written = buf.numel()
        for start, length, src in bp.copies:
            if src is None:  # a computed slice: evaluated now, copied, dropped
                assert spec.per_layer is not None
                src = spec.per_layer(layers[start])
            if spec.kind == "custom":
                dst = buf
            elif spec.kind == "stack":
                dst = buf[start]
            else:
                dst = buf.narrow(spec.dim, start, length)
            dst.copy_(src)
            rep.elements_written += dst.numel()
        rep.slices_written = len(bp.copies) if spec.kind != "custom" else 0
    live = current_buffer(backbone, spec.name)
    if live is not None:
        rep.nbytes = live.numel() * live.element_size()
        rep.data_ptr = live.data_ptr()
    report.buffers.append(rep)
