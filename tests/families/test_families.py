"""One suite for every draft family in `models.FAMILIES`: a family registered there is covered with no edit here.
(The differential oracle, warm reload = cold load, runs over the same families in `test_oracle.py`.)

For each family: fused path vs per-layer reference path, every derived buffer actually read by the fused path
(a layer's slice by that layer only), refresh refused until the last layer (or its last tensor) arrived, a
checkpoint of another layout refused (at load, and at refresh when parameters are swapped behind the loader),
selective refresh of one layer, and cold-only vs reload hooks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from lifecycle import (
    DraftBackbone,
    LayersNotReadyError,
    Phase,
    SourceLayoutError,
    StorageDriftError,
    StorageIdentity,
    StorageReallocationError,
    TensorSpec,
    WeightShapeError,
)
from lifecycle.hooks import collect_hooks
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.storage import count_allocations
from lifecycle.testing import cold_load, undeclared_hook_writes
from models import FAMILIES
from support.family_helpers import (
    Fam,
    L,
    S,
    assert_unchanged,
    bit_equal,
    derived,
    identities,
    layer_slices,
    reload,
    slice_bytes,
    snapshot,
    specs,
)


@pytest.fixture(params=list(FAMILIES))
def fam(request: pytest.FixtureRequest, tmp_path: Path) -> Fam:
    return Fam.make(request.param, tmp_path)


# ---- fused path vs per-layer reference path ----------------------------------------------------------------

N_CTX = 6  # context tokens in every family's example inputs


@pytest.mark.parametrize("which", ["cold", "warm"])
def test_fused_path_matches_reference_path(fam: Fam, which: str) -> None:
    m = fam.cold("a")
    if which == "warm":
        m.capture_graphs()
        reload(m, fam.ckpt["b"], bucket_by=2, shuffle=True)
        m.refresh_derived_buffers()
    for seed in (0, 1):
        fused, ref = fam.outputs(m, seed=seed), fam.outputs(m, reference=True, seed=seed)
        assert len(fused) == len(ref) >= 3  # context K/V (or MLA latents) of every layer, then the draft step
        assert fused[0].shape[:2] == fused[1].shape[:2] == (L, N_CTX)
        if hasattr(fam.cfg, "num_key_value_heads"):  # K/V per layer, context token, KV head
            assert fused[0].shape == (L, N_CTX, fam.cfg.num_key_value_heads, fam.cfg.head_dim)
        for x, y in zip(fused, ref, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


# read by the query block's attention, not by the context projection: MLA's absorbed matrices
READ_BY_THE_BLOCK_ONLY = {"_W_UK_T", "_W_UV"}


def test_every_derived_buffer_is_read_by_the_fused_path(fam: Fam) -> None:
    """Corrupt layer 1's slice of one per-layer buffer at a time: the fused context K/V of layer 1, and of layer 1
    only, leaves the reference path, and so does the draft step. A whole-buffer value (custom) is perturbed as a
    whole. Aliases are their sources, so not those. So the fused-vs-reference comparison can fail for every
    buffer."""
    m = fam.cold("a")
    for spec in specs(m, "concat", "stack", "custom"):
        buf = getattr(m, spec.name)
        kept = buf.clone()
        with torch.no_grad():
            if spec.kind == "custom":
                buf.add_(0.5)
            else:
                layer_slices(m, spec, buf)[1].mul_(1.5).add_(0.5)
        fused, ref = fam.outputs(m), fam.outputs(m, reference=True)
        assert any(not torch.allclose(x, y, atol=1e-5, rtol=0) for x, y in zip(fused[2:], ref[2:], strict=True)), \
            f"{spec.name} is not read by the fused path"
        if spec.kind != "custom":
            agree = [all(torch.allclose(x[i], y[i], atol=1e-5, rtol=0) for x, y in zip(fused[:2], ref[:2], strict=True))
                     for i in range(L)]
            assert agree == ([True] * L if spec.name in READ_BY_THE_BLOCK_ONLY else [True, False, True]), spec.name
        with torch.no_grad():
            buf.copy_(kept)
    for x, y in zip(fam.outputs(m), fam.outputs(m, reference=True), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


# ---- refresh refused until the last layer (or its last tensor) arrived ------------------------------------------

LAST = f"layers.{L - 1}"


def held_back(fam: Fam, which: str) -> list[set[str]]:
    """What a test holds back of the last layer: all of it, or (one at a time) each tensor a derived buffer reads."""
    if which == "whole-layer":
        return [{n for n in fam.weights["a"] if n.startswith(LAST + ".")}]
    m = fam.build()
    return [{f"{LAST}.{src}"} for src in dict.fromkeys(s for spec in specs(m, "concat", "stack") for s in spec.sources)]


@pytest.mark.parametrize("which", ["whole-layer", "one-source"])
def test_cold_build_refused_until_the_last_layer_arrived(fam: Fam, which: str) -> None:
    cold = fam.cold("a")
    for missing in held_back(fam, which):
        m = fam.build()
        load_safetensors(m, fam.ckpt["a"], bucket_by=2, shuffle=True, subset=lambda n, x=missing: n not in x)
        with pytest.raises(LayersNotReadyError) as ei:
            m.refresh_derived_buffers()
        assert {layer: set(names) for layer, names in ei.value.missing.items()} == {LAST: missing}
        assert m.lifecycle.state is S.PARTIALLY_LOADED
        assert all(m._buffers[name] is None for name in m.derived_buffer_names()), "a refused refresh built a buffer"
        load_safetensors(m, fam.ckpt["a"], subset=list(missing))
        m.finalize_loading()
        m.refresh_derived_buffers()
        for name, t in derived(cold).items():
            assert bit_equal(getattr(m, name), t), name


@pytest.mark.parametrize("which", ["whole-layer", "one-source"])
def test_reload_refresh_refused_until_the_last_layer_arrived(fam: Fam, which: str) -> None:
    cold = fam.cold("b")
    for missing in held_back(fam, which):
        m = fam.cold("a")
        m.capture_graphs()
        snap = snapshot(m)
        m.begin_reload()
        load_safetensors(m, fam.ckpt["b"], bucket_by=3, shuffle=True, subset=lambda n, x=missing: n not in x)
        for action in (m.refresh_derived_buffers, m.finalize_loading):
            with capture_logs() as logs, pytest.raises(LayersNotReadyError) as ei:
                action()
            assert {layer: set(names) for layer, names in ei.value.missing.items()} == {LAST: missing}
            assert [e["error"] for e in logs if e["event"] == "refused"] == ["LayersNotReadyError"]
            assert m.lifecycle.state is S.PARTIALLY_LOADED
            assert_unchanged(m, snap)  # not even the slices of the ready, dirty layers were written
        load_safetensors(m, fam.ckpt["b"], bucket_by=1, subset=list(missing))
        m.finalize_loading()
        m.refresh_derived_buffers()
        assert m.lifecycle.state is S.GRAPH_CAPTURED
        for name, t in derived(cold).items():
            assert bit_equal(getattr(m, name), t), name
            assert StorageIdentity.of(getattr(m, name)) == snap[name][2]


# ---- a checkpoint whose layout would change a derived buffer's shape ---------------------------------------------

_RESHAPED: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Size]]] = {}


def reshaped(fam: Fam) -> tuple[dict[str, torch.Tensor], dict[str, torch.Size]]:
    """A config of the same family under which some derived buffer has another shape, with the same tensor names
    (more KV heads, say): (that config's random weights, the non-alias derived buffers whose shape changes -> their
    shape under it). Found by doubling one integer field at a time, KV/head fields first, so any registered family
    has one."""
    key = fam.family.name
    if key in _RESHAPED:
        return _RESHAPED[key]
    ref = fam.cold("a")
    names = set(ref.lifecycle.specs)
    fields = [f.name for f in dataclasses.fields(fam.cfg)
              if type(getattr(fam.cfg, f.name)) is int and f.name != "num_hidden_layers"]
    fields.sort(key=lambda f: 0 if ("kv" in f or "key_value" in f) else 1 if "head" in f else 2)
    for field in fields:
        try:
            cfg2 = dataclasses.replace(fam.cfg, **{field: 2 * getattr(fam.cfg, field)})
            w2 = fam.family.random_weights(cfg2, 5)
            m2 = cold_load(fam.family.build(cfg2, device="meta"),
                           write_checkpoint(w2, fam.tmp / f"reshaped-{field}.safetensors"))
        except Exception:  # a combination the family does not accept (heads not divisible, ...): next field
            continue
        if set(w2) != names:
            continue
        changed = {s.name: getattr(m2, s.name).shape for s in specs(ref, "concat", "stack", "custom")
                   if getattr(ref, s.name).shape != getattr(m2, s.name).shape}
        if changed:
            _RESHAPED[key] = (w2, changed)
            return _RESHAPED[key]
    raise AssertionError(f"{key}: no config field changes a derived buffer's shape")


def test_checkpoint_of_another_layout_is_refused_at_load(fam: Fam) -> None:
    """The realistic route (a checkpoint for more KV heads, say): the loader refuses it from the header, naming
    every mismatched tensor, before anything is written."""
    w2, _ = reshaped(fam)
    m = fam.cold("a")
    m.capture_graphs()
    snap = snapshot(m)
    params = {n: t.clone() for n, t in m.state_dict().items()}
    mismatched = {n for n, t in w2.items() if tuple(t.shape) != tuple(params[n].shape)}
    assert mismatched
    m.begin_reload()
    with pytest.raises(WeightShapeError) as ei:
        load_safetensors(m, write_checkpoint(w2, fam.tmp / "other-layout.safetensors"))
    assert {p.split(":")[0] for p in ei.value.problems} == mismatched
    assert m.lifecycle.state is S.PARTIALLY_LOADED
    assert_unchanged(m, snap, sources_rewritten=False)
    assert all(bit_equal(t, params[n]) for n, t in m.state_dict().items())
    # the right checkpoint then goes through, in place
    load_safetensors(m, fam.ckpt["b"])
    m.finalize_loading()
    m.refresh_derived_buffers()
    assert m.lifecycle.state is S.GRAPH_CAPTURED
    assert identities(m) == {n: i for n, (_, _, i) in snap.items()}
    for name, t in derived(fam.cold("b")).items():
        assert bit_equal(getattr(m, name), t), name


def swap_in(m: DraftBackbone, tensors: dict[str, torch.Tensor]) -> None:
    """What a loader that materialises new tensors instead of copying does: replace the parameters (or
    buffers) themselves, then report them loaded."""
    for name, value in tensors.items():
        path, _, leaf = name.rpartition(".")
        owner = m.get_submodule(path) if path else m
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(value.clone(), requires_grad=False)
        else:
            owner._buffers[leaf] = value.clone()
    m.lifecycle.weights_loaded(list(tensors))


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs-captured", "no-graphs"])
def test_swapped_parameters_of_another_layout_are_refused_at_refresh(fam: Fam, graphs: bool) -> None:
    """Behind the loader's back. Under captured graphs the moved parameters are drift, refused before anything
    else. Without graphs the sources are not in the declared layout (SourceLayoutError); if the layout is
    re-declared too, the derived-buffer guard itself refuses, naming each buffer with its old and new shape: the
    buffers would need new storage. An explicit `rebuild=True` (no graphs) then allocates them."""
    w2, changed = reshaped(fam)
    m = fam.cold("a")
    lc = m.lifecycle
    if graphs:
        m.capture_graphs()
    snap = snapshot(m)
    swapped = {n: t for n, t in w2.items() if tuple(t.shape) != lc.specs[n].shape}
    m.begin_reload()
    load_safetensors(m, fam.ckpt["b"], subset=lambda n: n not in swapped)
    swap_in(m, swapped)
    m.finalize_loading()  # readiness tracks names and META, not shapes: the layer counts as loaded

    if graphs:
        with pytest.raises(StorageDriftError) as drift:
            m.refresh_derived_buffers()
        assert {p.split(":")[0] for p in drift.value.problems} >= set(swapped)
        assert lc.state is S.FINALIZED
        assert_unchanged(m, snap)
        return

    with pytest.raises(SourceLayoutError) as layout:
        m.refresh_derived_buffers()
    assert any(n in p for p in layout.value.problems for n in swapped)
    assert lc.state is S.FINALIZED
    assert_unchanged(m, snap)

    for n, t in swapped.items():  # the backbone re-declares its layout for the new checkpoint
        lc.specs[n] = TensorSpec.of(t)
    with pytest.raises(StorageReallocationError) as realloc:
        m.refresh_derived_buffers()
    problems = {p.split(":")[0]: p for p in realloc.value.problems}
    assert problems.keys() == changed.keys()
    for name, new_shape in changed.items():
        assert str(tuple(new_shape)) in problems[name] and f"shape {tuple(snap[name][0].shape)}" in problems[name]
    assert lc.state is S.FINALIZED
    assert_unchanged(m, snap)

    m.refresh_derived_buffers(rebuild=True)
    assert lc.state is S.DERIVED_REFRESHED
    assert {name: getattr(m, name).shape for name in changed} == changed


# ---- selective refresh ------------------------------------------------------------------------------------------

SENTINEL = 1234.5


@pytest.mark.parametrize("layer", range(L))
def test_reloading_one_layer_rewrites_one_slice(fam: Fam, layer: int) -> None:
    m = fam.cold("a")
    prefix = f"layers.{layer}."
    sliced = specs(m, "concat", "stack")
    assert sliced, "every family derives at least one per-layer buffer"
    with torch.no_grad():
        for spec in sliced:
            getattr(m, spec.name).fill_(SENTINEL)  # where the sentinel survives, the slice was not written
    reload(m, fam.mixed(prefix), subset=lambda n: n.startswith(prefix), bucket_by=2, shuffle=True)
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert log.at_least(min(slice_bytes(m, spec) for spec in sliced)) == [], log.records
    expected = 0
    for spec in sliced:
        buf, rep = getattr(m, spec.name), report[spec.name]
        assert (rep.mode, rep.slices_written, rep.slices_total) == ("in_place", 1, L), spec.name
        assert rep.elements_written == buf.numel() // L, spec.name
        expected += rep.elements_written
        layers = m.get_submodule(spec.layers_attr)
        for i, live in enumerate(layer_slices(m, spec, buf)):
            if i == layer:
                assert torch.equal(live, spec.per_layer(layers[i])), f"{spec.name}: layer {i} not refreshed"  # type: ignore[misc]
            else:
                assert bool((live == SENTINEL).all()), f"{spec.name}: slice of untouched layer {i} was written"
    for spec in specs(m, "custom"):
        touched = any(n.startswith(prefix) for n in spec.source_names(m))
        assert report[spec.name].elements_written == (getattr(m, spec.name).numel() if touched else 0)
        expected += report[spec.name].elements_written
    for spec in specs(m, "alias"):
        assert report[spec.name].elements_written == 0
    assert report.elements_written == expected


# ---- hooks ------------------------------------------------------------------------------------------------------


def test_cold_only_hooks_never_run_on_reload_and_reload_hooks_do(fam: Fam) -> None:
    m = fam.build()
    spec = specs(m, "concat", "stack")[0]
    source = f"{spec.layers_attr}.0.{spec.sources[0]}"
    calls: list[tuple[str, int]] = []

    def convert(b: DraftBackbone) -> None:  # a one-time conversion: the checkpoint stores half the runtime value
        calls.append(("convert", b.lifecycle.epoch))
        with torch.no_grad():
            b.live_tensor(source).mul_(2)  # type: ignore[union-attr]

    m.register_post_load_hook(convert, Phase.COLD_LOAD)
    m.register_post_load_hook(lambda b: calls.append(("recompute", b.lifecycle.epoch)), Phase.RELOAD,
                              name="recompute")
    declared: Callable[[Phase], list[str]] = lambda p: [h.name for h in collect_hooks(type(m), p)]  # noqa: E731
    assert "init_rope_caches" in declared(Phase.COLD_LOAD)  # every family computes its RoPE tables once
    load_safetensors(m, fam.ckpt["a"])
    assert m.finalize_loading() == [*declared(Phase.COLD_LOAD), "convert"]
    m.refresh_derived_buffers()
    raw = fam.weights["a"][source]
    assert torch.equal(m.live_tensor(source), raw * 2)  # type: ignore[arg-type]
    first_slice = layer_slices(m, spec, getattr(m, spec.name))[0]
    assert torch.equal(first_slice, spec.per_layer(m.get_submodule(spec.layers_attr)[0]))  # type: ignore[misc]

    m.capture_graphs()
    cold_made = {n: StorageIdentity.of(t) for n, t in m.named_buffers() if n not in m.state_dict()}
    for which in ("b", "a"):
        m.begin_reload()
        load_safetensors(m, fam.ckpt[which], bucket_by=2, shuffle=True)
        with capture_logs() as logs:
            assert m.finalize_loading() == [*declared(Phase.RELOAD), "recompute"]
        assert [e["hook"] for e in logs if e["event"] == "hook_run"] == [*declared(Phase.RELOAD), "recompute"]
        m.refresh_derived_buffers()  # under captured graphs: refused if a cold-only hook had re-made a buffer
        assert m.lifecycle.state is S.GRAPH_CAPTURED
        assert torch.equal(m.live_tensor(source), fam.weights[which][source])  # type: ignore[arg-type]
        assert {n: StorageIdentity.of(t) for n, t in m.named_buffers() if n in cold_made} == cold_made
    assert calls == [("convert", 0), ("recompute", 1), ("recompute", 2)]


@pytest.mark.parametrize("phase", [Phase.COLD_LOAD, Phase.RELOAD])
def test_what_each_hook_declares_it_writes_holds(fam: Fam, phase: Phase) -> None:
    """A hook that declares what it writes (`writes=`) has only that read around it: each declaration of a family's
    hooks is checked against what the hook does, every tracked tensor read before and after it."""
    m = fam.cold("a")
    assert undeclared_hook_writes(m, phase) == {}
    if phase is Phase.COLD_LOAD:  # every family's RoPE tables: a buffer the checkpoint does not hold
        assert {h.name: h.writes for h in m.post_load_hooks(phase)}["init_rope_caches"] == ()
