"""What a push costs in deterministic counts, whatever the machine's load (issue 33 item 4): the bytes it hashed, the
fresh storages of 1 MiB or more it allocated, the bytes it read from the checkpoint and the bytes it copied into
the draft's tensors (apart: into its derived buffers), and vLLM's dry runs of a loader (to count what a load writes),
so that a hash, a materialised copy or a dry run added to the push path fails a test instead of hiding in a noisy
benchmark.

    with push_counts(draft_model, payload_bytes) as counts:
        push()
    counts.bytes_hashed, counts.fresh_storages, counts.read_passes, counts.write_passes, counts.loader_dry_runs

Counted from outside the code: the weight checker's own counter (`DraftRuntime.bytes_hashed`), the checkpoint
reader's read of a tensor's bytes (`lifecycle.checkpoint._read_tensor`; the headers are not the payload) and a
dispatch mode that sees every torch op
(`aten.copy_` into a real tensor; every op output whose storage is new and at least `FRESH_MIN` bytes). The
benchmark `benchmarks.engine_push` prints the same counts for each push it times.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["FRESH_MIN", "PushCounts", "push_counts"]

FRESH_MIN = 2**20  # a fresh storage this large or larger counts


@dataclass
class PushCounts:
    payload_bytes: int
    bytes_hashed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0  # copied into the draft's tensors (weights, kept or materialised)
    bytes_derived: int = 0  # copied into the draft's derived buffers (the fused K/V rows, the K/V shadows)
    loader_dry_runs: int = 0  # vLLM's dry runs of a loader on a META placeholder, to count what a load writes
    fresh: list[tuple[str, int]] = field(default_factory=list)  # (op, bytes) of each fresh storage >= FRESH_MIN

    @property
    def fresh_storages(self) -> int:
        return len(self.fresh)

    @property
    def read_passes(self) -> float:
        return self.bytes_read / self.payload_bytes

    @property
    def write_passes(self) -> float:
        return self.bytes_written / self.payload_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"payload_bytes": self.payload_bytes, "bytes_hashed": self.bytes_hashed, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "bytes_derived": self.bytes_derived,
                "fresh_storages_1mib": self.fresh_storages, "loader_dry_runs": self.loader_dry_runs,
                "fresh_mib": round(sum(n for _, n in self.fresh) / 2**20, 1),
                "read_passes": round(self.read_passes, 3), "write_passes": round(self.write_passes, 3),
                "derived_mib": round(self.bytes_derived / 2**20, 2)}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _real(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta and t.device.type != "meta"


def _counting_mode(counts: PushCounts, derived: set[int]) -> Any:
    from lifecycle.torch_private import DispatchMode, tree_leaves

    class Counting(DispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[int] = set()
            self.held: list[torch.UntypedStorage] = []  # a counted storage is held: its address is never reused

        def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if _real(t)}
            out = func(*args, **kwargs)
            if func is torch.ops.aten.copy_.default and _real(args[0]):
                nbytes = args[0].numel() * args[0].element_size()
                if _storage(args[0]) in derived:
                    counts.bytes_derived += nbytes
                else:
                    counts.bytes_written += nbytes
            for t in tree_leaves(out):
                if not _real(t):
                    continue
                st = t.untyped_storage()
                if st.nbytes() < FRESH_MIN or st.data_ptr() in inputs or st.data_ptr() in self.seen:
                    continue
                self.seen.add(st.data_ptr())
                self.held.append(st)
                counts.fresh.append((str(func), st.nbytes()))
            return out

    return Counting()


@contextmanager
def push_counts(model: nn.Module, payload_bytes: int) -> Iterator[PushCounts]:
    """Count what the block does to `model`'s lifecycle draft (module doc)."""
    from lifecycle import checkpoint
    from lifecycle.vllm.drafts.owners import backbones_in

    (backbone,) = backbones_in(model)
    runtime = backbone.lifecycle_runtime
    counts = PushCounts(payload_bytes)

    # the derived buffers' storages (the K/V shadows are views of the fused buffer; an alias IS its source, a
    # weight): they never move
    derived = {_storage(t) for spec in backbone.derived_buffers if spec.kind != "alias"
               if isinstance(t := backbone._buffers.get(spec.name), torch.Tensor) and _real(t)}

    read_tensor = checkpoint._read_tensor

    def counted_read(f: Any, entry: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        counts.bytes_read += entry.nbytes
        return read_tensor(f, entry, *args, **kwargs)

    from vllm.model_executor.model_loader.reload.meta import CopyCounter

    own_enter = vars(CopyCounter).get("__enter__")  # vLLM's class may define one of its own: put back, not deleted
    enter = CopyCounter.__enter__

    def counted_dry_run(mode: Any) -> Any:
        counts.loader_dry_runs += 1
        return enter(mode)

    hashed = runtime.bytes_hashed
    checkpoint._read_tensor = counted_read  # type: ignore[assignment]
    CopyCounter.__enter__ = counted_dry_run  # type: ignore[method-assign]
    try:
        with _counting_mode(counts, derived):
            yield counts
    finally:
        checkpoint._read_tensor = read_tensor  # type: ignore[assignment]
        if own_enter is None:
            del CopyCounter.__enter__  # its base class's again
        else:
            CopyCounter.__enter__ = own_enter  # type: ignore[method-assign]
        counts.bytes_hashed = runtime.bytes_hashed - hashed
