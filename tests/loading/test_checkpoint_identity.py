"""A checkpoint rewritten in place with its old mtime put back is detected (lifecycle/checkpoint.py; issue 25,
item 6).

Before, a file's identity was (size, mtime_ns, inode, device): a same-size rewrite followed by `os.utime` with the
old mtime_ns passed every check, and a load mixed the two versions (26 of 27 tensors from the new bytes) and was
committed. `st_ctime_ns` changes with every write and every `utime`, and cannot be set from user space.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lifecycle.checkpoint import checkpoint_index, iter_buckets, write_checkpoint
from lifecycle.errors import CheckpointError
from lifecycle.loading import load_safetensors
from lifecycle.states import LifecycleState
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.reference import assert_same, snapshot

S = LifecycleState


def _rewrite_keeping_mtime(path: Path, new: bytes) -> None:
    """What a trainer (or an attacker) can do: same size, same inode, new bytes, the old mtime put back."""
    before = path.stat()
    assert len(new) == before.st_size
    with path.open("r+b") as fh:
        fh.write(new)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def test_a_rewrite_with_the_old_mtime_between_buckets_is_refused_and_nothing_mixed_is_kept(tmp_path: Path) -> None:
    cfg = DFlashConfig(num_hidden_layers=3)
    path = write_checkpoint(random_weights(cfg, 1), tmp_path / "ckpt.safetensors")
    validated = random_weights(cfg, 1)
    draft = DFlashQwen3Draft(cfg)
    load_safetensors(draft, write_checkpoint(random_weights(cfg, 0), tmp_path / "a.safetensors"))
    draft.finalize_loading()
    draft.refresh_derived_buffers()
    before = snapshot(draft)
    new = write_checkpoint(random_weights(cfg, 2), tmp_path / "new.safetensors").read_bytes()
    buckets: list[int] = []
    written: dict[str, torch.Tensor] = {}

    def after_bucket(progress: object) -> None:
        buckets.append(1)
        if len(buckets) == 1:
            _rewrite_keeping_mtime(path, new)

    def record(module: object, name: str, value: torch.Tensor, device: object) -> None:
        from lifecycle.loading import write_tensor

        written[name] = value.clone()
        write_tensor(draft, name, value, "cpu")

    with pytest.raises(CheckpointError, match=r"ckpt\.safetensors changed since its header was read.*ctime_ns"), \
            draft.reload_session(rollback=True, writer=record) as s:
        s.load(path, bucket_by="layer", progress=after_bucket)
        s.commit()  # before: reached, with a load of two files mixed
    assert len(buckets) == 1  # refused at the second bucket, before it was handed out
    assert written and all(torch.equal(t, validated[n]) for n, t in written.items())  # all from the file indexed
    assert draft.lifecycle.state is S.QUARANTINED
    assert_same(draft, before)  # rolled back


def test_a_rewrite_with_the_old_mtime_between_the_index_and_the_first_read_is_refused(tmp_path: Path) -> None:
    path = write_checkpoint({"a": torch.ones(64), "b": torch.zeros(64)}, tmp_path / "w.safetensors")
    index = checkpoint_index(path)
    _rewrite_keeping_mtime(path, write_checkpoint({"a": torch.full((64,), 5.0), "b": torch.zeros(64)},
                                                  tmp_path / "other.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"changed since its header was read \(opened for reading\).*ctime_ns"):
        list(iter_buckets(index, [["a"], ["b"]]))


def test_a_descriptor_opened_on_another_file_is_refused_though_the_path_names_the_indexed_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-bucket check stats the path only: that stands for the descriptor's file because the descriptor
    itself was checked when it was opened. A path swapped to another file for the moment of the open (and back
    before any look at it) leaves a descriptor on that other file: refused at the open, nothing read from it."""
    from lifecycle import checkpoint

    path = write_checkpoint({"a": torch.ones(64), "b": torch.zeros(64)}, tmp_path / "w.safetensors")
    other = write_checkpoint({"a": torch.full((64,), 5.0), "b": torch.zeros(64)}, tmp_path / "other.safetensors")
    index = checkpoint_index(path)
    opened = checkpoint._open_regular
    monkeypatch.setattr(checkpoint, "_open_regular", lambda _path, root=None: opened(other, root))
    with pytest.raises(CheckpointError, match=r"w\.safetensors changed since its header was read \(opened for "
                                              r"reading\): .*inode"):
        list(iter_buckets(index, [["a"], ["b"]]))


def test_a_chmod_of_the_file_during_a_load_also_refuses_it(tmp_path: Path) -> None:
    """The price of ctime, chosen: any change to the inode between the header and the last bucket (a chmod, a
    hard link, a rename of the file) refuses the load, fail-closed; the caller loads again."""
    path = write_checkpoint({"a": torch.ones(64), "b": torch.zeros(64)}, tmp_path / "w.safetensors")
    read = iter_buckets(checkpoint_index(path), [["a"], ["b"]])
    next(read)
    path.chmod(0o400)
    with pytest.raises(CheckpointError, match=r"after reading 1 tensor\(s\).*ctime_ns"):
        next(read)


def test_a_write_through_a_shared_mapping_to_pages_it_already_dirtied_is_not_detected(tmp_path: Path) -> None:
    """What is NOT detected, pinned so that docs/guarantees.md stays exact (issue 32, item 13): a process that holds
    the file mapped shared and writable, and already wrote to a page (the kernel updates mtime and ctime at the
    first write to a clean page, not at later ones), changes no stat field when it writes that page again. A load
    between two buckets then reads the new bytes unnoticed. A trainer must not rewrite a checkpoint in place (the
    refusals say: write the next checkpoint to a new path)."""
    import mmap

    path = write_checkpoint({"a": torch.ones(1024), "b": torch.zeros(1024)}, tmp_path / "w.safetensors")
    index = checkpoint_index(path)
    start = index["b"].start
    with path.open("r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapped:
        mapped[start:start + 4] = mapped[start:start + 4]  # the page of b dirtied (times updated) before the index
        index = checkpoint_index(path)
        got = []
        for bucket in iter_buckets(index, [["a"], ["b"]]):
            if not got:
                mapped[start:start + 4] = torch.tensor([5.0]).numpy().tobytes()  # between the buckets, no stat change
            got.append(bucket)
    assert float(got[1][0][1][0]) == 5.0  # read, undetected: the promise says so
