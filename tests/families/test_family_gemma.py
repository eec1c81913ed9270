"""What is specific to Gemma4 DSpark: the K = V context path over one fused K weight, the constant v-norm weights
(a derived buffer with no sources: built once, never rewritten or reallocated), and the `normalizer` buffer made
by a cold_load hook. (The oracle, the refusals of another layout, among them more KV heads, and the allocation
checks run for every family in `test_oracle.py` and `test_families.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lifecycle import LifecycleState, StorageDriftError, StorageIdentity
from lifecycle.loading import load_safetensors
from models.gemma_dspark import GemmaDSparkConfig, GemmaDSparkDraft
from models.layers import rms_norm
from support.family_helpers import Fam, L, reload

S = LifecycleState
CFG = GemmaDSparkConfig(num_hidden_layers=L)
HD = CFG.head_dim


@pytest.fixture
def fam(tmp_path: Path) -> Fam:
    return Fam.make("gemma-dspark", tmp_path)


@pytest.fixture
def model(fam: Fam) -> GemmaDSparkDraft:
    return fam.cold("a")


# ---- K = V over one fused K weight -------------------------------------------------------------------------------


def test_checkpoint_layout_is_k_eq_v_with_vllm_names(model: GemmaDSparkDraft) -> None:
    names = set(model.lifecycle.specs)
    assert {"layers.0.self_attn.k_proj.weight", "layers.0.self_attn.k_norm.weight", "layers.0.layer_scalar",
            "layers.0.pre_feedforward_layernorm.weight", "embed_tokens.weight", "markov_head.markov_w1.weight",
            "confidence_head.proj.bias"} <= names
    assert not any("v_proj" in n or "v_norm" in n for n in names)  # one projection; v_norm has no weight
    assert "normalizer" not in names and "normalizer" in dict(model.named_buffers())  # non-persistent


def test_fused_k_weight_and_context_v_come_from_the_same_projection(model: GemmaDSparkDraft) -> None:
    kw = [layer.self_attn.k_proj.weight for layer in model.layers]
    assert torch.equal(model._fused_k_weight, torch.cat(kw))
    assert model._fused_k_weight.shape == (L * CFG.num_key_value_heads * HD, CFG.hidden_size)
    assert torch.equal(model._k_norm_weights, torch.stack([layer.self_attn.k_norm.weight for layer in model.layers]))
    ctx, pos = torch.randn(5, CFG.hidden_size), torch.arange(5)
    k, v = model.precompute_context_kv(ctx, pos)
    x = rms_norm(ctx, model.hidden_norm.weight, CFG.rms_norm_eps)
    for i, w in enumerate(kw):
        raw = F.linear(x, w).view(5, CFG.num_key_value_heads, HD)
        torch.testing.assert_close(v[i], rms_norm(raw, None, CFG.rms_norm_eps), atol=1e-6, rtol=0)  # V = v_norm(K)
    assert not torch.allclose(k, v)  # K is k-normed and rotated besides


# ---- the constant v-norm weights ----------------------------------------------------------------------------


def test_v_norm_weights_are_a_constant_built_once(fam: Fam, model: GemmaDSparkDraft) -> None:
    const = model._v_norm_weights
    assert torch.equal(const, torch.ones(L, HD)) and const.dtype == model._k_norm_weights.dtype
    ident = StorageIdentity.of(const)
    with torch.no_grad():
        const.fill_(-3.0)  # a sentinel: any rewrite (vLLM rebuilds it with torch.ones per load) would erase it
    steps = [
        ("full reload", {}, {}),
        ("one layer", {"subset": lambda n: n.startswith("layers.1.")}, {}),
        ("confidence head only", {"subset": lambda n: n.startswith("confidence_head.")}, {}),
        ("full=True", {}, {"full": True}),
    ]
    model.capture_graphs()
    for _, load_kw, refresh_kw in steps:
        reload(model, fam.ckpt["b"], bucket_by=1, shuffle=True, **load_kw)
        report = model.refresh_derived_buffers(**refresh_kw)
        rep = report["_v_norm_weights"]
        assert (rep.mode, rep.elements_written, rep.data_ptr) == ("skipped", 0, ident.data_ptr)
        assert model._v_norm_weights is const and StorageIdentity.of(const) == ident
        assert bool((const == -3.0).all())
    assert model.lifecycle.state is S.GRAPH_CAPTURED
    model.release_graphs()
    reload(model, fam.ckpt["a"])
    report = model.refresh_derived_buffers(rebuild=True)  # everything else gets new storage; same layout: kept
    assert report["_fused_k_weight"].mode == "cold" and report["_v_norm_weights"].mode == "skipped"
    assert model._v_norm_weights is const and bool((const == -3.0).all())


# ---- the normalizer -----------------------------------------------------------------------------------------


def test_normalizer_is_made_once_by_a_cold_hook_and_read_by_the_embedding(fam: Fam) -> None:
    m = GemmaDSparkDraft(CFG)
    assert m.normalizer.is_meta
    load_safetensors(m, fam.ckpt["a"])
    assert m.normalizer.is_meta  # not a checkpoint tensor: the loader never touches it
    assert m.finalize_loading() == ["init_rope_caches", "init_normalizer"]
    assert m.normalizer.item() == pytest.approx(CFG.hidden_size**0.5) and m.normalizer.dtype == CFG.dtype
    m.refresh_derived_buffers()
    ids = torch.tensor([3, 0, 95])
    assert torch.equal(m.embed_input_ids(ids), m.embed_tokens.weight[ids] * m.normalizer)
    normalizer = m.normalizer
    ptr = normalizer.data_ptr()
    m.capture_graphs()
    assert "normalizer" in m.lifecycle.pinned.identities  # captured graphs read it
    for which in ("b", "a"):
        assert reload(m, fam.ckpt[which]) == []  # neither cold hook replays
        m.refresh_derived_buffers()
        assert m.normalizer is normalizer and normalizer.data_ptr() == ptr
    assert m.lifecycle.state is S.GRAPH_CAPTURED


def test_replaying_the_normalizer_hook_under_captured_graphs_is_refused(fam: Fam, model: GemmaDSparkDraft) -> None:
    """Why init_normalizer is cold_load only: replayed, it gives the buffer new storage under captured graphs."""
    model.capture_graphs()
    old = model.normalizer.data_ptr()
    reload(model, fam.ckpt["b"])
    model.init_normalizer()  # what a phase-less hook system would do on every load
    with pytest.raises(StorageDriftError, match="normalizer: data_ptr") as ei:
        model.refresh_derived_buffers()
    assert hex(old) in str(ei.value)
    assert model.lifecycle.state is S.FINALIZED
