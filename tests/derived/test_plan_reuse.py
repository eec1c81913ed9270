"""A refresh reuses the last validated plan of its alias, concat and stack buffers while nothing that plan read
changed (`lifecycle.derived.reuse`), and a stale plan is never used: every mutation of what a plan reads between
two refreshes (a replaced parameter, a `.data =` swap, a resize, a transpose, a moved or replaced buffer, a new
declaration) gives exactly what a refresh without the memory gives: the same report, the same error, the same bits.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lifecycle import DraftBackbone, alias, concat, custom, stack, write_checkpoint
from lifecycle.derived.backing import is_view_of
from lifecycle.errors import LifecycleError
from lifecycle.storage import count_allocations
from lifecycle.testing import cold_load, random_checkpoint
from support.reloads import reload_layers

L, HIDDEN, Q, KV = 4, 8, 8, 4
calls: Counter[tuple[str, int]] = Counter()


class Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.q = Q  # what the K/V slice starts after (per_layer reads it)
        self.qkv_proj = nn.Linear(HIDDEN, Q + 2 * KV, bias=False)
        self.k_norm = nn.RMSNorm(KV)


def kv_rows(layer: Layer) -> torch.Tensor:
    calls["kv", layer.index] += 1
    return layer.qkv_proj.weight[layer.q:]


def k_norm(layer: Layer) -> torch.Tensor:
    calls["norm", layer.index] += 1
    return layer.k_norm.weight


SPECS = (
    concat("_kv", sources=("qkv_proj.weight",), per_layer=kv_rows),
    stack("_k_norms", sources=("k_norm.weight",), per_layer=k_norm),
    alias("_final_norm", source="norm.weight"),
    custom("_colsum", depends_on=("layers.*.qkv_proj.weight",),
           into=lambda m, out: torch.stack([layer.qkv_proj.weight.sum(0) for layer in m.layers], out=out)),
)


class Draft(DraftBackbone):
    derived_buffers = SPECS

    def __init__(self, *, memory: bool) -> None:
        super().__init__()
        with torch.device("meta"):
            self.layers = nn.ModuleList(Layer(i) for i in range(L))
            self.norm = nn.RMSNorm(HIDDEN)
        self.requires_grad_(False)
        self.init_lifecycle(f"reuse-{memory}")
        if not memory:
            self._plan_memory = None  # type: ignore[assignment]  # every refresh plans afresh: the oracle

    def expected(self) -> dict[str, torch.Tensor]:
        return {"_kv": torch.cat([layer.qkv_proj.weight[layer.q:] for layer in self.layers]),
                "_k_norms": torch.stack([layer.k_norm.weight for layer in self.layers]),
                "_final_norm": self.norm.weight,
                "_colsum": torch.stack([layer.qkv_proj.weight.sum(0) for layer in self.layers])}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reuse") / "a.safetensors"
    return write_checkpoint(random_checkpoint(Draft(memory=True), seed=0), path)


def built(ckpt: Path, *, memory: bool) -> Draft:
    m = cold_load(Draft(memory=memory), ckpt)
    reload_layers(m, [])
    m.refresh_derived_buffers()  # a refresh of an existing buffer: what the next one may reuse
    return m


def outcome(m: Draft) -> tuple[object, ...]:
    """What a refresh did: its report (or its error), and the bits of every buffer."""
    try:
        with count_allocations() as log:
            report = m.refresh_derived_buffers()
        result: object = ([b.as_log() | {"data_ptr": None} for b in report.buffers], log.storages_created)
    except LifecycleError as e:
        result = (type(e).__name__, re.sub(r"0x[0-9a-f]+", "0x?", str(e).replace(m.lifecycle.name, "<name>")))
    return result, {s.name: m._buffers[s.name].clone() for s in SPECS}


# ---- reuse: what an unchanged backbone skips ---------------------------------------------------------------


def test_an_unchanged_backbone_evaluates_per_layer_only_for_the_slices_it_writes(ckpt: Path) -> None:
    m = built(ckpt, memory=True)
    calls.clear()
    reload_layers(m, [2], value=0.5)
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert calls == Counter({("kv", 2): 1, ("norm", 2): 1})  # the written slices only, once each
    assert log.storages_created == report.temporaries  # no storage besides what the custom writer's stack made
    assert (report["_kv"].mode, report["_kv"].slices_written, report["_kv"].elements_written) == \
        ("in_place", 1, 2 * KV * HIDDEN)
    assert (report["_k_norms"].slices_written, report["_k_norms"].elements_written) == (1, KV)
    assert all(torch.equal(m._buffers[n], v) for n, v in m.expected().items())

    calls.clear()
    reload_layers(m, [])  # nothing written: nothing evaluated, nothing copied
    report = m.refresh_derived_buffers()
    assert calls == Counter() and report.elements_written == 0
    assert [b.mode for b in report.buffers] == ["skipped", "skipped", "alias", "skipped"]

    calls.clear()
    m.begin_reload()
    m.lifecycle.weights_loaded(list(m.lifecycle.specs))
    m.finalize_loading()
    m.refresh_derived_buffers(full=True)
    assert calls == Counter({(k, i): 1 for k in ("kv", "norm") for i in range(L)})


def test_a_new_declaration_is_planned_afresh(ckpt: Path) -> None:
    m = built(ckpt, memory=True)
    m.derived_buffers = tuple(dataclasses.replace(s) for s in m.derived_buffers)
    calls.clear()
    reload_layers(m, [1], value=2.0)
    m.refresh_derived_buffers()
    assert calls == Counter({(k, i): 1 for k in ("kv", "norm") for i in range(L)})  # every layer validated
    calls.clear()
    reload_layers(m, [1], value=3.0)
    m.refresh_derived_buffers()
    assert calls == Counter({("kv", 1): 1, ("norm", 1): 1})  # and remembered again
    assert all(torch.equal(m._buffers[n], v) for n, v in m.expected().items())


# ---- never stale: every mutation between two refreshes gives what a refresh without memory gives -----------

Mutation = Callable[[Draft], None]


def _swap_data(m: Draft) -> None:
    m.layers[1].qkv_proj.weight.data = torch.full((Q + 2 * KV, HIDDEN), 7.0)


def _replace_parameter(m: Draft) -> None:
    m.layers[2].k_norm.weight = nn.Parameter(torch.full((KV,), 5.0), requires_grad=False)


def _resize(m: Draft) -> None:
    with torch.no_grad():
        m.layers[0].qkv_proj.weight.resize_(Q + 2 * KV + 2, HIDDEN)


def _grow_by_data(m: Draft) -> None:
    m.layers[3].k_norm.weight.data = torch.ones(KV + 1)


def _transpose(m: Draft) -> None:
    w = m.layers[1].qkv_proj.weight
    w.data = w.detach().t().contiguous().t()  # same shape and values, column-major strides


def _move_buffer(m: Draft) -> None:
    m._kv = m._kv.clone()


def _replace_buffer_other_layout(m: Draft) -> None:
    m.register_buffer("_k_norms", torch.zeros(L + 1, KV), persistent=False)


def _alias_source_replaced(m: Draft) -> None:
    m.norm.weight = nn.Parameter(torch.full((HIDDEN,), 9.0), requires_grad=False)


def _dtype_by_data(m: Draft) -> None:
    m.layers[0].k_norm.weight.data = m.layers[0].k_norm.weight.detach().to(torch.float64)


MUTATIONS: dict[str, Mutation] = {
    "data_swap": _swap_data, "replaced_parameter": _replace_parameter, "resize_": _resize,
    "grown_by_data": _grow_by_data, "transposed": _transpose, "buffer_moved": _move_buffer,
    "buffer_replaced_other_layout": _replace_buffer_other_layout,
    "alias_source_replaced": _alias_source_replaced, "dtype_by_data": _dtype_by_data,
}


@pytest.mark.parametrize("written", [[], [2], [0, 1, 2, 3]], ids=["none-written", "layer-2-written", "all-written"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_refresh_after_a_mutation_is_what_a_fresh_plan_gives(ckpt: Path, mutation: str, written: list[int]
                                                                ) -> None:
    twins = built(ckpt, memory=True), built(ckpt, memory=False)
    results = []
    for m in twins:
        reload_layers(m, [1], value=1.5)  # a refresh the memory remembers...
        m.refresh_derived_buffers()
        MUTATIONS[mutation](m)            # ...then what it read changes behind its back
        reload_layers(m, written, value=0.25)
        results.append(outcome(m))
    (reused, reused_bits), (fresh, fresh_bits) = results
    assert reused == fresh
    assert reused_bits.keys() == fresh_bits.keys()
    assert all(torch.equal(reused_bits[n], fresh_bits[n]) for n in fresh_bits), "a buffer differs"
    # and the next refresh, with the mutation in place, still agrees (remembered afresh, or refused again)
    again = [outcome(m) for m in twins]
    assert again[0][0] == again[1][0]


@pytest.mark.parametrize("mutation", ["data_swap", "replaced_parameter", "buffer_moved"])
def test_under_captured_graphs_a_moved_identity_is_refused_before_any_plan(ckpt: Path, mutation: str) -> None:
    twins = built(ckpt, memory=True), built(ckpt, memory=False)
    results = []
    for m in twins:
        m.capture_graphs()
        reload_layers(m, [0], value=1.0)
        m.refresh_derived_buffers()
        MUTATIONS[mutation](m)
        reload_layers(m, [0], value=2.0)
        results.append(outcome(m))
    assert results[0][0] == results[1][0] and results[0][0][0] == "StorageDriftError"


def test_per_layer_is_trusted_to_depend_on_its_sources_only_for_the_slices_not_written(ckpt: Path) -> None:
    """The contract a reused plan relies on (as `stack(computed=True)` does): `per_layer` is a function of the
    layer's sources. A slice that is written is evaluated and checked at every refresh, so a `per_layer` that
    now gives another layout there is refused as a fresh plan refuses it; a slice that is not written keeps the
    layout its last evaluation validated while its sources keep their identity."""
    twins = built(ckpt, memory=True), built(ckpt, memory=False)
    for m in twins:
        m.layers[2].q = Q - 2  # layer 2's slice is now two rows longer
    reload_layers(twins[0], [2], value=0.5)
    reload_layers(twins[1], [2], value=0.5)
    assert outcome(twins[0])[0] == outcome(twins[1])[0] and outcome(twins[0])[0][0] == "StorageReallocationError"
    m = built(ckpt, memory=True)
    m.layers[2].q = Q - 2
    reload_layers(m, [1], value=0.5)
    report = m.refresh_derived_buffers()  # layer 2 not written: its remembered layout stands
    assert (report["_kv"].mode, report["_kv"].slices_written) == ("in_place", 1)
    assert torch.equal(m._kv.narrow(0, 2 * KV, 2 * KV), m.layers[1].qkv_proj.weight[Q:])


# ---- backed buffers: the observation is the verification -----------------------------------------------------


class BackedDraft(Draft):
    derived_buffers = (stack("_k_norms", sources=("k_norm.weight",), per_layer=k_norm, backed=True),)


@pytest.mark.parametrize("mutation", ["none", "replaced_parameter", "data_swap_norm"])
def test_a_backed_buffer_is_verified_by_the_observation_and_a_replaced_source_is_backed_again(
        ckpt: Path, mutation: str) -> None:
    twins = []
    for memory in (True, False):
        m = cold_load(BackedDraft(memory=memory), ckpt)
        reload_layers(m, [])
        m.refresh_derived_buffers()
        twins.append(m)
    reports = []
    for m in twins:
        if mutation == "replaced_parameter":
            _replace_parameter(m)
        elif mutation == "data_swap_norm":
            m.layers[0].k_norm.weight.data = torch.full((KV,), 4.0)
        calls.clear()
        reload_layers(m, [0, 1, 2, 3])
        report = m.refresh_derived_buffers()
        reports.append((report["_k_norms"].as_log() | {"data_ptr": None}, dict(calls)))
        assert all(is_view_of(layer.k_norm.weight, m._k_norms[i]) for i, layer in enumerate(m.layers))
        assert torch.equal(m._k_norms, torch.stack([layer.k_norm.weight for layer in m.layers]))
    (reused, reused_calls), (fresh, _) = reports
    assert reused == fresh
    if mutation == "none":
        assert reused["mode"] == "backed" and reused_calls == {}  # verified without evaluating any layer
    else:
        assert reused["mode"] == "in_place" and reused["rebacked"] == 1


def test_a_refresh_runs_without_autograd_and_restores_the_grad_mode(ckpt: Path) -> None:
    m = built(ckpt, memory=True)
    m.layers[0].qkv_proj.weight.requires_grad_(True)
    reload_layers(m, [0])
    assert torch.is_grad_enabled()
    m.refresh_derived_buffers()
    assert torch.is_grad_enabled()
    assert not m._kv.requires_grad and m._kv.grad_fn is None
    assert torch.equal(m._kv, m.expected()["_kv"])
    with torch.no_grad():
        reload_layers(m, [0])
        m.refresh_derived_buffers()
        assert not torch.is_grad_enabled()


def test_the_memory_holds_no_tensor_so_a_replaced_source_is_freed(ckpt: Path) -> None:
    import gc
    import weakref

    m = built(ckpt, memory=True)
    old = weakref.ref(m.layers[1].qkv_proj.weight)
    m.layers[1].qkv_proj.weight = nn.Parameter(torch.zeros(Q + 2 * KV, HIDDEN), requires_grad=False)
    gc.collect()
    assert old() is None  # nothing of the last plan kept the replaced parameter (or its storage) alive
    reload_layers(m, [1])
    m.refresh_derived_buffers()
    assert torch.equal(m._kv.narrow(0, 2 * KV, 2 * KV), torch.zeros(2 * KV, HIDDEN))


class _BufferLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.register_buffer("scale", torch.ones(4))


class _BufferSources(DraftBackbone):
    """A stack whose per-layer source is a registered buffer, not a Parameter: a reused plan must ask whether each
    part is a computed temporary, which needs the backbone's storages."""

    derived_buffers = (stack("_scales", sources=("scale",), per_layer=lambda layer: layer.scale),)

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_BufferLayer() for _ in range(layers))
        self.requires_grad_(False)
        self.init_lifecycle("buffer-sources")


