"""Fault injection: every fault ends with a clear error, a quarantined (or unchanged) backbone, and nothing lost.

Faults are real: builders and weight writers that raise, a tensor whose copy fails mid-refresh, files cut
short or overwritten with garbage, NaN bytes in a checkpoint, a parameter replaced behind the lifecycle's back.
"Nothing lost": the derived buffers are the same objects at the same addresses with the same bits as before the
failed reload (their last good values), and with rollback every weight is restored bit for bit, after which
`recover()` makes the backbone usable again without a reload.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from lifecycle.errors import (
    CheckpointError,
    DerivedBuildError,
    LayersNotReadyError,
    NonFiniteWeightError,
    QuarantinedError,
    RecoveryError,
    RefreshInterruptedError,
    StorageDriftError,
    WeightWriteError,
)
from lifecycle.hooks import Phase
from lifecycle.loading import apply_bucket, load_safetensors, write_checkpoint, write_tensor
from lifecycle.states import LifecycleState
from lifecycle.testing import cold_load, reload
from models.qwen3_dflash import DFlashConfig, random_weights
from support.reference import FaultyDraft, Snap, assert_derived_current, assert_same, derived_names, snapshot

S = LifecycleState
ALIASES = {"_hidden_norm_weight", "_rope_cos_sin_cache"}


@pytest.fixture(params=[False, True], ids=["refreshed", "captured"])
def draft(request: pytest.FixtureRequest, tiny_cfg: DFlashConfig, ckpt_a: Path) -> FaultyDraft:
    """A FaultyDraft cold-loaded from A and refreshed; with graphs captured for the "captured" variant."""
    return cold_load(FaultyDraft(tiny_cfg), ckpt_a, capture_graphs=request.param)


def usable_state(m: FaultyDraft) -> LifecycleState:
    return S.GRAPH_CAPTURED if m.lifecycle.graphs_pinned else S.DERIVED_REFRESHED


def weights_only(m: FaultyDraft, snap: Snap) -> set[str]:
    return set(snap) - derived_names(m) - {n for n in snap if n.endswith("cos_sin_cache")}


def assert_quarantined(m: FaultyDraft, before: Snap, *, rolled_back: bool, reason: str) -> None:
    """QUARANTINED with `reason`; the fused path refuses; every non-alias derived buffer holds its last good
    value at its old address; with rollback every weight (and so every alias) is back bit for bit."""
    lc = m.lifecycle
    assert lc.state is S.QUARANTINED
    assert reason in (lc.quarantine_reason or ""), lc.quarantine_reason
    with pytest.raises(QuarantinedError) as ei:
        m.precompute_context_kv(torch.randn(3, m.config.hidden_size), torch.arange(3))
    assert ei.value.quarantine_reason == lc.quarantine_reason
    assert reason in str(ei.value)
    assert_same(m, before, only=derived_names(m) - ALIASES)  # last good derived values, same storage
    if rolled_back:
        assert_same(m, before)  # every weight, buffer and alias, bit for bit
        assert lc.recovery_blocker is None
        assert "recover()" in str(ei.value)
    else:
        assert lc.recovery_blocker is not None


def assert_recovers(m: FaultyDraft, before: Snap, state: LifecycleState) -> None:
    """`recover()` returns to `state`; everything is as before the failed reload; the fused path runs."""
    assert m.recover() is state
    assert_same(m, before)
    assert_derived_current(m)
    ctx, pos = torch.randn(3, m.config.hidden_size), torch.arange(3)
    k, v = m.precompute_context_kv(ctx, pos)
    k_ref, v_ref = m.precompute_context_kv_reference(ctx, pos)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)


def reload_fully(m: FaultyDraft, ckpt: Path) -> None:
    """The other way out of QUARANTINED: a successful reload."""
    with m.reload_session() as s:
        s.load(ckpt)
        s.commit(full=False)
    assert m.lifecycle.state is usable_state(m)
    assert_derived_current(m)


# ---- faults inside a builder, halfway through a refresh ----------------------------------------------------


@pytest.mark.parametrize("rollback", [False, True], ids=["no-rollback", "rollback"])
@pytest.mark.parametrize("fault", ["per_layer_layer2", "custom_build"])
def test_builder_raising_mid_refresh_quarantines_and_keeps_last_good_buffers(
        draft: FaultyDraft, ckpt_b: Path, fault: str, rollback: bool) -> None:
    before = snapshot(draft)
    state = usable_state(draft)
    if fault == "per_layer_layer2":
        draft.layers[2].builder_fault = True  # layers 0 and 1 build fine; the plan fails on layer 2
        match = r"_o_proj_rows failed in per_layer for layers\.2: RuntimeError: injected fault in per_layer"
    else:
        draft.faults["build"] = True
        match = r"_fc_colsum failed in build: ValueError: injected fault in custom build"
    with (
        capture_logs() as logs, pytest.raises(DerivedBuildError, match=match) as ei,
        draft.reload_session(rollback=rollback) as s,
    ):
        s.load(ckpt_b)
        s.commit()
    assert "no buffer was written" in str(ei.value)
    assert_quarantined(draft, before, rolled_back=rollback, reason="DerivedBuildError")
    aborts = [e for e in logs if e["event"] == "transition" and e["trigger"] == "abort_reload"]
    assert len(aborts) == 1 and aborts[0]["rolled_back"] is rollback and aborts[0]["recoverable"] is rollback
    assert [e["phase"] for e in logs if e["event"] == "session"] == ["begin", "verify", "abort"]

    draft.layers[2].builder_fault = False
    draft.faults["build"] = False
    if rollback:
        assert_recovers(draft, before, state)
    else:
        with pytest.raises(RecoveryError, match="not rolled back"):
            draft.recover()
        reload_fully(draft, ckpt_b)


def test_builder_raising_outside_a_session_refuses_the_refresh_and_writes_nothing(
        draft: FaultyDraft, ckpt_b: Path) -> None:
    reload(draft, ckpt_b, refresh=False)
    after_load = snapshot(draft)
    draft.layers[2].builder_fault = True
    with capture_logs() as logs, pytest.raises(DerivedBuildError, match=r"layers\.2"):
        draft.refresh_derived_buffers()
    assert draft.lifecycle.state is S.FINALIZED  # refused: the state did not change
    assert_same(draft, after_load)
    assert [(e["event"], e["error"]) for e in logs if e["event"] == "refused"] == [("refused", "DerivedBuildError")]
    draft.layers[2].builder_fault = False
    draft.refresh_derived_buffers()
    assert_derived_current(draft)


# ---- a fault while the refresh writes (its plan was sound) --------------------------------------------------


def test_copy_failing_mid_refresh_marks_buffers_torn_and_the_next_refresh_rewrites_them(
        draft: FaultyDraft, ckpt_b: Path) -> None:
    before = snapshot(draft)
    draft.faults["copy"] = True
    touched_layer0_and_fc = lambda n: n.startswith("layers.0.") or n == "fc.weight"  # noqa: E731
    with (
        pytest.raises(RefreshInterruptedError, match="while writing _fc_colsum") as ei,
        draft.reload_session(rollback=True, keep_untouched=True) as s,
    ):
        s.load(ckpt_b, subset=touched_layer0_and_fc)
        s.commit()
    # the buffers written before the fault hold layer 0 of B: torn, not last good; the weights are rolled back
    assert "_fused_kv_weight" in ei.value.touched and "_fc_colsum" in ei.value.touched
    lc = draft.lifecycle
    assert lc.state is S.QUARANTINED and "_fused_kv_weight" in lc.torn_buffers
    assert_same(draft, before, only=weights_only(draft, before))
    assert_same(draft, before, only={"_fc_colsum"})  # the buffer whose copy failed was not written...
    assert not torch.equal(draft._fused_kv_weight, before["_fused_kv_weight"][2])  # ...those before it were
    with pytest.raises(RecoveryError, match="interrupted mid-write"):
        draft.recover()

    draft.faults["copy"] = False
    with draft.reload_session(keep_untouched=True) as s:  # a selective reload of layer 1 only
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.1."))
        report = s.commit()
    assert report["_fused_kv_weight"].slices_written == 3  # torn: rewritten fully, not just layer 1's slice
    assert lc.torn_buffers == frozenset()
    assert_derived_current(draft)


# ---- faults inside the weight loader --------------------------------------------------------------------------


class FailingWriter:
    """A per-tensor weight writer (like a model's own weight_loader) that fails on its `fail_at`-th write."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.failed: str | None = None

    def __call__(self, module: nn.Module, name: str, value: torch.Tensor, device: torch.device | str) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            self.failed = name
            raise OSError(f"injected: transfer of {name} reset by peer")
        write_tensor(module, name, value, device)


@pytest.mark.parametrize("rollback", [False, True], ids=["no-rollback", "rollback"])
def test_write_failing_mid_bucket(draft: FaultyDraft, ckpt_b: Path, rollback: bool) -> None:
    before = snapshot(draft)
    writer = FailingWriter(fail_at=8)  # bucket 2 of 5 tensors: 2 written, the 3rd fails
    with (
        pytest.raises(WeightWriteError, match=r"failed after 2 of 5 tensor\(s\) of the bucket") as ei,
        draft.reload_session(rollback=rollback, writer=writer) as s,
    ):
        s.load(ckpt_b, bucket_by=5)
        s.commit()
    assert ei.value.name == writer.failed and isinstance(ei.value.__cause__, OSError)
    assert writer.failed in str(ei.value)
    assert_quarantined(draft, before, rolled_back=rollback, reason="WeightWriteError")
    lc = draft.lifecycle
    if rollback:
        assert_recovers(draft, before, usable_state(draft))
        return
    # no rollback: the 7 tensors written are recorded (dirty), so a later selective reload propagates them
    assert len(lc.readiness.dirty_tensors()) == 8  # 7 written + the one that failed part way
    with pytest.raises(RecoveryError):
        draft.recover()
    # the failing tensor's layer holds part of B: no selective reload may keep it (issue 14, defect 2) ...
    partly = lc.readiness.layer_of_name[writer.failed]
    assert lc.readiness.partly_written == {partly}
    with pytest.raises(LayersNotReadyError, match="partly written"), \
            draft.reload_session(keep_untouched=True) as s:
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.2."))
        s.commit()
    # ... until a reload writes all of it
    with draft.reload_session(keep_untouched=True) as s:
        s.load(ckpt_b, subset=lambda n: n.startswith(("layers.2.", f"{partly}.")))
        s.commit()
    assert not lc.readiness.partly_written
    assert_derived_current(draft)  # includes what the failed bucket wrote


def test_a_failed_rewrite_of_a_tensor_already_loaded_makes_it_missing_again(draft: FaultyDraft, ckpt_b: Path
                                                                            ) -> None:
    """A duplicate send of a tensor whose layer is already complete fails part way: the tensor may be half
    written, so it counts as missing (the finish is refused, naming it) until it is sent again in full; it
    used to stay counted as loaded."""
    b = random_weights(draft.config, 1)
    name = "layers.1.self_attn.qkv_proj.weight"
    with draft.reload_session() as s:
        s.load(ckpt_b)
        failing = FailingWriter(fail_at=1)
        with pytest.raises(WeightWriteError):
            apply_bucket(draft, [(name, b[name])], writer=failing)
        with pytest.raises(LayersNotReadyError, match="a write of it failed part way") as ei:
            s.finalize_loading()
        assert ei.value.missing == {"layers.1": (f"{name} (a write of it failed part way)",)}
        with pytest.raises(LayersNotReadyError, match="send it again"):
            s.weights_unchanged([name])
        s.apply({name: b[name]})
        s.commit()
    assert draft.lifecycle.state is usable_state(draft)
    assert_derived_current(draft)


@pytest.mark.parametrize("interrupt", [ConnectionError, KeyboardInterrupt])
@pytest.mark.parametrize("rollback", [False, True], ids=["no-rollback", "rollback"])
def test_exception_between_buckets_quarantines_with_its_reason(draft: FaultyDraft, ckpt_b: Path,
                                                               interrupt: type[BaseException], rollback: bool
                                                               ) -> None:
    before = snapshot(draft)
    b = random_weights(draft.config, 1)
    with (
        capture_logs() as logs, pytest.raises(interrupt),
        draft.reload_session(rollback=rollback) as s,
    ):
        s.apply({n: t for n, t in b.items() if n.startswith("layers.0.")})
        s.apply([(n, t) for n, t in b.items() if n.startswith("layers.1.")])
        raise interrupt("trainer went away between buckets")
    reason = f"{interrupt.__name__}: trainer went away between buckets"
    assert draft.lifecycle.quarantine_reason == reason
    assert_quarantined(draft, before, rolled_back=rollback, reason=reason)
    abort = next(e for e in logs if e["event"] == "session" and e["phase"] == "abort")
    assert abort["reason"] == reason and abort["outcome"] == "quarantined"
    assert abort["snapshot_bytes"] == (sum(t.numel() * 4 for n, t in b.items() if n.startswith(("layers.0.",
                                                                                                   "layers.1.")))
                                       if rollback else 0)
    if rollback:
        assert_recovers(draft, before, usable_state(draft))
    else:
        reload_fully(draft, ckpt_b)


# ---- damaged checkpoints ---------------------------------------------------------------------------------------


def _damage(good: Path, how: str, out: Path) -> Path:
    data = good.read_bytes()
    if how == "truncated_data":
        out.write_bytes(data[:-64])  # header intact, the last tensor's data cut short
    elif how == "truncated_header":
        out.write_bytes(data[:20])  # the 8-byte length says more header than there is
    else:
        out.write_bytes(b"\x00" * 8 + b"not a safetensors header" * 10)
    return out


@pytest.mark.parametrize("how", ["truncated_data", "truncated_header", "garbage"])
def test_damaged_checkpoint_mid_session_is_refused_and_rolled_back(draft: FaultyDraft, ckpt_b: Path,
                                                                   tmp_path: Path, how: str) -> None:
    before = snapshot(draft)
    bad = _damage(ckpt_b, how, tmp_path / f"{how}.safetensors")
    with (
        pytest.raises(CheckpointError, match="cannot read checkpoint") as ei,
        draft.reload_session(rollback=True) as s,
    ):
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.0."))  # one good file first
        s.load(bad)  # then the damaged one: refused before any of its tensors is written
    assert str(bad) in str(ei.value)
    assert_quarantined(draft, before, rolled_back=True, reason="CheckpointError")
    assert_recovers(draft, before, usable_state(draft))


def test_nan_bytes_in_a_checkpoint_are_caught_by_the_finite_check(draft: FaultyDraft, ckpt_b: Path,
                                                                  tmp_path: Path) -> None:
    """Corrupt data bytes (0xFF.. is a NaN in float32) pass every header check; the finite check names them."""
    before = snapshot(draft)
    corrupt = tmp_path / "corrupt.safetensors"
    data = bytearray(ckpt_b.read_bytes())
    data[-16:] = b"\xff" * 16  # the last tensor's last 4 floats
    corrupt.write_bytes(bytes(data))
    with (
        pytest.raises(NonFiniteWeightError, match=r"4 NaN, 0 Inf of \d+ elements") as ei,
        draft.reload_session(rollback=True, finite_check=True) as s,
    ):
        s.load(corrupt, bucket_by="layer")  # the earlier buckets are written before the bad one is read
    assert len(ei.value.problems) == 1
    assert_quarantined(draft, before, rolled_back=True, reason="NonFiniteWeightError")
    assert_recovers(draft, before, usable_state(draft))
    # without the check (the default) the NaNs load: the check is what stops them
    with draft.reload_session() as s:
        s.load(corrupt)
        s.commit()
    assert any(torch.isnan(p).any() for p in draft.parameters())


@pytest.mark.parametrize("bad", ["nan", "inf", "both"])
def test_nan_or_inf_in_a_bucket_is_refused_before_any_write(draft: FaultyDraft, bad: str) -> None:
    before = snapshot(draft)
    b = random_weights(draft.config, 1)
    name = "layers.1.mlp.down_proj.weight"
    poisoned = b[name].clone()
    if bad in ("nan", "both"):
        poisoned[0, :3] = float("nan")
    if bad in ("inf", "both"):
        poisoned[1, :2] = float("-inf")
    bucket = {"layers.1.mlp.gate_up_proj.weight": b["layers.1.mlp.gate_up_proj.weight"], name: poisoned}
    counts = {"nan": "3 NaN, 0 Inf", "inf": "0 NaN, 2 Inf", "both": "3 NaN, 2 Inf"}[bad]
    with (
        pytest.raises(NonFiniteWeightError, match=rf"{name}: {counts} of {poisoned.numel()} elements"),
        draft.reload_session(finite_check=True) as s,
    ):
        s.apply(bucket)
    # refused before the first write of the bucket: even without rollback no weight changed
    assert_quarantined(draft, before, rolled_back=False, reason="NonFiniteWeightError")
    assert_same(draft, before, only=set(bucket))


def test_verify_catches_inf_produced_by_the_writer(draft: FaultyDraft, ckpt_b: Path) -> None:
    """The values sent are finite; a writer's conversion (a zero dequantisation scale) makes them Inf. Only
    the post-write check in verify() sees it."""
    before = snapshot(draft)

    def dequantising_writer(module: nn.Module, name: str, value: torch.Tensor, device: torch.device | str) -> None:
        scale = 0.0 if name == "fc.weight" else 1.0
        write_tensor(module, name, value / scale, device)

    with (
        pytest.raises(NonFiniteWeightError, match=r"fc\.weight: 0 NaN, \d+ Inf") as ei,
        draft.reload_session(rollback=True, finite_check=True, writer=dequantising_writer) as s,
    ):
        s.load(ckpt_b)
        s.commit()
    assert "verify" in str(ei.value)
    assert_quarantined(draft, before, rolled_back=True, reason="NonFiniteWeightError")
    assert_recovers(draft, before, usable_state(draft))


# ---- drift, hooks, cold loads ----------------------------------------------------------------------------------


def test_storage_drift_found_by_verify_is_undone_by_the_rollback(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                                 ckpt_b: Path) -> None:
    m = cold_load(FaultyDraft(tiny_cfg), ckpt_a, capture_graphs=True)
    before = snapshot(m)
    with (
        pytest.raises(StorageDriftError, match=r"fc\.weight: data_ptr"),
        m.reload_session(rollback=True) as s,
    ):
        s.load(ckpt_b)
        fc = m.fc  # someone re-materialises a parameter the graphs read (new storage)
        fc._parameters["weight"] = nn.Parameter(fc.weight.detach().clone(), requires_grad=False)
        s.commit()
    # the rollback put the original parameter object back: the pinned addresses hold again
    assert_quarantined(m, before, rolled_back=True, reason="StorageDriftError")
    assert_recovers(m, before, S.GRAPH_CAPTURED)


def test_drift_outside_the_rollback_blocks_recover_until_undone(draft: FaultyDraft, ckpt_b: Path) -> None:
    if not draft.lifecycle.graphs_pinned:
        draft.capture_graphs()
    before = snapshot(draft)
    with draft.reload_session(rollback=True) as s:
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.0."))
        s.abort("operator abort")
    norm = draft.norm
    original = norm._parameters["weight"]
    norm._parameters["weight"] = nn.Parameter(original.detach().clone(), requires_grad=False)  # untouched tensor
    with pytest.raises(StorageDriftError, match=r"norm\.weight: data_ptr"):
        draft.recover()
    assert draft.lifecycle.state is S.QUARANTINED
    norm._parameters["weight"] = original
    assert_recovers(draft, before, S.GRAPH_CAPTURED)


def test_reload_hook_raising_in_finalize_quarantines(draft: FaultyDraft, ckpt_b: Path) -> None:
    before = snapshot(draft)

    def rescale(_m: FaultyDraft) -> None:
        raise RuntimeError("injected: scale tensor missing")

    draft.register_post_load_hook(rescale, Phase.RELOAD)
    with (
        capture_logs() as logs, pytest.raises(RuntimeError, match="scale tensor missing"),
        draft.reload_session(rollback=True) as s,
    ):
        s.load(ckpt_b)
        s.commit()
    assert [e["hook"] for e in logs if e["event"] == "hook_failed"] == ["rescale"]
    assert_quarantined(draft, before, rolled_back=True, reason="RuntimeError: injected: scale tensor missing")
    assert_recovers(draft, before, usable_state(draft))


def test_cold_load_session_failing_before_any_report_leaves_meta(tiny_cfg: DFlashConfig) -> None:
    m = FaultyDraft(tiny_cfg)
    b = random_weights(tiny_cfg, 1)
    with (
        capture_logs() as logs, pytest.raises(WeightWriteError),
        m.reload_session(rollback=True, writer=FailingWriter(fail_at=1)) as s,
    ):
        s.apply({n: b[n] for n in list(b)[:3]})
    assert m.lifecycle.state is S.META
    assert all(p.is_meta for p in m.parameters())
    abort = next(e for e in logs if e["event"] == "session" and e["phase"] == "abort")
    assert abort["outcome"] == "unchanged (META)"


def test_cold_load_session_failing_later_puts_meta_placeholders_back(tiny_cfg: DFlashConfig, ckpt_a: Path
                                                                     ) -> None:
    m = FaultyDraft(tiny_cfg)
    placeholders = {n: p for n, p in m.named_parameters()}
    with (
        pytest.raises(WeightWriteError),
        m.reload_session(rollback=True, writer=FailingWriter(fail_at=20)) as s,
    ):
        s.load(ckpt_a, bucket_by=6)
    lc = m.lifecycle
    assert lc.state is S.QUARANTINED
    assert all(p is placeholders[n] and p.is_meta for n, p in m.named_parameters())  # the same META objects
    with pytest.raises(RecoveryError, match="did not start from refreshed derived buffers"):
        m.recover()
    with m.reload_session() as s:  # a new session from QUARANTINED: a full load succeeds
        s.load(ckpt_a)
        s.commit()
    assert lc.state is S.DERIVED_REFRESHED
    assert_derived_current(m)


@pytest.mark.parametrize("how", ["rewritten_in_place", "replaced"])
def test_rewriting_the_checkpoint_after_a_cold_load_changes_no_weight(tiny_cfg: DFlashConfig, tmp_path: Path,
                                                                     how: str) -> None:
    """safetensors hands out views of the file's memory map; a cold load must copy them, or a trainer writing
    the next checkpoint to the same path changes (or, truncating it, crashes) the loaded weights."""
    import struct

    path = write_checkpoint(random_weights(tiny_cfg, 0), tmp_path / "ckpt.safetensors")
    m = FaultyDraft(tiny_cfg)
    load_safetensors(m, path)
    before = snapshot(m)
    if how == "rewritten_in_place":
        data = bytearray(path.read_bytes())
        header = 8 + struct.unpack("<Q", data[:8])[0]
        data[header:] = bytes(len(data) - header)
        with path.open("r+b") as fh:
            fh.write(bytes(data))
    else:
        write_checkpoint(random_weights(tiny_cfg, 1), path)
    assert_same(m, before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_finite_check_counts_nan_and_inf_in_every_float_dtype(dtype: torch.dtype) -> None:
    from lifecycle.loading import non_finite

    values = torch.tensor([1.0, float("nan"), float("nan"), float("inf"), -2.0])
    has_inf = dtype is not torch.float8_e4m3fn  # e4m3fn has no Inf: casting one gives a finite value
    want = "2 NaN, 1 Inf" if has_inf else "2 NaN, 0 Inf"
    assert non_finite([("w", values.to(dtype)), ("ok", torch.ones(3, dtype=dtype))]) == [f"w: {want} of 5 elements"]
