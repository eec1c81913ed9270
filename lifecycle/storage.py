"""Storage identity: what a captured CUDA graph holds on to, and the checks that it did not move.

Identity = (data_ptr, storage_offset, shape, stride, dtype, device), as vLLM RFC #48478 defines it.

>>> import torch
>>> t = torch.zeros(4, 2)
>>> a = StorageIdentity.of(t)
>>> t.copy_(torch.ones(4, 2)) is t and StorageIdentity.of(t) == a
True
>>> a.matches(t), a.matches(t.t()), a.matches(t.clone()), a.matches(t[1:])
(True, False, False, False)
>>> describe_changes("w", a, StorageIdentity.of(t.t()))
['w: shape (4, 2) -> (2, 4)', 'w: stride (2, 1) -> (1, 2)']
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any, cast

import torch

from .torch_private import DispatchMode, is_fake, torch_function_bypassed, tree_leaves
from .types import dtype_name

__all__ = ["AllocationLog", "AllocationRecord", "IdentityColumns", "PinnedContent", "PinnedStorage",
           "StorageIdentity", "content_digest", "count_allocations", "describe_changes"]


@dataclass(frozen=True)
class StorageIdentity:
    data_ptr: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> StorageIdentity:
        # objects, not strings: this runs for every pinned tensor at every check
        return cls(0 if t.is_meta else t.data_ptr(),
                   t.storage_offset(),  # type: ignore[arg-type]  # torch's stubs: int | SymInt; a real tensor's: int
                   tuple(t.shape), t.stride(), t.dtype, t.device)

    def matches(self, t: torch.Tensor) -> bool:
        """Whether `t` has exactly this identity: `StorageIdentity.of(t) == self` without building one (the
        per-tensor hot path of pin verification; cheapest fields first)."""
        return ((0 if t.is_meta else t.data_ptr()) == self.data_ptr and t.storage_offset() == self.storage_offset
                and t.shape == self.shape and t.stride() == self.stride and t.dtype == self.dtype
                and t.device == self.device)

    def as_log(self) -> dict[str, object]:
        return {"data_ptr": hex(self.data_ptr), "shape": list(self.shape), "dtype": dtype_name(self.dtype),
                "device": str(self.device)}


_FIELDS = ("data_ptr", "storage_offset", "shape", "stride", "dtype", "device")


def describe_changes(name: str, old: StorageIdentity, new: StorageIdentity, fields: tuple[str, ...] = _FIELDS
                     ) -> list[str]:
    """One line per changed field, `name: field old -> new` (pointers in hex)."""
    out = []
    for f in fields:
        a, b = getattr(old, f), getattr(new, f)
        if a != b:
            if f == "data_ptr":
                a, b = hex(a), hex(b)
            elif f in ("dtype", "device"):
                a, b = dtype_name(a), dtype_name(b)
            out.append(f"{name}: {f} {a} -> {b}")
    return out


class IdentityColumns:
    """The storage identities of a list of tensors, one column per field, compared with live tensors in bulk.

    A pin verification compares every graph-visible tensor twice per refresh, the second time right after the
    refresh's copies went through the caches: so a pass reads each field of every live tensor with one C-level
    `map`, cheapest and likeliest to change first (`data_ptr` first, a META tensor's being 0 as in
    `StorageIdentity.of`), and compares it with a compact column: the pointers in an `array`, every other value
    interned (the few distinct shapes, strides, dtypes and devices of a model are each one object), so that a
    pass touches little besides the live tensors themselves.

    >>> t = torch.zeros(4, 2)
    >>> cols = IdentityColumns.of([t, t[1:]])
    >>> cols.same([t, t[1:]]), cols.same([t, t[2:]]), cols.same([t, None])
    (True, False, False)
    """

    __slots__ = ("_ptrs", "_rest")

    _READERS: tuple[Callable[[torch.Tensor], object], ...] = (
        torch.Tensor.storage_offset, attrgetter("shape"), torch.Tensor.stride, attrgetter("dtype"),
        attrgetter("device"))

    def __init__(self, identities: Iterable[StorageIdentity]) -> None:
        idents = list(identities)
        pool: dict[object, object] = {}
        self._ptrs = array("Q", [i.data_ptr for i in idents])
        self._rest = [[pool.setdefault(v, v) for v in (getattr(i, f) for i in idents)] for f in _FIELDS[1:]]

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> IdentityColumns:
        return cls(map(StorageIdentity.of, tensors))

    def same(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Whether every tensor has exactly the identity in its place (False for a None, or a tensor without
        storage: the caller's per-tensor check says what)."""
        # a None among `tensors` raises in a reader (TypeError, AttributeError): the answer is False
        present = cast("Sequence[torch.Tensor]", tensors)
        try:
            # a tensor subclass with its own `__torch_function__` (vLLM's parameters) would answer each field
            # through it: read as a plain tensor's (the same values), a pin check of a draft costs half as much
            with torch_function_bypassed():
                return (array("Q", map(torch.Tensor.data_ptr, present)) == self._ptrs
                        and all(list(map(read, present)) == column
                                for read, column in zip(self._READERS, self._rest, strict=True)))
        except (AttributeError, TypeError, RuntimeError, OverflowError):
            return False