def test_a_reused_plan_walks_the_backbones_storages_once_per_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: the reused plan walked every parameter and buffer once per written part (64 walks and a
    refresh 20x slower than a fresh plan on 64 layers); a fresh plan walks them once."""
    from lifecycle.derived import buffer_plan, per_layer, reuse

    walks = Counter[str]()
    real = buffer_plan.owned_storages

    def counted(backbone: nn.Module) -> set[int]:
        walks["owned"] += 1
        return real(backbone)

    monkeypatch.setattr(reuse, "owned_storages", counted)
    monkeypatch.setattr(per_layer, "owned_storages", counted)
    m = _BufferSources(16)
    lc = m.lifecycle

    def reload_and_refresh() -> str:
        m.begin_reload()
        lc.weights_loaded(list(lc.specs))
        m.finalize_loading()
        return m.refresh_derived_buffers()["_scales"].mode

    lc.weights_loaded(list(lc.specs))
    m.finalize_loading()
    m.refresh_derived_buffers()
    reload_and_refresh()  # the plan is remembered
    walks.clear()
    assert reload_and_refresh() == "in_place"
    assert walks["owned"] == 1
    assert torch.equal(m._scales, torch.stack([layer.scale for layer in m.layers]))


# ---- under captured graphs: the refresh's own pin verification stands for the observation ---------------------


def _identity_passes(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How many tensors each bulk identity comparison read (`IdentityColumns.same`), by count of tensors."""
    from lifecycle.storage import IdentityColumns

    passes = Counter[int]()
    real = IdentityColumns.same

    def counted(self: IdentityColumns, tensors: object) -> bool:
        passes[len(tensors)] += 1  # type: ignore[arg-type]
        return real(self, tensors)  # type: ignore[arg-type]

    monkeypatch.setattr(IdentityColumns, "same", counted)
    return passes


