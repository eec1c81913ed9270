"""Plain data shared by the lifecycle modules."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TensorSpec:
    """What a checkpoint tensor must look like: the parameter's shape and dtype at construction."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype)

    def mismatch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """A line naming what differs, or None when `shape`/`dtype` match."""
        if dtype == self.dtype and (shape is self.shape or tuple(shape) == self.shape):  # hot path: per tensor
            return None
        parts = []
        if tuple(shape) != self.shape:
            parts.append(f"shape expected {self.shape} got {tuple(shape)}")
        if dtype != self.dtype:
            parts.append(f"dtype expected {_dt(self.dtype)} got {_dt(dtype)}")
        return f"{name}: {', '.join(parts)}" if parts else None


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


@dataclass
class BufferReport:
    """What one refresh did to one derived buffer."""

    name: str
    kind: str
    mode: str  # "cold" (allocated), "in_place", "alias", "skipped" (nothing dirty), "fallback"
    slices_written: int = 0
    slices_total: int = 0
    elements_written: int = 0
    nbytes: int = 0
    data_ptr: int = 0
    reason: str = ""

    def as_log(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name, "kind": self.kind, "mode": self.mode, "nbytes": self.nbytes,
            "data_ptr": hex(self.data_ptr), "elements_written": self.elements_written,
        }
        if self.slices_total:
            out["slices_written"] = self.slices_written
            out["slices_total"] = self.slices_total
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass
class RefreshReport:
    buffers: list[BufferReport] = field(default_factory=list)
    duration_ms: float = 0.0

    def __getitem__(self, name: str) -> BufferReport:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def elements_written(self) -> int:
        return sum(b.elements_written for b in self.buffers)

    @property
    def bytes_allocated(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.mode == "cold")
