"""The differential oracle: a warm in-place reload A -> B must be indistinguishable from a cold load of B.

Bit for bit: every derived buffer, every parameter and buffer, and the fused path's outputs. Also: the fused
path agrees with the per-layer reference path, and a reload under captured graphs moves no storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_helpers import bit_equal, derived, everything

from lifecycle import LifecycleState
from lifecycle.loading import load_safetensors, write_checkpoint
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

S = LifecycleState

# how the warm reload delivers B; "partial-layer-1" reloads only layers.1 into B' = A with layers.1 from B
STRATEGIES = {
    "layer-buckets-file-order": {"bucket_by": "layer"},
    "shuffled-buckets-of-3": {"bucket_by": 3, "shuffle": True, "seed": 1},
    "one-at-a-time-shuffled-duplicates": {"bucket_by": 1, "shuffle": True, "seed": 2, "duplicates": 5},
    "partial-layer-1": {"subset": lambda n: n.startswith("layers.1."), "bucket_by": 1, "shuffle": True, "seed": 3},
}


# ---- helpers ----------------------------------------------------------------------------------------------------


def cold_load(cfg: DFlashConfig, path: Path) -> DFlashQwen3Draft:
    model = DFlashQwen3Draft(cfg)
    load_safetensors(model, path)
    model.finalize_loading()
    model.refresh_derived_buffers()
    assert model.lifecycle.state is S.DERIVED_REFRESHED
    return model


def inputs(cfg: DFlashConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_ctx, n_q = 7, 4
    return {
        "context_states": torch.randn(n_ctx, cfg.hidden_size, generator=g),
        "context_positions": torch.arange(3, 3 + n_ctx),
        "input_embeds": torch.randn(n_q, cfg.hidden_size, generator=g),
        "positions": torch.arange(3 + n_ctx, 3 + n_ctx + n_q),
    }


def outputs(model: DFlashQwen3Draft, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        k, v = model.precompute_context_kv(x["context_states"], x["context_positions"])
        h = model(x["input_embeds"], x["positions"], x["context_states"], x["context_positions"])
    return {"k": k, "v": v, "forward": h}


def assert_same_model(warm: DFlashQwen3Draft, cold: DFlashQwen3Draft, cfg: DFlashConfig) -> None:
    w, c = everything(warm), everything(cold)
    assert w.keys() == c.keys()
    for name in c:
        assert bit_equal(w[name], c[name]), f"{name}: warm reload differs from a cold load"
    x = inputs(cfg)
    wo, co = outputs(warm, x), outputs(cold, x)
    for name in co:
        assert bit_equal(wo[name], co[name]), f"output {name}: warm reload differs from a cold load"


def partial_checkpoint(cfg: DFlashConfig, path: Path) -> Path:
    """B' = A with only layers.1 replaced by B's tensors."""
    a, b = random_weights(cfg, 0), random_weights(cfg, 1)
    mixed = {n: (b[n] if n.startswith("layers.1.") else t) for n, t in a.items()}
    return write_checkpoint(mixed, path)


# ---- the oracle ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs-captured"])
@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=list(STRATEGIES))
def test_warm_reload_equals_cold_load(tiny_cfg, loaded, ckpt_a, ckpt_b, tmp_path, strategy, graphs):
    kw = dict(STRATEGIES[strategy])
    partial = "subset" in kw
    target = partial_checkpoint(tiny_cfg, tmp_path / "b_prime.safetensors") if partial else ckpt_b
    cold_a = cold_load(tiny_cfg, ckpt_a)
    cold_target = cold_load(tiny_cfg, target)
    # the comparison is not vacuous: A and the target differ in what the oracle looks at
    x = inputs(tiny_cfg)
    assert not bit_equal(outputs(cold_a, x)["forward"], outputs(cold_target, x)["forward"])
    assert not bit_equal(cold_a._fused_kv_weight, cold_target._fused_kv_weight)

    if graphs:
        loaded.capture_graphs()
    loaded.begin_reload()
    load_safetensors(loaded, target, **kw)
    loaded.finalize_loading(keep_untouched=partial)
    report = loaded.refresh_derived_buffers()
    assert loaded.lifecycle.state is (S.GRAPH_CAPTURED if graphs else S.DERIVED_REFRESHED)
    L = tiny_cfg.num_hidden_layers
    fused = report["_fused_kv_weight"]
    assert fused.mode == "in_place"
    assert (fused.slices_written, fused.slices_total) == ((1, L) if partial else (L, L))
    assert_same_model(loaded, cold_target, tiny_cfg)


def test_chained_reloads_track_cold_loads(tiny_cfg, loaded, ckpt_a, ckpt_b):
    """A -> B -> A -> B, each step equal to a cold load of what was loaded last."""
    cold = {"a": cold_load(tiny_cfg, ckpt_a), "b": cold_load(tiny_cfg, ckpt_b)}
    loaded.capture_graphs()
    for step, (key, path) in enumerate([("b", ckpt_b), ("a", ckpt_a), ("b", ckpt_b)]):
        loaded.begin_reload()
        load_safetensors(loaded, path, bucket_by=2, shuffle=True, seed=step)
        loaded.finalize_loading()
        loaded.refresh_derived_buffers()
        assert_same_model(loaded, cold[key], tiny_cfg)


# ---- fused path vs per-layer reference ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["cold", "warm"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_path_matches_reference_path(tiny_cfg, loaded, ckpt_b, which, seed):
    if which == "warm":
        loaded.begin_reload()
        load_safetensors(loaded, ckpt_b, bucket_by=3, shuffle=True)
        loaded.finalize_loading()
        loaded.refresh_derived_buffers()
    x = inputs(tiny_cfg, seed)
    with torch.no_grad():
        k, v = loaded.precompute_context_kv(x["context_states"], x["context_positions"])
        k_ref, v_ref = loaded.precompute_context_kv_reference(x["context_states"], x["context_positions"])
    L, n = tiny_cfg.num_hidden_layers, x["context_states"].shape[0]
    assert k.shape == k_ref.shape == (L, n, tiny_cfg.num_key_value_heads, tiny_cfg.head_dim)
    assert v.shape == v_ref.shape
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=0)


def test_reference_path_sees_stale_fused_buffer(tiny_cfg, loaded):
    """The fused-vs-reference comparison can fail: corrupt one layer's slice of the fused buffer and it does."""
    x = inputs(tiny_cfg)
    rows = 2 * tiny_cfg.num_key_value_heads * tiny_cfg.head_dim
    with torch.no_grad():
        loaded._fused_kv_weight[rows:2 * rows].mul_(1.5)  # layer 1's slice, in place
        k, v = loaded.precompute_context_kv(x["context_states"], x["context_positions"])
        k_ref, v_ref = loaded.precompute_context_kv_reference(x["context_states"], x["context_positions"])
    assert torch.allclose(k[0], k_ref[0], atol=1e-5, rtol=0) and torch.allclose(v[2], v_ref[2], atol=1e-5, rtol=0)
    assert not torch.allclose(v[1], v_ref[1], atol=1e-5, rtol=0)


