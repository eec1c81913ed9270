"""Helpers shared by the per-family test files (`test_family_*.py`): cold loads, reloads, snapshots, bit equality.

Every helper works on any `DraftBackbone` registered in `models.FAMILIES`; the family-specific checks stay in the
test files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lifecycle import DraftBackbone, LifecycleState
from lifecycle.derived import current_buffer
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.storage import StorageIdentity
from models.registry import DraftFamily

S = LifecycleState

# how a warm reload delivers the target; "partial-layer-1" reloads only layers.1 (B' = A with layers.1 from B)
STRATEGIES: dict[str, dict[str, Any]] = {
    "shuffled-buckets-of-3": {"bucket_by": 3, "shuffle": True, "seed": 1},
    "one-at-a-time-shuffled-duplicates": {"bucket_by": 1, "shuffle": True, "seed": 2, "duplicates": 5},
    "partial-layer-1": {"subset": lambda n: n.startswith("layers.1."), "bucket_by": 1, "shuffle": True, "seed": 3},
}


def cold_load(family: DraftFamily, cfg: Any, path: Path, name: str = "cold") -> DraftBackbone:
    model = family.build(cfg, device="meta", name=name)
    load_safetensors(model, path)
    model.finalize_loading()
    model.refresh_derived_buffers()
    assert model.lifecycle.state is S.DERIVED_REFRESHED
    return model


def reload(model: DraftBackbone, path: Path, **kw: Any) -> None:
    """begin_reload, load (any strategy), finalize; a `subset` reload keeps untouched layers."""
    model.begin_reload()
    load_safetensors(model, path, **kw)
    model.finalize_loading(keep_untouched="subset" in kw)


def partial_checkpoint(family: DraftFamily, cfg: Any, path: Path, layer: int = 1) -> Path:
    """B' = A with only layers.{layer} replaced by B's tensors."""
    a, b = family.random_weights(cfg, 0), family.random_weights(cfg, 1)
    prefix = f"layers.{layer}."
    return write_checkpoint({n: (b[n] if n.startswith(prefix) else t) for n, t in a.items()}, path)


def derived(model: DraftBackbone) -> dict[str, torch.Tensor]:
    out = {}
    for name in model.derived_buffer_names():
        t = current_buffer(model, name)
        assert t is not None, f"derived buffer {name} was never built"
        out[name] = t
    return out


def everything(model: DraftBackbone) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones included) and every derived buffer, by name."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    out.update(derived(model))
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def outputs(family: DraftFamily, model: DraftBackbone, x: dict[str, torch.Tensor],
            path: Callable[[DraftBackbone, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]] | None = None
            ) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return (path or family.fused)(model, x)


def assert_same_model(family: DraftFamily, warm: DraftBackbone, cold: DraftBackbone, cfg: Any) -> None:
    """Bit for bit: every tensor the model holds, and the fused path's outputs."""
    w, c = everything(warm), everything(cold)
    assert w.keys() == c.keys()
    for name in c:
        assert bit_equal(w[name], c[name]), f"{name}: warm reload differs from a cold load"
    x = family.example_inputs(cfg, 5, "cpu")
    for i, (wo, co) in enumerate(zip(outputs(family, warm, x), outputs(family, cold, x), strict=True)):
        assert bit_equal(wo, co), f"fused output {i}: warm reload differs from a cold load"


def snapshot(model: DraftBackbone) -> dict[str, tuple[torch.Tensor, torch.Tensor, StorageIdentity]]:
    """name -> (the buffer object, a clone of its values, its storage identity), every built derived buffer."""
    return {name: (t, t.detach().clone(), StorageIdentity.of(t)) for name, t in derived(model).items()}


def assert_unchanged(model: DraftBackbone, snap: dict[str, tuple[torch.Tensor, torch.Tensor, StorageIdentity]],
                     *, skip_aliases: bool = True) -> None:
    """Same object, same storage identity, same bits (an alias IS its source, which a loader may rewrite: with
    `skip_aliases` its values are not compared)."""
    kinds = {spec.name: spec.kind for spec in model.derived_buffers}
    for name, (obj, values, ident) in snap.items():
        live = model._buffers[name]
        assert live is obj, f"{name}: re-registered"
        assert StorageIdentity.of(live) == ident, f"{name}: storage moved"
        if not (skip_aliases and kinds[name] == "alias"):
            assert torch.equal(live, values), f"{name}: values written"
