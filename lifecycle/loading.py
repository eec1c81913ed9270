"""A reference safetensors loader: streams tensors in buckets and drives the backbone's lifecycle.

>>> import tempfile, torch
>>> from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
>>> from lifecycle.events import configure_audit; _ = configure_audit(console=False)
>>> cfg = DFlashConfig(num_hidden_layers=2)
>>> path = write_checkpoint(random_weights(cfg, seed=0), tempfile.mkdtemp() + "/a.safetensors")
>>> model = DFlashQwen3Draft(cfg)
>>> report = load_safetensors(model, path, bucket_by="layer")
>>> model.lifecycle.state.value, report.buckets
('FULLY_LOADED', 5)

The whole checkpoint header is validated (names, shapes, dtypes) before the first tensor is read, so a bad
file changes nothing. Then each bucket is read from disk (only that bucket is in memory), written into the
parameters (copied in place when they exist, materialised when they are META), and reported to the lifecycle
as one `weights_loaded` call. Buckets can come in any order, with duplicates, or cover only a subset.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from safetensors.torch import save_file
from torch import nn

from . import events
from .checkpoint import IndexEntry, check_paths, checkpoint_index, iter_buckets
from .errors import (
    MESSAGE_ITEMS_CAP,
    CheckpointError,
    LifecycleError,
    NonFiniteWeightError,
    UnknownWeightError,
    WeightShapeError,
    WeightWriteError,
)
from .types import capped

if TYPE_CHECKING:
    from .backbone import DraftBackbone
    from .machine import BackboneLifecycle

__all__ = [
    "VALIDATED_HEADERS_CAP",
    "BeforeWrite",
    "BucketBy",
    "IndexEntry",
    "LoadProgress",
    "LoadReport",
    "Subset",
    "Writer",
    "apply_bucket",
    "checkpoint_index",
    "iter_buckets",
    "load_safetensors",
    "non_finite",
    "plan_buckets",
    "validate_index",
    "write_checkpoint",
    "write_tensor",
]

BucketBy = Literal["layer"] | int
Subset = Iterable[str] | Callable[[str], bool] | None
#: Writes one validated tensor into the module: (module, name, value, device). `write_tensor` by default; a
#: model's own per-parameter loader (sharding, conversion) can take its place.
Writer = Callable[[nn.Module, str, torch.Tensor, "torch.device | str"], None]
#: Called with a bucket's names after it was validated and before its first write (a rollback snapshot).
BeforeWrite = Callable[[Sequence[str]], None]


@dataclass
class LoadReport:
    """What `load_safetensors` did: the files read, tensors and buckets written (a resent tensor counts again), the
    layers the load completed, its duration, and `nbytes`: the bytes written, from the checkpoint header (counted
    when asked, not per bucket)."""

    files: list[str]
    tensors: int = 0
    buckets: int = 0
    duration_ms: float = 0.0
    layers_completed: list[str] = field(default_factory=list)
    _index: dict[str, IndexEntry] = field(default_factory=dict, repr=False)
    _plan: list[list[str]] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for bucket in self._plan[:self.buckets] for e in map(self._index.__getitem__, bucket))


@dataclass(frozen=True)
class LoadProgress:
    bucket: int
    buckets: int
    tensors_done: int
    tensors_total: int
    layers_ready: int
    layers_total: int


def _check_plan(bucket_by: object, duplicates: object) -> None:
    if bucket_by != "layer" and (type(bucket_by) is not int or bucket_by < 1):
        raise ValueError(f"bucket_by must be 'layer' or a positive int, got {bucket_by!r:.80}")
    if type(duplicates) is not int or duplicates < 0:
        raise ValueError(f"duplicates must be an int >= 0, got {duplicates!r:.80}")


def write_checkpoint(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
                     ) -> Path:
    """Save `tensors` as one safetensors file (contiguous CPU copies). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: _own_storage(v.detach().to("cpu").contiguous()) for k, v in tensors.items()}, str(path),
              metadata=metadata)
    return path


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy when it is a view of a larger storage (the weights of a backed derived buffer share it, and
    safetensors refuses tensors that share memory)."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


#: The most header bytes a backbone keeps to skip the check of a checkpoint whose headers it checked before.
VALIDATED_HEADERS_CAP = 16 * 2**20


