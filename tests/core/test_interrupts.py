"""Interrupts (any `BaseException`: `KeyboardInterrupt`, `SystemExit`, `GeneratorExit`) land where issue #24 found
them, one test each: between two copies of the in-place refresh, inside a bucket write, inside an abort's rollback,
and a reload hook that writes then raises. Each ends refusing forward use, never recoverable when it is not exact,
and the next complete reload ends equal to a cold build. The injection is `support.crash.interrupting`: the
write points are found from outside the code (`Tensor.copy_`, the loader's writer), the k-th raises.

The crash-consistency harness (`tests/core/test_crash.py`) interrupts every write point of every operation in turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lifecycle import DraftBackbone, Phase, QuarantinedError, RecoveryError, StateError
from lifecycle.loading import apply_bucket, load_safetensors
from lifecycle.session import WeightSnapshot
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft
from support.crash import interrupting, torch_writes
from support.reference import assert_derived_current

INTERRUPTS = [KeyboardInterrupt, SystemExit, GeneratorExit]


def context(m: DFlashQwen3Draft) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, m.config.hidden_size), torch.arange(3)


def reloads_to_a_cold_build(m: DFlashQwen3Draft, ckpt: Path) -> None:
    """The way out: a complete reload (after an `abort_reload` if a load is still open), equal to a cold build."""
    if m.lifecycle.can("abort_reload") and not m.lifecycle.can("begin_reload"):
        m.abort_reload("interrupted")
    with m.reload_session() as s:
        s.load(ckpt)
        s.commit()
    assert m.lifecycle.usable
    assert_derived_current(m)
    oracle = cold_load(DFlashQwen3Draft(m.config), ckpt)
    assert torch.equal(m._fused_kv_weight, oracle._fused_kv_weight)


@pytest.mark.parametrize("interrupt", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_between_two_copies_of_the_in_place_refresh_leaves_it_torn_and_not_recoverable(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, interrupt: str) -> None:
    """Item 1: the rollback restores the weights, but a buffer holds part of B: recover() must be refused."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    with (pytest.raises(BaseException) as ei,
          interrupting(2, interrupt, probes=[torch_writes()], within=(DraftBackbone, "refresh_derived_buffers"),
                       only="copy_") as points,
          draft.reload_session(rollback=True) as s):
        s.load(ckpt_b)
        s.commit()
    assert ei.value is points.injected and len(points.labels) >= 2  # between two copies of the refresh
    lc = draft.lifecycle
    assert lc.quarantined and lc.torn_buffers, lc.torn_buffers
    assert not s.recoverable
    with pytest.raises(RecoveryError, match="interrupted mid-write"):
        draft.recover()
    with pytest.raises(QuarantinedError):
        draft.precompute_context_kv(*context(draft))
    reloads_to_a_cold_build(draft, ckpt_b)  # the torn buffers are rewritten whole


