"""The bulk reads a refresh makes: a pin verification pass (`storage.PinnedStorage.changes`, compared in bulk by
`IdentityColumns`) finds exactly what the per-tensor comparison finds, and `slots.Slots.gather` reads exactly
what `live_tensor` reads for each name, whatever happened to the module tables in between."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lifecycle import DraftBackbone, concat, stack
from lifecycle.errors import StorageDriftError
from lifecycle.slots import Slots
from lifecycle.storage import IdentityColumns, PinnedStorage, StorageIdentity, describe_changes
from lifecycle.testing import random_checkpoint
from support.reloads import reload_layers

L, H = 3, 6


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H, bias=False)  # square: a transpose keeps the shape
        self.norm = nn.RMSNorm(H)
        self.register_buffer("scale", torch.ones(H))


class Draft(DraftBackbone):
    derived_buffers = (concat("_rows", sources=("proj.weight",), per_layer=lambda layer: layer.proj.weight),
                       stack("_norms", sources=("norm.weight",), per_layer=lambda layer: layer.norm.weight))

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(L))
        self.requires_grad_(False)
        self.init_lifecycle("bulk")


def captured() -> Draft:
    m = Draft()
    with torch.no_grad():
        for name, value in random_checkpoint(m, seed=0).items():
            m.live_tensor(name).copy_(value)  # type: ignore[union-attr]
    m.lifecycle.weights_loaded(list(m.lifecycle.specs))
    m.finalize_loading()
    m.refresh_derived_buffers()
    m.capture_graphs()
    return m


def one_by_one(pins: PinnedStorage, live: Mapping[str, torch.Tensor | None]) -> list[str]:
    """The per-tensor comparison the bulk pass stands for."""
    out: list[str] = []
    for name, old in pins.identities.items():
        t = live.get(name)
        if t is None:
            out.append(f"{name}: pinned tensor is gone (was {hex(old.data_ptr)})")
        else:
            out.extend(describe_changes(name, old, StorageIdentity.of(t)))
    return out


def _swap(m: Draft) -> None:
    m.layers[0].proj.weight.data = torch.zeros(H, H)


def _transpose(m: Draft) -> None:
    with torch.no_grad():
        m.layers[1].proj.weight.t_()  # same data_ptr and shape, strides swapped


def _resize(m: Draft) -> None:
    with torch.no_grad():
        m.layers[2].norm.weight.resize_(H - 1)  # same data_ptr, shorter


def _dtype(m: Draft) -> None:
    w = m.layers[0].norm.weight
    w.data = w.detach().view(torch.int32)  # same data_ptr, shape and strides; another dtype


def _offset(m: Draft) -> None:
    w = m.layers[1].norm.weight
    w.data = torch.empty(0).set_(w.untyped_storage(), 1, (H - 1,))  # same storage, one element further


def _gone(m: Draft) -> None:
    del m.layers[2].proj.weight


def _param_to_buffer(m: Draft) -> None:  # the same tensor, now a buffer: what graphs read did not move
    w = m.layers[0].proj.weight
    del m.layers[0].proj.weight
    m.layers[0].proj.register_buffer("weight", w)


def _param_shadows_buffer(m: Draft) -> None:  # a parameter slipped in under a buffer's name: it is what is read
    m.layers[1]._parameters["scale"] = nn.Parameter(torch.ones(H), requires_grad=False)


def _buffer_moved(m: Draft) -> None:
    m._norms = m._norms.clone()


def _nothing(m: Draft) -> None:
    pass


CHANGES: dict[str, tuple[Callable[[Draft], None], str | None]] = {
    "data_swap": (_swap, r"layers\.0\.proj\.weight: data_ptr"),
    "transpose_": (_transpose, r"layers\.1\.proj\.weight: stride"),
    "resize_": (_resize, r"layers\.2\.norm\.weight: shape"),
    "dtype_view": (_dtype, r"layers\.0\.norm\.weight: dtype"),
    "storage_offset": (_offset, r"layers\.1\.norm\.weight: data_ptr"),
    "gone": (_gone, r"layers\.2\.proj\.weight: pinned tensor is gone"),
    "param_to_buffer": (_param_to_buffer, None),
    "param_shadows_buffer": (_param_shadows_buffer, r"layers\.1\.scale: data_ptr"),
    "buffer_moved": (_buffer_moved, r"_norms: data_ptr"),
    "nothing": (_nothing, None),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_pin_pass_finds_exactly_what_the_per_tensor_comparison_finds(change: str) -> None:
    m = captured()
    mutate, message = CHANGES[change]
    mutate(m)
    lc = m.lifecycle
    assert lc.pinned is not None
    found = lc.pinned_changes()
    assert found == one_by_one(lc.pinned, m.graph_visible_tensors())
    if message is None:
        assert found == []
        reload_layers(m, [0])
        m.refresh_derived_buffers()
    else:
        assert found
        with pytest.raises(StorageDriftError, match=message):
            lc.verify_pinned()


def test_identity_columns_compare_every_field() -> None:
    base = torch.arange(12.0)
    ts = [base[:6].view(2, 3), base, torch.zeros(2, 2, dtype=torch.float64)]
    cols = IdentityColumns.of(ts)
    assert cols.same(ts) and cols.same(list(ts))
    variants = [
        [base[1:7].view(2, 3), base, ts[2]],          # data_ptr and storage_offset
        [base[:6].view(3, 2), base, ts[2]],           # shape and stride
        [ts[0], base, ts[2].t()],                     # a square's strides
        [ts[0], base.view(torch.int32), ts[2]],       # dtype
        [ts[0], base, torch.zeros(2, 2, dtype=torch.float64, device="meta")],  # device (and data_ptr 0)
        [ts[0], None, ts[2]],
        ts[:2],
    ]
    assert not any(cols.same(v) for v in variants)
    assert cols.same([base[:6].view(2, 3), base.view(12), ts[2]])  # other objects, the same identities


# ---- Slots.gather reads what live_tensor reads ------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["del_param", "param_to_buffer", "buffer_to_param", "shadow", "none_param",
                                          "new_param", "new_buffer"]), st.integers(0, 2), st.sampled_from(["a", "b"])),
               max_size=12)


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.register_buffer("b", torch.zeros(2))


@given(ops=OPS)
@settings(max_examples=150, deadline=None)
def test_gather_reads_exactly_what_live_reads(ops: list[tuple[str, int, str]]) -> None:
    mods = [Leaf() for _ in range(3)]
    table = {f"m{i}.{leaf}": (mod, leaf) for i, mod in enumerate(mods) for leaf in ("a", "b")}
    slots = Slots(table, lambda name: None)
    names = [*table, "unslotted"]
    slotted = list(table)
    slots.gather(names), slots.gather(slotted)  # compiled before the tables change
    for op, i, leaf in ops:
        mod = mods[i]
        params, buffers = mod._parameters, mod._buffers
        if op == "del_param":
            params.pop(leaf, None)
        elif op == "param_to_buffer" and params.get(leaf) is not None:
            buffers[leaf] = params.pop(leaf).detach()
        elif op == "buffer_to_param" and buffers.get(leaf) is not None:
            params[leaf] = nn.Parameter(buffers.pop(leaf), requires_grad=False)
        elif op == "shadow":
            params[leaf] = nn.Parameter(torch.ones(2), requires_grad=False)
        elif op == "none_param":
            params[leaf] = None
        elif op == "new_param":
            params[leaf] = nn.Parameter(torch.ones(3), requires_grad=False)
        elif op == "new_buffer":
            buffers[leaf] = torch.ones(4)
        for ns in (names, slotted, list(slotted)):
            got = slots.gather(ns)
            assert len(got) == len(ns) and all(g is slots.live(n) for g, n in zip(got, ns, strict=True))
        view = slots.view()
        assert all(t is view.get(n) for t, n in zip(view.tensors_at(names), names, strict=True))


class _HeadedDraft(DraftBackbone):
    """An optional head the checkpoint lacks (it stays on META until `freeze_structure` stops tracking it)."""

    derived_buffers = (stack("_norms", sources=("norm.weight",), per_layer=lambda layer: layer.norm.weight),)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(4)}) for _ in range(2))
        with torch.device("meta"):
            self.head = nn.Linear(4, 1)
        self.requires_grad_(False)
        self.init_lifecycle("headed")


def test_the_meta_scan_follows_a_frozen_structure() -> None:
    """Found in review: after `freeze_structure` untracked the head, the scan in C still read the head's
    tensors (on META), so it fell back to the per-tensor loop on every scan. It reads the tracked ones only, and
    still finds a tracked tensor swapped for META."""
    d = _HeadedDraft()
    lc = d.lifecycle
    tracked = [f"layers.{i}.norm.{p}" for i in range(2) for p in ("weight", "bias")]
    lc.weights_loaded(tracked)
    d.freeze_structure({"head": False}, ["head.weight", "head.bias"])
    assert d._scan is not None
    p_modules, p_leaves, b_modules, b_leaves = d._scan  # the slots in a parameter table, then in a buffer table
    assert [*zip(p_modules, p_leaves, strict=True), *zip(b_modules, b_leaves, strict=True)] == [
        (m, leaf) for _, m, leaf in d._checkpoint_slots]
    assert d.meta_or_absent() == set()
    norm = d.layers[1].norm
    norm.weight = nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)
    assert d.meta_or_absent() == {"layers.1.norm.weight"}
