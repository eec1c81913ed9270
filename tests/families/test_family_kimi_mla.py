"""Kimi-K3 MLA DSpark (`models/kimi_k3_mla_dspark.py`): what is specific to it.

Its derived state includes a computation, not only copies: the absorbed `W_UK_T` / `W_UV` of every layer,
computed from `kv_b_proj.weight` (`stack(..., computed=True)`), next to the concatenated context-latent
projection, the stacked `kv_a_layernorm` weights and the RoPE alias. The fused path (absorbed multi-query
attention over the latent cache) must agree with the per-layer path that expands K/V with `kv_b_proj` (checked for
every family in `test_families.py`, with the oracle and the refusals in `test_oracle.py` and there).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from lifecycle import LifecycleState, Phase, StorageReallocationError
from lifecycle.loading import load_safetensors
from lifecycle.types import TensorSpec
from models.kimi_k3_mla_dspark import K3DSparkConfig, K3DSparkDraft
from support.family_helpers import Fam, L, assert_unchanged, reload, snapshot

S = LifecycleState
CFG = K3DSparkConfig(num_hidden_layers=L)
N = CFG.num_attention_heads
P, R, V, LKV = CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim, CFG.kv_lora_rank
ABSORBED = ("_W_UK_T", "_W_UV")
SENTINEL = 1234.5


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Fam:
    return Fam.make("kimi-k3-mla", tmp_path_factory.mktemp("k3"))


@pytest.fixture
def model(fam: Fam) -> K3DSparkDraft:
    return fam.cold("a")


def absorbed_from_scratch(kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK_T [N, P, Lkv] and W_UV [N, Lkv, V] written out from the definition kv_b_proj(c) = [k_nope | v] per
    head, independently of the model's helpers: k_nope[n] = W_UK_T[n] @ c and v[n] = c @ W_UV[n]."""
    per_head = kv_b_weight.view(N, P + V, LKV)  # rows of head n: [P nope rows | V value rows]
    return per_head[:, :P, :].clone(), per_head[:, P:, :].transpose(1, 2).clone()


def test_the_latent_cache_is_one_normed_latent_and_one_rope_key_per_token(fam: Fam, model: K3DSparkDraft) -> None:
    kv_c, k_pe, h = fam.outputs(model, seed=3)
    assert kv_c.shape == (L, 6, LKV) and k_pe.shape == (L, 6, R) and h.shape == (4, CFG.hidden_size)


# ---- the absorbed matrices -----------------------------------------------------------------------------------


def test_absorbed_matrices_equal_a_fresh_computation_after_reload(fam: Fam, model: K3DSparkDraft) -> None:
    model.capture_graphs()
    reload(model, fam.ckpt["b"], bucket_by=1, shuffle=True, seed=4)
    model.refresh_derived_buffers()
    b = fam.weights["b"]
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


def test_one_layer_kv_b_proj_reload_computes_only_that_layer(fam: Fam, model: K3DSparkDraft,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
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
    load_safetensors(model, fam.ckpt["b"], subset=["layers.2.self_attn.kv_b_proj.weight"])
    model.lifecycle.weights_unchanged([n for n in model.lifecycle.specs  # the rest of layer 2: restored unchanged
                                       if n.startswith("layers.2.") and not n.endswith("kv_b_proj.weight")])
    model.finalize_loading(keep_untouched=True)
    report = model.refresh_derived_buffers()
    assert calls == Counter({("absorbed_W_UK_T", 2): 2, ("absorbed_W_UV", 2): 2})
    for name in ABSORBED:
        rep = report[name]
        assert (rep.mode, rep.slices_written, rep.elements_written) == ("in_place", 1, N * P * LKV)
        for i in range(L):
            if i == 2:
                fresh = absorbed_from_scratch(model.layers[i].self_attn.kv_b_proj.weight)[ABSORBED.index(name)]
                assert torch.equal(getattr(model, name)[i], fresh)
            else:
                assert bool((getattr(model, name)[i] == SENTINEL).all()), f"{name}: slice {i} was written"
    assert report["_context_kv_weight"].mode == report["_context_kv_norm_weights"].mode == "skipped"


# ---- guards ----------------------------------------------------------------------------------------------------


def test_reload_changing_an_absorbed_shape_is_refused_and_keeps_old_values(fam: Fam, model: K3DSparkDraft) -> None:
    """A kv_b_proj with a larger v_head_dim would need a new `_W_UV`: refused before anything is written, though
    `_W_UK_T` (same shape, dirty) and the context buffers were valid."""
    snap = snapshot(model)
    reload(model, fam.ckpt["b"])
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
    assert model.lifecycle.state is S.FINALIZED
    assert_unchanged(model, snap)


# ---- the RoPE tables ----------------------------------------------------------------------------------------


def test_rope_tables_are_fp32_over_the_rope_dims_and_made_once(fam: Fam, model: K3DSparkDraft) -> None:
    """One cold-only hook and no reload hook; the GPT-J-style tables cover `qk_rope_head_dim` in float32 and are
    the same objects after a reload under captured graphs (the alias included)."""
    assert [h.name for h in model.post_load_hooks(Phase.COLD_LOAD)] == ["init_rope_caches"]
    assert model.post_load_hooks(Phase.RELOAD) == []
    tables = [layer.self_attn.rotary_emb.cos_sin_cache for layer in model.layers]
    assert not model.layers[0].self_attn.rotary_emb.is_neox_style
    assert tables[0].dtype == torch.float32 and tables[0].shape == (CFG.max_position_embeddings, R)
    model.capture_graphs()
    assert reload(model, fam.ckpt["b"], bucket_by=4, shuffle=True) == []
    model.refresh_derived_buffers()
    assert all(layer.self_attn.rotary_emb.cos_sin_cache is t for layer, t in zip(model.layers, tables, strict=True))
    assert model._rope_cos_sin_cache is tables[0]
    assert model.lifecycle.verify_pinned() == len(model.lifecycle.pinned.identities)
