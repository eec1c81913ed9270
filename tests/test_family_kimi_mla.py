"""Kimi-K3 MLA DSpark (`models/kimi_k3_mla_dspark.py`): what is specific to it.

Its derived state includes a computation, not only copies: the absorbed `W_UK_T` / `W_UV` of every layer,
computed from `kv_b_proj.weight` (`stack(..., computed=True)`), next to the concatenated context-latent
projection, the stacked `kv_a_layernorm` weights and the RoPE alias. The fused path (absorbed multi-query
attention over the latent cache) must agree with the per-layer path that expands K/V with `kv_b_proj`.
"""

from __future__ import annotations

from collections import Counter
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

from lifecycle import LayersNotReadyError, LifecycleState, Phase, StorageReallocationError
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.storage import StorageIdentity, count_allocations
from lifecycle.types import TensorSpec
from models import get_family
from models.kimi_k3_mla_dspark import K3DSparkConfig, K3DSparkDraft

S = LifecycleState
FAMILY = get_family("kimi-k3-mla")
CFG = K3DSparkConfig(num_hidden_layers=3)
L, N = CFG.num_hidden_layers, CFG.num_attention_heads
P, R, V, LKV = CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim, CFG.kv_lora_rank
SLICE_ELEMENTS = {  # buffer -> elements of one layer's slice
    "_context_kv_weight": (LKV + R) * CFG.hidden_size,
    "_context_kv_norm_weights": LKV,
    "_W_UK_T": N * P * LKV,
    "_W_UV": N * LKV * V,
}
ABSORBED = ("_W_UK_T", "_W_UV")
SENTINEL = 1234.5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("k3")
    return {"a": write_checkpoint(FAMILY.random_weights(CFG, 0), d / "a.safetensors"),
            "b": write_checkpoint(FAMILY.random_weights(CFG, 1), d / "b.safetensors"),
            "b1": partial_checkpoint(FAMILY, CFG, d / "b_layer1.safetensors")}


@pytest.fixture
def model(ckpts: dict[str, Path]) -> K3DSparkDraft:
    return cold_load(FAMILY, CFG, ckpts["a"], name="k3")  # type: ignore[return-value]


