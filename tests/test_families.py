"""One suite for every draft family in `models.FAMILIES`: a family registered there is covered with no edit here.

For each family: the differential oracle (a warm reload A -> B equals a cold load of B, bit for bit, under
captured graphs, for every derived buffer and the fused path's outputs), fused path vs per-layer reference path,
every derived buffer actually read by the fused path, refresh refused until the last layer arrived, a checkpoint
of another layout refused (at load, and at refresh when parameters are swapped behind the loader), selective
refresh of one layer, and cold-only vs reload hooks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import (
    DraftBackbone,
    LayersNotReadyError,
    LifecycleState,
    Phase,
    SourceLayoutError,
    StorageDriftError,
    StorageIdentity,
    StorageReallocationError,
    TensorSpec,
    WeightShapeError,
)
from lifecycle.derived import DerivedSpec, current_buffer
from lifecycle.hooks import collect_hooks
from lifecycle.loading import load_safetensors, write_checkpoint
from models import FAMILIES, DraftFamily

S = LifecycleState
L = 3  # layers in every tiny config
IDS = list(FAMILIES)


@dataclass
class Fam:
    family: DraftFamily
    cfg: Any
    weights: dict[str, dict[str, torch.Tensor]]
    ckpt: dict[str, Path]
    tmp: Path

    def build(self, cfg: Any = None) -> DraftBackbone:
        return self.family.build(cfg if cfg is not None else self.cfg, device="meta")

    def cold(self, which: str | Path) -> DraftBackbone:
        m = self.build()
        load_safetensors(m, self.ckpt[which] if isinstance(which, str) else which)
        m.finalize_loading()
        m.refresh_derived_buffers()
        assert m.lifecycle.state is S.DERIVED_REFRESHED
        return m

    def outputs(self, m: DraftBackbone, *, reference: bool = False, seed: int = 0) -> tuple[torch.Tensor, ...]:
        x = self.family.example_inputs(self.cfg, seed, "cpu")
        with torch.no_grad():
            return (self.family.reference if reference else self.family.fused)(m, x)

    def mixed(self, prefix: str) -> Path:
        """A with every tensor under `prefix` taken from B."""
        a, b = self.weights["a"], self.weights["b"]
        return write_checkpoint({n: b[n] if n.startswith(prefix) else t for n, t in a.items()},
                                self.tmp / f"mixed-{prefix.strip('.')}.safetensors")


@pytest.fixture(params=IDS)
def fam(request: pytest.FixtureRequest, tmp_path: Path) -> Fam:
    family = FAMILIES[request.param]
    cfg = family.config(num_hidden_layers=L)
    weights = {"a": family.random_weights(cfg, 0), "b": family.random_weights(cfg, 1)}
    ckpt = {k: write_checkpoint(w, tmp_path / f"{k}.safetensors") for k, w in weights.items()}
    return Fam(family, cfg, weights, ckpt, tmp_path)


# ---- helpers ----------------------------------------------------------------------------------------------------


def specs(m: DraftBackbone, *kinds: str) -> list[DerivedSpec]:
    return [s for s in m.derived_buffers if not kinds or s.kind in kinds]


def derived(m: DraftBackbone) -> dict[str, torch.Tensor]:
    out = {}
    for name in m.derived_buffer_names():
        t = current_buffer(m, name)
        assert t is not None, f"derived buffer {name} was never built"
        out[name] = t
    return out


def everything(m: DraftBackbone) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(m.named_parameters(remove_duplicate=False))
    out.update(m.named_buffers(remove_duplicate=False))
    out.update(derived(m))
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def identities(m: DraftBackbone) -> dict[str, StorageIdentity]:
    return {n: StorageIdentity.of(t) for n, t in derived(m).items()}


def snapshot(m: DraftBackbone) -> dict[str, tuple[torch.Tensor, torch.Tensor, StorageIdentity]]:
    return {n: (t, t.detach().clone(), StorageIdentity.of(t)) for n, t in derived(m).items()}


def assert_unchanged(m: DraftBackbone, snap: dict[str, tuple[torch.Tensor, torch.Tensor, StorageIdentity]], *,
                     sources_rewritten: bool = True) -> None:
    """Same object, same storage identity, same bits. An alias IS its source: a loader writing the source in
    place changes its values without any refresh, so with `sources_rewritten` aliases are compared by identity."""
    kinds = {s.name: s.kind for s in m.derived_buffers}
    for name, (obj, values, ident) in snap.items():
        live = m._buffers[name]
        assert live is obj, f"{name}: re-registered"
        assert StorageIdentity.of(live) == ident, f"{name}: storage moved"
        if not (sources_rewritten and kinds[name] == "alias"):
            assert bit_equal(live, values), f"{name}: values written"


def layer_slices(m: DraftBackbone, spec: DerivedSpec, buf: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's slice of a concat/stack buffer."""
    layers = m.get_submodule(spec.layers_attr)
    if spec.kind == "stack":
        return [buf[i] for i in range(len(layers))]
    out, start = [], 0
    for layer in layers:
        n = spec.per_layer(layer).shape[spec.dim]  # type: ignore[misc]
        out.append(buf.narrow(spec.dim, start, n))
        start += n
    return out


