"""`stack(..., computed=True)`: a derived buffer whose per-layer slice is a real computation (MLA's absorbed
matrices; here a matmul of two sources), refreshed in place without ever holding a buffer-sized temporary.

A plain `stack` evaluates `per_layer` for every layer while planning and keeps every result until it writes: for a
view that costs nothing, for a computation it is L slice-sized temporaries alive at once (a buffer's worth) and
work for layers that did not change. The computed variant evaluates only the slices it writes, one at a time.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from lifecycle import DraftBackbone, SourceLayoutError, StorageReallocationError, concat, stack
from lifecycle.derived import DerivedSpec
from lifecycle.states import LifecycleState
from lifecycle.storage import StorageIdentity, count_allocations
from lifecycle.types import TensorSpec

S = LifecycleState
L, ROWS, INNER, COLS = 4, 16, 8, 32
SLICE_BYTES = ROWS * COLS * 4
SENTINEL = 1234.5


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(ROWS, INNER), requires_grad=False)
        self.b = nn.Parameter(torch.empty(INNER, COLS), requires_grad=False)


calls: Counter[int] = Counter()


def product(layer: nn.Module) -> torch.Tensor:
    """A computed slice: a new [ROWS, COLS] tensor per call; counts calls per layer."""
    calls[layer.index] += 1
    return layer.a @ layer.b


class ComputedDraft(DraftBackbone):
    derived_buffers = (
        stack("_products", sources=("a", "b"), per_layer=product, computed=True),
        concat("_a_cat", sources=("a",), per_layer=lambda layer: layer.a),
    )

    def __init__(self, computed: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(L))
        for i, layer in enumerate(self.layers):
            layer.index = i
        if not computed:  # the plain variant, for contrast
            self.derived_buffers = (stack("_products", sources=("a", "b"), per_layer=product),
                                    *type(self).derived_buffers[1:])
        self.init_lifecycle("computed-toy")

    def write(self, layers: list[int], seed: int) -> None:
        """A loader: writes a and b of `layers` in place and reports them."""
        g = torch.Generator().manual_seed(seed)
        names = []
        for i in layers:
            for leaf in ("a", "b"):
                p = getattr(self.layers[i], leaf)
                p.copy_(torch.randn(p.shape, generator=g))
                names.append(f"layers.{i}.{leaf}")
        self.lifecycle.weights_loaded(names)

    def expected(self) -> torch.Tensor:
        return torch.stack([layer.a @ layer.b for layer in self.layers])


@pytest.fixture
def model() -> ComputedDraft:
    m = ComputedDraft()
    m.write(list(range(L)), seed=0)
    m.finalize_loading()
    m.refresh_derived_buffers()
    calls.clear()
    return m


def reload(m: ComputedDraft, layers: list[int], seed: int = 1) -> None:
    m.begin_reload()
    m.write(layers, seed)
    m.finalize_loading(keep_untouched=True)


def test_cold_build_allocates_the_buffer_once_and_slice_temporaries() -> None:
    m = ComputedDraft()
    m.write(list(range(L)), seed=0)
    m.finalize_loading()
    calls.clear()
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert report["_products"].mode == "cold"
    assert torch.equal(m._products, m.expected())
    buf_bytes = L * SLICE_BYTES
    products = [r for r in log.records if r.nbytes == buf_bytes]
    assert len(products) == 1, log.records  # the buffer itself (torch.empty), not a torch.stack of temporaries
    assert all(r.nbytes <= SLICE_BYTES for r in log.records if r.nbytes != buf_bytes and "mm" in r.op)
    assert calls == Counter(dict.fromkeys(range(L), 2))  # validated in plan, computed again in apply


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs-captured"])
def test_full_in_place_refresh_holds_one_slice_temporary_at_a_time(model: ComputedDraft, graphs: bool) -> None:
    if graphs:
        model.capture_graphs()
    ident = StorageIdentity.of(model._products)
    reload(model, list(range(L)))
    with count_allocations() as log:
        report = model.refresh_derived_buffers()
    rep = report["_products"]
    assert (rep.mode, rep.slices_written, rep.elements_written) == ("in_place", L, L * ROWS * COLS)
    assert StorageIdentity.of(model._products) == ident
    assert torch.equal(model._products, model.expected())
    assert log.at_least(SLICE_BYTES + 1) == [], log.records  # nothing bigger than one slice
    assert report.bytes_allocated == 0
    assert model.lifecycle.state is (S.GRAPH_CAPTURED if graphs else S.DERIVED_REFRESHED)


@pytest.mark.parametrize("layer", range(L))
def test_one_layer_reload_computes_and_writes_one_slice(model: ComputedDraft, layer: int) -> None:
    with torch.no_grad():
        model._products.fill_(SENTINEL)
    reload(model, [layer])
    with count_allocations() as log:
        report = model.refresh_derived_buffers()
    rep = report["_products"]
    assert (rep.slices_written, rep.slices_total, rep.elements_written) == (1, L, ROWS * COLS)
    assert calls == Counter({layer: 2})  # no other layer's slice was computed
    assert log.at_least(SLICE_BYTES + 1) == [], log.records
    for i in range(L):
        if i == layer:
            assert torch.equal(model._products[i], model.layers[i].a @ model.layers[i].b)
        else:
            assert bool((model._products[i] == SENTINEL).all()), f"slice {i} was written"


def test_plain_stack_of_a_computation_evaluates_every_layer_and_holds_them() -> None:
    """The contrast (and the counter's positive control): a plain stack computes all L slices for a one-layer
    reload, and keeps them alive together, a buffer's worth of temporaries."""
    m = ComputedDraft(computed=False)
    m.write(list(range(L)), seed=0)
    m.finalize_loading()
    m.refresh_derived_buffers()
    calls.clear()
    reload(m, [2])
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert report["_products"].slices_written == 1
    assert calls == Counter(dict.fromkeys(range(L), 1))
    # all L products were alive at once (distinct storages): a buffer's worth of temporaries
    assert sum(r.nbytes for r in log.records if "mm" in r.op) == L * SLICE_BYTES, log.records


def test_refresh_full_recomputes_every_slice(model: ComputedDraft) -> None:
    with torch.no_grad():
        model._products.fill_(SENTINEL)
    reload(model, [0])
    report = model.refresh_derived_buffers(full=True)
    assert report["_products"].slices_written == L
    assert torch.equal(model._products, model.expected())
    assert calls == Counter(dict.fromkeys(range(L), 2))


def test_computed_slice_whose_shape_changes_is_refused_and_nothing_is_written(model: ComputedDraft) -> None:
    snap = {n: (getattr(model, n).clone(), StorageIdentity.of(getattr(model, n))) for n in ("_products", "_a_cat")}
    model.begin_reload()
    model.write(list(range(L)), seed=1)  # _a_cat's slices are valid and dirty
    model.finalize_loading()
    for i, layer in enumerate(model.layers):  # every b grows (a config change): products become [ROWS, COLS + 1]
        layer.b = nn.Parameter(torch.randn(INNER, COLS + 1), requires_grad=False)
        model.lifecycle.specs[f"layers.{i}.b"] = TensorSpec((INNER, COLS + 1), torch.float32)
    with pytest.raises(StorageReallocationError) as ei:
        model.refresh_derived_buffers()
    (problem,) = ei.value.problems
    assert problem.startswith("_products:") and f"({L}, {ROWS}, {COLS + 1})" in problem
    assert model.lifecycle.state is S.FINALIZED
    for n, (values, ident) in snap.items():
        assert torch.equal(getattr(model, n), values) and StorageIdentity.of(getattr(model, n)) == ident


def test_computed_slices_that_disagree_are_refused(model: ComputedDraft) -> None:
    snap = model._products.clone()
    model.begin_reload()
    model.write(list(range(L)), seed=1)
    model.finalize_loading()
    model.layers[1].b = nn.Parameter(torch.randn(INNER, COLS + 1), requires_grad=False)
    model.lifecycle.specs["layers.1.b"] = TensorSpec((INNER, COLS + 1), torch.float32)
    with pytest.raises(SourceLayoutError, match=r"layers \[0, 2, 3\]: \(16, 32\).*layers \[1\]: \(16, 33\)"):
        model.refresh_derived_buffers()
    assert torch.equal(model._products, snap)


def test_computed_slices_that_disagree_refuse_the_cold_build() -> None:
    m = ComputedDraft()
    m.layers[2].b = nn.Parameter(torch.empty(INNER, COLS + 1), requires_grad=False)
    m.lifecycle.specs["layers.2.b"] = TensorSpec((INNER, COLS + 1), torch.float32)
    m.write(list(range(L)), seed=0)
    m.finalize_loading()
    with pytest.raises(SourceLayoutError, match="computed per-layer slices disagree"):
        m.refresh_derived_buffers()
    assert m._buffers["_products"] is None and m._buffers["_a_cat"] is None


def test_computed_is_only_for_stack() -> None:
    with pytest.raises(ValueError, match="only supported for stack"):
        DerivedSpec("x", "concat", ("a",), per_layer=lambda layer: layer.a, computed=True)