def absorbed_from_scratch(kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK_T [N, P, Lkv] and W_UV [N, Lkv, V] written out from the definition kv_b_proj(c) = [k_nope | v] per
    head, independently of the model's helpers: k_nope[n] = W_UK_T[n] @ c and v[n] = c @ W_UV[n]."""
    per_head = kv_b_weight.view(N, P + V, LKV)  # rows of head n: [P nope rows | V value rows]
    return per_head[:, :P, :].clone(), per_head[:, P:, :].transpose(1, 2).clone()


def slice_of(m: K3DSparkDraft, buffer: str, i: int) -> torch.Tensor:
    t = getattr(m, buffer)
    return t[i * (LKV + R):(i + 1) * (LKV + R)] if buffer == "_context_kv_weight" else t[i]


def expected_slice(m: K3DSparkDraft, buffer: str, i: int) -> torch.Tensor:
    attn = m.layers[i].self_attn
    if buffer == "_context_kv_weight":
        return attn.fused_qkv_a_proj.weight[CFG.q_lora_rank:]
    if buffer == "_context_kv_norm_weights":
        return attn.kv_a_layernorm.weight
    return absorbed_from_scratch(attn.kv_b_proj.weight)[ABSORBED.index(buffer)]


# ---- the differential oracle -----------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs-captured"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_warm_reload_equals_cold_load(model, ckpts, strategy, graphs):
    kw = STRATEGIES[strategy]
    target = ckpts["b1"] if "subset" in kw else ckpts["b"]
    cold_target = cold_load(FAMILY, CFG, target)
    x = FAMILY.example_inputs(CFG, 5, "cpu")
    for name in SLICE_ELEMENTS:  # not vacuous
        assert not bit_equal(getattr(model, name), getattr(cold_target, name)), name
    assert not bit_equal(outputs(FAMILY, model, x)[2], outputs(FAMILY, cold_target, x)[2])
    if graphs:
        model.capture_graphs()
    before = {n: StorageIdentity.of(t) for n, t in derived(model).items()}
    reload(model, target, **kw)
    report = model.refresh_derived_buffers()
    assert model.lifecycle.state is (S.GRAPH_CAPTURED if graphs else S.DERIVED_REFRESHED)
    for name in SLICE_ELEMENTS:
        assert report[name].mode == "in_place"
        assert report[name].slices_written == (1 if "subset" in kw else L)
    assert {n: StorageIdentity.of(t) for n, t in derived(model).items()} == before
    assert_same_model(FAMILY, model, cold_target, CFG)


@pytest.mark.parametrize("which", ["cold", "warm"])
def test_absorbed_attention_matches_kv_b_proj_reference(model, ckpts, which):
    if which == "warm":
        reload(model, ckpts["b"], bucket_by=2, shuffle=True)
        model.refresh_derived_buffers()
    x = FAMILY.example_inputs(CFG, 3, "cpu")
    fused, ref = outputs(FAMILY, model, x), outputs(FAMILY, model, x, FAMILY.reference)
    assert fused[0].shape == (L, 6, LKV) and fused[1].shape == (L, 6, R) and fused[2].shape == (4, CFG.hidden_size)
    for f, r in zip(fused, ref, strict=True):
        torch.testing.assert_close(f, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("buffer", list(SLICE_ELEMENTS))
def test_every_derived_buffer_is_read_by_the_fused_path(model, buffer):
    """Corrupt layer 1's slice of one buffer: the fused path leaves the reference (so the agreement above is
    evidence the buffers are current, not a coincidence)."""
    x = FAMILY.example_inputs(CFG, 3, "cpu")
    with torch.no_grad():
        slice_of(model, buffer, 1).add_(0.5)
    (kv_c, k_pe, h), (kv_c_ref, k_pe_ref, h_ref) = outputs(FAMILY, model, x), outputs(FAMILY, model, x,
                                                                                     FAMILY.reference)
    assert not torch.allclose(h, h_ref, atol=1e-4)
    latents_same = [torch.allclose(kv_c[i], kv_c_ref[i], atol=1e-5) and torch.allclose(k_pe[i], k_pe_ref[i],
                                                                                          atol=1e-5)
                    for i in range(L)]
    # the absorbed matrices act inside attention only; the context buffers change layer 1's latents only
    assert latents_same == ([True] * L if buffer in ABSORBED else [True, False, True])


# ---- the absorbed matrices -----------------------------------------------------------------------------------


def test_absorbed_matrices_equal_a_fresh_computation_after_reload(model, ckpts):
    model.capture_graphs()
    reload(model, ckpts["b"], bucket_by=1, shuffle=True, seed=4)
    model.refresh_derived_buffers()
    b = FAMILY.random_weights(CFG, 1)
    c = torch.randn(7, LKV)
    for i, layer in enumerate(model.layers):
        w = b[f"layers.{i}.self_attn.kv_b_proj.weight"]
        assert torch.equal(layer.self_attn.kv_b_proj.weight, w)
        W_UK_T, W_UV = absorbed_from_scratch(w)
        assert torch.equal(model._W_UK_T[i], W_UK_T) and torch.equal(model._W_UV[i], W_UV)
        # and what they mean: kv_b_proj(c) per head is [W_UK_T c | c W_UV]
        kv = (c @ w.T).view(7, N, P + V)
        torch.testing.assert_close(torch.einsum("npl,sl->snp", model._W_UK_T[i], c), kv[..., :P])
        torch.testing.assert_close(torch.einsum("sl,nlv->snv", c, model._W_UV[i]), kv[..., P:])


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs-captured"])
def test_in_place_refresh_of_the_absorbed_matrices_allocates_nothing_buffer_sized(model, ckpts, graphs):
    if graphs:
        model.capture_graphs()
    reload(model, ckpts["b"], bucket_by=3, shuffle=True)
    with count_allocations() as log:
        report = model.refresh_derived_buffers()
    for name in ABSORBED:
        rep = report[name]
        assert (rep.kind, rep.mode, rep.slices_written) == ("stack", "in_place", L)
        assert rep.elements_written == L * SLICE_ELEMENTS[name]
    assert report.bytes_allocated == 0
    smallest_slice = min(SLICE_ELEMENTS.values()) * 4
    assert log.at_least(smallest_slice) == [], log.records


def test_one_layer_kv_b_proj_reload_computes_only_that_layer(model, ckpts, monkeypatch):
    """The absorbed slices are computed lazily: a reload of layer 2's kv_b_proj evaluates layer 2 only (once to
    validate, once to write) and rewrites one slice of each; the other buffers are skipped."""
    calls: Counter[tuple[str, int]] = Counter()
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for fn in ("absorbed_W_UK_T", "absorbed_W_UV"):
            original = getattr(attn, fn)
            monkeypatch.setattr(attn, fn, lambda original=original, fn=fn, i=i: (calls.update([(fn, i)]),
                                                                                 original())[1])
    with torch.no_grad():
        for name in ABSORBED:
            getattr(model, name).fill_(SENTINEL)
    model.begin_reload()
    load_safetensors(model, ckpts["b"], subset=["layers.2.self_attn.kv_b_proj.weight"])
    model.lifecycle.weights_unchanged([n for n in model.lifecycle.specs  # the rest of layer 2: restored unchanged
                                       if n.startswith("layers.2.") and not n.endswith("kv_b_proj.weight")])
    model.finalize_loading(keep_untouched=True)
    report = model.refresh_derived_buffers()
    assert calls == Counter({("absorbed_W_UK_T", 2): 2, ("absorbed_W_UV", 2): 2})
    for name in ABSORBED:
        rep = report[name]
        assert (rep.mode, rep.slices_written, rep.elements_written) == ("in_place", 1, SLICE_ELEMENTS[name])
        for i in range(L):
            if i == 2:
                assert torch.equal(getattr(model, name)[i], expected_slice(model, name, i))
            else:
                assert bool((getattr(model, name)[i] == SENTINEL).all()), f"{name}: slice {i} was written"
    assert report["_context_kv_weight"].mode == report["_context_kv_norm_weights"].mode == "skipped"


@pytest.mark.parametrize("layer", range(L))
def test_one_layer_reload_rewrites_one_slice_of_each_buffer(model, tmp_path, layer):
    target = partial_checkpoint(FAMILY, CFG, tmp_path / "b_one.safetensors", layer=layer)
    with torch.no_grad():
        for name in SLICE_ELEMENTS:
            getattr(model, name).fill_(SENTINEL)
    reload(model, target, subset=lambda n: n.startswith(f"layers.{layer}."), bucket_by=2, shuffle=True)
    report = model.refresh_derived_buffers()
    for name, elements in SLICE_ELEMENTS.items():
        rep = report[name]
        assert (rep.mode, rep.slices_written, rep.slices_total, rep.elements_written) == ("in_place", 1, L, elements)
        for i in range(L):
            if i == layer:
                assert torch.equal(slice_of(model, name, i), expected_slice(model, name, i))
            else:
                assert bool((slice_of(model, name, i) == SENTINEL).all()), f"{name}: slice {i} was written"
    assert report.elements_written == sum(SLICE_ELEMENTS.values())


# ---- guards ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("held_back", ["layers.2.self_attn.kv_b_proj.weight",
                                       "layers.2.self_attn.fused_qkv_a_proj.weight"])
