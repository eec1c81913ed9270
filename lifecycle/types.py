"""Plain data shared by the lifecycle modules."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

__all__ = ["BufferReport", "RefreshReport", "TensorSpec", "capped", "clipped", "describe_error", "dtype_name",
           "layer_line"]

T = TypeVar("T")


def dtype_name(x: torch.dtype | torch.device | str) -> str:
    """How messages and audit events name a dtype (`float32`, not `torch.float32`); a device is unchanged."""
    return str(x).removeprefix("torch.")


def describe_error(exc: BaseException) -> str:
    """`ErrorClass: first line of its reason`, at most 300 characters: how an exception becomes a quarantine
    reason (a session ended by it, a failed engine reload)."""
    text = str(getattr(exc, "reason", None) or exc).strip()
    first = text.splitlines()[0] if text else ""
    out = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return out if len(out) <= 300 else out[:297] + "..."


def capped(items: Iterable[T], cap: int) -> tuple[list[T], int]:
    """The first `cap` items and how many were left out: every bounded list of names (audit events at
    `events.LIST_CAP`, error messages at `errors.MESSAGE_ITEMS_CAP`) is cut by this one helper."""
    items = list(items)
    return items[:cap], max(0, len(items) - cap)


def clipped(text: str, cap: int) -> str:
    """`text`, or as much of it as fits in `cap` characters with how many were cut: every bounded string of a
    message or a kept reason is cut by this one helper.

    >>> clipped("abcdef", 6), clipped("a" * 50, 30)
    ('abcdef', 'aaaaaaaaaaa...(+39 characters)')
    """
    if len(text) <= cap:
        return text
    keep = max(0, cap - len(f"...(+{len(text)} characters)"))
    return f"{text[:keep]}...(+{len(text) - keep} characters)"


def layer_line(layer: str, names: Sequence[str]) -> str:
    """`layer: a, b, c`; where every name carries the same reason (`name (why)`), the reason once, after the layer:
    repeated per name it would fill the line's cap before the names it is about."""
    split = [n.partition(" (") for n in names]
    reasons = {sep + rest for _, sep, rest in split}
    if len(names) > 1 and len(reasons) == 1 and "" not in reasons:
        return f"{layer} {next(iter(reasons)).strip()}: {', '.join(n for n, _, _ in split)}"
    return f"{layer}: {', '.join(names)}"


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
            parts.append(f"dtype expected {dtype_name(self.dtype)} got {dtype_name(dtype)}")
        return f"{name}: {', '.join(parts)}" if parts else None


@dataclass
class BufferReport:
    """What one refresh did to one derived buffer."""

    name: str
    kind: str
    mode: str  # "cold" (allocated), "in_place", "alias", "skipped" (nothing dirty), "backed" (verified), "fallback"
    slices_written: int = 0
    slices_total: int = 0
    elements_written: int = 0
    nbytes: int = 0
    data_ptr: int = 0
    reason: str = ""
    # storages the refresh created for this buffer besides the buffer itself (builders' results that are not views
    # of the backbone's tensors: a computing `per_layer`, each computed slice, a custom `build` value, what an
    # `into` writer allocates), and their bytes; 0 for views and parts copied straight into place
    temporaries: int = 0
    temporary_bytes: int = 0
    # a backed buffer: how many sources are views of it, and how many this refresh made so (all at a cold build;
    # afterwards only sources that had been replaced)
    backed_sources: int = 0
    rebacked: int = 0

    def as_log(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name, "kind": self.kind, "mode": self.mode, "nbytes": self.nbytes,
            "data_ptr": hex(self.data_ptr), "elements_written": self.elements_written,
        }
        if self.slices_total:
            out["slices_written"] = self.slices_written
            out["slices_total"] = self.slices_total
        if self.temporaries:
            out["temporaries"] = self.temporaries
            out["temporary_bytes"] = self.temporary_bytes
        if self.backed_sources:
            out["backed_sources"] = self.backed_sources
            out["rebacked"] = self.rebacked
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass
class RefreshReport:
    buffers: list[BufferReport] = field(default_factory=list)
    duration_ms: float = 0.0
    # the audit `refresh` event's fields, once asked for (a refresh asks before its bulk copies: see `audit_fields`)
    _audit: dict[str, object] | None = field(default=None, init=False, repr=False, compare=False)

    def audit_fields(self) -> dict[str, object]:
        """What the audit `refresh` event says of the buffers: `as_log()` of each and the totals. Built once: a
        refresh builds it when every buffer's report is final and before its bulk copies, which leave the caches
        cold (the event itself is written after them)."""
        if self._audit is None:
            self._audit = {"buffers": [b.as_log() for b in self.buffers], "elements_written": self.elements_written,
                           "bytes_allocated": self.bytes_allocated, "temporary_bytes": self.temporary_bytes}
        return self._audit

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
        """Bytes of the buffers this refresh allocated (cold builds): what stays."""
        return sum(b.nbytes for b in self.buffers if b.mode == "cold")

    @property
    def temporaries(self) -> int:
        """Storages this refresh created besides the buffers it allocated (see `BufferReport.temporaries`)."""
        return sum(b.temporaries for b in self.buffers)

    @property
    def temporary_bytes(self) -> int:
        """Their bytes: what the refresh held for a while besides `bytes_allocated`."""
        return sum(b.temporary_bytes for b in self.buffers)
