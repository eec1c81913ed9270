"""The rules that keep one push's calls apart from another's, without an engine (lifecycle/vllm/online/pushes.py,
chunks.py; the live interleavings are tests/vllm_plugin/online/test_vllm_push_ownership.py): a tensor sent again is
compared by where its bytes come from first, and read only when that differs (counted); push ids bind at the first
chunk; labels are bounded."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from lifecycle.checkpoint import write_checkpoint
from lifecycle.vllm.online import chunks
from lifecycle.vllm.online.chunks import ChunkConflictError, admit, record
from lifecycle.vllm.online.pushes import (
    CONFLICT,
    LABEL_CAP,
    Push,
    WeightUpdateRefused,
    check_chunk,
    check_finish,
    check_label,
    take_push_id,
)
from lifecycle.vllm.reload.payload import plan_payload


def _push() -> Push:
    now = time.monotonic()
    return Push(draft=True, started=now, last_call=now, epoch=7)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    a = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}
    other = {"w": torch.zeros(3, 4), "b": torch.ones(4)}
    out = {"a": write_checkpoint(a, tmp_path / "a" / "model.safetensors"),
           "other": write_checkpoint(other, tmp_path / "other" / "model.safetensors")}
    (tmp_path / "copy").mkdir()
    out["copy"] = Path(shutil.copy(out["a"], tmp_path / "copy" / "model.safetensors"))
    return out


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every tensor `chunks` reads to compare bytes."""
    seen: list[str] = []
    original = chunks._read

    def counted(index: dict, name: str) -> torch.Tensor:
        seen.append(name)
        return original(index, name)

    monkeypatch.setattr(chunks, "_read", counted)
    return seen


def test_a_tensor_sent_again_from_the_same_file_is_skipped_without_reading_it(files: dict[str, Path],
                                                                              reads: list[str]) -> None:
    push = _push()
    first = plan_payload(files["a"])
    assert admit(push, first, None) is first  # nothing sent before: the payload as planned
    record(push, first)
    again = admit(push, plan_payload(files["a"]), None)
    assert again.tensors == 0 and push.resent == 2 and reads == []  # the same file, unchanged: not read at all


def test_a_tensor_sent_again_from_another_file_is_compared_byte_for_byte(files: dict[str, Path],
                                                                         reads: list[str]) -> None:
    push = _push()
    record(push, plan_payload(files["a"]))
    assert admit(push, plan_payload(files["copy"]), None).tensors == 0 and sorted(reads) == ["b", "b", "w", "w"]
    with pytest.raises(ChunkConflictError, match=r"sends w with other bytes than this push already wrote \(from "):
        admit(push, plan_payload(files["other"]), None)
    assert push.resent == 2  # the refused chunk counted nothing


def test_bytes_that_cannot_be_compared_refuse_the_chunk(files: dict[str, Path]) -> None:
    push = _push()
    record(push, plan_payload(files["a"]))
    payload = plan_payload(files["copy"])
    os.utime(files["a"], ns=(1, 1))  # the first file changed since the push read it
    with pytest.raises(ChunkConflictError, match=r"this push wrote \w from .* the bytes cannot be compared"):
        admit(push, payload, None)


def test_push_ids_bind_at_the_first_chunk_and_a_finish_repeats_its_id() -> None:
    push = _push()
    check_chunk(push, "t1")
    check_chunk(push, "t1")
    for other in ("t2", None):
        with pytest.raises(WeightUpdateRefused, match=f"^{CONFLICT.replace('(', '[(]').replace(')', '[)]')}"):
            check_chunk(push, other)
    with pytest.raises(WeightUpdateRefused, match="it carries weight_version t2"):
        check_finish(push, "t2")
    check_finish(push, "t1")
    silent = _push()
    check_chunk(silent, None)  # a push without an id: every chunk without one, any finish
    with pytest.raises(WeightUpdateRefused, match="and sent no push id"):
        check_chunk(silent, "late")
    check_finish(silent, "anything")


def test_labels_are_bounded_and_the_push_id_is_taken_out_of_update_info() -> None:
    assert check_label("r2-t1:step/5@x=y#z+1.0", "v") == "r2-t1:step/5@x=y#z+1.0"
    for bad in ("", "a b", "é", "x" * (LABEL_CAP + 1), "a\nb"):
        with pytest.raises(ValueError, match=f"v must be 1 to {LABEL_CAP} characters"):
            check_label(bad, "v")
    with pytest.raises(TypeError, match="must be a string or null, got int"):
        check_label(5, "v")
    info = {"path": "/p", "push_id": "t1"}
    assert take_push_id(info) == ({"path": "/p"}, "t1") and info == {"path": "/p", "push_id": "t1"}
    assert take_push_id([{"path": "/p", "push_id": "t1"}] * 2) == ([{"path": "/p"}] * 2, "t1")
    with pytest.raises(ValueError, match="every rank's item must carry the same"):
        take_push_id([{"push_id": "t1"}, {"push_id": "t2"}])