def validate_index(backbone: DraftBackbone, index: dict[str, IndexEntry], names: Iterable[str]) -> None:
    """Refuse (before anything is written) unknown names and shape/dtype mismatches, naming every one.

    `names` are names of `index`. An index read by `checkpoint_index` carries its files' header bytes: once every
    tensor of some headers passed, the backbone keeps them (up to `VALIDATED_HEADERS_CAP` bytes), and an index
    with the same bytes (the next push of the same model: same names, shapes, dtypes, offsets) is not checked
    tensor by tensor again; a change of what the backbone tracks (`freeze_structure`) forgets them."""
    lc = backbone.lifecycle
    headers = getattr(index, "headers", None)
    if headers and headers == lc.validated_headers:  # bytes compared in C: identical headers, identical check
        return
    names = names if type(names) is list else list(names)
    specs = lc.specs
    # per tensor, the common case inline: known, same shape, same dtype (the messages only for the others)
    suspects = [n for n in names if (spec := specs.get(n)) is None or (entry := index[n]).shape != spec.shape
                or entry.dtype != spec.dtype]
    if not suspects:
        if (headers and sum(map(len, headers)) <= VALIDATED_HEADERS_CAP and len(names) >= len(index)
                and index.keys() == set(names)):  # every tensor of these headers was checked
            lc.validated_headers = headers
        return
    unknown = [n for n in suspects if n not in specs]
    error: LifecycleError | None = None
    if unknown:
        error = UnknownWeightError(unknown, backbone=lc.name, state=lc.state.value, source=_files(index, names))
    elif problems := [p for n in suspects if (p := specs[n].mismatch(n, index[n].shape, index[n].dtype))]:
        error = WeightShapeError(problems, backbone=lc.name, state=lc.state.value, source=_files(index, names))
    if error is not None:
        try:
            raise lc.record_refusal("weights_loaded", error)
        finally:
            del error  # see `errors`: a local holding the raised error keeps every frame of it alive


_PATH = attrgetter("path")


def _file_list(index: dict[str, IndexEntry], names: Iterable[str]) -> list[str]:
    """The files `names` come from, sorted. Entries of one file share one Path object, so they are told apart
    by their hash (a Path caches it) in C: no per-tensor formatting."""
    return sorted({str(p) for p in set(map(_PATH, map(index.__getitem__, names)))})


def _files(index: dict[str, IndexEntry], names: Iterable[str]) -> str:
    return ", ".join(_file_list(index, names))


def _refused(backbone: DraftBackbone, e: CheckpointError) -> CheckpointError:
    """The reader's error, naming the backbone and its state as every error does; audited as a refusal."""
    lc = backbone.lifecycle
    error = CheckpointError(e.reason, backbone=lc.name, state=lc.state.value)
    lc.record_refusal("weights_loaded", error)
    return error


def plan_buckets(names: Sequence[str], layer_key: Callable[[str], str], *, bucket_by: BucketBy = "layer",
                 shuffle: bool = False, seed: int = 0, duplicates: int = 0) -> list[list[str]]:
    """Group tensor names into buckets: one per layer, or `bucket_by` tensors each; optionally shuffled;
    `duplicates` tensors are sent a second time in a later bucket (as trainers sometimes do)."""
    _check_plan(bucket_by, duplicates)
    rng = random.Random(seed)
    names = list(names)
    if bucket_by == "layer":
        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(layer_key(n), []).append(n)
        buckets = list(groups.values())
        if shuffle:
            rng.shuffle(buckets)
            for b in buckets:
                rng.shuffle(b)
    else:
        if shuffle:
            rng.shuffle(names)
        buckets = [names[i:i + bucket_by] for i in range(0, len(names), bucket_by)]
    for n in rng.sample(names, min(duplicates, len(names))):
        # strictly after the bucket that first sends `n`; a fixed-size plan gets the resend as its own bucket
        # so no bucket exceeds `bucket_by` (bucket_by=1 stays one tensor at a time)
        first = next(i for i, b in enumerate(buckets) if n in b)
        later = rng.randrange(first + 1, len(buckets) + 1)
        if bucket_by == "layer" and later < len(buckets):
            buckets[later].append(n)
        else:
            buckets.insert(later, [n])
    return buckets