@dataclass(frozen=True)
class PinnedStorage:
    """Storage identities snapshotted at graph capture. Verification compares them with the live tensors.

    `identities` is read-only: a verification first compares the live tensors with the snapshot in bulk
    (`IdentityColumns`); only when something differs does the per-tensor loop say what.

    >>> t = torch.zeros(4, 2)
    >>> pins = PinnedStorage.snapshot({"w": t})
    >>> pins.changes({"w": t}), pins.changes({"w": t.t()}), pins.changes({})
    ([], ['w: shape (4, 2) -> (2, 4)', 'w: stride (2, 1) -> (1, 2)'], ['w: pinned tensor is gone (was 0x...)'])
    """

    identities: Mapping[str, StorageIdentity] = field(default_factory=dict)
    _names: list[str] = field(init=False, repr=False, compare=False)
    _columns: IdentityColumns = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "identities", MappingProxyType(dict(self.identities)))
        object.__setattr__(self, "_names", list(self.identities))
        object.__setattr__(self, "_columns", IdentityColumns(self.identities.values()))

    @classmethod
    def snapshot(cls, tensors: Mapping[str, torch.Tensor]) -> PinnedStorage:
        return cls({name: StorageIdentity.of(t) for name, t in tensors.items()})

    def changes(self, live: Mapping[str, torch.Tensor | None]) -> list[str]:
        # a live view that reads many names at once (`lifecycle.slots.LiveSlots`), else one `get` per name
        bulk = getattr(live, "tensors_at", None)
        tensors = bulk(self._names) if bulk is not None else list(map(live.get, self._names))
        if self._columns.same(tensors):
            return []
        problems: list[str] = []
        for (name, old), t in zip(self.identities.items(), tensors, strict=True):
            if t is None:
                problems.append(f"{name}: pinned tensor is gone (was {hex(old.data_ptr)})")
            elif not old.matches(t):
                problems.extend(describe_changes(name, old, StorageIdentity.of(t)))
        return problems

    def __len__(self) -> int:
        return len(self.identities)


def content_digest(t: torch.Tensor) -> str:
    """A digest of `t`'s bytes (blake2b, 128 bits), as they are stored; a device tensor is read back first.

    >>> content_digest(torch.zeros(3)) == content_digest(torch.zeros(3)), content_digest(torch.ones(3))[:8]
    (True, '0e2942e7')
    """
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(raw), digest_size=16).hexdigest()  # type: ignore[arg-type]  # numpy's stubs


@dataclass(frozen=True)
class PinnedContent:
    """The CONTENT of the tensors graphs read that no reload writes (constant derived buffers: a RoPE table a
    cold-load hook computed, a custom buffer with no dependencies), pinned by digest at capture: their storage
    identity is pinned too, but a write into that memory, or its corruption, keeps the identity. Checked by
    `verify_pinned()` (not at every refresh: a digest reads every byte)."""

    digests: Mapping[str, str]

    @classmethod
    def snapshot(cls, tensors: Mapping[str, torch.Tensor | None]) -> PinnedContent:
        return cls(MappingProxyType({n: content_digest(t) for n, t in tensors.items() if t is not None}))

    def changes(self, live: Mapping[str, torch.Tensor | None]) -> list[str]:
        problems = []
        for name, was in self.digests.items():
            t = live.get(name)
            if t is None:
                problems.append(f"{name}: pinned constant buffer is gone")
            elif (now := content_digest(t)) != was:
                problems.append(f"{name}: content changed since capture (digest {was} -> {now}); no reload writes "
                                "this constant derived buffer: its memory was written or corrupted")
        return problems

    def __len__(self) -> int:
        return len(self.digests)


# ---- counting allocations (tests and benchmarks) ---------------------------------------------------------


@dataclass
class AllocationRecord:
    op: str
    nbytes: int


@dataclass
class AllocationLog:
    records: list[AllocationRecord] = field(default_factory=list)

    @property
    def storages_created(self) -> int:
        return len(self.records)

    @property
    def bytes_allocated(self) -> int:
        return sum(r.nbytes for r in self.records)

    def at_least(self, nbytes: int) -> list[AllocationRecord]:
        return [r for r in self.records if r.nbytes >= nbytes]


def _real(t: object) -> bool:
    """A tensor with real storage: not META, not a fake tensor of a dry run (`custom(..., into=)`)."""
    return isinstance(t, torch.Tensor) and not t.is_meta and not is_fake(t)


class _CountNewStorages(DispatchMode):
    """Counts op outputs whose storage is new: neither an input's storage nor one seen before. Every storage
    counted is held until the block ends: a freed storage's address, reused by a later allocation, would
    otherwise look "seen before" and that allocation would go uncounted (a loader's read buffers, freed after
    each bucket, hid a rollback snapshot's copies)."""

    def __init__(self, log: AllocationLog) -> None:
        super().__init__()
        self.log = log
        self._seen: set[int] = set()
        self._held: list[torch.UntypedStorage] = []

    def __torch_dispatch__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if _real(t)
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not _real(t):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in inputs or ptr in self._seen:
                continue
            self._seen.add(ptr)
            self._held.append(st)
            self.log.records.append(AllocationRecord(str(func), st.nbytes()))
        return out


@contextmanager
def count_allocations() -> Iterator[AllocationLog]:
    """Record every new tensor storage created by torch ops inside the block.

    >>> with count_allocations() as log:
    ...     buf = torch.zeros(8)
    ...     _ = buf.copy_(torch.ones(8))
    >>> log.storages_created  # zeros and ones; copy_ wrote in place
    2
    """
    log = AllocationLog()
    with _CountNewStorages(log):
        yield log
