"""Writing one bucket into the backbone: the checks before its first write, the tensor writes, and the report.

A bucket is refused before anything of it is written (audited, nothing changed) for a state that allows no
loading, unknown names, a shape or dtype mismatch, and with the finite check a NaN or Inf value (`non_finite`).
Then every tensor is written (`write_tensor`, or the caller's `Writer`) and the bucket is reported to the
lifecycle as one `weights_loaded` call; a write that fails part way says what it left behind (`WeightWriteError`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import (
    NonFiniteWeightError,
    UnknownWeightError,
    WeightShapeError,
    WeightTypeError,
    WeightWriteError,
    raise_unheld,
)
from ..torch_private import as_plain_tensor, own_buffers, own_parameters
from ..types import clipped, dtype_name

if TYPE_CHECKING:
    from ..errors import LifecycleError
    from ..machine import BackboneLifecycle
    from .target import LoadTarget

__all__ = ["BeforeWrite", "Writer", "apply_bucket", "non_finite", "non_finite_refusal", "write_and_report",
           "write_bucket", "write_tensor"]

#: Writes one validated tensor into the module: (module, name, value, device). `write_tensor` by default; a
#: model's own per-parameter loader (sharding, conversion) can take its place.
Writer = Callable[[nn.Module, str, torch.Tensor, "torch.device | str"], None]
#: Called with a bucket's names after it was validated and before its first write (a rollback snapshot).
BeforeWrite = Callable[[Sequence[str]], None]


@torch.no_grad()
def write_tensor(module: nn.Module, name: str, value: torch.Tensor, device: torch.device | str) -> None:
    """Copy into the existing tensor (same storage), or materialise a META placeholder as a copy: it never shares
    storage with `value` (a trainer may reuse its buffer; a tensor read by safetensors is a view of the file's
    memory map, which changes if the file is rewritten in place)."""
    path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(path) if path else module
    params = own_parameters(owner)
    is_param = leaf in params
    current = params[leaf] if is_param else own_buffers(owner)[leaf]
    assert current is not None
    if current.is_meta:
        fresh = value.to(device=device, dtype=current.dtype).contiguous()
        if fresh.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
            fresh = fresh.clone()
        if is_param:
            params[leaf] = nn.Parameter(fresh, requires_grad=False)
        else:
            own_buffers(owner)[leaf] = fresh
    else:
        current.copy_(value)


def non_finite(bucket: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per floating-point tensor holding NaN or Inf: `name: 2 NaN, 1 Inf of 512 elements`.

    >>> non_finite([("a", torch.tensor([1.0, float("nan"), float("inf")])), ("b", torch.ones(2))])
    ['a: 1 NaN, 1 Inf of 3 elements']
    """
    problems = []
    for name, t in bucket:
        if not (t.is_floating_point() or t.is_complex()) or t.is_meta:
            continue
        if t.element_size() == 1:  # float8: no isfinite kernel; widening is exact
            t = t.float()
        finite = torch.isfinite(t)
        if bool(finite.all()):
            continue
        nan = int(torch.isnan(t).sum())
        problems.append(f"{name}: {nan} NaN, {int((~finite).sum()) - nan} Inf of {t.numel()} elements")
    return problems


def apply_bucket(backbone: LoadTarget, bucket: Sequence[tuple[str, torch.Tensor]],
                 device: torch.device | str = "cpu", *, finite_check: bool = False, writer: Writer | None = None,
                 before_write: BeforeWrite | None = None, validated: bool = False) -> list[str]:
    """Validate a bucket of (name, tensor), write it, report it. Returns the layers it completed.

    Refused before any write (audited, nothing changed): a state that allows no loading, a bucket that is not
    (name, tensor) pairs or holds a value that is not a tensor (or a tensor subclass misreporting its shape or
    dtype: `WeightTypeError`), unknown names, a shape or dtype mismatch, and with `finite_check` a NaN or Inf
    value (`NonFiniteWeightError`). A write that fails part way raises `WeightWriteError` (an interrupt, any
    `BaseException`, comes out as itself): the tensors written before it are reported as loaded, the failing one
    as possibly written. Thread-safe on a locked lifecycle: the bucket is written and reported under a write lease.
    `validated=True` skips the per-tensor checks: for tensors read from a checkpoint whose header
    `validate_index` already checked (safetensors returns exactly the header's shape and dtype), as
    `load_safetensors` does. Whether loading is allowed now (and the finite check) happen either way.
    """
    if not validated:
        bucket = _pairs(backbone.lifecycle, bucket)
    elif type(bucket) is not list:
        bucket = list(bucket)
    return write_and_report(backbone, list(map(_NAME, bucket)), bucket, device, finite_check=finite_check,
                            writer=writer, before_write=before_write, validated=validated)


_NAME = itemgetter(0)
_PLAIN = (torch.Tensor, nn.Parameter)


def _pairs(lc: BackboneLifecycle, bucket: object) -> list[tuple[str, torch.Tensor]]:
    """`bucket` as a list of (name, value) pairs, or the audited refusal of what it is instead."""
    pairs: list[Any] | None = None
    if isinstance(bucket, Mapping):
        pairs = list(bucket.items())
    elif isinstance(bucket, Iterable):
        pairs = list(bucket)
    if pairs is None or not all(type(p) in (tuple, list) and len(p) == 2 and type(p[0]) is str for p in pairs):
        raise lc.record_refusal("weights_loaded", WeightTypeError(
            [f"the bucket: {clipped(repr(bucket), 80)} ({type(bucket).__name__}) is not a mapping of name -> "
             "tensor, nor (name, tensor) pairs"], backbone=lc.name, state=lc.state.value))
    return [(p[0], p[1]) for p in pairs]