@torch.no_grad()
def write_tensor(module: nn.Module, name: str, value: torch.Tensor, device: torch.device | str) -> None:
    """Copy into the existing tensor (same storage), or materialise a META placeholder as a copy: it never shares
    storage with `value` (a trainer may reuse its buffer; a tensor read by safetensors is a view of the file's
    memory map, which changes if the file is rewritten in place)."""
    path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(path) if path else module
    is_param = leaf in owner._parameters
    current = owner._parameters[leaf] if is_param else owner._buffers[leaf]
    assert current is not None
    if current.is_meta:
        fresh = value.to(device=device, dtype=current.dtype).contiguous()
        if fresh.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
            fresh = fresh.clone()
        if is_param:
            owner._parameters[leaf] = nn.Parameter(fresh, requires_grad=False)
        else:
            owner._buffers[leaf] = fresh
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


def apply_bucket(backbone: DraftBackbone, bucket: Sequence[tuple[str, torch.Tensor]],
                 device: torch.device | str = "cpu", *, finite_check: bool = False, writer: Writer | None = None,
                 before_write: BeforeWrite | None = None, validated: bool = False) -> list[str]:
    """Validate a bucket of (name, tensor), write it, report it. Returns the layers it completed.

    Refused before any write (audited, nothing changed): a state that allows no loading, unknown names, a shape
    or dtype mismatch, and with `finite_check` a NaN or Inf value (`NonFiniteWeightError`). A write that fails
    part way raises `WeightWriteError`: the tensors written before it are reported as loaded, the failing one as
    possibly written. Thread-safe on a locked lifecycle: the bucket is written and reported under a write lease.
    `validated=True` skips the per-tensor name/shape/dtype checks: for tensors read from a checkpoint whose
    header `validate_index` already checked (safetensors returns exactly the header's shape and dtype), as
    `load_safetensors` does. Whether loading is allowed now (and the finite check) happen either way.
    """
    bucket = bucket if type(bucket) is list else list(bucket)
    return _write_and_report(backbone, list(map(_NAME, bucket)), bucket, device, finite_check=finite_check,
                             writer=writer, before_write=before_write, validated=validated)


_NAME = itemgetter(0)
_VALUE = itemgetter(1)
_NBYTES = attrgetter("nbytes")


def _write_and_report(backbone: DraftBackbone, names: list[str], bucket: list[tuple[str, torch.Tensor]],
                      device: torch.device | str, *, finite_check: bool, writer: Writer | None,
                      before_write: BeforeWrite | None, validated: bool) -> list[str]:
    """`apply_bucket` with the bucket's names given (`names[i]` is `bucket[i]`'s name)."""
    lc = backbone.lifecycle
    lease = lc.acquire_write_lease()
    try:
        error: LifecycleError | None = None
        if not validated and (unknown := lc.readiness.unknown(names)):
            error = UnknownWeightError(unknown, backbone=lc.name, state=lc.state.value)
        elif not validated and (
                problems := [p for n, t in bucket if (p := lc.specs[n].mismatch(n, tuple(t.shape), t.dtype))]):
            error = WeightShapeError(problems, backbone=lc.name, state=lc.state.value)
        if error is not None:
            try:
                raise lc.record_refusal("weights_loaded", error)
            finally:
                del error  # see `errors`: a local holding the raised error keeps every frame of it alive
        if finite_check and (refusal := _non_finite_refusal(lc, bucket)):
            try:
                raise refusal
            finally:
                del refusal  # as above
        if before_write is not None:
            before_write(names)
        _write_bucket(backbone, names, bucket, device, writer)
        return lc.weights_loaded(names, materialized=writer is None)  # write_tensor leaves nothing on META
    finally:
        lc.release_write_lease(lease)


def _write_bucket(backbone: DraftBackbone, names: list[str], bucket: list[tuple[str, torch.Tensor]],
                  device: torch.device | str, writer: Writer | None,
                  before_failure: Callable[[], None] | None = None) -> None:
    """Write every tensor of a bucket (`writer`, else `write_tensor`). A write that fails part way raises
    `WeightWriteError` (after `before_failure`): the tensors before it are reported loaded, the failing one as
    possibly written (dirty, missing until sent again); the refusal is audited."""
    write = writer or write_tensor
    done = 0
    try:
        for name, value in bucket:
            write(backbone, name, value, device)
            done += 1
    except Exception as e:
        if before_failure is not None:
            before_failure()
        lc = backbone.lifecycle
        written = names[:done]
        err = WeightWriteError(names[done], written, len(names), e, backbone=lc.name, state=lc.state.value)
        lc.mark_dirty([names[done]])
        if written:
            lc.weights_loaded(written, materialized=writer is None)
        lc.record_refusal("weights_loaded", err)
        raise err from e


