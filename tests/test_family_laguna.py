"""Laguna DFlash (`models/laguna_dflash.py`): what is specific to it.

Three stacked buffers read by one batched GEMM (`_kv_weights`), one grouped per-layer RMSNorm of the context
(`_input_layernorm_weights`) and one grouped k-norm (`_k_norm_weights`), a RoPE alias over a partial-rotary table,
and `mask_embedding`, a non-persistent buffer no checkpoint carries.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_helpers import (
    STRATEGIES,
    assert_same_model,
    assert_unchanged,
    bit_equal,
    cold_load,
    derived,
    outputs,
    partial_checkpoint,
    reload,
    snapshot,
)
from structlog.testing import capture_logs
from torch import nn

from lifecycle import LayersNotReadyError, LifecycleState, Phase, StorageDriftError, StorageReallocationError
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.storage import StorageIdentity, count_allocations
from lifecycle.types import TensorSpec
from models import get_family
from models.laguna_dflash import DFlashLagunaDraft, LagunaDFlashConfig
from models.layers import apply_rope

S = LifecycleState
FAMILY = get_family("laguna-dflash")
CFG = LagunaDFlashConfig(num_hidden_layers=3)
L = CFG.num_hidden_layers
KV_ROWS = 2 * CFG.num_key_value_heads * CFG.head_dim
STACKED = {  # buffer -> (the per-layer source it stacks, elements of one slice)
    "_kv_weights": ("self_attn.qkv_proj.weight", KV_ROWS * CFG.hidden_size),
    "_input_layernorm_weights": ("input_layernorm.weight", CFG.hidden_size),
    "_k_norm_weights": ("self_attn.k_norm.weight", CFG.head_dim),
}
SENTINEL = 1234.5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("laguna")
    return {"a": write_checkpoint(FAMILY.random_weights(CFG, 0), d / "a.safetensors"),
            "b": write_checkpoint(FAMILY.random_weights(CFG, 1), d / "b.safetensors"),
            "b1": partial_checkpoint(FAMILY, CFG, d / "b_layer1.safetensors")}


@pytest.fixture
def model(ckpts: dict[str, Path]) -> DFlashLagunaDraft:
    return cold_load(FAMILY, CFG, ckpts["a"], name="laguna")  # type: ignore[return-value]


def expected_slice(m: DFlashLagunaDraft, buffer: str, i: int) -> torch.Tensor:
    layer = m.layers[i]
    if buffer == "_kv_weights":
        return layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:]
    return layer.get_parameter(STACKED[buffer][0])


# ---- the differential oracle -----------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs-captured"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_warm_reload_equals_cold_load(model, ckpts, strategy, graphs):
    kw = STRATEGIES[strategy]
    target = ckpts["b1"] if "subset" in kw else ckpts["b"]
    cold_target = cold_load(FAMILY, CFG, target)
    x = FAMILY.example_inputs(CFG, 5, "cpu")
    # not vacuous: A and the target differ in every derived stack and in the fused outputs
    for name in STACKED:
        assert not bit_equal(getattr(model, name), getattr(cold_target, name)), name
    assert not bit_equal(outputs(FAMILY, model, x)[2], outputs(FAMILY, cold_target, x)[2])
    if graphs:
        model.capture_graphs()
    before = {n: StorageIdentity.of(t) for n, t in derived(model).items()}
    reload(model, target, **kw)
    report = model.refresh_derived_buffers()
    assert model.lifecycle.state is (S.GRAPH_CAPTURED if graphs else S.DERIVED_REFRESHED)
    for name in STACKED:
        assert report[name].mode == "in_place"
        assert report[name].slices_written == (1 if "subset" in kw else L)
    assert {n: StorageIdentity.of(t) for n, t in derived(model).items()} == before
    assert_same_model(FAMILY, model, cold_target, CFG)


@pytest.mark.parametrize("which", ["cold", "warm"])
def test_fused_path_matches_per_layer_reference(model, ckpts, which):
    if which == "warm":
        reload(model, ckpts["b"], bucket_by=2, shuffle=True)
        model.refresh_derived_buffers()
    x = FAMILY.example_inputs(CFG, 3, "cpu")
    fused, ref = outputs(FAMILY, model, x), outputs(FAMILY, model, x, FAMILY.reference)
    assert fused[0].shape == (L, 6, CFG.num_key_value_heads, CFG.head_dim)
    for f, r in zip(fused, ref, strict=True):
        torch.testing.assert_close(f, r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", [{"gating": "per-element", "partial_rotary_factor": 1.0},
                                     {"gating": False, "partial_rotary_factor": 0.25}], ids=["per-element", "no-gate"])
def test_config_variants_fused_path_matches_reference(tmp_path, variant):
    cfg = LagunaDFlashConfig(num_hidden_layers=2, **variant)
    m = cold_load(FAMILY, cfg, write_checkpoint(FAMILY.random_weights(cfg, 0), tmp_path / "v.safetensors"))
    rotary_dim = int(cfg.head_dim * variant["partial_rotary_factor"])
    assert m._rope_cos_sin_cache.shape == (cfg.max_position_embeddings, rotary_dim)
    assert (m.layers[0].self_attn.g_proj is None) == (variant["gating"] is False)
    x = FAMILY.example_inputs(cfg, 3, "cpu")
    for f, r in zip(outputs(FAMILY, m, x), outputs(FAMILY, m, x, FAMILY.reference), strict=True):
        torch.testing.assert_close(f, r, atol=1e-5, rtol=0)
    # partial rotary: channels past rotary_dim pass through, the first rotary_dim are rotated
    k = torch.randn(3, 2, cfg.head_dim)
    roped = apply_rope(k, torch.tensor([1, 5, 9]), m._rope_cos_sin_cache)
    assert torch.equal(roped[..., rotary_dim:], k[..., rotary_dim:])
    assert not torch.allclose(roped[..., :rotary_dim], k[..., :rotary_dim])


@pytest.mark.parametrize("buffer", list(STACKED))
def test_every_stacked_buffer_is_read_by_the_fused_path(model, buffer):
    """Corrupt layer 1's slice of one buffer: the fused context K/V of layer 1 (only) leaves the reference."""
    x = FAMILY.example_inputs(CFG, 3, "cpu")
    with torch.no_grad():
        getattr(model, buffer)[1].mul_(1.5)
    (k, v, _), (k_ref, v_ref, _) = outputs(FAMILY, model, x), outputs(FAMILY, model, x, FAMILY.reference)
    for i in range(L):
        same = torch.allclose(k[i], k_ref[i], atol=1e-5) and torch.allclose(v[i], v_ref[i], atol=1e-5)
        assert same == (i != 1), f"layer {i}"


