"""Laguna DFlash (`models/laguna_dflash.py`): what is specific to it.

Its context K/V read each layer's own `input_layernorm` (one grouped norm over stacked weights, one batched GEMM),
RoPE over part of each head (partial rotary), an optional softplus output gate, and `mask_embedding`, a
non-persistent buffer no checkpoint carries. What every family shares (the oracle, refusals, selective refresh,
hooks) runs in `test_oracle.py` and `test_families.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import Phase, StorageDriftError
from lifecycle.storage import StorageIdentity
from models.laguna_dflash import DFlashLagunaDraft, LagunaDFlashConfig
from models.layers import apply_rope
from support.family_helpers import Fam, assert_unchanged, bit_equal, reload, snapshot


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Fam:
    return Fam.make("laguna-dflash", tmp_path_factory.mktemp("laguna"))


@pytest.fixture
def model(fam: Fam) -> DFlashLagunaDraft:
    return fam.cold("a")


# ---- the context path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [{"gating": "per-element", "partial_rotary_factor": 1.0},
                                     {"gating": False, "partial_rotary_factor": 0.25}], ids=["per-element", "no-gate"])
def test_config_variants_fused_path_matches_reference(tmp_path: Path, variant: dict[str, Any]) -> None:
    vfam = Fam.make("laguna-dflash", tmp_path, num_hidden_layers=2, **variant)
    cfg: LagunaDFlashConfig = vfam.cfg
    m = vfam.cold("a")
    rotary_dim = int(cfg.head_dim * variant["partial_rotary_factor"])
    assert m._rope_cos_sin_cache.shape == (cfg.max_position_embeddings, rotary_dim)
    assert (m.layers[0].self_attn.g_proj is None) == (variant["gating"] is False)
    fused, ref = vfam.outputs(m, seed=3), vfam.outputs(m, reference=True, seed=3)
    assert fused[0].shape == (2, 6, cfg.num_key_value_heads, cfg.head_dim)
    for f, r in zip(fused, ref, strict=True):
        torch.testing.assert_close(f, r, atol=1e-5, rtol=0)
    # partial rotary: channels past rotary_dim pass through, the first rotary_dim are rotated
    k = torch.randn(3, 2, cfg.head_dim)
    roped = apply_rope(k, torch.tensor([1, 5, 9]), m._rope_cos_sin_cache)
    assert torch.equal(roped[..., rotary_dim:], k[..., rotary_dim:])
    assert not torch.allclose(roped[..., :rotary_dim], k[..., :rotary_dim])


def test_context_is_normed_per_layer_not_by_hidden_norm(fam: Fam, model: DFlashLagunaDraft) -> None:
    """Laguna's context K/V read each layer's input_layernorm; hidden_norm belongs to combine_hidden_states."""
    k0, v0, _ = fam.outputs(model, seed=3)
    with torch.no_grad():
        model.hidden_norm.weight.mul_(3.0)
    k1, v1, _ = fam.outputs(model, seed=3)
    assert bit_equal(k0, k1) and bit_equal(v0, v1)
    target = torch.randn(5, fam.cfg.target_hidden_size * fam.cfg.num_target_features)
    ctx = model.combine_hidden_states(target)
    with torch.no_grad():
        model.hidden_norm.weight.div_(3.0)
    torch.testing.assert_close(model.combine_hidden_states(target) * 3.0, ctx)


# ---- mask_embedding, made by a cold-only hook ------------------------------------------------------------------


def test_mask_embedding_is_a_non_persistent_buffer_made_once(fam: Fam, model: DFlashLagunaDraft) -> None:
    assert [h.name for h in model.post_load_hooks(Phase.COLD_LOAD)] == ["init_rope_caches", "init_mask_embedding"]
    assert "mask_embedding" not in model.state_dict()
    assert "mask_embedding" not in model.lifecycle.specs  # not a checkpoint tensor: readiness never waits for it
    assert not model.mask_embedding.is_meta and bool((model.mask_embedding == 0).all())
    assert model.mask_embedding.shape == (fam.cfg.hidden_size,)
    model.capture_graphs()
    assert "mask_embedding" in model.lifecycle.pinned.identities
    obj, ident = model.mask_embedding, StorageIdentity.of(model.mask_embedding)
    rope = model._rope_cos_sin_cache
    assert reload(model, fam.ckpt["b"]) == []  # neither cold-only hook replays
    model.refresh_derived_buffers()
    assert model.mask_embedding is obj and StorageIdentity.of(obj) == ident
    assert model._rope_cos_sin_cache is rope is model.layers[0].self_attn.rotary_emb.cos_sin_cache


def test_mask_embedding_is_used_only_when_a_separate_one_is_loaded(fam: Fam, model: DFlashLagunaDraft) -> None:
    hidden = fam.cfg.hidden_size
    ids = torch.tensor([5, 7, 5, 1])
    embeds = torch.randn(4, hidden)
    assert model.apply_mask_embedding(embeds, ids) is embeds  # vLLM's Laguna loader never enables it
    model.mask_token_id, model.has_separate_mask_embedding = 5, True
    with torch.no_grad():
        model.mask_embedding.fill_(2.0)  # in place: what a lifecycle-aware loader of mask_embedding.pt must do
    out = model.apply_mask_embedding(embeds, ids)
    assert torch.equal(out[[0, 2]], torch.full((2, hidden), 2.0))
    assert torch.equal(out[[1, 3]], embeds[[1, 3]])


def test_replaying_the_mask_embedding_hook_on_reload_would_be_caught(fam: Fam, model: DFlashLagunaDraft) -> None:
    """Why it is cold-only: re-creating the buffer on reload moves pinned storage, and the refresh is refused."""
    model.capture_graphs()
    snap = snapshot(model)
    reload(model, fam.ckpt["b"])
    model._buffers["mask_embedding"] = torch.zeros(fam.cfg.hidden_size)  # a reload hook that re-creates it
    with pytest.raises(StorageDriftError, match="mask_embedding: data_ptr"):
        model.refresh_derived_buffers()
    assert_unchanged(model, snap)
