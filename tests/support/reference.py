"""What the property, fault and concurrency tests compare against: derived buffers computed directly from the
parameters, bit-for-bit snapshots of weights and buffers, and a DFlash draft with builders that raise on demand.

Nothing here goes through the refresh engine: `expected_derived` rebuilds every buffer from the live parameters
with plain torch, the way a cold build would.
"""

from __future__ import annotations

import torch
from torch import nn

from lifecycle import DraftBackbone, concat, custom
from lifecycle.storage import StorageIdentity
from models.qwen3_dflash import DFlashQwen3Draft

# ---- expected values -----------------------------------------------------------------------------------------


def expected_derived(m: DFlashQwen3Draft) -> dict[str, torch.Tensor]:
    """The DFlash derived buffers as a cold build from the current weights would make them."""
    out = {
        "_fused_kv_weight": torch.cat([la.self_attn.qkv_proj.weight[la.self_attn.q_size:] for la in m.layers]),
        "_k_norm_weights": torch.stack([la.self_attn.k_norm.weight for la in m.layers]),
    }
    if isinstance(m, FaultyDraft):
        out["_o_proj_rows"] = torch.cat([la.self_attn.o_proj.weight for la in m.layers])
        out["_fc_colsum"] = m.fc.weight.sum(0)
    return out


def assert_derived_current(m: DFlashQwen3Draft) -> None:
    """Every derived buffer equals a cold build from the live weights; aliases ARE their live sources."""
    for name, want in expected_derived(m).items():
        got = m._buffers[name]
        assert got is not None and not got.is_meta, f"{name}: not built"
        assert torch.equal(got, want), f"{name}: differs from a cold build of the current weights"
    assert m._hidden_norm_weight is m.hidden_norm.weight
    assert m._rope_cos_sin_cache is m.layers[0].self_attn.rotary_emb.cos_sin_cache
    rot = m.layers[0].self_attn.rotary_emb
    assert torch.equal(m._rope_cos_sin_cache, rot.compute_cos_sin_cache(m._rope_cos_sin_cache.device))


# ---- snapshots -----------------------------------------------------------------------------------------------

Snap = dict[str, tuple[torch.Tensor, StorageIdentity | None, torch.Tensor | None]]


def snapshot(m: nn.Module) -> Snap:
    """name -> (the tensor object, its storage identity, a clone of its bits) for every parameter and buffer
    (derived buffers included once built); META tensors have no identity or bits."""
    out: Snap = {}
    for name, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]:
        if t.is_meta:
            out[name] = (t, None, None)
        else:
            out[name] = (t, StorageIdentity.of(t), t.detach().clone())
    return out


def assert_same(m: nn.Module, before: Snap, *, only: set[str] | None = None, skip: set[str] = frozenset()) -> None:
    """The same tensor objects, storage identities and bits as in `before` (restricted to `only`, minus `skip`)."""
    now = snapshot(m)
    names = set(before) | set(now) if only is None else only
    for name in sorted(names - set(skip)):
        assert name in before and name in now, f"{name}: appeared or disappeared"
        (obj0, id0, bits0), (obj1, id1, bits1) = before[name], now[name]
        assert obj1 is obj0, f"{name}: a different tensor object"
        assert id1 == id0, f"{name}: storage identity changed {id0} -> {id1}"
        if bits0 is not None:
            assert bits1 is not None and torch.equal(bits1, bits0), f"{name}: values changed"


def derived_names(m: DraftBackbone) -> set[str]:
    return {s.name for s in m.derived_buffers}


def weight_names(m: DraftBackbone) -> set[str]:
    return set(m.lifecycle.specs)


# ---- a DFlash draft whose builders can be made to fail -------------------------------------------------------


class FailsOnCopy(torch.Tensor):
    """A tensor whose `copy_` from it raises: a device fault in the middle of a refresh's writes."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            raise RuntimeError("injected device fault while copying")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _o_proj_rows(layer: nn.Module) -> torch.Tensor:
    if getattr(layer, "builder_fault", False):
        raise RuntimeError("injected fault in per_layer")
    return layer.self_attn.o_proj.weight


def _fc_colsum(m: nn.Module) -> torch.Tensor:
    if m.faults["build"]:
        raise ValueError("injected fault in custom build")
    value = m.fc.weight.sum(0)
    return value.as_subclass(FailsOnCopy) if m.faults["copy"] else value


class FaultyDraft(DFlashQwen3Draft):
    """DFlash plus two more derived buffers written after the four real ones: a concat whose `per_layer` raises
    on a layer with `builder_fault = True`, and a custom build that raises (`faults["build"]`) or hands the
    refresh a value whose copy fails (`faults["copy"]`)."""

    derived_buffers = (
        *DFlashQwen3Draft.derived_buffers,
        concat("_o_proj_rows", sources=("self_attn.o_proj.weight",), per_layer=_o_proj_rows),
        custom("_fc_colsum", build=_fc_colsum, depends_on=("fc.weight",)),
    )

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.faults = {"build": False, "copy": False}