def test_context_is_normed_per_layer_not_by_hidden_norm(model):
    """Laguna's context K/V read each layer's input_layernorm; hidden_norm belongs to combine_hidden_states."""
    x = FAMILY.example_inputs(CFG, 3, "cpu")
    k0, v0, _ = outputs(FAMILY, model, x)
    with torch.no_grad():
        model.hidden_norm.weight.mul_(3.0)
    k1, v1, _ = outputs(FAMILY, model, x)
    assert bit_equal(k0, k1) and bit_equal(v0, v1)
    target = torch.randn(5, CFG.target_hidden_size * CFG.num_target_features)
    ctx = model.combine_hidden_states(target)
    with torch.no_grad():
        model.hidden_norm.weight.div_(3.0)
    torch.testing.assert_close(model.combine_hidden_states(target) * 3.0, ctx)


# ---- guards ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("held_back", ["layers.2.input_layernorm.weight", "layers.2.self_attn.qkv_proj.weight"])
def test_refresh_before_the_last_layer_is_refused_and_writes_nothing(model, ckpts, held_back):
    snap = snapshot(model)
    model.capture_graphs()
    model.begin_reload()
    load_safetensors(model, ckpts["b"], bucket_by=1, shuffle=True, subset=lambda n: n != held_back)
    with capture_logs() as logs, pytest.raises(LayersNotReadyError) as ei:
        model.refresh_derived_buffers()
    assert ei.value.missing == {"layers.2": (held_back,)}
    assert model.lifecycle.state is S.PARTIALLY_LOADED
    assert_unchanged(model, snap)
    assert [e["error"] for e in logs if e["event"] == "refused"] == ["LayersNotReadyError"]
    load_safetensors(model, ckpts["b"], subset=[held_back])
    model.finalize_loading()
    model.refresh_derived_buffers()
    for name in STACKED:
        assert torch.equal(getattr(model, name), torch.stack([expected_slice(model, name, i) for i in range(L)]))


def test_cold_refresh_before_the_last_layer_builds_nothing(ckpts):
    m = DFlashLagunaDraft(CFG)
    load_safetensors(m, ckpts["a"], subset=lambda n: not n.startswith("layers.2."))
    with pytest.raises(LayersNotReadyError) as ei:
        m.refresh_derived_buffers()
    assert set(ei.value.missing) == {"layers.2"}
    assert all(m._buffers[n] is None for n in m.derived_buffer_names())


def test_reload_changing_a_stacked_shape_is_refused_and_keeps_old_values(model, ckpts):
    """A new input_layernorm size would need a new `_input_layernorm_weights`: refused, nothing written (the valid,
    dirty `_kv_weights` included)."""
    snap = snapshot(model)
    reload(model, ckpts["b"])
    for i, layer in enumerate(model.layers):
        layer.input_layernorm._parameters["weight"] = nn.Parameter(torch.ones(CFG.hidden_size + 8),
                                                                   requires_grad=False)
        model.lifecycle.specs[f"layers.{i}.input_layernorm.weight"] = TensorSpec((CFG.hidden_size + 8,),
                                                                                 torch.float32)
    with pytest.raises(StorageReallocationError) as ei:
        model.refresh_derived_buffers()
    (problem,) = ei.value.problems
    assert problem.startswith("_input_layernorm_weights:")
    assert f"({L}, {CFG.hidden_size + 8})" in problem and f"shape ({L}, {CFG.hidden_size})" in problem
    assert model.lifecycle.state is S.FULLY_LOADED
    assert_unchanged(model, snap)


