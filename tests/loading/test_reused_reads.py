"""The loader's reads into one reused buffer (`iter_buckets(reuse=True)`).

Before it, every value of a checkpoint was read into a fresh tensor and freed with its bucket. On a real-size
draft (8 layers, hidden 4096, bf16, 1.5 GB) each bucket's tensors were above the allocator's mmap threshold:
every reload faulted all 1.5 GB in again (377k minor faults, 820 ms; with the reused buffer 61k faults, 300 ms),
and on a 155 MB draft of small tensors the heap sometimes gave its pages back between buckets (15k faults and
+46% for the lifecycle's reload in two benchmark processes out of five). These tests pin what the reuse must not
change: the values each bucket yields, that nothing the loader leaves behind aliases the buffer, and that a
`writer` that keeps what it is given still gets tensors of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lifecycle.checkpoint import ReadBuffer, checkpoint_index, iter_buckets
from lifecycle.loading import load_safetensors, plan_buckets, write_checkpoint, write_tensor
from lifecycle.read_buffers import MappedBuffer
from lifecycle.readiness import layer_of
from lifecycle.states import LifecycleState
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

CFG = DFlashConfig(num_hidden_layers=3)


def _mixed(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Values of several dtypes and sizes that are not multiples of 64 bytes, an empty one, in three buckets."""
    g = torch.Generator().manual_seed(0)
    values = {
        "layers.0.a": torch.randn(3, 5, generator=g),  # 60 bytes
        "layers.0.b": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes
        "layers.0.c": torch.arange(3, dtype=torch.int64),
        "layers.1.a": torch.randn(33, 17, generator=g),  # the largest bucket comes second
        "layers.1.e": torch.empty(0, 4),
        "layers.1.f": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "layers.2.a": torch.randn(2, generator=g).double(),
    }
    return write_checkpoint(values, tmp_path / "mixed.safetensors"), values


def test_each_bucket_yields_the_values_in_the_file_either_way(tmp_path: Path) -> None:
    path, values = _mixed(tmp_path)
    index = checkpoint_index(path)
    buckets = plan_buckets(list(index), layer_of)
    fresh = [[(n, t.clone()) for n, t in b] for b in iter_buckets(index, buckets)]
    for bucket, expected in zip(iter_buckets(index, buckets, reuse=True), fresh, strict=True):
        assert [n for n, _ in bucket] == [n for n, _ in expected]
        for (name, got), (_, want) in zip(bucket, expected, strict=True):
            assert got.dtype == values[name].dtype and got.shape == values[name].shape, name
            assert torch.equal(got, want) and torch.equal(got, values[name]), name
            assert got.data_ptr() % 64 == 0, f"{name} starts at {got.data_ptr() % 64} bytes past a 64-byte line"


def test_a_read_buffer_kept_by_its_owner_yields_the_values_in_its_one_buffer(tmp_path: Path) -> None:
    """`iter_buckets(into=ReadBuffer())` (the loader's `read_buffer=`, the plugin's staging the same way): each value
    is made over the owner's buffer (one `as_strided`, `read_buffers.MappedBuffer`), and a second read of the same
    checkpoint reuses that buffer."""
    path, values = _mixed(tmp_path)
    index = checkpoint_index(path)
    buckets = plan_buckets(list(index), layer_of)
    kept = ReadBuffer()

    def read_all() -> torch.Tensor:
        for bucket in iter_buckets(index, buckets, into=kept):
            assert kept.buffer is not None
            for name, got in bucket:
                assert got.dtype == values[name].dtype and got.shape == values[name].shape, name
                assert torch.equal(got, values[name]) and got.is_contiguous(), name
                if got.numel():
                    assert got.untyped_storage().data_ptr() == kept.buffer.untyped_storage().data_ptr(), name
        assert kept.buffer is not None
        return kept.buffer

    first = read_all()
    assert read_all() is first, "the second read reused the buffer the first one grew"


@pytest.mark.parametrize("bad", [torch.empty(64), torch.empty(2, 64, dtype=torch.uint8),
                                 torch.empty(128, dtype=torch.uint8)[1:], torch.empty(128, dtype=torch.uint8)[::2]],
                         ids=["float32", "2-D", "unaligned start", "strided"])
def test_a_mapped_buffer_refuses_a_tensor_it_could_not_make_values_over(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"a read buffer is a contiguous 1-D uint8 tensor starting 64-byte aligned"):
        MappedBuffer(bad)


def test_the_buffer_is_reused_and_grows_only_for_a_larger_bucket(tmp_path: Path) -> None:
    path, _ = _mixed(tmp_path)
    index = checkpoint_index(path)
    # by layer, in this order (the index lists the names in file order): bucket 1 is the largest, bucket 2 small
    buckets = [[n for n in index if n.startswith(f"layers.{i}.")] for i in range(3)]
    storages = [{t.untyped_storage().data_ptr() for _, t in b if t.numel()} for b in iter_buckets(index, buckets,
                                                                                                  reuse=True)]
    assert all(len(s) == 1 for s in storages), "one buffer per bucket"
    assert storages[2] == storages[1], "a smaller bucket is read into the buffer the larger one grew"
    fresh = [{t.untyped_storage().data_ptr() for _, t in b if t.numel()} for b in iter_buckets(index, buckets)]
    assert len(fresh[0]) == 3, "without reuse each value has a storage of its own"


def test_a_loaded_backbone_shares_no_storage_with_the_reads(tmp_path: Path) -> None:
    """Cold load (META placeholders materialised) and reload: every parameter equals the file's value after the
    whole load, i.e. no parameter was left a view of the buffer the next bucket overwrote."""
    weights = [random_weights(CFG, seed) for seed in (0, 1)]
    paths = [write_checkpoint(w, tmp_path / f"w{i}.safetensors") for i, w in enumerate(weights)]
    m = DFlashQwen3Draft(CFG, name="reused")
    for i, path in enumerate(paths):
        if i:
            m.begin_reload()
        load_safetensors(m, path)
        m.finalize_loading()
        live = m.state_dict()
        for name, value in weights[i].items():
            assert torch.equal(live[name], value), f"{name} after load {i}"
        ptrs = [t.untyped_storage().data_ptr() for t in live.values()]
        assert len(set(ptrs)) == len(ptrs), "two parameters share a storage"
    assert m.lifecycle.state is LifecycleState.FINALIZED


def test_a_writer_that_keeps_its_values_gets_tensors_of_its_own(tmp_path: Path) -> None:
    """A `writer` may keep what it is given (a trainer's staging, a recorder): the loader reads without reuse
    for it, so the first bucket's values are intact after the last bucket was read."""
    weights = random_weights(CFG, 0)
    path = write_checkpoint(weights, tmp_path / "w.safetensors")
    kept: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, name: str, value: torch.Tensor, device: object) -> None:
        kept[name] = value
        write_tensor(module, name, value, device)

    m = cold_load(DFlashQwen3Draft(CFG, name="kept"), path, refresh=False)
    m.begin_reload()
    load_safetensors(m, path, writer=keep)
    assert kept.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(kept[name], value), f"{name} was overwritten by a later bucket"
