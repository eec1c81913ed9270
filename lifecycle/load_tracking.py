"""What the writers tell a lifecycle: tensors written or declared unchanged, failed writes, and their write leases.

Tensors written are reported per bucket (`weights_loaded`), per batch of buckets or per whole layer; tensors kept
are declared unchanged; a write that failed part way marks its tensor dirty (`mark_dirty`).

>>> t = LoadTracking("toy", 0, LayerReadiness(["layers.0.w", "norm.weight"]), locked=True, recent_events=8)
>>> t.weights_loaded(["layers.0.w"]), t.weights_loaded(["norm.weight"]), t.state.value
(['layers.0'], ['norm'], 'FULLY_LOADED')

The per-tensor bookkeeping is a plain counter update in `LayerReadiness`; the machine fires only when a report
changes the state (`TableMachine._bucket_moves`): the first report after META, the last layer of an epoch. With a
locked lifecycle, a writer holds a lease (`leases.py`) between its "may I write?" check and its report, and the
transitions that end or abort loading wait for every lease.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import chain

from .errors import ConcurrentUseError, LayersNotReadyError, UnknownWeightError
from .events import LIST_CAP
from .firing import MetaScan, PinnedTensors, Resolver, TableMachine
from .leases import WriteLeases
from .readiness import LayerReadiness, UnknownNames
from .states import ALLOWED_TRIGGERS
from .types import capped, clipped

__all__ = ["LoadTracking"]


class LoadTracking(TableMachine):
    """A `TableMachine` that the writers report to (see the module doc); `BackboneLifecycle` adds the other
    triggers."""

    def __init__(self, name: str, rank: int, readiness: LayerReadiness, *, locked: bool, recent_events: int,
                 resolve: Resolver | None = None, pinned_tensors: PinnedTensors | None = None,
                 meta_scan: MetaScan | None = None) -> None:
        super().__init__(name, rank, readiness, locked=locked, recent_events=recent_events, resolve=resolve,
                         pinned_tensors=pinned_tensors, meta_scan=meta_scan)
        self._leases = WriteLeases(self._lock, locked=locked)

    # ---- reports ------------------------------------------------------------------------------------------------
    def _refuse_unknown(self, names: list[str]) -> None:
        unknown = self.readiness.unknown(names)
        if unknown:
            self._raise_unknown(unknown)

    def _raise_unknown(self, unknown: list[str]) -> None:
        raise self.record_refusal("weights_loaded", UnknownWeightError(unknown, backbone=self.name,
                                                                      state=self.state.value))

    def weights_loaded_buckets(self, buckets: Iterable[tuple[list[str], int]], *, materialized: bool = False
                               ) -> list[list[str]]:
        """`weights_loaded` of buckets written earlier, in the order written, each with the time it was written
        (`time.time_ns()`): its `layer_ready` event carries that time. A loader on an unlocked lifecycle (one
        thread: nothing can act between its buckets) reports this way after its writes, in one pass while the
        lifecycle's tables are in the caches, rather than between each bucket's reads and copies. Returns each
        bucket's completed layers."""
        buckets = list(buckets)
        for _, at_ns in buckets:  # every time checked before the first bucket is recorded
            if type(at_ns) is not int or not 0 <= at_ns < 2**63:
                raise TypeError(f"weights_loaded_buckets of backbone {self.name!r}: each bucket's time must be a "
                                f"time.time_ns() value (an int in [0, 2**63)), got {type(at_ns).__name__} "
                                f"{clipped(repr(at_ns), 60)}; nothing recorded")
        with self._lock:
            return [self.weights_loaded(names, materialized=materialized, at_ns=at_ns) for names, at_ns in buckets]

    def weights_loaded_whole_layers(self, buckets: list[tuple[list[str], int]], layers: list[str]
                                    ) -> list[list[str]]:
        """`weights_loaded_buckets` of buckets the loader wrote with its own copy where `buckets[i]` is every
        tracked tensor of `layers[i]` (its plan by layer of a checkpoint that holds every tracked tensor,
        `loading.plan.whole_layer_plan`): when no layer of them received anything yet in this epoch, each completes
        its layer, counted per layer without reading a name, and the names join the written set in one step.
        Otherwise the general path."""
        readiness = self.readiness
        with self._lock:
            if (not buckets or len(layers) != len(buckets)
                    or "weights_loaded" not in ALLOWED_TRIGGERS[self._model.state]
                    or not readiness.fresh_layers(layers)):
                return self.weights_loaded_buckets(buckets, materialized=True)
            self._audit_whole_layers(layers, buckets, readiness.mark_layers_written(layers))
            if self._bucket_moves("weights_loaded", True):
                self._fire("weights_loaded", tensors=len(buckets[-1][0]))
            return [[layer] for layer in layers]

    def weights_loaded(self, names: Iterable[str], *, materialized: bool = False, at_ns: int | None = None
                       ) -> list[str]:
        """Record that tensors were written (one bucket; one tensor is fine). Unknown names are refused and
        nothing is recorded. Returns the layers that completed with this bucket. `materialized=True` says the
        writer left each of them off META (the loader's own `write_tensor`): while every report of an epoch says
        so, the FULLY_LOADED condition and the finish guard trust the counts instead of scanning every live tensor
        for a placeholder (`missing_by_counts`); the refresh scans either way.

        Per bucket: one `layer_ready` event listing the layers it completed (none if it completed none); the
        machine fires only when the state changes (the first report after META, the last layer of an epoch):
        a report that leaves PARTIALLY_LOADED as it is is bookkeeping (`Transition.per_bucket`)."""
        names = names if type(names) is list else list(names)
        if at_ns is not None and (type(at_ns) is not int or not 0 <= at_ns < 2**63):
            raise TypeError(f"weights_loaded of backbone {self.name!r}: at_ns must be a time.time_ns() value (an int "
                            f"in [0, 2**63)), got {type(at_ns).__name__} {clipped(repr(at_ns), 60)}; nothing recorded")
        with self._lock:
            if not materialized:
                self._meta_possible = True
            if "weights_loaded" not in ALLOWED_TRIGGERS[self._model.state]:
                self._fire("weights_loaded")  # raises IllegalTransitionError and records the refusal
            try:
                completed = self.readiness.mark_loaded(names)
            except UnknownNames as e:
                self._raise_unknown(e.names)
            if completed:
                self._audit_layers("layer_ready", completed, len(names), at_ns)
            if self._bucket_moves("weights_loaded", bool(completed)):
                self._fire("weights_loaded", tensors=len(names))
            return completed

    def weights_unchanged(self, names: Iterable[str]) -> None:
        """Declare tensors unchanged in this epoch: they count as loaded, but nothing derived from them is dirty
        (a selective reload that sends some tensors of a layer). Refused (`LayersNotReadyError`, nothing
        marked) for a tensor whose layer an aborted or abandoned reload left partly written, whose write failed
        part way, or that is still META: those must be written."""
        names = list(names)
        with self._lock:
            self._require_allowed_audited("weights_loaded")
            self._refuse_unknown(names)
            refusals = self.readiness.unchanged_refusals(names)
            for name in names:  # a placeholder has no value to keep
                if self._is_meta(name):
                    layer = self.readiness.layer_of_name[name]
                    refusals[layer] = (*refusals.get(layer, ()), f"{name} (META: nothing to keep, load it)")
            if refusals:
                raise self.record_refusal("weights_loaded", LayersNotReadyError(
                    "weights_unchanged", refusals, backbone=self.name, state=self.state.value))
            self._meta_possible = True  # declared, not written: the scan looks again at the end
            completed = self.readiness.mark_unchanged(names)
            if completed:
                self._audit_unchanged(completed)
                if self._bucket_moves("weights_loaded", True):
                    self._fire("weights_loaded", tensors=0, unchanged=len(names))

    def _audit_unchanged(self, layers: list[str]) -> None:
        self._audit_layers("layers_unchanged", layers)

    # ---- writers --------------------------------------------------------------------------------------------------
    def ensure_loading_allowed(self) -> None:
        """Raise (audited) unless weights may be written now. A loader calls this BEFORE it writes anything:
        writing weights under refreshed derived buffers without `begin_reload()` is how values go stale."""
        with self._lock:
            self._require_allowed_audited("weights_loaded")

    def acquire_write_lease(self) -> int:
        """Raise (audited) unless weights may be written now, else take a write lease (`leases.py`) for this
        thread and return its token for `release_write_lease`. With `locked=True`, `begin_reload`,
        `finalize_loading`, `refresh_derived` and `abort_reload` wait until no other thread holds a lease; an
        unlocked lifecycle refuses a second thread while one holds a lease (`ConcurrentUseError`)."""
        with self._lock:
            if "weights_loaded" not in ALLOWED_TRIGGERS[self._model.state]:
                self._fire("weights_loaded")  # raises IllegalTransitionError and records the refusal
            leases = self._leases
            if not self._locked and leases.others():
                self._refuse_second_thread("weights_loaded")
            return leases.acquire()

    def release_write_lease(self, token: int) -> None:
        """End the lease; what its write named (`writing`) and did not report was possibly written and is marked
        so (`mark_dirty`: missing until sent again, its layer partly written if the epoch ends first)."""
        with self._lock:
            left = self._leases.release(token)
            if left:
                self._mark_unreported(left)

    def writing(self, token: int, buckets: Sequence[Sequence[str]]) -> None:
        """Before the first write under lease `token`: the names it may change, until `reported(token)`."""
        self._leases.unreported[token] = buckets

    def reported(self, token: int) -> None:
        """Every name `writing` gave for lease `token` was reported (or marked, `mark_dirty`)."""
        self._leases.unreported.pop(token, None)

    def _mark_unreported(self, buckets: Sequence[Sequence[str]]) -> None:
        names = list(chain.from_iterable(buckets))
        self.mark_dirty(names)
        shown, more = capped(names, LIST_CAP)
        self._audit("writes_unreported", tensors=len(names), names=shown, names_more=more)

    def _quiesce(self, action: str) -> None:
        """Before a transition that ends or aborts loading (holding the lock): a locked lifecycle waits until no
        other thread holds a lease; an unlocked one refuses while another does (audited)."""
        if self._locked:
            self._leases.wait_until_idle()
        elif self._leases.others():
            self._refuse_second_thread(action)

    def _refuse_second_thread(self, action: str) -> None:
        others = self._leases.others()
        raise self.record_refusal(action, ConcurrentUseError(
            f"{action} refused: this backbone's lifecycle is unlocked (not thread-safe) and {len(others)} other "
            "thread(s) are writing to it; nothing was changed. Build it with locked=True to load it from several "
            "threads", backbone=self.name, state=self.state.value))

    @contextmanager
    def loading(self) -> Iterator[None]:
        """A write lease as a context manager: raise (audited) unless weights may be written now, else hold the
        lease while writing and reporting one bucket (`acquire_write_lease`)."""
        token = self.acquire_write_lease()
        try:
            yield
        finally:
            self.release_write_lease(token)

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        """Hold the lifecycle (no trigger, no new write lease) once no other thread is writing (an unlocked
        lifecycle refuses while one is: `ConcurrentUseError`)."""
        with self._lock:
            self._quiesce("abort_reload")
            yield

    def mark_dirty(self, names: Iterable[str]) -> None:
        """Record tensors possibly written by a write that failed part way: missing until sent again in full;
        their layers count as partly written if the epoch ends first."""
        with self._lock:
            self._meta_possible = True
            self.readiness.mark_dirty(names)