def _not_a_tensor(name: str, value: object) -> str | None:
    """Why `value` is no tensor the loader can check and write as it says it is, or None."""
    if type(value) in _PLAIN:
        return None
    if not isinstance(value, torch.Tensor):
        return f"{name}: got {type(value).__name__} {clipped(repr(value), 60)}, not a tensor"
    plain = as_plain_tensor(value)  # what its data is, whatever the subclass says
    said, holds = (tuple(value.shape), value.dtype), (tuple(plain.shape), plain.dtype)
    if said != holds:
        return (f"{name}: a {type(value).__name__} that says shape {said[0]} {dtype_name(said[1])} but holds "
                f"{holds[0]} {dtype_name(holds[1])}")
    return None


def _trusted(writer: Writer | None, device: torch.device | str) -> bool:
    """Whether every tensor written is off META afterwards by construction: the loader's own copy (no `writer`)
    onto a device that is not META (`weights_loaded(materialized=...)`)."""
    return writer is None and (device == "cpu" or torch.device(device).type != "meta")


def write_and_report(backbone: LoadTarget, names: list[str], bucket: list[tuple[str, torch.Tensor]],
                     device: torch.device | str, *, finite_check: bool, writer: Writer | None,
                     before_write: BeforeWrite | None, validated: bool) -> list[str]:
    """`apply_bucket` with the bucket's names given (`names[i]` is `bucket[i]`'s name). The names are recorded
    as being written before the first write and dropped once reported, so an interrupt anywhere between leaves
    them marked possibly written when the lease ends (`LoadTracking.release_write_lease`)."""
    lc = backbone.lifecycle
    lease = lc.acquire_write_lease()
    try:
        if not validated:
            raise_unheld(_bucket_refusal(lc, names, bucket))
        if finite_check:
            raise_unheld(non_finite_refusal(lc, bucket))
        if before_write is not None:
            before_write(names)
        lc.writing(lease, (names,))
        write_bucket(backbone, names, bucket, device, writer, lease=lease)
        completed = lc.weights_loaded(names, materialized=_trusted(writer, device))
        lc.reported(lease)
        return completed
    finally:
        lc.release_write_lease(lease)


def _bucket_refusal(lc: BackboneLifecycle, names: list[str], bucket: list[tuple[str, torch.Tensor]]
                    ) -> LifecycleError | None:
    """The audited refusal of a bucket's unknown names, else of its values that are not tensors, else of its shape
    or dtype mismatches; None if sound."""
    if unknown := lc.readiness.unknown(names):
        return lc.record_refusal("weights_loaded", UnknownWeightError(unknown, backbone=lc.name,
                                                                      state=lc.state.value))
    if wrong := [p for n, t in bucket if (p := _not_a_tensor(n, t))]:
        return lc.record_refusal("weights_loaded", WeightTypeError(wrong, backbone=lc.name, state=lc.state.value))
    if problems := [p for n, t in bucket if (p := lc.specs[n].mismatch(n, tuple(t.shape), t.dtype))]:
        return lc.record_refusal("weights_loaded", WeightShapeError(problems, backbone=lc.name,
                                                                    state=lc.state.value))
    return None


def write_bucket(backbone: LoadTarget, names: list[str], bucket: list[tuple[str, torch.Tensor]],
                 device: torch.device | str, writer: Writer | None,
                 before_failure: Callable[[], None] | None = None, *, lease: int | None = None) -> None:
    """Write every tensor of a bucket (`writer`, else `write_tensor`). Whatever stops it part way (an error or an
    interrupt: any `BaseException`) is recorded before it propagates (after `before_failure`): the tensors before
    it are reported loaded, the one it stopped at as possibly written (dirty, missing until sent again), and what
    `lease` named as being written is settled. An error raises `WeightWriteError` (audited); an interrupt comes
    out as itself."""
    write = writer or write_tensor
    done = 0
    try:
        for name, value in bucket:
            # no protocol can say a LoadTarget is an nn.Module; a cast would be a call per tensor
            write(backbone, name, value, device)  # type: ignore[arg-type]  # a LoadTarget is an nn.Module
            done += 1
    except BaseException as e:
        lc = backbone.lifecycle
        state = lc.state.value  # the error names the state the write failed in, before the report below
        if before_failure is not None:
            before_failure()
        lc.mark_dirty(names[done:done + 1])  # none when it stopped after the last write counted
        written = names[:done]
        if written:
            lc.weights_loaded(written, materialized=_trusted(writer, device))
        if lease is not None:
            lc.reported(lease)
        if not isinstance(e, Exception):
            lc.record_refusal("weights_loaded", e, written=len(written), tensors=len(names))
            raise
        raise lc.record_refusal("weights_loaded", WeightWriteError(
            names[done], written, len(names), e, backbone=lc.name, state=state)) from e


def non_finite_refusal(lc: BackboneLifecycle, bucket: list[tuple[str, torch.Tensor]],
                       before: Callable[[], None] | None = None) -> NonFiniteWeightError | None:
    """The `finite_check` refusal of a bucket holding NaN or Inf, audited (after `before`), or None."""
    problems = non_finite(bucket)
    if not problems:
        return None
    if before is not None:
        before()
    return lc.record_refusal("weights_loaded", NonFiniteWeightError(problems, backbone=lc.name,
                                                                    state=lc.state.value))
