"""Allocation accounting: an in-place refresh creates no storage the size of a derived buffer; a cold build
and a vLLM-style `torch.cat` rebuild do, and the counter sees them (so the in-place assertions can fail)."""

from __future__ import annotations

import pytest
import torch

from lifecycle import LifecycleState
from lifecycle.storage import count_allocations
from lifecycle.testing import cold_load, reload
from models.qwen3_dflash import DFlashQwen3Draft

S = LifecycleState


def fused_slices(model: DFlashQwen3Draft) -> list[torch.Tensor]:
    return [layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:] for layer in model.layers]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def smallest_sliced_buffer(model: DFlashQwen3Draft) -> int:
    return min(nbytes(model._fused_kv_weight), nbytes(model._k_norm_weights))


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs-captured"])
@pytest.mark.parametrize("full", [False, True], ids=["selective", "full"])
def test_in_place_refresh_allocates_nothing_buffer_sized(loaded, ckpt_b, graphs, full):
    if graphs:
        loaded.capture_graphs()
    buf_bytes = nbytes(loaded._fused_kv_weight)
    reload(loaded, ckpt_b, bucket_by=2, shuffle=True, refresh=False)
    with count_allocations() as log:
        report = loaded.refresh_derived_buffers(full=full)
    assert report["_fused_kv_weight"].mode == "in_place"
    assert report["_fused_kv_weight"].elements_written == loaded._fused_kv_weight.numel()
    assert report.bytes_allocated == 0
    assert log.at_least(buf_bytes) == [], log.records
    assert log.at_least(smallest_sliced_buffer(loaded)) == [], log.records
    assert log.storages_created <= 2, log.records


def test_selective_refresh_allocates_nothing_buffer_sized(loaded, ckpt_b):
    reload(loaded, ckpt_b, subset=lambda n: n.startswith("layers.1."), refresh=False)
    with count_allocations() as log:
        report = loaded.refresh_derived_buffers()
    assert report["_fused_kv_weight"].slices_written == 1
    assert log.at_least(nbytes(loaded._fused_kv_weight) // loaded.config.num_hidden_layers) == [], log.records
    assert log.storages_created <= 2, log.records


def test_cold_build_allocates_and_the_counter_sees_it(tiny_cfg, ckpt_a):
    """The positive control: the first build allocates the buffers, and the counter records it."""
    model = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, refresh=False)
    with count_allocations() as log:
        report = model.refresh_derived_buffers()
    assert report["_fused_kv_weight"].mode == "cold"
    fused, knorm = nbytes(model._fused_kv_weight), nbytes(model._k_norm_weights)
    big = log.at_least(fused)
    assert len(big) >= 1, log.records
    assert any(r.nbytes >= fused for r in big)
    assert len(log.at_least(knorm)) >= 2  # the stacked k-norm weights are a new storage too
    assert log.bytes_allocated >= fused + knorm
    assert report.bytes_allocated >= fused + knorm


def test_explicit_rebuild_allocates_new_storage(loaded, ckpt_b):
    """rebuild=True (no graphs captured) is a cold build: new storage, and the counter sees it."""
    old_ptr = loaded._fused_kv_weight.data_ptr()
    old = loaded._fused_kv_weight  # keep it alive so the new one cannot reuse its address
    reload(loaded, ckpt_b, refresh=False)
    with count_allocations() as log:
        report = loaded.refresh_derived_buffers(rebuild=True)
    assert report["_fused_kv_weight"].mode == "cold"
    assert loaded._fused_kv_weight.data_ptr() != old_ptr
    assert len(log.at_least(nbytes(old))) >= 1, log.records


def test_vllm_style_cat_rebuild_is_detected(loaded):
    """What vLLM's `_build_fused_kv_buffers()` does after every load_weights: a fresh torch.cat."""
    buf = loaded._fused_kv_weight
    with count_allocations() as log, torch.no_grad():
        rebuilt = torch.cat(fused_slices(loaded))
    assert torch.equal(rebuilt, buf)
    assert [r.nbytes for r in log.at_least(nbytes(buf))] == [nbytes(buf)], log.records
    assert "cat" in log.at_least(nbytes(buf))[0].op


def test_cat_into_existing_buffer_and_slice_copy_are_not_flagged(loaded):
    """The in-place alternatives (torch.cat(out=buf), a slice copy_) create no buffer-sized storage."""
    buf = loaded._fused_kv_weight
    ptr = buf.data_ptr()
    with count_allocations() as log, torch.no_grad():
        torch.cat(fused_slices(loaded), out=buf)
        rows = buf.shape[0] // len(loaded.layers)
        buf[rows:2 * rows].copy_(fused_slices(loaded)[1])
    assert buf.data_ptr() == ptr
    assert log.at_least(nbytes(buf)) == [], log.records
    assert log.storages_created == 0, log.records
