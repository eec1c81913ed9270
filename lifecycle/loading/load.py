"""`load_safetensors`: a checkpoint streamed into a backbone bucket by bucket, and what the load did.

The whole header is checked first (`validate`), the buckets planned (`plan`), then each bucket is read from disk
(only that bucket is in memory), written and reported (`write`). On an unlocked lifecycle with no callback between
buckets, the buckets are reported once they are written (`_load_reported_later`): what the lifecycle ends up
knowing, and every event, are those of a load that reports each bucket as it is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import events
from ..checkpoint import IndexEntry, ReadBuffer, check_paths, checkpoint_index, iter_buckets
from ..errors import MESSAGE_ITEMS_CAP, CheckpointError, raise_unheld
from ..types import capped
from .plan import BucketBy, check_plan, plan_buckets, whole_layer_plan
from .validate import file_list, validate_index
from .write import BeforeWrite, Writer, _trusted, non_finite_refusal, write_and_report, write_bucket

if TYPE_CHECKING:
    from ..machine import BackboneLifecycle
    from .target import LoadTarget

__all__ = ["LoadProgress", "LoadReport", "Subset", "load_safetensors"]

#: Which tensors of the checkpoint to load: names, a predicate on names, or None (every one).
Subset = Iterable[str] | Callable[[str], bool] | None


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


_VALUE = itemgetter(1)
_NBYTES = attrgetter("nbytes")


def _refused(backbone: LoadTarget, e: CheckpointError) -> CheckpointError:
    """The reader's error, naming the backbone and its state as every error does; audited as a refusal."""
    lc = backbone.lifecycle
    return lc.record_refusal("weights_loaded", CheckpointError(e.reason, backbone=lc.name, state=lc.state.value))


def _load_reported_later(backbone: LoadTarget, buckets: list[list[str]],
                         read: Iterator[list[tuple[str, torch.Tensor]]], device: torch.device | str,
                         finite_check: bool, report: LoadReport, whole_layers: list[str] | None) -> None:
    """The loader's own buckets on an unlocked lifecycle, with no callback between them: each bucket is read and
    copied, and the lifecycle is told once the buckets are written (`weights_loaded_buckets`, each with the time
    it was written), in one pass while its tables are hot, instead of between each bucket's reads and copies
    (which evict them). Nothing else can act between the buckets (one thread, no progress callback, no debug
    event), so what it says is the same. On a backbone with nothing loaded yet the first bucket is reported at
    once (the transition out of META it fires is stamped before the later buckets' events; in a reload only the
    last layer's completion moves the state, and it is reported after every bucket's event). Whatever ends the
    loop early (a read or write failure, a NaN) reports the buckets written before it first; an interrupt (any
    `BaseException`) anywhere else leaves every bucket marked possibly written (`LoadTracking.writing`).
    `whole_layers`: each bucket is every tracked tensor of this layer
    (`BackboneLifecycle.weights_loaded_whole_layers`)."""
    lc = backbone.lifecycle
    written: list[tuple[list[str], int]] = []

    def report_written() -> None:
        _report_written(lc, written, report, whole_layers)

    first_from_meta = lc.unloaded  # nothing else can change the state during the loop
    # one lease for the load, naming every bucket before the first write: whatever interrupts it where no
    # bookkeeping below runs, what it wrote is marked possibly written when the lease ends
    lease = lc.acquire_write_lease()

    def report_every_write() -> None:  # what an early end says: every write before it, and no more
        report_written()
        lc.reported(lease)

    try:
        lc.writing(lease, buckets)
        for names in buckets:
            try:
                bucket = next(read)
            except CheckpointError as e:  # the file changed or shrank while read: this bucket is not written
                report_every_write()
                raise _refused(backbone, e) from e
            if finite_check:  # the buckets before it are reported first
                raise_unheld(non_finite_refusal(lc, bucket, report_every_write))
            write_bucket(backbone, names, bucket, device, None, before_failure=report_written, lease=lease)
            written.append((names, time.time_ns()))
            report.tensors += len(bucket)
            if first_from_meta:  # the first report from META moves the state: in its time
                first_from_meta = False
                report_written()
            del bucket  # only the bucket being read is held: the peak extra memory is one bucket
        report_every_write()
    finally:
        lc.release_write_lease(lease)


