"""Each guard refuses with its full reason, leaves the state as it was, and writes nothing.

"Nothing written" is checked on every derived buffer: the same tensor object, the same data_ptr, and the same
bits (torch.equal against a clone taken before).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from lifecycle import DraftBackbone, concat, stack
from lifecycle.errors import (
    IllegalTransitionError,
    LayersNotReadyError,
    QuarantinedError,
    SourceLayoutError,
    StorageDriftError,
    StorageReallocationError,
)
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.readiness import layer_of
from lifecycle.states import LifecycleState
from lifecycle.testing import reload
from lifecycle.types import TensorSpec
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

S = LifecycleState
DERIVED = ("_fused_kv_weight", "_k_norm_weights", "_rope_cos_sin_cache", "_hidden_norm_weight")


# ---- helpers ---------------------------------------------------------------------------------------------------


def snapshot_derived(m: DraftBackbone) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """name -> (the buffer object, a clone of its values, its data_ptr) for every built derived buffer."""
    out = {}
    for name in m.derived_buffer_names():
        t = m._buffers.get(name)
        if t is not None:
            out[name] = (t, t.detach().clone(), t.data_ptr())
    return out


def assert_derived_unchanged(m: DraftBackbone, snap: dict[str, tuple[torch.Tensor, torch.Tensor, int]],
                             *, sources_rewritten: bool = True) -> None:
    """Same object, same data_ptr, same bits. An alias IS its source tensor, so a loader writing the source in
    place changes its values without any refresh; with `sources_rewritten` only the non-alias buffers are
    compared bit for bit (the aliases by object and address)."""
    assert snap, "nothing to compare: take the snapshot after the buffers were built"
    kinds = {spec.name: spec.kind for spec in m.derived_buffers}
    for name in m.derived_buffer_names():
        live = m._buffers.get(name)
        if name not in snap:
            assert live is None, f"{name} was built by a refused refresh"
            continue
        obj, values, ptr = snap[name]
        assert live is obj, f"{name}: re-registered"
        assert live.data_ptr() == ptr, f"{name}: data_ptr {hex(ptr)} -> {hex(live.data_ptr())}"
        if not (sources_rewritten and kinds[name] == "alias"):
            assert torch.equal(live, values), f"{name}: values written"


def expected_fused(m: DFlashQwen3Draft) -> torch.Tensor:
    return torch.cat([layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:] for layer in m.layers])


def expected_k_norms(m: DFlashQwen3Draft) -> torch.Tensor:
    return torch.stack([layer.self_attn.k_norm.weight for layer in m.layers])


def assert_derived_current(m: DFlashQwen3Draft) -> None:
    """Every derived buffer equals what a fresh build from the live weights would give."""
    assert torch.equal(m._fused_kv_weight, expected_fused(m))
    assert torch.equal(m._k_norm_weights, expected_k_norms(m))
    assert m._hidden_norm_weight is m.hidden_norm.weight
    assert m._rope_cos_sin_cache is m.layers[0].self_attn.rotary_emb.cos_sin_cache
    ctx = torch.randn(5, m.config.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(5)
    for fused, ref in zip(m.precompute_context_kv(ctx, pos), m.precompute_context_kv_reference(ctx, pos),
                          strict=True):
        torch.testing.assert_close(fused, ref)


def grouped(names: list[str], order: list[str]) -> dict[str, tuple[str, ...]]:
    """`names` grouped by layer, in the order of `order` (the lifecycle's spec order)."""
    out: dict[str, list[str]] = {}
    for n in order:
        if n in names:
            out.setdefault(layer_of(n), []).append(n)
    return {k: tuple(v) for k, v in out.items()}


def meta_param(like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(like.shape, dtype=like.dtype, device="meta"), requires_grad=False)


# ---- refresh before the last layer arrives -------------------------------------------------------------------

HELD_BACK: dict[str, Callable[[str], bool]] = {
    "last-layer": lambda n: n.startswith("layers.2."),
    "one-tensor": lambda n: n == "layers.2.self_attn.k_norm.weight",
    "scattered": lambda n: n in ("hidden_norm.weight", "layers.0.mlp.down_proj.weight",
                                 "layers.1.self_attn.q_norm.weight"),
}


@pytest.mark.parametrize("held_back", list(HELD_BACK), ids=str)
def test_cold_build_refused_until_every_layer_arrived(tiny_cfg: DFlashConfig, ckpt_a: Path, held_back: str) -> None:
    m = DFlashQwen3Draft(tiny_cfg)
    lc = m.lifecycle
    skip = HELD_BACK[held_back]
    load_safetensors(m, ckpt_a, subset=lambda n: not skip(n))
    assert lc.state is S.PARTIALLY_LOADED
    absent = [n for n in lc.specs if skip(n)]
    for action in (m.refresh_derived_buffers, m.finalize_loading):
        with pytest.raises(LayersNotReadyError) as ei:
            action()
        assert ei.value.missing == grouped(absent, list(lc.specs))
        for n in absent:
            assert n in str(ei.value)
        assert lc.state is S.PARTIALLY_LOADED
    assert all(m._buffers[name] is None for name in DERIVED)  # no buffer was built, not even the ready ones


@pytest.mark.parametrize("held_back", list(HELD_BACK), ids=str)
def test_reload_refresh_refused_until_every_layer_arrived(loaded: DFlashQwen3Draft, ckpt_b: Path,
                                                          held_back: str) -> None:
    lc = loaded.lifecycle
    snap = snapshot_derived(loaded)
    skip = HELD_BACK[held_back]
    loaded.begin_reload()
    load_safetensors(loaded, ckpt_b, bucket_by=2, shuffle=True, subset=lambda n: not skip(n))
    assert lc.state is S.PARTIALLY_LOADED
    with capture_logs() as logs, pytest.raises(LayersNotReadyError) as ei:
        loaded.refresh_derived_buffers()
    absent = [n for n in lc.specs if skip(n)]
    assert ei.value.missing == grouped(absent, list(lc.specs))
    assert lc.state is S.PARTIALLY_LOADED
    assert_derived_unchanged(loaded, snap)
    (ev,) = [e for e in logs if e["event"] == "refused"]
    assert ev["error"] == "LayersNotReadyError" and sorted(ev["missing"]) == sorted(absent)
    # the missing tensors arrive: now the refresh goes through and the buffers follow the new weights
    load_safetensors(loaded, ckpt_b, subset=skip)
    loaded.finalize_loading()
    loaded.refresh_derived_buffers()
    assert lc.state is S.DERIVED_REFRESHED
    assert_derived_current(loaded)
    for name, (obj, _, ptr) in snap.items():
        if name in ("_fused_kv_weight", "_k_norm_weights"):
            assert loaded._buffers[name] is obj and obj.data_ptr() == ptr  # refreshed in place


# ---- a tensor marked loaded but still on META --------------------------------------------------------------


def test_tensor_reported_loaded_but_still_meta_is_never_ready(tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    m = DFlashQwen3Draft(tiny_cfg)
    lc = m.lifecycle
    names = list(lc.specs)
    lc.weights_loaded(names)  # the events say everything arrived; nothing was written
    assert lc.readiness.counts_complete()
    assert lc.state is S.PARTIALLY_LOADED  # the FULLY_LOADED row's condition saw the META tensors
    with pytest.raises(LayersNotReadyError, match=r"\(META\)") as ei:
        lc.finalize_loading()
    assert ei.value.missing == {layer: tuple(f"{n} (META)" for n in ns)
                                for layer, ns in grouped(names, names).items()}
    with pytest.raises(LayersNotReadyError, match=r"\(META\)"):
        m.refresh_derived_buffers()
    assert lc.state is S.PARTIALLY_LOADED
    assert all(m._buffers[name] is None for name in DERIVED)
    # the tensors are really written now: the same epoch completes
    load_safetensors(m, ckpt_a)
    m.finalize_loading()
    m.refresh_derived_buffers()
    assert_derived_current(m)


def test_meta_placeholder_left_by_a_reload_is_never_ready(loaded: DFlashQwen3Draft) -> None:
    lc = loaded.lifecycle
    snap = snapshot_derived(loaded)
    loaded.begin_reload()
    down = loaded.layers[1].mlp.down_proj
    down._parameters["weight"] = meta_param(down.weight)
    lc.weights_loaded(list(lc.specs))
    with pytest.raises(LayersNotReadyError) as ei:
        loaded.finalize_loading()
    assert ei.value.missing == {"layers.1": ("layers.1.mlp.down_proj.weight (META)",)}
    assert lc.state is S.PARTIALLY_LOADED
    assert_derived_unchanged(loaded, snap, sources_rewritten=False)


def test_a_load_the_loader_wrote_scans_for_meta_at_the_refresh_not_before(loaded: DFlashQwen3Draft, ckpt_b: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The FULLY_LOADED condition and the finish guard trust the loader's own copies (no placeholder survives
    `write_tensor`); the refresh, which builds from the weights after other code could run, scans every live
    tensor. A report that did not come from the loader's copy scans at once, and at the finish."""
    scans = []
    real = loaded.meta_or_absent
    monkeypatch.setattr(loaded.lifecycle, "_meta_scan", lambda: scans.append(1) or real())
    loaded.begin_reload()
    load_safetensors(loaded, ckpt_b)
    assert loaded.lifecycle.state is S.FULLY_LOADED and scans == []
    loaded.finalize_loading()
    assert scans == []
    loaded.refresh_derived_buffers()
    assert len(scans) == 1
    scans.clear()
    loaded.begin_reload()
    loaded.lifecycle.weights_loaded(list(loaded.lifecycle.specs))  # reported, not written by the loader
    assert loaded.lifecycle.state is S.FULLY_LOADED and len(scans) == 1
    loaded.finalize_loading()
    assert len(scans) == 2


def test_a_tensor_put_on_meta_after_the_loaders_write_stops_the_refresh(loaded: DFlashQwen3Draft,
                                                                        ckpt_b: Path) -> None:
    """Swapped for META behind the loader's back after its write: the finish trusts the loader's copies, the
    refresh does not: it is refused naming the tensor, every derived buffer as it was; a reload of the tensor
    (from FINALIZED) makes the backbone usable again."""
    snap = snapshot_derived(loaded)
    loaded.begin_reload()
    load_safetensors(loaded, ckpt_b)
    down = loaded.layers[1].mlp.down_proj
    down._parameters["weight"] = meta_param(down.weight)  # behind the loader's back, after its write
    loaded.finalize_loading()
    with pytest.raises(LayersNotReadyError) as ei:
        loaded.refresh_derived_buffers()
    assert ei.value.missing == {"layers.1": ("layers.1.mlp.down_proj.weight (META)",)}
    assert loaded.lifecycle.state is S.FINALIZED
    assert_derived_unchanged(loaded, snap, sources_rewritten=True)
    reload(loaded, ckpt_b)
    assert not down.weight.is_meta and loaded.lifecycle.usable


def test_a_tensor_put_on_meta_between_a_reported_write_and_the_finish_stops_the_finish(
        loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    """A writer other than the loader's own copy (here: a custom `writer`) is not trusted: the finish scans."""
    from lifecycle.loading import write_tensor
    snap = snapshot_derived(loaded)
    loaded.begin_reload()
    load_safetensors(loaded, ckpt_b, writer=write_tensor)
    down = loaded.layers[1].mlp.down_proj
    down._parameters["weight"] = meta_param(down.weight)
    with pytest.raises(LayersNotReadyError) as ei:
        loaded.finalize_loading()
    assert ei.value.missing == {"layers.1": ("layers.1.mlp.down_proj.weight (META)",)}
    assert_derived_unchanged(loaded, snap, sources_rewritten=True)


def test_one_pass_meta_scan_agrees_with_resolving_each_name(loaded: DFlashQwen3Draft) -> None:
    """The readiness check's one-pass scan (`meta_or_absent`) sees what `live_tensor` sees, name by name: a META
    placeholder, a parameter deleted, a parameter re-registered as a buffer (still there)."""
    lc = loaded.lifecycle
    loaded.begin_reload()
    lc.weights_loaded(list(lc.specs))
    assert loaded.meta_or_absent() == set() and lc.missing() == {}
    down = loaded.layers[1].mlp.down_proj
    down._parameters["weight"] = meta_param(down.weight)
    norm = loaded.layers[0].input_layernorm
    del norm._parameters["weight"]  # absent
    fc = loaded.fc
    w = fc._parameters.pop("weight")
    fc._buffers["weight"] = w.detach()  # moved from the parameters to the buffers: still present
    expected = {"layers.1.mlp.down_proj.weight", "layers.0.input_layernorm.weight"}
    assert loaded.meta_or_absent() == expected
    assert expected == {n for n in lc.specs if (t := loaded.live_tensor(n)) is None or t.is_meta}
    assert lc.missing() == {"layers.1": ("layers.1.mlp.down_proj.weight (META)",),
                            "layers.0": ("layers.0.input_layernorm.weight (META)",)}
    assert lc.missing(names=sorted(expected)) == lc.missing()  # the per-name path says the same


# ---- a refresh that would reallocate ----------------------------------------------------------------------


def test_reload_changing_a_derived_shape_is_refused(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    lc = loaded.lifecycle
    snap = snapshot_derived(loaded)
    reload(loaded, ckpt_b, refresh=False)
    # the new weights give every layer a k_norm of another size (as a config change would), and the
    # backbone's declared layout follows them: the stacked buffer would need a new shape
    for i, layer in enumerate(loaded.layers):
        layer.self_attn.k_norm._parameters["weight"] = nn.Parameter(torch.ones(16), requires_grad=False)
        lc.specs[f"layers.{i}.self_attn.k_norm.weight"] = TensorSpec((16,), torch.float32)
    with capture_logs() as logs, pytest.raises(StorageReallocationError) as ei:
        loaded.refresh_derived_buffers()
    (problem,) = ei.value.problems
    assert problem.startswith("_k_norm_weights:")
    assert "(3, 16)" in problem and "shape (3, 32)" in problem  # new and old layout
    assert lc.state is S.FINALIZED
    assert_derived_unchanged(loaded, snap)  # the fused KV weight was valid and dirty, and still not written
    assert [e["error"] for e in logs if e["event"] == "refused"] == ["StorageReallocationError"]


def test_pinned_alias_whose_source_moved_is_refused(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    lc = loaded.lifecycle
    loaded.capture_graphs()
    snap = snapshot_derived(loaded)
    reload(loaded, ckpt_b, refresh=False)
    # a loader that materialises a fresh tensor instead of copying into the captured one
    original = loaded.hidden_norm.weight
    moved = nn.Parameter(original.detach().clone(), requires_grad=False)
    loaded.hidden_norm._parameters["weight"] = moved
    # the pinned parameter itself moved: refused before any write, naming old and new address
    with pytest.raises(StorageDriftError) as ei:
        loaded.refresh_derived_buffers()
    assert f"hidden_norm.weight: data_ptr {hex(original.data_ptr())} -> {hex(moved.data_ptr())}" in ei.value.problems
    assert lc.state is S.FINALIZED
    assert_derived_unchanged(loaded, snap)
    # the loader is fixed to copy in place: the refresh goes through and the pins hold
    loaded.hidden_norm._parameters["weight"] = original
    # but not as a rebuild, which would give pinned buffers new storage: refused and audited like any refusal
    # (issue 14: it was a plain ValueError, not audited)
    with capture_logs() as logs, pytest.raises(StorageReallocationError, match="release_graphs"):
        loaded.refresh_derived_buffers(rebuild=True)
    assert [(e["trigger"], e["error"]) for e in logs if e["event"] == "refused"] == [
        ("refresh_derived", "StorageReallocationError")]
    assert lc.state is S.FINALIZED
    assert_derived_unchanged(loaded, snap)
    loaded.refresh_derived_buffers()
    assert lc.state is S.GRAPH_CAPTURED
    assert_derived_current(loaded)


# ---- a source in the wrong layout --------------------------------------------------------------------------


def test_emptied_source_is_refused_and_nothing_is_written(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    lc = loaded.lifecycle
    snap = snapshot_derived(loaded)
    reload(loaded, ckpt_b, refresh=False)
    attn = loaded.layers[1].self_attn
    packed_away = attn.qkv_proj.weight
    attn.qkv_proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # vLLM's CPU repack
    with pytest.raises(SourceLayoutError) as ei:
        loaded.refresh_derived_buffers()
    (problem,) = ei.value.problems
    name = "layers.1.self_attn.qkv_proj.weight"
    assert problem.startswith(f"concat _fused_kv_weight <- {name}:")
    assert "(0,)" in problem and str(lc.specs[name].shape) in problem
    assert lc.state is S.FINALIZED
    assert_derived_unchanged(loaded, snap)  # not even _k_norm_weights, whose sources were fine
    # a refused refresh consumed nothing: once the source is back, every new weight reaches the buffers
    attn.qkv_proj.weight = packed_away
    loaded.refresh_derived_buffers()
    assert_derived_current(loaded)


# ---- a declared fallback -----------------------------------------------------------------------------------


class _ToyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.norm = nn.Parameter(torch.ones(4), requires_grad=False)


class ToyDraft(DraftBackbone):
    derived_buffers = (
        concat("_fused_proj", sources=("proj.weight",), per_layer=lambda layer: layer.proj.weight,
               fallback="per_layer_projection"),
        stack("_norms", sources=("norm",), per_layer=lambda layer: layer.norm),
    )

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ToyLayer() for _ in range(3))
        self.requires_grad_(False)
        self.init_lifecycle("toy")

    def write(self, names: list[str], value: float) -> None:
        self.lifecycle.ensure_loading_allowed()
        for n in names:
            self.get_parameter(n).fill_(value)
        self.lifecycle.weights_loaded(names)


def test_declared_fallback_disables_the_buffer_instead_of_refusing() -> None:
    m = ToyDraft()
    lc = m.lifecycle
    names = list(lc.specs)
    m.write(names, 1.0)
    m.finalize_loading()
    m.refresh_derived_buffers()
    assert m.derived_usable("_fused_proj") and m.derived_fallbacks == {}

    snap = snapshot_derived(m)
    m.begin_reload()
    m.write(names, 2.0)
    m.finalize_loading()
    kept = m.layers[1].proj.weight
    m.layers[1].proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    with capture_logs() as logs:
        report = m.refresh_derived_buffers()
    assert lc.state is S.DERIVED_REFRESHED
    assert report["_fused_proj"].mode == "fallback"
    assert "layers.1.proj.weight" in report["_fused_proj"].reason
    assert set(m.derived_fallbacks) == {"_fused_proj"}
    assert "layers.1.proj.weight" in m.derived_fallbacks["_fused_proj"]
    assert not m.derived_usable("_fused_proj")
    assert m.derived_usable("_norms")
    # the disabled buffer keeps its last values, in place; the other one was refreshed in place
    obj, values, ptr = snap["_fused_proj"]
    assert m._fused_proj is obj and m._fused_proj.data_ptr() == ptr and torch.equal(m._fused_proj, values)
    assert report["_norms"].mode == "in_place" and torch.equal(m._norms, torch.full((3, 4), 2.0))
    assert m._norms.data_ptr() == snap["_norms"][2]
    (refresh_ev,) = [e for e in logs if e["event"] == "refresh"]
    (fused_log,) = [b for b in refresh_ev["buffers"] if b["name"] == "_fused_proj"]
    assert fused_log["mode"] == "fallback" and "layers.1.proj.weight" in fused_log["reason"]

    # a selective reload restores layer 1 in the right layout: the buffer leaves fallback with EVERY slice current
    m.begin_reload()
    m.layers[1].proj.weight = kept
    m.write(["layers.1.proj.weight", "layers.1.norm"], 3.0)
    m.finalize_loading(keep_untouched=True)
    report = m.refresh_derived_buffers()
    assert m.derived_fallbacks == {} and m.derived_usable("_fused_proj")
    assert torch.equal(m._fused_proj, torch.cat([layer.proj.weight for layer in m.layers]))
    assert m._fused_proj is obj and m._fused_proj.data_ptr() == ptr
    assert report["_fused_proj"].mode == "in_place"


def test_fallback_needs_a_declaration() -> None:
    """The same emptied source without a declared fallback refuses the refresh."""

    class NoFallback(ToyDraft):
        derived_buffers = (concat("_fused_proj", sources=("proj.weight",), per_layer=lambda layer: layer.proj.weight),)

    m = NoFallback()
    m.write(list(m.lifecycle.specs), 1.0)
    m.finalize_loading()
    m.refresh_derived_buffers()
    snap = snapshot_derived(m)
    m.begin_reload()
    m.write(list(m.lifecycle.specs), 2.0)
    m.finalize_loading()
    m.layers[0].proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(SourceLayoutError, match=r"layers\.0\.proj\.weight"):
        m.refresh_derived_buffers()
    assert m.derived_fallbacks == {}
    assert_derived_unchanged(m, snap)


# ---- storage drift behind the lifecycle's back -----------------------------------------------------------------

DRIFTED: dict[str, Callable[[DFlashQwen3Draft], torch.Tensor]] = {
    "parameter": lambda m: m.layers[0].self_attn.o_proj.weight,
    "derived-buffer": lambda m: m._fused_kv_weight,
}


@pytest.mark.parametrize("what", list(DRIFTED), ids=str)
def test_storage_drift_is_detected(loaded: DFlashQwen3Draft, ckpt_b: Path, what: str) -> None:
    lc = loaded.lifecycle
    loaded.capture_graphs()
    t = DRIFTED[what](loaded)
    name = next(n for n, x in loaded.graph_visible_tensors().items() if x is t)
    old = t.data_ptr()
    t.data = t.data.clone()  # new storage under the same tensor object
    new = t.data_ptr()
    assert new != old
    snap = snapshot_derived(loaded)
    with capture_logs() as logs, pytest.raises(StorageDriftError) as ei:
        lc.verify_pinned()
    assert f"{name}: data_ptr {hex(old)} -> {hex(new)}" in ei.value.problems
    assert f"{hex(old)} -> {hex(new)}" in str(ei.value)
    assert lc.state is S.GRAPH_CAPTURED
    assert_derived_unchanged(loaded, snap, sources_rewritten=False)
    (ev,) = [e for e in logs if e["event"] == "storage_check"]
    assert ev["ok"] is False and ev["checked"] == len(lc.pinned)

    # a reload + refresh in that situation is refused BEFORE any write (fail closed), and stays pinned
    reload(loaded, ckpt_b, refresh=False)
    snap = snapshot_derived(loaded)
    with capture_logs() as logs, pytest.raises(StorageDriftError) as ei:
        loaded.refresh_derived_buffers()
    assert f"{name}: data_ptr {hex(old)} -> {hex(new)}" in ei.value.problems
    assert lc.state is S.FINALIZED and lc.graphs_pinned
    refused = [e for e in logs if e["event"] == "refused"]
    assert [(e["trigger"], e["error"]) for e in refused] == [("refresh_derived", "StorageDriftError")]
    assert_derived_unchanged(loaded, snap, sources_rewritten=False)
    with pytest.raises(IllegalTransitionError):
        loaded.release_graphs()


# ---- an alias never keeps a META placeholder ------------------------------------------------------------------


def test_alias_is_repointed_from_a_meta_placeholder_to_the_live_tensor(loaded: DFlashQwen3Draft,
                                                                       ckpt_b: Path) -> None:
    lc = loaded.lifecycle
    loaded.begin_reload()
    placeholder = meta_param(loaded.hidden_norm.weight)
    loaded.hidden_norm._parameters["weight"] = placeholder  # vLLM's layerwise reload puts META placeholders
    loaded.register_buffer("_hidden_norm_weight", placeholder, persistent=False)  # and the alias follows it
    load_safetensors(loaded, ckpt_b)  # the loader materialises a real tensor in the placeholder's place
    live = loaded.hidden_norm.weight
    assert not live.is_meta and live is not placeholder
    loaded.finalize_loading()
    report = loaded.refresh_derived_buffers()
    assert report["_hidden_norm_weight"].mode == "alias"
    assert loaded._hidden_norm_weight is live and not loaded._hidden_norm_weight.is_meta
    assert loaded._hidden_norm_weight.data_ptr() == live.data_ptr()
    assert torch.equal(loaded._hidden_norm_weight, random_weights(loaded.config, 1)["hidden_norm.weight"])
    assert lc.state is S.DERIVED_REFRESHED
    assert_derived_current(loaded)


def test_alias_source_still_meta_at_refresh_is_refused(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    lc = loaded.lifecycle
    snap = snapshot_derived(loaded)
    reload(loaded, ckpt_b, refresh=False)
    loaded.hidden_norm._parameters["weight"] = meta_param(loaded.hidden_norm.weight)
    with pytest.raises(LayersNotReadyError) as ei:
        loaded.refresh_derived_buffers()
    assert ei.value.missing == {"hidden_norm": ("hidden_norm.weight (META)",)}
    assert lc.state is S.FINALIZED
    assert_derived_unchanged(loaded, snap)
    assert not loaded._hidden_norm_weight.is_meta


def test_alias_to_an_untracked_meta_buffer_is_refused(tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    """The RoPE table is not in the checkpoint (so readiness does not track it); the alias check still sees it
    is META when the cold_load hooks were skipped, and a META source is never ready."""
    m = DFlashQwen3Draft(tiny_cfg)
    load_safetensors(m, ckpt_a)
    m.lifecycle.finalize_loading()  # the loader is done, but the phase hooks never ran
    with pytest.raises(LayersNotReadyError) as ei:
        m.refresh_derived_buffers()
    assert ei.value.missing == {"layers.0": ("layers.0.self_attn.rotary_emb.cos_sin_cache (META)",)}
    assert m.lifecycle.state is S.FINALIZED
    assert all(m._buffers[name] is None for name in DERIVED)  # transactional: the ready buffers were not built
    assert m.finalize_loading() == ["init_rope_caches"]
    m.refresh_derived_buffers()
    assert_derived_current(m)


# ---- QUARANTINED -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recovery", ["full", "selective"])
def test_quarantine_keeps_last_good_values_and_recovers(loaded: DFlashQwen3Draft, ckpt_b: Path,
                                                        recovery: str) -> None:
    lc = loaded.lifecycle
    snap = snapshot_derived(loaded)
    ctx, pos = torch.randn(4, loaded.config.hidden_size), torch.arange(4)
    loaded.begin_reload()
    load_safetensors(loaded, ckpt_b, subset=lambda n: n.startswith("layers.0."))  # layer 0 now holds B
    loaded.abort_reload("trainer died mid-transfer")
    assert lc.state is S.QUARANTINED and lc.quarantine_reason == "trainer died mid-transfer"
    with pytest.raises(QuarantinedError, match="trainer died mid-transfer"):
        loaded.precompute_context_kv(ctx, pos)
    with pytest.raises(QuarantinedError):
        loaded(torch.randn(2, loaded.config.hidden_size), torch.arange(2), ctx, pos)
    assert_derived_unchanged(loaded, snap, sources_rewritten=False)
    with pytest.raises(IllegalTransitionError):
        loaded.refresh_derived_buffers()
    assert_derived_unchanged(loaded, snap, sources_rewritten=False)

    if recovery == "full":
        reload(loaded, ckpt_b)
    else:
        # only layer 1 is sent again; layer 0 still holds what the aborted epoch wrote
        reload(loaded, ckpt_b, subset=lambda n: n.startswith("layers.1."))
    assert lc.state is S.DERIVED_REFRESHED and lc.quarantine_reason is None
    assert_derived_current(loaded)  # includes the aborted epoch's layer-0 writes
    for name, (obj, _, ptr) in snap.items():
        assert loaded._buffers[name] is obj and obj.data_ptr() == ptr


def test_epoch_without_refresh_leaves_its_writes_for_the_next_refresh(loaded: DFlashQwen3Draft, ckpt_b: Path,
                                                                      tiny_cfg: DFlashConfig, tmp_path: Path
                                                                      ) -> None:
    ckpt_c = write_checkpoint(random_weights(tiny_cfg, 2), tmp_path / "c.safetensors")
    reload(loaded, ckpt_b, refresh=False)
    reload(loaded, ckpt_c, subset=lambda n: n.startswith("layers.1."), refresh=False)  # before anyone refreshed
    report = loaded.refresh_derived_buffers()
    assert report["_fused_kv_weight"].slices_written == 3
    assert_derived_current(loaded)
    # and once refreshed, a selective reload rewrites only its own slice
    reload(loaded, ckpt_b, subset=lambda n: n.startswith("layers.2."), refresh=False)
    report = loaded.refresh_derived_buffers()
    assert report["_fused_kv_weight"].slices_written == 1
    assert_derived_current(loaded)



def test_refused_selective_finish_marks_nothing(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    """finish(keep_untouched=True) refused (a touched layer is incomplete) must not leave the untouched layers
    declared unchanged: a refused trigger changes nothing, bookkeeping included."""
    lc = loaded.lifecycle
    loaded.begin_reload()
    load_safetensors(loaded, ckpt_b, subset=["layers.0.self_attn.qkv_proj.weight"])  # layer 0 incomplete
    missing, untouched = lc.missing(), lc.readiness.untouched_layers()
    with capture_logs() as logs, pytest.raises(LayersNotReadyError) as ei:
        loaded.finalize_loading(keep_untouched=True)
    assert list(ei.value.missing) == ["layers.0"]  # the untouched layers are not what blocks it
    assert lc.missing() == missing and lc.readiness.untouched_layers() == untouched
    assert lc.state is S.PARTIALLY_LOADED
    assert [(e["event"], e["trigger"]) for e in logs] == [("refused", "finalize_loading")]


def test_a_reason_every_tensor_of_a_layer_shares_is_said_once_so_every_name_fits_the_message() -> None:
    """Nine long-named tensors of one layer, each with the same long reason (a dummy start's `load_format='dummy'`
    values, vLLM's names): repeated per name the reason filled the line's cap and the last names were cut, so a
    refusal could leave out the very tensor it is about."""
    why = "(holds what vLLM's loader put there without load_weights (load_format='dummy': random values), not a " \
          "checkpoint's: write every tensor of it)"
    names = [f"layers.1.{leaf}.weight" for leaf in ("input_layernorm", "mlp.down_proj", "mlp.gate_up_proj",
                                                    "post_attention_layernorm", "self_attn.k_norm", "self_attn.o_proj",
                                                    "self_attn.q_norm", "self_attn.qkv_proj", "self_attn.sinks")]
    err = LayersNotReadyError("weights_unchanged", {"layers.1": [f"{n} {why}" for n in names]}, backbone="b",
                              state="PARTIALLY_LOADED")
    assert all(n in str(err) for n in names) and str(err).count("load_format='dummy'") == 1
    assert err.missing == {"layers.1": tuple(f"{n} {why}" for n in names)}  # what callers read is unchanged
    mixed = LayersNotReadyError("finalize_loading", {"layers.0": ["a (META)", "b"]}, backbone="b", state="S")
    assert "layers.0: a (META), b" in str(mixed)  # different reasons stay beside their names