def reload(m: DraftBackbone, path: Path, **kw: Any) -> None:
    m.begin_reload()
    load_safetensors(m, path, **kw)
    m.finalize_loading(keep_untouched="subset" in kw)


# ---- the differential oracle, under captured graphs -------------------------------------------------------------

STRATEGIES: dict[str, dict[str, Any]] = {
    "shuffled-buckets": {"bucket_by": 3, "shuffle": True, "seed": 1},
    "one-at-a-time-duplicates": {"bucket_by": 1, "shuffle": True, "seed": 2, "duplicates": 4},
    "partial-layer-1": {"subset": lambda n: n.startswith("layers.1."), "bucket_by": 2, "shuffle": True, "seed": 3},
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_warm_reload_equals_cold_load(fam: Fam, strategy: str) -> None:
    kw = dict(STRATEGIES[strategy])
    target = fam.mixed("layers.1.") if "subset" in kw else fam.ckpt["b"]
    warm, cold_a, cold_target = fam.cold("a"), fam.cold("a"), fam.cold(target)
    # not vacuous: the fused outputs and every per-layer buffer differ between A and the target
    assert not all(bit_equal(x, y) for x, y in zip(fam.outputs(cold_a), fam.outputs(cold_target), strict=True))
    for spec in specs(warm, "concat", "stack"):
        assert not bit_equal(getattr(cold_a, spec.name), getattr(cold_target, spec.name)), spec.name

    pinned = warm.capture_graphs()
    before = identities(warm)
    reload(warm, target, **kw)
    report = warm.refresh_derived_buffers()

    assert warm.lifecycle.state is S.GRAPH_CAPTURED
    assert warm.lifecycle.verify_pinned() == pinned
    assert identities(warm) == before, "a derived buffer moved under captured graphs"
    assert report.bytes_allocated == 0
    w, c = everything(warm), everything(cold_target)
    assert w.keys() == c.keys()
    for name in c:
        assert bit_equal(w[name], c[name]), f"{name}: warm reload differs from a cold load"
    for i, (x, y) in enumerate(zip(fam.outputs(warm), fam.outputs(cold_target), strict=True)):
        assert bit_equal(x, y), f"fused output {i}: warm reload differs from a cold load"


# ---- fused path vs per-layer reference path ----------------------------------------------------------------


@pytest.mark.parametrize("which", ["cold", "warm"])
def test_fused_path_matches_reference_path(fam: Fam, which: str) -> None:
    m = fam.cold("a")
    if which == "warm":
        m.capture_graphs()
        reload(m, fam.ckpt["b"], bucket_by=2, shuffle=True)
        m.refresh_derived_buffers()
    for seed in (0, 1):
        fused, ref = fam.outputs(m, seed=seed), fam.outputs(m, reference=True, seed=seed)
        assert len(fused) == len(ref) >= 2
        for x, y in zip(fused, ref, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_every_derived_buffer_is_read_by_the_fused_path(fam: Fam) -> None:
    """Perturb one derived buffer at a time (aliases are their sources, so not those): the fused path must then
    disagree with the reference path. So the fused-vs-reference comparison above can fail for every buffer."""
    m = fam.cold("a")
    for spec in specs(m, "concat", "stack", "custom"):
        buf = getattr(m, spec.name)
        kept = buf.clone()
        with torch.no_grad():
            buf.add_(0.5)
        fused, ref = fam.outputs(m), fam.outputs(m, reference=True)
        assert any(not torch.allclose(x, y, atol=1e-5, rtol=0) for x, y in zip(fused, ref, strict=True)), \
            f"{spec.name} is not read by the fused path"
        with torch.no_grad():
            buf.copy_(kept)
    for x, y in zip(fam.outputs(m), fam.outputs(m, reference=True), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


# ---- refresh refused until the last layer arrived ---------------------------------------------------------------

LAST = f"layers.{L - 1}"


def test_cold_build_refused_until_the_last_layer_arrived(fam: Fam) -> None:
    m = fam.build()
    load_safetensors(m, fam.ckpt["a"], bucket_by=2, shuffle=True, subset=lambda n: not n.startswith(LAST + "."))
    with pytest.raises(LayersNotReadyError) as ei:
        m.refresh_derived_buffers()
    assert set(ei.value.missing) == {LAST}
    assert m.lifecycle.state is S.PARTIALLY_LOADED
    assert all(m._buffers[name] is None for name in m.derived_buffer_names()), "a refused refresh built a buffer"
    load_safetensors(m, fam.ckpt["a"], subset=lambda n: n.startswith(LAST + "."))
    m.finalize_loading()
    m.refresh_derived_buffers()
    cold = fam.cold("a")
    for name, t in derived(cold).items():
        assert bit_equal(getattr(m, name), t), name


def test_reload_refresh_refused_until_the_last_layer_arrived(fam: Fam) -> None:
    m = fam.cold("a")
    m.capture_graphs()
    snap = snapshot(m)
    m.begin_reload()
    load_safetensors(m, fam.ckpt["b"], bucket_by=3, shuffle=True, subset=lambda n: not n.startswith(LAST + "."))
    for action in (m.refresh_derived_buffers, m.finalize_loading):
        with pytest.raises(LayersNotReadyError) as ei:
            action()
        assert set(ei.value.missing) == {LAST}
        assert m.lifecycle.state is S.PARTIALLY_LOADED
        assert_unchanged(m, snap)
    load_safetensors(m, fam.ckpt["b"], bucket_by=1, subset=lambda n: n.startswith(LAST + "."))
    m.finalize_loading()
    m.refresh_derived_buffers()
    assert m.lifecycle.state is S.GRAPH_CAPTURED
    cold = fam.cold("b")
    for name, t in derived(cold).items():
        assert bit_equal(getattr(m, name), t), name
        assert StorageIdentity.of(getattr(m, name)) == snap[name][2]


# ---- a checkpoint whose layout would change a derived buffer's shape ---------------------------------------------

_RESHAPED: dict[str, tuple[dict[str, torch.Tensor], set[str]]] = {}


def reshaped(fam: Fam) -> tuple[dict[str, torch.Tensor], set[str]]:
    """A config of the same family under which some derived buffer has another shape, with the same tensor names
    (more KV heads, say): (that config's random weights, the non-alias derived buffers whose shape changes).
    Found by doubling one integer field at a time, KV/head fields first, so any registered family has one."""
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
            m2 = fam.family.build(cfg2, device="meta")
            load_safetensors(m2, write_checkpoint(w2, fam.tmp / f"reshaped-{field}.safetensors"))
            m2.finalize_loading()
            m2.refresh_derived_buffers()
        except Exception:  # a combination the family does not accept (heads not divisible, ...): next field
            continue
        if set(w2) != names:
            continue
        changed = {s.name for s in specs(ref, "concat", "stack", "custom")
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
    re-declared too, the derived-buffer guard itself refuses: the buffers would need new storage."""
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
        assert lc.state is S.FULLY_LOADED
        assert_unchanged(m, snap)
        return

    with pytest.raises(SourceLayoutError) as layout:
        m.refresh_derived_buffers()
    assert any(n in p for p in layout.value.problems for n in swapped)
    assert lc.state is S.FULLY_LOADED
    assert_unchanged(m, snap)

    for n, t in swapped.items():  # the backbone re-declares its layout for the new checkpoint
        lc.specs[n] = TensorSpec.of(t)
    with pytest.raises(StorageReallocationError) as realloc:
        m.refresh_derived_buffers()
    assert {p.split(":")[0] for p in realloc.value.problems} == changed
    assert lc.state is S.FULLY_LOADED
    assert_unchanged(m, snap)


# ---- selective refresh ------------------------------------------------------------------------------------------

SENTINEL = 1234.5


def test_reloading_one_layer_rewrites_one_slice(fam: Fam) -> None:
    m = fam.cold("a")
    sliced = specs(m, "concat", "stack")
    assert sliced, "every family derives at least one per-layer buffer"
    with torch.no_grad():
        for spec in sliced:
            getattr(m, spec.name).fill_(SENTINEL)  # where the sentinel survives, the slice was not written
    reload(m, fam.mixed("layers.1."), subset=lambda n: n.startswith("layers.1."))
    report = m.refresh_derived_buffers()
    expected = 0
    for spec in sliced:
        buf, rep = getattr(m, spec.name), report[spec.name]
        assert (rep.mode, rep.slices_written, rep.slices_total) == ("in_place", 1, L), spec.name
        assert rep.elements_written == buf.numel() // L, spec.name
        expected += rep.elements_written
        layers = m.get_submodule(spec.layers_attr)
        for i, live in enumerate(layer_slices(m, spec, buf)):
            if i == 1:
                assert torch.equal(live, spec.per_layer(layers[1])), f"{spec.name}: layer 1 not refreshed"  # type: ignore[misc]
            else:
                assert bool((live == SENTINEL).all()), f"{spec.name}: slice of untouched layer {i} was written"
    for spec in specs(m, "custom"):
        touched = any(n.startswith("layers.1.") for n in spec.source_names(m))
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
        assert m.finalize_loading() == [*declared(Phase.RELOAD), "recompute"]
        m.refresh_derived_buffers()  # under captured graphs: refused if a cold-only hook had re-made a buffer
        assert m.lifecycle.state is S.GRAPH_CAPTURED
        assert torch.equal(m.live_tensor(source), fam.weights[which][source])  # type: ignore[arg-type]
        assert {n: StorageIdentity.of(t) for n, t in m.named_buffers() if n in cold_made} == cold_made
    assert calls == [("convert", 0), ("recompute", 1), ("recompute", 2)]