def _report_written(lc: BackboneLifecycle, written: list[tuple[list[str], int]], report: LoadReport,
                    whole_layers: list[str] | None) -> None:
    """Report the buckets written so far (`_load_reported_later`), once: `written` is emptied."""
    if not written:
        return
    buckets, written[:] = written[:], []
    first = report.buckets  # the plan's index of buckets[0]: the buckets are reported in the order written
    report.buckets += len(buckets)
    # write_tensor leaves nothing on META: materialized
    reported = (lc.weights_loaded_whole_layers(buckets, whole_layers[first:first + len(buckets)]) if whole_layers
                else lc.weights_loaded_buckets(buckets, materialized=True))
    for completed in reported:
        if completed:
            report.layers_completed.extend(completed)


def load_safetensors(
    backbone: LoadTarget,
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
    read_buffer: ReadBuffer | None = None,
) -> LoadReport:
    """Stream a checkpoint into `backbone` in buckets, driving its lifecycle (`weights_loaded` per bucket).

    It does not finish the load: call `backbone.finalize_loading()` afterwards (a reload may arrive from
    several files or sessions). `subset`: names, or a predicate on names, to load only part of the file.
    `finite_check`: refuse a bucket holding NaN or Inf (`NonFiniteWeightError`, off by default: it reads every
    value once). The header is checked whole before any write; values are read per bucket, so a NaN (or a
    failed write) in a later bucket stops the load after the earlier buckets were written: use a reload session
    (`backbone.reload_session(rollback=True)`) to undo them. `writer`, `before_write`: see `apply_bucket`.
    `read_buffer`: where the values are read, kept by the caller from load to load (a `ReadBuffer`, pinned for a
    CUDA device); without it one buffer is made for this load (a `writer` that may keep a value: fresh tensors).
    """
    check_paths(paths)
    check_plan(bucket_by, duplicates)
    t0 = time.perf_counter()
    try:
        index = checkpoint_index(paths)
    except CheckpointError as e:
        raise _refused(backbone, e) from e
    names = _selected(backbone, index, subset)
    validate_index(backbone, index, names)
    lc = backbone.lifecycle
    lc.ensure_loading_allowed()
    buckets = plan_buckets(names, lc.readiness.layer_of_name.__getitem__, bucket_by=bucket_by,
                           shuffle=shuffle, seed=seed, duplicates=duplicates)
    # one file: the report's file list needs no look at the names
    report = LoadReport(files=[str(Path(paths))] if isinstance(paths, (str, PathLike)) and names
                        else file_list(index, names), _index=index, _plan=buckets)
    if (writer is None and before_write is None and progress is None and not lc.locked
            and not events.enabled("debug") and _trusted(None, device)):
        # the plan by layer of every tracked tensor (the names are the specs': validated, and as many): each
        # bucket is one whole layer
        every_layer_whole = (bucket_by == "layer" and subset is None and not shuffle and not duplicates
                             and len(names) == len(lc.specs))
        whole_layers = whole_layer_plan(lc.readiness, buckets) if every_layer_whole else None
        # write_tensor copies each value: one buffer for every bucket
        with closing(iter_buckets(index, buckets, reuse=True, into=read_buffer)) as read:
            _load_reported_later(backbone, buckets, read, device, finite_check, report, whole_layers)
        report.duration_ms = (time.perf_counter() - t0) * 1e3
        return report
    done = 0
    total = sum(map(len, buckets))
    # a `writer` may keep a value: a buffer of its own for each; `write_tensor` copies (one reused buffer)
    with closing(iter_buckets(index, buckets, reuse=writer is None,
                              into=read_buffer if writer is None else None)) as read:
        for i, bucket_names in enumerate(buckets):
            try:
                bucket = next(read)
            except CheckpointError as e:  # the file changed or shrank while read: this bucket is not written
                raise _refused(backbone, e) from e
            completed = write_and_report(backbone, bucket_names, bucket, device, finite_check=finite_check,
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


def _selected(backbone: LoadTarget, index: dict[str, IndexEntry], subset: Subset) -> list[str]:
    """The names of `index` that `subset` selects; subset names the checkpoint lacks are refused (audited)."""
    if subset is None:
        return list(index)
    if callable(subset):
        return [n for n in index if subset(n)]
    wanted = list(subset)
    absent = [n for n in wanted if n not in index]
    if absent:
        lc = backbone.lifecycle
        shown, more = capped(absent, MESSAGE_ITEMS_CAP)
        raise lc.record_refusal("weights_loaded", CheckpointError(
            f"subset names not in the checkpoint: {', '.join(shown)}" + (f" ... and {more} more" if more else ""),
            backbone=lc.name, state=lc.state.value))
    return wanted