@pytest.mark.parametrize("path", ["loader", "apply_bucket"])
@pytest.mark.parametrize("interrupt", ["KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_inside_a_bucket_write_marks_what_it_wrote_and_no_layer_of_it_is_kept(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, path: str, interrupt: str) -> None:
    """Item 2: three tensors of layer 1 are written, then the interrupt lands: neither `keep_untouched` (in this
    reload or the next) nor a bare finish may keep layer 1, which mixes the two checkpoints."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    draft.begin_reload()
    layer1 = list(draft.lifecycle.readiness.tensors_of_layer["layers.1"])
    with pytest.raises(BaseException) as ei, interrupting(4, interrupt, only="write_tensor") as points:
        if path == "loader":
            load_safetensors(draft, ckpt_b, subset=layer1)
        else:
            from safetensors.torch import load_file
            b = load_file(ckpt_b)
            apply_bucket(draft, [(n, b[n]) for n in layer1])
    assert ei.value is points.injected
    lc = draft.lifecycle
    assert lc.missing().get("layers.1"), "the layer an interrupt wrote part of counts as ready"
    with pytest.raises(StateError, match=r"layers\.1"):
        draft.finalize_loading(keep_untouched=True)
    assert not lc.usable
    draft.abort_reload("interrupted")  # and in the next reload it is owed a full write
    draft.begin_reload()
    with pytest.raises(StateError, match=r"layers\.1.*aborted or abandoned"):
        draft.finalize_loading(keep_untouched=True)
    reloads_to_a_cold_build(draft, ckpt_b)


def test_a_second_interrupt_during_the_rollback_quarantines_as_rollback_incomplete(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path) -> None:
    """Item 3: Ctrl-C ends the block, a second Ctrl-C lands in the abort's rollback after 4 tensors were restored:
    quarantined (not left PARTIALLY_LOADED), the session closed, not recoverable, every layer the reload wrote
    owed a full write; the next complete reload recovers."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    with (pytest.raises(KeyboardInterrupt) as ei,
          interrupting(5, "KeyboardInterrupt", probes=[torch_writes()], within=(WeightSnapshot, "restore"),
                       only="copy_") as points,
          draft.reload_session(rollback=True) as s):
        s.load(ckpt_b)
        raise KeyboardInterrupt  # the first
    assert ei.value is points.injected  # the second, raised once the backbone was quarantined
    lc = draft.lifecycle
    assert lc.quarantined and s.status == "aborted"
    assert "rollback is incomplete" in (lc.recovery_blocker or "") and not s.recoverable
    with pytest.raises(RecoveryError, match="rollback is incomplete"):
        draft.recover()
    draft.begin_reload()
    with pytest.raises(StateError, match="aborted or abandoned"):
        draft.finalize_loading(keep_untouched=True)
    reloads_to_a_cold_build(draft, ckpt_b)


def _writes_layer_0_then_raises(m: DFlashQwen3Draft) -> None:
    m.layers[0].self_attn.k_norm.weight.mul_(2.0)
    raise RuntimeError("reload hook failed after writing layers.0.self_attn.k_norm.weight")


def test_a_reload_hook_that_writes_and_raises_makes_the_rollback_inexact(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path) -> None:
    """Item 4: the hook's write is outside the rollback snapshot: `recover()` is refused, naming it."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    draft.register_post_load_hook(_writes_layer_0_then_raises, Phase.RELOAD)
    with (pytest.raises(RuntimeError, match="reload hook failed"),
          draft.reload_session(rollback=True, keep_untouched=True) as s):
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.1."))
        s.commit()
    assert draft.lifecycle.quarantined and not s.recoverable
    with pytest.raises(RecoveryError, match=r"written outside the rollback snapshot: layers\.0\.self_attn\.k_norm"):
        draft.recover()
    draft._runtime_hooks.clear()
    reloads_to_a_cold_build(draft, ckpt_b)


def _doubles_layer_0(m: DFlashQwen3Draft) -> None:
    m.layers[0].self_attn.k_norm.weight.mul_(2.0)


def test_what_a_reload_hook_writes_is_refreshed(tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path) -> None:
    """Item 4, the same hook without the failure: a selective reload of layer 1 whose hook writes layer 0 refreshes
    layer 0's slices too (the hook's writes are found by the tensors' version counters)."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    draft.register_post_load_hook(_doubles_layer_0, Phase.RELOAD)
    with draft.reload_session(rollback=True, keep_untouched=True) as s:
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.1."))
        s.commit(full=False)
    assert_derived_current(draft)


@pytest.mark.parametrize("interrupt", INTERRUPTS)
def test_any_base_exception_out_of_a_session_quarantines_and_recovers_exactly(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, interrupt: type[BaseException]) -> None:
    """A `GeneratorExit` (a generator closed around the reload), a `SystemExit` (a SIGTERM handler), a
    `KeyboardInterrupt` out of a rollback session between buckets: quarantined, rolled back exactly, recovered."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}

    def stops_after_two_buckets(progress: object) -> None:
        if getattr(progress, "bucket", 0) == 2:
            raise interrupt()

    with pytest.raises(interrupt), draft.reload_session(rollback=True) as s:
        s.load(ckpt_b, progress=stops_after_two_buckets)
    assert draft.lifecycle.quarantined and s.recoverable
    draft.recover()
    assert all(torch.equal(p, before[n]) for n, p in draft.named_parameters())
    assert_derived_current(draft)
