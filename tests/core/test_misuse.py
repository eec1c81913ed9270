"""Misuse that is refused, not raced (issue #24, items 5-8): an unlocked backbone written from a second thread,
nested reload sessions, a load onto the META device, and bucket values that are not tensors (or lie about their
shape). Each refusal comes before anything is written, names what was wrong and is audited; what was there stays.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from structlog.testing import capture_logs

from lifecycle import LayersNotReadyError, LifecycleError, LoadRefusedError, SessionStateError, StateError
from lifecycle.loading import apply_bucket, load_safetensors, write_tensor
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft
from support.reference import assert_derived_current, assert_same, snapshot

QKV = "layers.1.self_attn.qkv_proj.weight"


# ---- item 5: an unlocked backbone written from two threads ----------------------------------------------------
def _writer_waiting(entered: threading.Event, go: threading.Event) -> Any:
    """A writer that stops between its lease check and its copy until `go` (a slow device, a large tensor)."""
    def write(module: torch.nn.Module, name: str, value: torch.Tensor, device: Any) -> None:
        entered.set()
        assert go.wait(10)
        write_tensor(module, name, value, device)
    return write


@pytest.mark.parametrize("second", ["finalize_loading", "commit", "apply_bucket", "abort_reload"])
def test_an_unlocked_backbone_refuses_a_second_thread_while_one_writes(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, second: str) -> None:
    """Item 5: thread W sits between its lease check and its copy; the main thread's finish, commit, write or
    abort is refused (`ConcurrentUseError`, a `StateError`) before anything is written; W's write then lands and
    is reported, and the reload ends current."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)  # unlocked: the default
    b = load_file(ckpt_b)
    session = draft.reload_session()
    session.begin()
    session.load(ckpt_b)  # every layer loaded from B: FULLY_LOADED
    entered, go, failures = threading.Event(), threading.Event(), []

    def w() -> None:
        try:
            apply_bucket(draft, [(QKV, b[QKV] * 2)], writer=_writer_waiting(entered, go))
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=w)
    thread.start()
    assert entered.wait(10)
    before = snapshot(draft)
    with capture_logs() as logs, pytest.raises(StateError, match=r"unlocked.*other thread") as ei:
        if second == "finalize_loading":
            draft.finalize_loading()
        elif second == "commit":
            session.commit()
        elif second == "apply_bucket":
            apply_bucket(draft, [("fc.weight", b["fc.weight"] * 3)])
        else:
            draft.abort_reload("from the other thread")
    assert type(ei.value).__name__ == "ConcurrentUseError"
    assert [e["error"] for e in logs if e["event"] == "refused"] == ["ConcurrentUseError"]
    assert_same(draft, before)  # nothing written, the state as it was
    go.set()
    thread.join(10)
    assert not failures, failures
    assert torch.equal(draft.live_tensor(QKV), b[QKV] * 2)  # W's write landed and was reported
    session.commit()
    assert draft.lifecycle.usable
    assert_derived_current(draft)