def _non_finite_refusal(lc: BackboneLifecycle, bucket: list[tuple[str, torch.Tensor]],
                        before: Callable[[], None] | None = None) -> NonFiniteWeightError | None:
    """The `finite_check` refusal of a bucket holding NaN or Inf, audited (after `before`), or None."""
    problems = non_finite(bucket)
    if not problems:
        return None
    if before is not None:
        before()
    error = NonFiniteWeightError(problems, backbone=lc.name, state=lc.state.value)
    lc.record_refusal("weights_loaded", error)
    return error


def _load_reported_later(backbone: DraftBackbone, buckets: list[list[str]],
                         read: Iterator[list[tuple[str, torch.Tensor]]], device: torch.device | str,
                         finite_check: bool, report: LoadReport, whole_layers: list[str] | None) -> None:
    """The loader's own buckets on an unlocked lifecycle, with no callback between them: each bucket is read and
    copied, and the lifecycle is told once the buckets are written (`weights_loaded_buckets`, each with the time
    it was written), in one pass while its tables are hot, instead of between each bucket's reads and copies
    (which evict them). Nothing else can act between the buckets (one thread, no progress callback, no debug
    event), so what it says is the same. On a backbone with nothing loaded yet the first bucket is reported at
    once (the transition out of META it fires is stamped before the later buckets' events; in a reload only the
    last layer's completion moves the state, and it is reported after every bucket's event). Whatever ends the
    loop early (a read or write failure, a NaN, an interrupt) reports the buckets written before it first.
    `whole_layers`: each bucket is every tracked tensor of this layer (`BackboneLifecycle._whole_layers_loaded`)."""
    lc = backbone.lifecycle
    written: list[tuple[list[str], int]] = []

    def report_written() -> None:
        _report_written(lc, written, report, whole_layers)

    first_from_meta = lc.unloaded  # nothing else can change the state during the loop
    try:
        for names in buckets:
            try:
                bucket = next(read)
            except CheckpointError as e:  # the file changed or shrank while read: this bucket is not written
                report_written()
                raise _refused(backbone, e) from e
            if finite_check and (refusal := _non_finite_refusal(lc, bucket, report_written)):
                try:
                    raise refusal  # the buckets before it were reported first
                finally:
                    del refusal  # see `errors`: a local holding the raised error keeps every frame of it alive
            _write_bucket(backbone, names, bucket, device, None, before_failure=report_written)
            written.append((names, time.time_ns()))
            report.tensors += len(bucket)
            if first_from_meta:  # the first report from META moves the state: in its time
                first_from_meta = False
                report_written()
            del bucket  # only the bucket being read is held: the peak extra memory is one bucket
    finally:
        report_written()


def _whole_layer_plan(lc: BackboneLifecycle, buckets: list[list[str]]) -> list[str] | None:
    """Each bucket's layer, when each is every tracked tensor of one layer (a plan by layer of a checkpoint with
    every tracked tensor: one bucket per layer by construction; `LayerReadiness.fresh_layers` checks again that
    none comes twice): read while the plan's names are in the caches. Else None."""
    layer_of_name, tensors_of = lc.readiness.layer_of_name, lc.readiness.tensors_of_layer
    layers = [layer_of_name[b[0]] for b in buckets]
    if any(len(b) != len(tensors_of[la]) for la, b in zip(layers, buckets, strict=True)):
        return None
    return layers


def _report_written(lc: BackboneLifecycle, written: list[tuple[list[str], int]], report: LoadReport,
                    whole_layers: list[str] | None) -> None:
    """Report the buckets written so far (`_load_reported_later`), once: `written` is emptied."""
    if not written:
        return
    buckets, written[:] = written[:], []
    first = report.buckets  # the plan's index of buckets[0]: the buckets are reported in the order written
    report.buckets += len(buckets)
    # write_tensor leaves nothing on META: materialized
    reported = (lc._whole_layers_loaded(buckets, whole_layers[first:first + len(buckets)]) if whole_layers
                else lc.weights_loaded_buckets(buckets, materialized=True))
    for completed in reported:
        if completed:
            report.layers_completed.extend(completed)