# ---- storage stays put under captured graphs ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(STRATEGIES), ids=list(STRATEGIES))
def test_reload_under_captured_graphs_keeps_every_data_ptr(tiny_cfg, loaded, ckpt_b, tmp_path, strategy):
    kw = dict(STRATEGIES[strategy])
    partial = "subset" in kw
    target = partial_checkpoint(tiny_cfg, tmp_path / "b_prime.safetensors") if partial else ckpt_b
    pinned = loaded.capture_graphs()
    assert loaded.lifecycle.state is S.GRAPH_CAPTURED
    params = {n: p.data_ptr() for n, p in loaded.named_parameters(remove_duplicate=False)}
    buffers = {n: t.data_ptr() for n, t in loaded.named_buffers(remove_duplicate=False)}
    bufs = {n: t.data_ptr() for n, t in derived(loaded).items()}
    pinned_names = set(loaded.lifecycle.pinned.identities)
    assert len(pinned_names) == pinned
    assert pinned_names >= set(bufs) | set(dict(loaded.named_parameters()))
    before = {n: t.clone() for n, t in everything(loaded).items()}

    loaded.begin_reload()
    load_safetensors(loaded, target, **kw)
    loaded.finalize_loading(keep_untouched=partial)
    loaded.refresh_derived_buffers()

    assert loaded.lifecycle.state is S.GRAPH_CAPTURED
    assert loaded.lifecycle.verify_pinned() == pinned
    assert {n: p.data_ptr() for n, p in loaded.named_parameters(remove_duplicate=False)} == params
    assert {n: t.data_ptr() for n, t in loaded.named_buffers(remove_duplicate=False)} == buffers
    assert {n: t.data_ptr() for n, t in derived(loaded).items()} == bufs
    # and the values did change where B differs (the reload was not a no-op)
    assert not torch.equal(loaded._fused_kv_weight, before["_fused_kv_weight"])
    assert not torch.equal(loaded.layers[1].self_attn.qkv_proj.weight, before["layers.1.self_attn.qkv_proj.weight"])