# ---- item 6: nested sessions ------------------------------------------------------------------------------------
def test_a_second_open_session_on_one_backbone_is_refused(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                          ckpt_b: Path) -> None:
    """Item 6: the inner session is refused at begin (audited), so the outer one's rollback still undoes the
    reload exactly when it fails, and `recover()` returns to the last good buffers."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    before = snapshot(draft)
    with pytest.raises(RuntimeError, match="outer fails"), draft.reload_session(rollback=True) as outer:
        outer.load(ckpt_b)
        with (capture_logs() as logs, pytest.raises(SessionStateError, match="another reload session"),
              draft.reload_session() as inner):
            inner.commit()
        assert [e["trigger"] for e in logs if e["event"] == "refused"] == ["begin_reload"]
        raise RuntimeError("outer fails")
    assert draft.lifecycle.quarantined and outer.recoverable
    draft.recover()
    assert_same(draft, before)
    with draft.reload_session() as again:  # the outer one closed: a new session opens
        again.load(ckpt_b)
        again.commit()
    assert_derived_current(draft)


def test_a_session_dropped_while_open_does_not_block_the_next(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                              ckpt_b: Path) -> None:
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a)
    draft.reload_session().begin()  # begun, never committed nor aborted, dropped
    draft.abort_reload("the trainer dropped its session")
    with draft.reload_session() as s:
        s.load(ckpt_b)
        s.commit()
    assert_derived_current(draft)


# ---- item 7: META is never trusted as the loader's own copy -----------------------------------------------------
@pytest.mark.parametrize("path", ["loader", "apply_bucket"])
def test_a_load_onto_meta_is_refused_at_the_finish_and_a_corrected_load_builds_everything(
        tiny_cfg: DFlashConfig, ckpt_a: Path, path: str) -> None:
    """Item 7: `device="meta"` leaves every placeholder on META: the finish names them and runs no hook (the RoPE
    table is not built on META and marked done); the corrected load on the same instance builds everything."""
    draft = DFlashQwen3Draft(tiny_cfg)
    if path == "loader":
        load_safetensors(draft, ckpt_a, device="meta")
    else:
        apply_bucket(draft, list(load_file(ckpt_a).items()), device="meta")
    with capture_logs() as logs, pytest.raises(LayersNotReadyError, match=r"\(META\)"):
        draft.finalize_loading()
    assert not [e for e in logs if e["event"] == "hook_run"]
    load_safetensors(draft, ckpt_a)  # corrected
    draft.finalize_loading()
    draft.refresh_derived_buffers()
    assert_derived_current(draft)  # the RoPE table too, computed on the weights' device
    oracle = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a)
    assert torch.equal(draft._rope_cos_sin_cache, oracle._rope_cos_sin_cache)


# ---- item 8: what a bucket holds must be tensors that say what they are -----------------------------------------
class ShapeLiar(torch.Tensor):
    """A tensor that says it has the weight's shape: `copy_` would broadcast its one value into the weight."""

    @property  # type: ignore[override]  # a property over Tensor.shape: the lie this test feeds the loader
    def shape(self) -> torch.Size:
        return torch.Size([128, 64])


@pytest.mark.parametrize(("value", "named"), [
    (None, "NoneType"), ([1.0, 2.0], "list"), (3, "int"), ("weights", "str"),
    (torch.ones(1).as_subclass(ShapeLiar), r"ShapeLiar that says shape \(128, 64\) float32 but holds \(1,\)"),
])
def test_a_value_that_is_not_a_tensor_is_refused_naming_it_and_nothing_changes(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, value: object, named: str) -> None:
    """Item 8: refused as a `LoadRefusedError` (`WeightTypeError`) naming the tensor and what it got, audited,
    before anything of the bucket is written (the sound tensor before it too)."""
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a, capture_graphs=True)
    before = snapshot(draft)
    with draft.reload_session(rollback=True) as s:
        with capture_logs() as logs, pytest.raises(LoadRefusedError, match=rf"{QKV}: .*{named}") as ei:
            s.apply({"fc.weight": load_file(ckpt_b)["fc.weight"], QKV: value})
        s.abort("refused")
    assert type(ei.value).__name__ == "WeightTypeError"
    assert [e["error"] for e in logs if e["event"] == "refused"] == ["WeightTypeError"]
    assert draft.recover()
    assert_same(draft, before)


@pytest.mark.parametrize("bucket", [5, None, [("fc.weight",)], [(7, torch.ones(1))], "fc.weight"])
def test_a_bucket_that_is_not_name_tensor_pairs_is_refused(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                           bucket: Any) -> None:
    draft = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a)
    draft.begin_reload()
    before = snapshot(draft)
    with pytest.raises(LifecycleError, match="not a mapping of name -> tensor"):
        apply_bucket(draft, bucket)
    assert_same(draft, before)
