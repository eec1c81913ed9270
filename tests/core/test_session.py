"""The reload session API: BEGIN -> APPLY -> FINALIZE -> VERIFY -> COMMIT, or ABORT; rollback and its cost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle import ReloadSession
from lifecycle.errors import IllegalTransitionError, QuarantinedError, RecoveryError, SessionStateError
from lifecycle.loading import load_safetensors
from lifecycle.states import LifecycleState
from lifecycle.storage import count_allocations
from lifecycle.testing import cold_load, reload
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft
from support.reference import assert_derived_current, assert_same, snapshot

S = LifecycleState


@pytest.mark.parametrize("graphs", [False, True], ids=["refreshed", "captured"])
@pytest.mark.parametrize("rollback", [False, True], ids=["no-rollback", "rollback"])
def test_committed_session_equals_a_cold_load_in_place(loaded: DFlashQwen3Draft, tiny_cfg: DFlashConfig,
                                                       ckpt_b: Path, graphs: bool, rollback: bool) -> None:
    if graphs:
        loaded.capture_graphs()
    buffers = {n: (loaded._buffers[n], loaded._buffers[n].data_ptr()) for n in ("_fused_kv_weight", "_k_norm_weights")}
    with capture_logs() as logs, loaded.reload_session(rollback=rollback) as s:
        s.load(ckpt_b, bucket_by=3, shuffle=True, duplicates=4)
        report = s.commit()
    assert s.status == "committed" and loaded.lifecycle.state is (S.GRAPH_CAPTURED if graphs else S.DERIVED_REFRESHED)
    assert report.bytes_allocated == 0 and report["_fused_kv_weight"].mode == "in_place"
    for name, (obj, ptr) in buffers.items():
        assert loaded._buffers[name] is obj and obj.data_ptr() == ptr
    oracle = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_b)
    assert all(torch.equal(p, oracle.get_parameter(n)) for n, p in loaded.named_parameters())
    assert_derived_current(loaded)
    assert [e["phase"] for e in logs if e["event"] == "session"] == ["begin", "verify", "commit"]
    commit = next(e for e in logs if e["event"] == "session" and e["phase"] == "commit")
    assert commit["touched"] == len(loaded.lifecycle.specs)
    assert commit["snapshot_bytes"] == (sum(p.numel() * 4 for p in loaded.parameters()) if rollback else 0)


def test_explicit_phases_and_selective_commit(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    s = ReloadSession(loaded, keep_untouched=True)
    assert s.begin() == 1 and loaded.lifecycle.state is S.PARTIALLY_LOADED
    with pytest.raises(SessionStateError, match="begun already"):
        s.begin()
    assert loaded.lifecycle.epoch == 1
    s.load(ckpt_b, subset=lambda n: n.startswith("layers.1."))
    assert s.finalize_loading() == []  # no reload hooks on DFlash; the cold_load one never replays
    assert s.verify() == 0  # nothing pinned, no finite check asked
    assert s.verify(finite=True) == len(s.touched)
    report = s.commit()
    assert report["_fused_kv_weight"].slices_written == 1
    assert_derived_current(loaded)


def test_leaving_without_commit_quarantines(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    with loaded.reload_session() as s:
        s.load(ckpt_b)
    assert loaded.lifecycle.state is S.QUARANTINED
    assert loaded.lifecycle.quarantine_reason == "the reload session ended without commit()"
    assert s.status == "aborted" and not s.recoverable
    with pytest.raises(QuarantinedError, match=r"ended without commit\(\).*reload \(begin_reload"):
        loaded.precompute_context_kv(torch.randn(2, 64), torch.arange(2))


def test_a_closed_session_refuses_everything(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    with loaded.reload_session(rollback=True) as s:
        s.abort("operator said stop")
        for call in (lambda: s.apply({}), lambda: s.load(ckpt_b), s.finalize_loading, s.verify, s.commit,
                     lambda: s.abort("again"), s.begin):
            with pytest.raises(SessionStateError, match=r"aborted \(operator said stop\)"):
                call()
    assert loaded.lifecycle.state is S.QUARANTINED and s.recoverable
    assert loaded.recover() is S.DERIVED_REFRESHED


def test_an_exception_after_commit_does_not_quarantine(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    with pytest.raises(ZeroDivisionError), loaded.reload_session() as s:
        s.load(ckpt_b)
        s.commit()
        _ = 1 / 0
    assert loaded.lifecycle.state is S.DERIVED_REFRESHED and s.status == "committed"


def test_a_session_cannot_begin_mid_load(tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    m = DFlashQwen3Draft(tiny_cfg)
    load_safetensors(m, ckpt_a, subset=lambda n: n.startswith("layers.0."))
    before = snapshot(m)
    with pytest.raises(IllegalTransitionError, match="begin_reload"), m.reload_session():
        pass
    assert m.lifecycle.state is S.PARTIALLY_LOADED
    assert_same(m, before)


def test_rollback_is_not_recoverable_when_the_reload_began_with_stale_buffers(loaded: DFlashQwen3Draft,
                                                                              ckpt_b: Path) -> None:
    reload(loaded, ckpt_b, subset=lambda n: n.startswith("layers.0."), refresh=False)  # derived buffers not refreshed
    with loaded.reload_session(rollback=True) as s:
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.1."))
        s.abort("stop")
    with pytest.raises(RecoveryError, match="did not start from refreshed derived buffers"):
        loaded.recover()


def test_writes_outside_the_session_make_the_rollback_inexact(loaded: DFlashQwen3Draft, ckpt_b: Path) -> None:
    with loaded.reload_session(rollback=True) as s:
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.0."))
        load_safetensors(loaded, ckpt_b, subset=lambda n: n == "fc.weight")  # not through the session
        s.abort("stop")
    with pytest.raises(RecoveryError, match=r"1 tensor\(s\) were written outside the rollback snapshot: fc\.weight"):
        loaded.recover()


def test_recovered_backbone_reloads_normally(loaded: DFlashQwen3Draft, tiny_cfg: DFlashConfig, ckpt_b: Path
                                             ) -> None:
    with loaded.reload_session(rollback=True) as s:
        s.load(ckpt_b, subset=lambda n: n.startswith("layers.2."))
        s.abort("stop")
    loaded.recover()
    assert loaded.lifecycle.missing() == {}  # every tensor counts as restored unchanged
    with loaded.reload_session() as s:
        s.load(ckpt_b)
        s.commit()
    oracle = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_b)
    assert torch.equal(loaded._fused_kv_weight, oracle._fused_kv_weight)


# ---- what rollback costs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [["layers.0."], ["layers.0.", "layers.2.", "fc."]])
def test_rollback_memory_is_the_bytes_of_the_touched_tensors(loaded: DFlashQwen3Draft, ckpt_b: Path,
                                                             layers: list[str]) -> None:
    """Measured: the storages the session allocates with rollback on minus those with it off (the loader's own
    reads are the same in both) equal the bytes of the distinct tensors touched; a duplicate costs nothing."""
    subset = lambda n: n.startswith(tuple(layers))  # noqa: E731
    touched = sum(p.numel() * p.element_size() for n, p in loaded.named_parameters() if subset(n))
    measured = {}
    for rollback in (True, False):  # the same reload from the same state: recover() undoes the first one
        with count_allocations() as log, loaded.reload_session(rollback=rollback) as s:
            s.load(ckpt_b, subset=subset, bucket_by=2, duplicates=3)
            s.abort("measure")
        measured[rollback] = (log.bytes_allocated, s.snapshot_bytes)
        if rollback:
            loaded.recover()
    assert measured[True][1] == touched and measured[False][1] == 0
    assert measured[True][0] - measured[False][0] == touched


def test_recoverable_says_what_recover_will_do_when_storage_drifted(loaded: DFlashQwen3Draft) -> None:
    """Issue 14, defect 3. The old `recoverable` read only the abort's verdict: a parameter the session never
    touched, replaced behind its back under captured graphs, left `recoverable` True while `recover()` raised
    `StorageDriftError`. It now checks what `recover()` checks."""
    from lifecycle.errors import StorageDriftError

    loaded.capture_graphs()
    with loaded.reload_session(rollback=True) as s:
        s.apply({"layers.1.self_attn.qkv_proj.weight": torch.zeros_like(loaded.layers[1].self_attn.qkv_proj.weight)})
        s.abort("trainer went away")
    assert s.recoverable
    fc = loaded.fc
    original = fc._parameters["weight"]
    fc._parameters["weight"] = torch.nn.Parameter(original.detach().clone(), requires_grad=False)
    assert not s.recoverable
    with pytest.raises(StorageDriftError):
        loaded.recover()
    fc._parameters["weight"] = original
    assert s.recoverable
    assert loaded.recover() is S.GRAPH_CAPTURED