def load_safetensors(
    backbone: DraftBackbone,
    paths: str | Path | Sequence[str | Path],
    *,
    bucket_by: BucketBy = "layer",
    shuffle: bool = False,
    seed: int = 0,
    subset: Subset = None,
    duplicates: int = 0,
    device: torch.device | str = "cpu",
    progress: Callable[[LoadProgress], None] | None = None,
    finite_check: bool = False,
    writer: Writer | None = None,
    before_write: BeforeWrite | None = None,
) -> LoadReport:
    """Stream a checkpoint into `backbone` in buckets, driving its lifecycle (`weights_loaded` per bucket).

    It does not finish the load: call `backbone.finalize_loading()` afterwards (a reload may arrive from
    several files or sessions). `subset`: names, or a predicate on names, to load only part of the file.
    `finite_check`: refuse a bucket holding NaN or Inf (`NonFiniteWeightError`, off by default: it reads every
    value once). The header is checked whole before any write; values are read per bucket, so a NaN (or a
    failed write) in a later bucket stops the load after the earlier buckets were written: use a reload session
    (`backbone.reload_session(rollback=True)`) to undo them. `writer`, `before_write`: see `apply_bucket`.
    """
    check_paths(paths)
    _check_plan(bucket_by, duplicates)
    t0 = time.perf_counter()
    try:
        index = checkpoint_index(paths)
    except CheckpointError as e:
        raise _refused(backbone, e) from e
    if subset is None:
        names = list(index)
    elif callable(subset):
        names = [n for n in index if subset(n)]
    else:
        wanted = list(subset)
        absent = [n for n in wanted if n not in index]
        if absent:
            shown, more = capped(absent, MESSAGE_ITEMS_CAP)
            raise backbone.lifecycle.record_refusal("weights_loaded", CheckpointError(
                f"subset names not in the checkpoint: {', '.join(shown)}" + (f" ... and {more} more" if more else ""),
                backbone=backbone.lifecycle.name, state=backbone.lifecycle.state.value))
        names = wanted
    validate_index(backbone, index, names)
    lc = backbone.lifecycle
    lc.ensure_loading_allowed()
    buckets = plan_buckets(names, lc.readiness.layer_of_name.__getitem__, bucket_by=bucket_by,
                           shuffle=shuffle, seed=seed, duplicates=duplicates)
    single = isinstance(paths, (str, PathLike))  # one file: the report's file list needs no look at the names
    report = LoadReport(files=[str(Path(paths))] if single and names else _file_list(index, names), _index=index,
                        _plan=buckets)
    if (writer is None and before_write is None and progress is None and not lc.locked
            and not events.enabled("debug")):
        # the plan by layer of every tracked tensor (the names are the specs': validated, and as many): each
        # bucket is one whole layer
        whole_layers = _whole_layer_plan(lc, buckets) if (bucket_by == "layer" and subset is None and not shuffle
                                                          and not duplicates and len(names) == len(lc.specs)) else None
        with closing(iter_buckets(index, buckets, reuse=True)) as read:  # write_tensor copies each value
            _load_reported_later(backbone, buckets, read, device, finite_check, report, whole_layers)
        report.duration_ms = (time.perf_counter() - t0) * 1e3
        return report
    done = 0
    total = sum(map(len, buckets))
    # a `writer` may keep a value: a buffer of its own for each; `write_tensor` copies (one reused buffer)
    with closing(iter_buckets(index, buckets, reuse=writer is None)) as read:
        for i, bucket_names in enumerate(buckets):
            try:
                bucket = next(read)
            except CheckpointError as e:  # the file changed or shrank while read: this bucket is not written
                raise _refused(backbone, e) from e
            completed = _write_and_report(backbone, bucket_names, bucket, device, finite_check=finite_check,
                                          writer=writer, before_write=before_write,
                                          validated=True)  # the header was validated above
            report.buckets += 1
            report.tensors += len(bucket)
            if completed:
                report.layers_completed.extend(completed)
            done += len(bucket)
            # per bucket (possibly per tensor): debug level, built only when someone keeps it
            if events.enabled("debug"):
                lc.audit_event("loader_bucket", level="debug", bucket=i, buckets=len(buckets), tensors=len(bucket),
                               nbytes=sum(map(_NBYTES, map(_VALUE, bucket))), layers_completed=completed,
                               layers_ready=lc.readiness.layers_ready, layers_total=lc.readiness.layers_total)
            del bucket  # only the bucket being read is held: the peak extra memory is one bucket
            if progress is not None:
                progress(LoadProgress(i + 1, len(buckets), done, total, lc.readiness.layers_ready,
                                      lc.readiness.layers_total))
    report.duration_ms = (time.perf_counter() - t0) * 1e3
    return report
