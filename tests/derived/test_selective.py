"""Selective refresh: a reload that wrote k of L layers rewrites exactly those k slices of the concat/stack
buffers, in place; the other slices are not touched (their bytes stay, whatever they hold)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lifecycle import LayersNotReadyError, LifecycleState, testing
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.types import RefreshReport
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

S = LifecycleState
CFG = DFlashConfig(num_hidden_layers=5)
L = CFG.num_hidden_layers
KV_ROWS = 2 * CFG.num_key_value_heads * CFG.head_dim  # rows of one layer's slice of the fused KV weight
KV_SLICE = KV_ROWS * CFG.hidden_size  # elements of one layer's slice
KNORM_SLICE = CFG.head_dim
SLICED = ("_fused_kv_weight", "_k_norm_weights")
SENTINEL = 1234.5  # a value no source holds: where it survives a refresh, that slice was not written


@pytest.fixture
def weights() -> dict[str, dict[str, torch.Tensor]]:
    return {"a": random_weights(CFG, 0), "b": random_weights(CFG, 1)}


@pytest.fixture
def ckpt(weights, tmp_path) -> dict[str, Path]:
    return {k: write_checkpoint(w, tmp_path / f"{k}.safetensors") for k, w in weights.items()}


@pytest.fixture
def model(ckpt) -> DFlashQwen3Draft:
    return testing.cold_load(DFlashQwen3Draft(CFG), ckpt["a"])


def layer_slice(model: DFlashQwen3Draft, buffer: str, i: int) -> torch.Tensor:
    t = getattr(model, buffer)
    return t[i * KV_ROWS:(i + 1) * KV_ROWS] if buffer == "_fused_kv_weight" else t[i]


def expected_slice(weights: dict[str, torch.Tensor], buffer: str, i: int) -> torch.Tensor:
    if buffer == "_fused_kv_weight":
        return weights[f"layers.{i}.self_attn.qkv_proj.weight"][CFG.num_attention_heads * CFG.head_dim:]
    return weights[f"layers.{i}.self_attn.k_norm.weight"]


def from_scratch(model: DFlashQwen3Draft, buffer: str) -> torch.Tensor:
    """What a full rebuild from the live sources would give."""
    attn = [layer.self_attn for layer in model.layers]
    if buffer == "_fused_kv_weight":
        return torch.cat([a.qkv_proj.weight[a.q_size:] for a in attn])
    return torch.stack([a.k_norm.weight for a in attn])


def reload(model: DFlashQwen3Draft, path: Path, subset, *, full: bool = False) -> RefreshReport:
    """A selective reload: only `subset` is written; layers that received nothing are kept unchanged."""
    lc = model.lifecycle
    wanted = subset if callable(subset) else set(subset).__contains__
    written = [n for n in lc.specs if wanted(n)]
    model.begin_reload()
    load_safetensors(model, path, subset=subset, bucket_by=1, shuffle=True, seed=0)
    # a layer that got only some of its tensors: the rest are declared restored unchanged (ready, not dirty)
    touched = {lc.readiness.layer_of_name[n] for n in written}
    lc.weights_unchanged([n for n in lc.specs if lc.readiness.layer_of_name[n] in touched and not wanted(n)])
    model.finalize_loading(keep_untouched=True)
    reload.dirty_layers = lc.readiness.dirty_layers()  # type: ignore[attr-defined]
    report = model.refresh_derived_buffers(full=full)
    assert lc.state is S.DERIVED_REFRESHED
    return report


def poison(model: DFlashQwen3Draft) -> None:
    with torch.no_grad():
        for name in SLICED:
            getattr(model, name).fill_(SENTINEL)


def pick_layers(k: int) -> list[int]:
    return sorted(random.Random(k).sample(range(L), k))


def of_layers(layers: list[int]):
    prefixes = tuple(f"layers.{i}." for i in layers)
    return lambda n: n.startswith(prefixes)


# ---- k of L layers --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", range(1, L + 1))
def test_reloading_k_layers_writes_exactly_k_slices(model, ckpt, weights, k):
    layers = pick_layers(k)
    ptrs = {name: getattr(model, name).data_ptr() for name in SLICED}
    old = {name: getattr(model, name).clone() for name in SLICED}

    report = reload(model, ckpt["b"], of_layers(layers))

    assert reload.dirty_layers == [f"layers.{i}" for i in layers]  # type: ignore[attr-defined]
    fused, knorm = report["_fused_kv_weight"], report["_k_norm_weights"]
    assert (fused.mode, knorm.mode) == ("in_place", "in_place")
    assert (fused.slices_written, fused.slices_total) == (k, L)
    assert (knorm.slices_written, knorm.slices_total) == (k, L)
    assert fused.elements_written == k * KV_SLICE
    assert knorm.elements_written == k * KNORM_SLICE
    assert report.elements_written == k * (KV_SLICE + KNORM_SLICE)
    for name in SLICED:
        assert getattr(model, name).data_ptr() == ptrs[name], f"{name} moved"
        for i in range(L):
            live = layer_slice(model, name, i)
            if i in layers:
                assert torch.equal(live, expected_slice(weights["b"], name, i)), f"{name} layer {i} not refreshed"
                assert not torch.equal(live, expected_slice(weights["a"], name, i))
            else:
                was = old[name][i * KV_ROWS:(i + 1) * KV_ROWS] if name == "_fused_kv_weight" else old[name][i]
                assert torch.equal(live.view(torch.uint8), was.view(torch.uint8)), f"{name} layer {i} changed"
        # the selective result is what a full rebuild from the live sources gives
        assert torch.equal(getattr(model, name), from_scratch(model, name))


@pytest.mark.parametrize("k", range(1, L + 1))
def test_untouched_slices_are_not_written_at_all(model, ckpt, weights, k):
    """Fill the buffers with a sentinel first: it must survive exactly in the slices of untouched layers."""
    layers = pick_layers(k)
    poison(model)
    reload(model, ckpt["b"], of_layers(layers))
    for name in SLICED:
        for i in range(L):
            live = layer_slice(model, name, i)
            if i in layers:
                assert torch.equal(live, expected_slice(weights["b"], name, i))
            else:
                assert bool((live == SENTINEL).all()), f"{name}: slice of untouched layer {i} was rewritten"


# ---- reloads that touch no source of a buffer ------------------------------------------------------------------


def test_mlp_only_reload_writes_no_fused_kv(model, ckpt, weights):
    poison(model)
    report = reload(model, ckpt["b"], lambda n: n.startswith("layers.2.mlp."))
    for name in SLICED:
        rep = report[name]
        assert rep.mode == "skipped"
        assert (rep.elements_written, rep.slices_written, rep.slices_total) == (0, 0, L)
        assert bool((getattr(model, name) == SENTINEL).all())
    assert report.elements_written == 0
    mlp = model.layers[2].mlp
    assert torch.equal(mlp.gate_up_proj.weight, weights["b"]["layers.2.mlp.gate_up_proj.weight"])
    assert torch.equal(mlp.down_proj.weight, weights["b"]["layers.2.mlp.down_proj.weight"])
    assert torch.equal(model.layers[2].self_attn.qkv_proj.weight, weights["a"]["layers.2.self_attn.qkv_proj.weight"])


def test_qkv_only_reload_writes_one_fused_slice_and_no_k_norm(model, ckpt, weights):
    poison(model)
    report = reload(model, ckpt["b"], ["layers.3.self_attn.qkv_proj.weight"])
    fused, knorm = report["_fused_kv_weight"], report["_k_norm_weights"]
    assert (fused.mode, fused.slices_written, fused.elements_written) == ("in_place", 1, KV_SLICE)
    assert (knorm.mode, knorm.elements_written) == ("skipped", 0)
    for i in range(L):
        live = layer_slice(model, "_fused_kv_weight", i)
        if i == 3:
            assert torch.equal(live, expected_slice(weights["b"], "_fused_kv_weight", 3))
        else:
            assert bool((live == SENTINEL).all())
    assert bool((model._k_norm_weights == SENTINEL).all())


def test_k_norm_only_reload_writes_one_stack_slice_and_no_fused_kv(model, ckpt, weights):
    poison(model)
    report = reload(model, ckpt["b"], ["layers.1.self_attn.k_norm.weight"])
    fused, knorm = report["_fused_kv_weight"], report["_k_norm_weights"]
    assert (knorm.mode, knorm.slices_written, knorm.elements_written) == ("in_place", 1, KNORM_SLICE)
    assert (fused.mode, fused.elements_written) == ("skipped", 0)
    assert torch.equal(model._k_norm_weights[1], weights["b"]["layers.1.self_attn.k_norm.weight"])
    assert bool((model._k_norm_weights[[0, 2, 3, 4]] == SENTINEL).all())
    assert bool((model._fused_kv_weight == SENTINEL).all())


# ---- full=True ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, L])
def test_full_refresh_rewrites_every_slice(model, ckpt, k):
    layers = pick_layers(k) if k else []
    ptrs = {name: getattr(model, name).data_ptr() for name in SLICED}
    poison(model)
    subset = of_layers(layers) if layers else (lambda n: n.startswith("layers.0.mlp."))
    report = reload(model, ckpt["b"], subset, full=True)
    fused, knorm = report["_fused_kv_weight"], report["_k_norm_weights"]
    assert (fused.mode, fused.slices_written, fused.elements_written) == ("in_place", L, L * KV_SLICE)
    assert (knorm.mode, knorm.slices_written, knorm.elements_written) == ("in_place", L, L * KNORM_SLICE)
    for name in SLICED:
        buf = getattr(model, name)
        assert buf.data_ptr() == ptrs[name]
        assert fused.elements_written + knorm.elements_written == report.elements_written
        assert not bool((buf == SENTINEL).any()), f"{name}: a slice was left unwritten by full=True"
        assert torch.equal(buf, from_scratch(model, name))


def test_partly_written_layer_is_not_silently_kept(model, ckpt):
    """keep_untouched covers layers that got nothing; a layer that got only some tensors must be declared."""
    model.begin_reload()
    load_safetensors(model, ckpt["b"], subset=lambda n: n.startswith("layers.2.mlp."))
    with pytest.raises(LayersNotReadyError) as ei:
        model.finalize_loading(keep_untouched=True)
    assert set(ei.value.missing) == {"layers.2"}
    assert "layers.2.self_attn.qkv_proj.weight" in ei.value.missing["layers.2"]
    assert model.lifecycle.state is S.PARTIALLY_LOADED


@pytest.mark.parametrize("graphs", [False, True], ids=["refreshed", "captured"])
def test_a_layer_half_written_by_an_aborted_reload_is_never_kept(model, ckpt, weights, graphs):
    """Issue 14, defect 2. A session without rollback writes one tensor of layer 0 and aborts; the next reload
    sends only layer 1 and finishes with `keep_untouched=True`. The old code declared layer 0 unchanged and
    reached a usable state with layer 0 holding one tensor of B and the rest of A. Such a layer now counts as
    touched until a complete write of it: the finish is refused, naming it, and marks nothing."""
    if graphs:
        model.capture_graphs()
    torn = "layers.0.self_attn.qkv_proj.weight"
    with model.reload_session(rollback=False) as s:
        s.apply({torn: weights["b"][torn]})
        s.abort("trainer went away")
    model.begin_reload()
    load_safetensors(model, ckpt["b"], subset=of_layers([1]))
    with pytest.raises(LayersNotReadyError, match="partly written") as ei:
        model.finalize_loading(keep_untouched=True)
    assert set(ei.value.missing) == {"layers.0"}
    assert model.lifecycle.state is S.PARTIALLY_LOADED
    with pytest.raises(LayersNotReadyError, match="partly written"):  # nor tensor by tensor
        model.weights_unchanged([n for n in model.lifecycle.specs if n.startswith("layers.0.") and n != torn])
    # a complete write of the layer ends it
    load_safetensors(model, ckpt["b"], subset=of_layers([0]))
    model.finalize_loading(keep_untouched=True)
    model.refresh_derived_buffers()
    assert model.lifecycle.usable
    for i in (0, 1):
        want = expected_slice(weights["b"], "_fused_kv_weight", i)
        assert torch.equal(layer_slice(model, "_fused_kv_weight", i), want)
    assert torch.equal(model._fused_kv_weight, from_scratch(model, "_fused_kv_weight"))


# ---- single tensors declared unchanged (issue 14, friction 4) -------------------------------------------------


@pytest.mark.parametrize("via", ["backbone", "session"])
def test_one_tensor_of_a_layer_with_the_rest_declared_unchanged(model, ckpt, weights, via):
    """Before, sending one tensor of a layer with keep_untouched raised LayersNotReadyError and the only way out
    was the lifecycle's undocumented `weights_unchanged`; the backbone and the session now offer it."""
    sent = "layers.3.self_attn.qkv_proj.weight"
    rest = [n for n in model.lifecycle.specs if n.startswith("layers.3.") and n != sent]
    poison(model)
    if via == "backbone":
        model.begin_reload()
        load_safetensors(model, ckpt["b"], subset=[sent])
        model.weights_unchanged(rest)
        model.finalize_loading(keep_untouched=True)
        report = model.refresh_derived_buffers()
    else:
        with model.reload_session(keep_untouched=True) as s:
            s.load(ckpt["b"], subset=[sent])
            s.weights_unchanged(rest)
            report = s.commit()
    fused, knorm = report["_fused_kv_weight"], report["_k_norm_weights"]
    assert (fused.mode, fused.slices_written, fused.elements_written) == ("in_place", 1, KV_SLICE)
    assert knorm.mode == "skipped"  # the k-norm of layer 3 was declared unchanged: nothing derived is dirty
    assert torch.equal(layer_slice(model, "_fused_kv_weight", 3), expected_slice(weights["b"], "_fused_kv_weight", 3))
    assert bool((model._k_norm_weights == SENTINEL).all())