def test_refresh_before_the_last_layer_is_refused_and_writes_nothing(model, ckpts, held_back):
    snap = snapshot(model)
    model.capture_graphs()
    model.begin_reload()
    load_safetensors(model, ckpts["b"], bucket_by=1, shuffle=True, subset=lambda n: n != held_back)
    with capture_logs() as logs, pytest.raises(LayersNotReadyError) as ei:
        model.refresh_derived_buffers()
    assert ei.value.missing == {"layers.2": (held_back,)}
    assert model.lifecycle.state is S.PARTIALLY_LOADED
    assert_unchanged(model, snap)  # the absorbed slices of layers 0 and 1 (ready, dirty) were not computed in
    assert [e["error"] for e in logs if e["event"] == "refused"] == ["LayersNotReadyError"]
    load_safetensors(model, ckpts["b"], subset=[held_back])
    model.finalize_loading()
    model.refresh_derived_buffers()
    for name in SLICE_ELEMENTS:
        for i in range(L):
            assert torch.equal(slice_of(model, name, i), expected_slice(model, name, i)), (name, i)


def test_cold_refresh_before_the_last_layer_builds_nothing(ckpts):
    m = K3DSparkDraft(CFG)
    load_safetensors(m, ckpts["a"], subset=lambda n: n != "layers.1.self_attn.kv_b_proj.weight")
    with pytest.raises(LayersNotReadyError) as ei:
        m.refresh_derived_buffers()
    assert ei.value.missing == {"layers.1": ("layers.1.self_attn.kv_b_proj.weight",)}
    assert all(m._buffers[n] is None for n in m.derived_buffer_names())


