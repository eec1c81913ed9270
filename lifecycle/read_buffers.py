"""The buffers checkpoint values are read into, reused from bucket to bucket, and how a value is made in one.

>>> import torch
>>> buffer = MappedBuffer(torch.arange(16, dtype=torch.uint8))
>>> buffer.value(torch.int16, (2, 2), 8).tolist() == torch.arange(8, 16, dtype=torch.uint8).view(torch.int16).view(
...     2, 2).tolist()
True

A reader that hands out a view of a reused buffer per value would make four tensors for it (the region's slice, a
numpy array to read into, a dtype view and the reshape): a few microseconds each, and tens when every bucket's read
and copy evicted the caches since the last one (one-tensor buckets inside an engine). A `MappedBuffer` keeps one
memoryview of its buffer for the reads and one view per dtype, so a value is read through a memoryview slice and
made with one `torch.as_strided`. `iter_buckets(into=)` asks its caller for each bucket's bytes and reads the bucket
into the `Region` it answers; `ReadBuffer` is such a caller that keeps one buffer from load to load.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["ALIGN", "MappedBuffer", "ReadBuffer", "Region", "padded"]

#: Each value in a reused buffer starts at a multiple of this: any dtype's alignment, a cache line.
ALIGN = 64


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to the next multiple of `ALIGN`: what a value takes in a reused buffer."""
    return -(-nbytes // ALIGN) * ALIGN


@functools.lru_cache(maxsize=4096)  # a checkpoint's few shapes; a hostile header's many cannot grow it further
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class MappedBuffer:
    """A 1-D uint8 buffer as a reader writes into it and hands values out of it (module doc). `bytes`: one
    memoryview over all of it, for `os.preadv`."""

    __slots__ = ("_start", "_typed", "buffer", "bytes")

    def __init__(self, buffer: torch.Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous() \
                or buffer.storage_offset() % ALIGN:
            raise ValueError(f"a read buffer is a contiguous 1-D uint8 tensor starting {ALIGN}-byte aligned in its "
                             f"storage, got {buffer.dtype} {tuple(buffer.shape)} at {buffer.storage_offset()}")
        self.buffer = buffer
        self._start = buffer.storage_offset()  # `as_strided` counts from the storage's start
        # (numpy's stubs give ndarray `__buffer__` only where typing has it, Python >= 3.12)
        self.bytes = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy's stubs
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.bytes)

    def value(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        """The tensor of `dtype` and `shape` whose bytes start at `offset` (a multiple of the dtype's size: `ALIGN`
        is one): a view of the buffer, valid until the buffer is written again."""
        typed = self._typed.get(dtype)
        if typed is None:
            whole = len(self.bytes) - len(self.bytes) % dtype.itemsize
            typed = self._typed[dtype] = self.buffer[:whole].view(dtype)
        return torch.as_strided(typed, shape, _contiguous_strides(shape),
                                (self._start + offset) // dtype.itemsize)


class Region(NamedTuple):
    """Where `iter_buckets(into=)` reads one bucket: `buffer` from byte `offset` (each value at the next multiple
    of `ALIGN`)."""

    buffer: MappedBuffer
    offset: int


class ReadBuffer:
    """One buffer every bucket is read into, kept by its owner from load to load (`iter_buckets(into=)`,
    `load_safetensors(read_buffer=)`): it grows to the largest bucket once, then no read allocates. `pinned`: page-
    locked host memory, so that the copy of each value to a CUDA device reads it directly."""

    def __init__(self, *, pinned: bool = False) -> None:
        self.pinned = pinned
        self.mapped: MappedBuffer | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        return None if self.mapped is None else self.mapped.buffer

    def __call__(self, need: int) -> Region:
        if self.mapped is None or len(self.mapped) < need:
            self.mapped = None  # the smaller one goes first
            self.mapped = MappedBuffer(torch.empty(padded(need), dtype=torch.uint8, pin_memory=self.pinned))
        return Region(self.mapped, 0)