def test_declaring_unchanged_is_refused_for_what_has_no_value_or_no_reload(model, ckpt):
    lc = model.lifecycle
    fresh = DFlashQwen3Draft(CFG)  # every tensor still META: nothing to keep
    with pytest.raises(LayersNotReadyError, match=r"META: nothing to keep"):
        fresh.weights_unchanged(["layers.0.self_attn.k_norm.weight"])
    assert fresh.lifecycle.state is S.META and fresh.lifecycle.readiness.layers_ready == 0
    from lifecycle import IllegalTransitionError, UnknownWeightError

    with pytest.raises(IllegalTransitionError):  # refreshed: weights may not change without begin_reload
        model.weights_unchanged(["fc.weight"])
    model.begin_reload()
    with pytest.raises(UnknownWeightError):
        model.weights_unchanged(["fc.wieght"])
    assert lc.readiness.layers_ready == 0


def test_a_rolled_back_abort_leaves_no_layer_partly_written(model, ckpt, weights):
    with model.reload_session(rollback=True) as s:
        s.apply({"layers.0.self_attn.qkv_proj.weight": weights["b"]["layers.0.self_attn.qkv_proj.weight"]})
        s.abort("trainer went away")
    assert model.lifecycle.readiness.partly_written == set()
    model.recover()
    testing.reload(model, ckpt["b"], subset=of_layers([1]))  # layer 0 was restored exactly: it may be kept
    assert torch.equal(model._fused_kv_weight, from_scratch(model, "_fused_kv_weight"))
