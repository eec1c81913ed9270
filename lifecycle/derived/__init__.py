"""Derived buffers: declared once on the backbone class, built cold once, refreshed in place ever after.

>>> class Toy(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 3, bias=False) for _ in range(2))
>>> spec = concat("fused", sources=("weight",), per_layer=lambda layer: layer.weight[1:])
>>> toy = Toy(); names = [n for n, _ in toy.named_parameters()]
>>> plan = plan_refresh(toy, [spec], tensor_specs={n: TensorSpec.of(p) for n, p in toy.named_parameters()},
...                     dirty=frozenset(names), context={"backbone": "toy", "state": "FINALIZED"})
>>> report = apply_refresh(toy, plan)
>>> toy.fused.shape, report["fused"].mode, "fused" in toy.state_dict()
(torch.Size([4, 2]), 'cold', False)

Every refresh runs in two phases. `plan_refresh` validates EVERY buffer (sources ready and in the expected
layout, the new layout equal to the existing buffer's) and raises before anything is written. `apply_refresh`
then writes: a cold build allocates once; every later refresh copies into the existing storage, only the
slices whose sources were written in this epoch, and checks afterwards that no storage moved.

A `stack(..., computed=True)` slice is a real per-layer computation (it allocates a slice-sized result), so it
is evaluated lazily, one slice at a time and only for the slices that are written: at most one slice-sized
temporary lives at any moment, never a buffer-sized one.

>>> calls = []
>>> def scaled(layer):
...     calls.append(layer)
...     return layer.weight * 2.0   # a new tensor: a computation, not a view
>>> spec2 = stack("doubled", sources=("weight",), per_layer=scaled, computed=True)
>>> plan = plan_refresh(toy, [spec2], tensor_specs={n: TensorSpec.of(p) for n, p in toy.named_parameters()},
...                     dirty=frozenset(names), context={"backbone": "toy", "state": "FINALIZED"})
>>> report = apply_refresh(toy, plan)
>>> toy.doubled.shape, report["doubled"].mode, len(calls)  # plan validated 2 slices, apply computed 2
(torch.Size([2, 3, 2]), 'cold', 4)

All fallible work happens in the plan: every builder runs there (`per_layer` functions, `custom` builds,
`torch.cat` / `torch.stack` of a cold build), and every copy is checked there to have equal shape, dtype and
device at both ends. So a builder that raises leaves every buffer as it was. (Two kinds compute while writing, by
design, to avoid a buffer-sized temporary: `stack(..., computed=True)` slices and `custom(..., into=)` writers; a
failure there is handled like a device fault, below.) The apply phase only registers buffers (cold build, alias)
and runs `copy_`s between those checked tensors. Should one of them raise anyway (a device fault), `apply_refresh`
raises `RefreshInterruptedError` naming every buffer it touched; the backbone records them as torn, keeps its
state (FINALIZED, not usable) and rewrites them fully at the next refresh.
"""

from __future__ import annotations

import torch  # noqa: F401  (the doctests above use it)

from ..types import TensorSpec  # noqa: F401  (the doctests above use it)
from .apply import apply_refresh
from .plan import RefreshPlan, plan_refresh
from .specs import DerivedSpec, PerLayer, alias, concat, current_buffer, custom, resolve_tensor, stack

__all__ = [
    "DerivedSpec",
    "PerLayer",
    "RefreshPlan",
    "alias",
    "apply_refresh",
    "concat",
    "current_buffer",
    "custom",
    "plan_refresh",
    "resolve_tensor",
    "stack",
]
