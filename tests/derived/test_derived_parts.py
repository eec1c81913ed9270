"""Per-layer slices made of several sources (separate K and V weights): `per_layer` returns the parts, each is
copied straight into its place in the buffer, only for the layers written, and the refresh report counts
honestly what a refresh allocates besides the buffer (issue 14, friction 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lifecycle import DerivedBuildError, DraftBackbone, SourceLayoutError, concat, stack
from lifecycle.storage import count_allocations

L, HIDDEN, KV = 4, 24, 8
SLICE_BYTES = 2 * KV * HIDDEN * 4  # one layer's K and V rows, float32


class KVLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.k_norm = nn.RMSNorm(KV)
        self.v_norm = nn.RMSNorm(KV)


def _kv_parts(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.k_proj.weight, layer.v_proj.weight


def _kv_cat(layer: nn.Module) -> torch.Tensor:  # the only way before parts: a temporary per layer
    return torch.cat([layer.k_proj.weight, layer.v_proj.weight])


class KVDraft(DraftBackbone):
    derived_buffers = (
        concat("_kv", sources=("k_proj.weight", "v_proj.weight"), per_layer=_kv_parts),
        concat("_kv_cols", sources=("k_proj.weight", "v_proj.weight"), dim=-1,  # parts side by side
               per_layer=lambda layer: (layer.k_proj.weight, layer.v_proj.weight)),
        stack("_norms", sources=("k_norm.weight", "v_norm.weight"),
              per_layer=lambda layer: (layer.k_norm.weight, layer.v_norm.weight)),
    )

    def __init__(self, specs: tuple | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(KVLayer() for _ in range(L))
        self.requires_grad_(False)
        if specs is not None:
            self.derived_buffers = specs
        self.init_lifecycle("kv-parts")

    def write(self, names: list[str], value: float) -> None:
        self.lifecycle.ensure_loading_allowed()
        with torch.no_grad():
            for n in names:
                t = self.get_parameter(n)
                t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t) + value)
        self.lifecycle.weights_loaded(names)


def loaded(specs: tuple | None = None) -> KVDraft:
    m = KVDraft(specs)
    m.write(list(m.lifecycle.specs), 0.0)
    m.finalize_loading()
    m.refresh_derived_buffers()
    return m


def reload(m: KVDraft, names: list[str], value: float) -> None:
    """Write `names`; the rest of their layers is declared unchanged tensor by tensor, other layers wholesale."""
    m.begin_reload()
    m.write(names, value)
    layers = {n.rsplit(".", 2)[0] for n in names}
    m.weights_unchanged([n for n in m.lifecycle.specs if n not in names and n.rsplit(".", 2)[0] in layers])
    m.finalize_loading(keep_untouched=True)


def expected(m: KVDraft) -> dict[str, torch.Tensor]:
    ks = [layer.k_proj.weight for layer in m.layers]
    vs = [layer.v_proj.weight for layer in m.layers]
    return {
        "_kv": torch.cat([t for k, v in zip(ks, vs, strict=True) for t in (k, v)]),
        "_kv_cols": torch.cat([torch.cat([k, v], dim=-1) for k, v in zip(ks, vs, strict=True)], dim=-1),
        "_norms": torch.stack([torch.cat([layer.k_norm.weight, layer.v_norm.weight]) for layer in m.layers]),
    }


def test_cold_build_lays_the_parts_out_in_one_allocation_and_equals_a_cat() -> None:
    m = KVDraft()
    m.write(list(m.lifecycle.specs), 0.0)
    m.finalize_loading()
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    for name, want in expected(m).items():
        assert torch.equal(getattr(m, name), want), name
        assert report[name].mode == "cold" and report[name].slices_written == L
    assert m._kv.shape == (L * 2 * KV, HIDDEN) and m._kv_cols.shape == (KV, L * 2 * HIDDEN)
    assert m._norms.shape == (L, 2 * KV)
    # exactly one storage per buffer, the buffer itself: no per-layer temporary
    assert log.storages_created == 3 and log.bytes_allocated == report.bytes_allocated
    assert report.temporaries == 0 and report.temporary_bytes == 0


@pytest.mark.parametrize("layer", range(L))
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_reload_of_one_source_writes_that_layer_s_parts_in_place_and_nothing_else(layer: int, which: str) -> None:
    m = loaded()
    ptrs = {n: getattr(m, n).data_ptr() for n in ("_kv", "_kv_cols", "_norms")}
    with torch.no_grad():
        for n in ("_kv", "_kv_cols", "_norms"):
            getattr(m, n).fill_(-1.0)  # a sentinel: survives exactly where nothing was written
    reload(m, [f"layers.{layer}.{which}_proj.weight"], 100.0)
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert log.storages_created == 0 and log.bytes_allocated == 0  # straight into place
    assert report.temporaries == 0 and report.temporary_bytes == 0
    for n in ("_kv", "_kv_cols"):
        rep = report[n]
        assert (rep.mode, rep.slices_written, rep.elements_written) == ("in_place", 1, 2 * KV * HIDDEN)
        assert getattr(m, n).data_ptr() == ptrs[n]
    assert report["_norms"].mode == "skipped"
    want = expected(m)
    rows = slice(layer * 2 * KV, (layer + 1) * 2 * KV)
    cols = slice(layer * 2 * HIDDEN, (layer + 1) * 2 * HIDDEN)
    assert torch.equal(m._kv[rows], want["_kv"][rows])
    assert torch.equal(m._kv_cols[:, cols], want["_kv_cols"][:, cols])
    others = torch.ones(L * 2 * KV, dtype=torch.bool)
    others[rows] = False
    assert bool((m._kv[others] == -1.0).all()), "a slice of a layer not written was rewritten"


def test_a_per_layer_cat_is_counted_as_the_temporaries_it_is() -> None:
    """The old way (`per_layer` calls `torch.cat`): every refresh evaluates every layer's slice, one temporary
    each, all held at once. The report says so, and agrees with the allocation counter."""
    specs = (concat("_kv", sources=("k_proj.weight", "v_proj.weight"), per_layer=_kv_cat),)
    m = loaded(specs)
    reload(m, ["layers.2.k_proj.weight"], 5.0)
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert report["_kv"].slices_written == 1
    assert (report.temporaries, report.temporary_bytes) == (L, L * SLICE_BYTES)
    assert (log.storages_created, log.bytes_allocated) == (L, L * SLICE_BYTES)
    assert report.bytes_allocated == 0  # no buffer was allocated: the temporaries are a separate figure
    assert torch.equal(m._kv, expected(m)["_kv"])


def test_parts_that_do_not_fit_together_are_refused_naming_the_layer() -> None:
    m = loaded()
    before = {n: (getattr(m, n), getattr(m, n).clone()) for n in ("_kv", "_kv_cols", "_norms")}
    m.derived_buffers = (concat("_kv", sources=("k_proj.weight", "v_proj.weight"),
                                per_layer=lambda layer: (layer.k_proj.weight, layer.v_proj.weight.t())),
                         *m.derived_buffers[1:])
    reload(m, ["layers.0.k_proj.weight"], 1.0)
    with pytest.raises(SourceLayoutError, match=r"layers\.0: parts disagree beyond dim 0"):
        m.refresh_derived_buffers()
    for n, (obj, values) in before.items():
        assert getattr(m, n) is obj and torch.equal(obj, values), f"{n} was written by a refused refresh"


@pytest.mark.parametrize("returned", [[], "weights", (1, 2)], ids=["empty", "str", "ints"])
def test_per_layer_returning_no_tensors_is_a_derived_build_error(returned: object) -> None:
    specs = (concat("_kv", sources=("k_proj.weight",), per_layer=lambda layer: returned),)
    m = KVDraft(specs)
    m.write(list(m.lifecycle.specs), 0.0)
    m.finalize_loading()
    with pytest.raises(DerivedBuildError, match=r"_kv failed in per_layer for layers\.0") as ei:
        m.refresh_derived_buffers()
    assert ei.value.buffer == "_kv"
    assert m._buffers["_kv"] is None


def test_a_computed_stack_of_parts_writes_each_part_in_place() -> None:
    specs = (stack("_scaled", sources=("k_proj.weight", "v_proj.weight"), computed=True,
                   per_layer=lambda layer: (layer.k_proj.weight * 2.0, layer.v_proj.weight * 3.0)),)
    m = loaded(specs)
    want = torch.stack([torch.cat([la.k_proj.weight * 2.0, la.v_proj.weight * 3.0]) for la in m.layers])
    assert torch.equal(m._scaled, want)
    reload(m, ["layers.1.v_proj.weight"], 7.0)
    report = m.refresh_derived_buffers()
    assert report["_scaled"].slices_written == 1
    # computed slices are temporaries by nature: two parts, evaluated in the plan and again in the apply
    assert report.temporaries == 4 and report.temporary_bytes == 2 * SLICE_BYTES
    want = torch.stack([torch.cat([la.k_proj.weight * 2.0, la.v_proj.weight * 3.0]) for la in m.layers])
    assert torch.equal(m._scaled, want)


@pytest.mark.parametrize("kind", [stack, concat])
def test_a_buffer_over_no_layers_is_refused_naming_it(kind: object) -> None:
    """Found in review: a `stack` or `concat` over an empty layer list failed with a bare IndexError."""

    class NoLayers(DraftBackbone):
        derived_buffers = (kind("_n", sources=("w",), per_layer=lambda layer: layer.w),)

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList()
            self.norm = nn.LayerNorm(4)
            self.init_lifecycle("no-layers")

    m = NoLayers()
    lc = m.lifecycle
    lc.weights_loaded(list(lc.specs))
    m.finalize_loading()
    with pytest.raises(SourceLayoutError, match=r"_n: layers has no layers") as e:
        m.refresh_derived_buffers()
    assert "no-layers" in str(e.value)
    assert m._n is None and lc.state.value == "FINALIZED"
