"""Checkpoints that change, vanish or lie while they are read (lifecycle/checkpoint.py and the loader).

Before this reader, `safetensors.safe_open` memory-mapped each file: a file truncated after its header was
validated killed the process with SIGBUS (shown below in a subprocess), a file rewritten in place during a load
mixed two checkpoints without an error, a FIFO given as the path hung the index forever, and a tensor present
in two shards was silently taken from the last file.
"""

from __future__ import annotations

import gc
import os
import signal
import struct
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

from lifecycle.checkpoint import checkpoint_files, checkpoint_index, iter_buckets
from lifecycle.errors import CheckpointError
from lifecycle.loading import plan_buckets, write_checkpoint
from lifecycle.readiness import layer_of
from lifecycle.states import LifecycleState
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.reference import assert_same, snapshot

S = LifecycleState


def _data_start(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_the_memory_mapped_reader_died_of_sigbus_on_a_truncated_file(tmp_path: Path) -> None:
    """The failure this module exists for, reproduced with the reader the loader used before: safetensors maps
    the file, so reading a tensor whose pages were cut away is a SIGBUS (exit -7), no error, no audit event."""
    path = write_checkpoint({"w": torch.ones(4096, 8)}, tmp_path / "w.safetensors")
    script = (
        "import os, sys\n"
        "from safetensors import safe_open\n"
        "f = safe_open(sys.argv[1], framework='pt')\n"
        "os.truncate(sys.argv[1], 4096)\n"  # the header was validated; the data is gone
        "print(float(f.get_tensor('w').sum()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-500:])


def test_a_file_truncated_after_its_header_was_read_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = write_checkpoint({"a": torch.ones(64, 8), "w": torch.ones(4096, 8)}, tmp_path / "w.safetensors")
    index = checkpoint_index(path)
    os.truncate(path, _data_start(path) + 1000)
    with pytest.raises(CheckpointError, match=r"w\.safetensors changed since its header was read.*size"):
        list(iter_buckets(index, [["a"], ["w"]]))
    # and truncated before the index: the byte ranges are checked against the file's size
    with pytest.raises(CheckpointError, match=r"tensor \w needs bytes .* but the file has .*: truncated"):
        checkpoint_index(path)


def test_a_short_read_is_an_error(tmp_path: Path) -> None:
    """A file that shrinks between the identity check and the read (no check can be atomic with a read)."""
    from lifecycle import checkpoint

    path = write_checkpoint({"w": torch.ones(1024)}, tmp_path / "w.safetensors")
    index = checkpoint_index(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = memoryview(bytearray(4096))
        os.truncate(path, _data_start(path) + 100)
        with pytest.raises(CheckpointError, match=r"the file ended after \d+ bytes while \d+ were expected"):
            checkpoint._read_exact(fd, out, index["w"].start, path)
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["in_place", "replaced", "removed"])
def test_a_checkpoint_changed_during_a_load_is_refused_and_nothing_mixed_is_written(tmp_path: Path, how: str
                                                                                  ) -> None:
    """A trainer rewrites the checkpoint while the loader is between buckets. The old (memory-mapped) loader
    wrote the later buckets from the new file next to the earlier ones from the old, and the load finished
    without an error. Now the bucket that saw the change is refused, every tensor written came from the file
    as indexed, and the session rolls back."""
    cfg = DFlashConfig(num_hidden_layers=3)
    path = write_checkpoint(random_weights(cfg, 1), tmp_path / "ckpt.safetensors")
    a, b = random_weights(cfg, 0), random_weights(cfg, 1)
    draft = cold_load(DFlashQwen3Draft(cfg), write_checkpoint(a, tmp_path / "a.safetensors"))
    before = snapshot(draft)
    new = write_checkpoint(random_weights(cfg, 2), tmp_path / "new.safetensors").read_bytes()
    seen: list[int] = []

    def trainer_writes(progress: object) -> None:
        seen.append(1)
        if len(seen) == 1:
            if how == "in_place":
                with path.open("r+b") as fh:  # same size, new values, same inode
                    fh.write(new)
                st = path.stat()
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later write time
            elif how == "replaced":
                tmp = tmp_path / "next.safetensors"
                tmp.write_bytes(new)
                tmp.replace(path)
            else:
                path.unlink()

    written: dict[str, torch.Tensor] = {}

    def record(module: object, name: str, value: torch.Tensor, device: object) -> None:
        from lifecycle.loading import write_tensor

        written[name] = value.clone()
        write_tensor(draft, name, value, "cpu")

    with pytest.raises(CheckpointError, match=r"ckpt\.safetensors changed since its header was read") as ei, \
            draft.reload_session(rollback=True, writer=record) as s:
        s.load(path, bucket_by="layer", progress=trainer_writes)
    assert str(path) in str(ei.value) and ei.value.backbone == draft.lifecycle.name
    assert len(seen) == 1  # refused at the second bucket, before it was written
    assert written and all(torch.equal(t, b[n]) for n, t in written.items())  # all from the file as indexed
    assert draft.lifecycle.state is S.QUARANTINED and "CheckpointError" in draft.lifecycle.quarantine_reason
    assert_same(draft, before)  # rolled back
    assert draft.recover() is S.DERIVED_REFRESHED


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO opened for reading waits for a writer: the old index hung here forever."""
    fifo = tmp_path / "ckpt.safetensors"
    os.mkfifo(fifo)
    result: list[BaseException | None] = []

    def index() -> None:
        try:
            checkpoint_index(fifo)
            result.append(None)
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=index, daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():  # unblock the reader so the thread can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("checkpoint_index blocked on a FIFO")
    assert isinstance(result[0], CheckpointError)
    assert "not a regular file (a FIFO)" in str(result[0]) and str(fifo) in str(result[0])


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_a_device_is_refused(path: str) -> None:
    with pytest.raises(CheckpointError, match=rf"{path}: not a regular file \(a character device\)"):
        checkpoint_index(path)


def test_a_tensor_in_two_shards_is_refused_naming_both_files(tmp_path: Path) -> None:
    """It used to be taken silently from the last file."""
    a = write_checkpoint({"x": torch.ones(2), "w": torch.ones(3)}, tmp_path / "model-00001.safetensors")
    b = write_checkpoint({"y": torch.ones(2), "w": torch.zeros(3)}, tmp_path / "model-00002.safetensors")
    with pytest.raises(CheckpointError, match="tensor w is in two checkpoint files") as ei:
        checkpoint_index(tmp_path)
    assert str(a) in str(ei.value) and str(b) in str(ei.value)
    assert checkpoint_index([a, a]).keys() == {"x", "w"}  # one file named twice is read once


def test_a_folder_is_its_safetensors_files_in_order_and_an_empty_one_is_refused(tmp_path: Path) -> None:
    for i in (2, 1):
        write_checkpoint({f"t{i}": torch.ones(1)}, tmp_path / f"model-{i}.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert [p.name for p in checkpoint_files(tmp_path)] == ["model-1.safetensors", "model-2.safetensors"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: the folder holds no \*\.safetensors file"):
        checkpoint_index(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint file given"):
        checkpoint_index([])


@pytest.mark.parametrize("damage", ["offsets_past_the_end", "wrong_size_for_shape", "negative_dim", "not_json"])
def test_a_header_that_lies_is_refused_from_the_index(tmp_path: Path, damage: str) -> None:
    import json

    path = write_checkpoint({"w": torch.ones(4, 4)}, tmp_path / "w.safetensors")
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if damage == "offsets_past_the_end":
        header["w"]["data_offsets"] = [0, 10_000]
        header["w"]["shape"] = [2500]
    elif damage == "wrong_size_for_shape":
        header["w"]["shape"] = [4, 5]
    elif damage == "negative_dim":
        header["w"]["shape"] = [-4, -4]
    text = b"{not json" if damage == "not_json" else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*w\.safetensors"):
        checkpoint_index(path)


def test_reading_a_folder_holds_at_most_one_bucket(tmp_path: Path) -> None:
    """Peak extra memory is bounded by the bucket: when a bucket is handed out, no tensor of an earlier one
    is alive (the reader allocates exactly each tensor's bytes; `benchmarks/checkpoint_memory.py` measures RSS)."""
    cfg = DFlashConfig(num_hidden_layers=4)
    weights = random_weights(cfg, 0)
    for i in range(4):
        write_checkpoint({n: t for n, t in weights.items() if layer_of(n) in (f"layers.{i}",) or
                          (i == 3 and not n.startswith("layers."))}, tmp_path / f"part-{i}.safetensors")
    index = checkpoint_index(tmp_path)
    buckets = plan_buckets(list(index), layer_of, bucket_by=5, shuffle=True, seed=3)
    alive: list[weakref.ref[torch.Tensor]] = []
    largest = max(sum(index[n].nbytes for n in b) for b in buckets)
    for bucket in iter_buckets(index, buckets):
        gc.collect()
        held = sum(t.nbytes for r in alive if (t := r()) is not None)
        assert held == 0, f"{held} bytes of earlier buckets still alive"
        assert sum(t.nbytes for _, t in bucket) <= largest
        for name, t in bucket:
            assert torch.equal(t, weights[name])
        alive = [weakref.ref(t) for _, t in bucket]
        del bucket