# ---- selective refresh --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", range(L))
def test_one_layer_reload_rewrites_one_slice_of_each_stack(model, ckpts, tmp_path, layer):
    target = partial_checkpoint(FAMILY, CFG, tmp_path / "b_one.safetensors", layer=layer)
    with torch.no_grad():
        for name in STACKED:
            getattr(model, name).fill_(SENTINEL)
    reload(model, target, subset=lambda n: n.startswith(f"layers.{layer}."), bucket_by=1, shuffle=True)
    with count_allocations() as log:
        report = model.refresh_derived_buffers()
    for name, (_, slice_elements) in STACKED.items():
        rep = report[name]
        assert (rep.mode, rep.slices_written, rep.slices_total) == ("in_place", 1, L)
        assert rep.elements_written == slice_elements
        buf = getattr(model, name)
        for i in range(L):
            if i == layer:
                assert torch.equal(buf[i], expected_slice(model, name, i))
            else:
                assert bool((buf[i] == SENTINEL).all()), f"{name}: slice {i} was written"
    assert report.elements_written == sum(e for _, e in STACKED.values())
    assert log.at_least(model._kv_weights.numel() * 4 // L) == [], log.records


def test_in_place_refresh_allocates_nothing_buffer_sized(model, ckpts):
    model.capture_graphs()
    reload(model, ckpts["b"], bucket_by=3, shuffle=True)
    with count_allocations() as log:
        report = model.refresh_derived_buffers()
    assert report.bytes_allocated == 0
    smallest = min(t.numel() * t.element_size() for n, t in derived(model).items() if n in STACKED)
    assert log.at_least(smallest) == [], log.records


# ---- mask_embedding and the cold-only hooks ------------------------------------------------------------------


def test_mask_embedding_is_a_non_persistent_buffer_made_once(model, ckpts):
    assert "mask_embedding" not in model.state_dict()
    assert "mask_embedding" not in model.lifecycle.specs  # not a checkpoint tensor: readiness never waits for it
    assert not model.mask_embedding.is_meta and bool((model.mask_embedding == 0).all())
    assert model.mask_embedding.shape == (CFG.hidden_size,)
    model.capture_graphs()
    assert "mask_embedding" in model.lifecycle.pinned.identities
    obj, ident = model.mask_embedding, StorageIdentity.of(model.mask_embedding)
    rope = model._rope_cos_sin_cache
    reload(model, ckpts["b"])
    model.refresh_derived_buffers()
    assert model.mask_embedding is obj and StorageIdentity.of(obj) == ident
    assert model._rope_cos_sin_cache is rope is model.layers[0].self_attn.rotary_emb.cos_sin_cache


def test_mask_embedding_is_used_only_when_a_separate_one_is_loaded(model):
    ids = torch.tensor([5, 7, 5, 1])
    embeds = torch.randn(4, CFG.hidden_size)
    assert model.apply_mask_embedding(embeds, ids) is embeds  # vLLM's Laguna loader never enables it
    model.mask_token_id, model.has_separate_mask_embedding = 5, True
    with torch.no_grad():
        model.mask_embedding.fill_(2.0)  # in place: what a lifecycle-aware loader of mask_embedding.pt must do
    out = model.apply_mask_embedding(embeds, ids)
    assert torch.equal(out[[0, 2]], torch.full((2, CFG.hidden_size), 2.0))
    assert torch.equal(out[[1, 3]], embeds[[1, 3]])


def test_cold_only_hooks_do_not_run_on_reload(model, ckpts):
    assert [h.name for h in model.post_load_hooks(Phase.COLD_LOAD)] == ["init_rope_caches", "init_mask_embedding"]
    tables = [layer.self_attn.rotary_emb.cos_sin_cache for layer in model.layers]
    mask = model.mask_embedding
    model.capture_graphs()
    model.begin_reload()
    load_safetensors(model, ckpts["b"])
    with capture_logs() as logs:
        assert model.finalize_loading() == []
    assert not [e for e in logs if e["event"] == "hook_run"]
    model.refresh_derived_buffers()
    assert all(a is b for a, b in zip(tables, [la.self_attn.rotary_emb.cos_sin_cache for la in model.layers],
                                      strict=True))
    assert model.mask_embedding is mask


def test_replaying_the_mask_embedding_hook_on_reload_would_be_caught(model, ckpts):
    """Why it is cold-only: re-creating the buffer on reload moves pinned storage, and the refresh is refused."""
    model.capture_graphs()
    snap = snapshot(model)
    reload(model, ckpts["b"])
    model._buffers["mask_embedding"] = torch.zeros(CFG.hidden_size)  # a reload hook that re-creates it
    with pytest.raises(StorageDriftError, match="mask_embedding: data_ptr"):
        model.refresh_derived_buffers()
    assert_unchanged(model, snap)