def test_reload_changing_an_absorbed_shape_is_refused_and_keeps_old_values(model, ckpts):
    """A kv_b_proj with a larger v_head_dim would need a new `_W_UV`: refused before anything is written, though
    `_W_UK_T` (same shape, dirty) and the context buffers were valid."""
    snap = snapshot(model)
    reload(model, ckpts["b"])
    v2 = V + 4
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        attn.kv_b_proj._parameters["weight"] = nn.Parameter(torch.randn(N * (P + v2), LKV), requires_grad=False)
        attn.v_head_dim = v2
        model.lifecycle.specs[f"layers.{i}.self_attn.kv_b_proj.weight"] = TensorSpec((N * (P + v2), LKV),
                                                                                      torch.float32)
    with pytest.raises(StorageReallocationError) as ei:
        model.refresh_derived_buffers()
    (problem,) = ei.value.problems
    assert problem.startswith("_W_UV:")
    assert f"({L}, {N}, {LKV}, {v2})" in problem and f"shape ({L}, {N}, {LKV}, {V})" in problem
    assert model.lifecycle.state is S.FULLY_LOADED
    assert_unchanged(model, snap)


# ---- hooks ------------------------------------------------------------------------------------------------------


def test_cold_only_hooks_do_not_run_on_reload(model, ckpts):
    assert [h.name for h in model.post_load_hooks(Phase.COLD_LOAD)] == ["init_rope_caches"]
    assert model.post_load_hooks(Phase.RELOAD) == []
    tables = [layer.self_attn.rotary_emb.cos_sin_cache for layer in model.layers]
    assert tables[0].dtype == torch.float32 and tables[0].shape == (CFG.max_position_embeddings, R)
    model.capture_graphs()
    model.begin_reload()
    load_safetensors(model, ckpts["b"], bucket_by=4, shuffle=True)
    with capture_logs() as logs:
        assert model.finalize_loading() == []
    assert not [e for e in logs if e["event"] == "hook_run"]
    model.refresh_derived_buffers()
    assert all(layer.self_attn.rotary_emb.cos_sin_cache is t for layer, t in zip(model.layers, tables, strict=True))
    assert model._rope_cos_sin_cache is tables[0]
    assert model.lifecycle.verify_pinned() == len(model.lifecycle.pinned.identities)