def test_under_captured_graphs_the_refresh_compares_identities_only_in_its_pin_checks(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = built(ckpt, memory=True)
    pinned = len(m.lifecycle.specs) + len(SPECS)  # every weight and every derived buffer
    passes = _identity_passes(monkeypatch)
    reload_layers(m, [1], value=1.5)
    m.refresh_derived_buffers()
    assert sum(passes.values()) == 2 and pinned not in passes  # no graphs: the memory's two observation passes
    m.capture_graphs()
    for round_ in range(3):  # the first refresh under these pins compares and remembers that the pins hold it
        passes.clear()
        reload_layers(m, [round_], value=float(round_))
        report = m.refresh_derived_buffers()
        assert passes[pinned] == 2  # the refresh's guard, then graphs_verified
        assert sum(passes.values()) == (4 if round_ == 0 else 2)
        assert report["_kv"].mode == "in_place" and torch.equal(m._kv, m.expected()["_kv"])
    m.release_graphs()  # captured again: other pins, compared again once
    reload_layers(m, [3], value=3.0)
    m.refresh_derived_buffers()
    m.capture_graphs()
    for expected in (4, 2):
        passes.clear()
        reload_layers(m, [2], value=7.0)
        m.refresh_derived_buffers()
        assert sum(passes.values()) == expected
    assert all(torch.equal(m._buffers[n], t) for n, t in m.expected().items())


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_under_captured_graphs_a_refresh_after_a_mutation_is_what_a_fresh_plan_gives(ckpt: Path, mutation: str
                                                                                      ) -> None:
    twins = built(ckpt, memory=True), built(ckpt, memory=False)
    results = []
    for m in twins:
        m.capture_graphs()
        for value in (1.0, 1.5):  # remembered, then reused on the strength of the pin verification
            reload_layers(m, [0], value=value)
            m.refresh_derived_buffers()
        MUTATIONS[mutation](m)
        reload_layers(m, [0, 2], value=2.0)
        results.append(outcome(m))
    (reused, reused_bits), (fresh, fresh_bits) = results
    assert reused == fresh
    assert all(torch.equal(reused_bits[n], fresh_bits[n]) for n in fresh_bits), "a buffer differs"


def test_what_a_pin_guard_verified_lives_only_inside_its_trigger(ckpt: Path) -> None:
    m = built(ckpt, memory=True)
    lc = m.lifecycle
    m.capture_graphs()
    seen: list[object] = []

    def spying_into(backbone: Draft, out: torch.Tensor | None) -> torch.Tensor:
        seen.append(backbone.lifecycle.verified_pins)
        return torch.stack([layer.qkv_proj.weight.sum(0) for layer in backbone.layers], out=out)

    spying = dataclasses.replace(SPECS[3], into=spying_into)
    m.derived_buffers = (*SPECS[:3], spying)  # type: ignore[misc]  # this backbone's declarations
    reload_layers(m, [1], value=1.0)
    m.refresh_derived_buffers()
    assert seen and all(p is lc.pinned for p in seen) and lc.pinned is not None  # inside the effect: its pins
    assert lc.verified_pins is None  # and not after it
    lc.verify_pinned()  # a verification outside any trigger...
    m.begin_reload()  # ...is not what the next trigger's effect may rely on
    assert lc.verified_pins is None
