"""`BackboneLifecycle`: one `transitions` state machine per backbone, built from the table in `states.py`.

>>> import torch; from lifecycle.events import configure_audit; _ = configure_audit(console=False)
>>> from lifecycle.errors import IllegalTransitionError
>>> lc = BackboneLifecycle("toy", {"layers.0.w": TensorSpec((2,), torch.float32)})
>>> lc.weights_loaded(["layers.0.w"]), lc.state
(['layers.0'], <LifecycleState.FULLY_LOADED: 'FULLY_LOADED'>)
>>> try:
...     lc.capture_graphs()
... except IllegalTransitionError as e:
...     print(e.reason)
trigger 'capture_graphs' is not allowed from state FULLY_LOADED; it is allowed from: DERIVED_REFRESHED

The machine (`firing.TableMachine`) holds the state and picks conditional destinations; the guards the table
names (`guards.py`) raise with the full reason before the state changes; the effect of a trigger (a refresh)
runs after the guards and before the state changes, so a refused trigger leaves both state and buffers as they
were. Per-tensor bookkeeping is a plain counter update in `LayerReadiness`; the machine fires per layer
completion and per phase. Here: what each trigger does, and what the table says about the current state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from . import events
from .errors import IllegalTransitionError, LayersNotReadyError, LifecycleError, UnknownWeightError
from .firing import TableMachine
from .guards import ReloadOrigin, recovery_verdict, refusal, require_all_layers_ready, require_pinned_unchanged
from .leases import WriteLeases
from .readiness import LayerReadiness, UnknownNames, layer_of
from .states import ALLOWED_TRIGGERS, INITIAL_STATE, QUARANTINE_STATE, USABLE_STATES, LifecycleState
from .storage import PinnedStorage
from .types import TensorSpec, capped, clipped

__all__ = ["BackboneLifecycle"]

T = TypeVar("T")
Resolver = Callable[[str], "torch.Tensor | None"]
PinnedTensors = Callable[[], Mapping[str, "torch.Tensor | None"]]
Rollback = Callable[[], Iterable[str]]
MetaScan = Callable[[], "set[str]"]


class BackboneLifecycle(TableMachine):
    """The reload lifecycle of one draft backbone.

    `tensor_specs`: every checkpoint tensor the backbone expects (name -> shape/dtype).
    `resolve`: finds the live tensor for a name (to see META placeholders); `pinned_tensors` lists what graphs
    read (derived buffers and parameters) for pinning; `meta_scan` (optional) returns, in one pass, the names of
    every checkpoint tensor that is absent or on META now: the full readiness check then needs no per-name
    resolve (it runs at every layer-complete load, finish and refresh). The backbone mixin wires all three.
    """

    def __init__(
        self,
        name: str,
        tensor_specs: Mapping[str, TensorSpec],
        *,
        rank: int = 0,
        resolve: Resolver | None = None,
        pinned_tensors: PinnedTensors | None = None,
        meta_scan: MetaScan | None = None,
        layer_key: Callable[[str], str] = layer_of,
        locked: bool = False,
        recent_events: int = 256,
    ) -> None:
        self.specs = dict(tensor_specs)
        super().__init__(name, rank, LayerReadiness(self.specs, layer_key), locked=locked,
                         recent_events=recent_events)
        self.pinned: PinnedStorage | None = None
        self.quarantine_reason: str | None = None
        self._resolve = resolve
        self._pinned_tensors = pinned_tensors
        self._meta_scan = meta_scan
        # whether a tensor counted loaded in this epoch may be on META: False while every one was written by the
        # loader's own copy (`weights_loaded(..., materialized=True)`: `write_tensor` leaves no placeholder), so
        # the FULLY_LOADED condition and the finish guard need no scan of the live tensors (`missing_by_counts`);
        # any other report, declaration or failed write sets it until the next epoch, and so does a finish: once
        # other code has run, the refresh (which builds from the weights) scans again
        self._may_hold_meta = False
        # an unlocked lifecycle is not thread-safe (no LockedMachine, leases never wait); the lock is there anyway:
        # an uncontended RLock costs less per call than a null context manager
        self._lock = threading.RLock()
        self._locked = locked
        self._leases = WriteLeases(self._lock, locked=locked)
        # what `recover` needs: where the current reload began, and why recovering would be wrong (None: it would not)
        self._origin = ReloadOrigin()
        self.recovery_blocker: str | None = "no reload was aborted"
        self.torn_buffers: frozenset[str] = frozenset()
        self.structure: dict[str, bool] | None = None  # optional submodule -> present, frozen by the first load
        #: counts the changes of `specs` (`freeze_structure`): what was checked against them before is void
        self.specs_revision = 0

    # ---- what the table says about the current state -----------------------------------------------------------
    @property
    def graphs_pinned(self) -> bool:
        return self.pinned is not None

    @property
    def in_reload(self) -> bool:
        return self.epoch > 0

    @property
    def usable(self) -> bool:
        """The derived buffers match the weights: the fused path may run (`states.USABLE_STATES`)."""
        return self.state in USABLE_STATES

    @property
    def quarantined(self) -> bool:
        """A failed or aborted load left the backbone refusing forward use (`states.QUARANTINE_STATE`)."""
        return self.state is QUARANTINE_STATE

    @property
    def unloaded(self) -> bool:
        """Nothing was reported yet: the initial state of the table (no reload to begin, nothing to abort)."""
        return self.state is INITIAL_STATE

    @property
    def awaiting_weights(self) -> bool:
        """Weights may still arrive and no derived buffer can be built yet: the table allows `weights_loaded`
        but not `refresh_derived` (some layer is not ready, or the load is not finalized)."""
        return self.can("weights_loaded") and not self.can("refresh_derived")

    def bind(self, *, resolve: Resolver | None = None, pinned_tensors: PinnedTensors | None = None,
             meta_scan: MetaScan | None = None) -> None:
        if resolve is not None:
            self._resolve = resolve
        if pinned_tensors is not None:
            self._pinned_tensors = pinned_tensors
        if meta_scan is not None:
            self._meta_scan = meta_scan

    # ---- what the guards read -----------------------------------------------------------------------------------
    def _is_meta(self, name: str) -> bool:
        if self._resolve is None:
            return False
        t = self._resolve(name)
        return t is None or t.is_meta

    def missing_by_counts(self) -> dict[str, tuple[str, ...]]:
        """`missing()` for `Guard`/`Condition.ALL_LAYERS_READY`: while every tensor of the epoch was materialised
        by the loader's own copy and the load is not finished, the counts say it and no live tensor is scanned
        (the scan costs about 0.5 us per tensor once the loader's copies have gone through the caches): the
        FULLY_LOADED condition at the last bucket and the finish guard. Any other writer, a declaration, a
        failed write, or a finished load (other code has run since) makes it scan: the refresh, which builds the
        derived buffers from the weights, scans after every finish."""
        if self._may_hold_meta:
            return self.missing()
        return self.readiness.missing(None)

    def missing(self, names: Iterable[str] | None = None) -> dict[str, tuple[str, ...]]:
        """Layer -> tensors not loaded in this epoch or still on META. Empty when every layer is ready."""
        if names is None and self._meta_scan is not None:
            bad = self._meta_scan()  # one pass over the live tensors
            return self.readiness.missing(bad.__contains__ if bad else None)
        resolve = self._resolve
        if resolve is None:
            return self.readiness.missing(None, names)

        def is_meta(name: str) -> bool:  # per tensor: one call into the resolver, no attribute lookups
            t = resolve(name)
            return t is None or t.is_meta

        return self.readiness.missing(is_meta, names)

    def pinned_changes(self) -> list[str]:
        if self.pinned is None or self._pinned_tensors is None:
            return []
        return self.pinned.changes(self._pinned_tensors())

    # ---- triggers ---------------------------------------------------------------------------------------------
    def _refuse_unknown(self, names: list[str]) -> None:
        unknown = self.readiness.unknown(names)
        if unknown:
            self._raise_unknown(unknown)

    def _raise_unknown(self, unknown: list[str]) -> None:
        raise self.record_refusal("weights_loaded", UnknownWeightError(unknown, backbone=self.name,
                                                                      state=self.state.value))

    @property
    def locked(self) -> bool:
        """Built for several writer threads (`LockedMachine`, write leases that triggers wait for)."""
        return self._locked

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
                self._may_hold_meta = True
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
            self._may_hold_meta = True  # declared, not written: the scan looks again at the end
            completed = self.readiness.mark_unchanged(names)
            if completed:
                self._audit_unchanged(completed)
                if self._bucket_moves("weights_loaded", True):
                    self._fire("weights_loaded", tensors=0, unchanged=len(names))

    def freeze_structure(self, modules: Mapping[str, bool], absent: Iterable[str]) -> None:
        """Record which optional submodules the first load gave the backbone (`modules`: name -> present), once,
        in epoch 0 before that load finished, and stop tracking the tensors of the absent ones (`absent`): no
        later epoch needs them, and a later write of one is unknown."""
        absent = sorted(absent)
        with self._lock:
            if self.structure is not None or self.epoch != 0 or not self.can("weights_loaded"):
                raise IllegalTransitionError("freeze_structure", backbone=self.name, state=self.state.value,
                                             allowed_from=["epoch 0, once, before its load finished"])
            self.readiness.forget(absent)
            for name in absent:
                self.specs.pop(name, None)
            self.specs_revision += 1  # a checkpoint checked against the specs before is not vouched for now
            self.structure = dict(modules)
            self._audit("structure_frozen", present=sorted(m for m, p in modules.items() if p),
                        absent=sorted(m for m, p in modules.items() if not p), tensors_untracked=len(absent),
                        **self._readiness_fields())

    def _audit_unchanged(self, layers: list[str]) -> None:
        self._audit_layers("layers_unchanged", layers)

    def begin_reload(self) -> int:
        """Start a reload epoch. Graph pinning (if any) stays in force. Returns the new epoch."""
        with self._lock:
            self._leases.wait_until_idle()
            src = self.state
            self._require_allowed_audited("begin_reload")
            # derived buffers match the weights at the start of this reload: a rollback to here can be recovered
            self._origin = ReloadOrigin(
                current=self.usable or (self.quarantined and self.recovery_blocker is None),
                dirty_parts=self.readiness.dirty_parts())
            self.readiness.new_epoch()
            self._may_hold_meta = False
            self.quarantine_reason = None
            self._fire("begin_reload", pinned=self.graphs_pinned, from_state=src.value)
            return self.epoch

    def finish_loading(self, *, keep_untouched: bool = False, effect: Callable[[], Any] | None = None) -> None:
        """The loader is done. Every layer must be ready; with `keep_untouched`, layers that received nothing
        in this reload are declared unchanged first (a selective reload; never a layer an aborted reload left
        partly written). LayersNotReadyError otherwise. `effect` (the backbone's post-load hooks) runs once the
        guard passed, before the state changes: if it raises, the finish is refused and the layers declared
        unchanged are unmarked again."""
        with self._lock:
            self._leases.wait_until_idle()
            self._require_allowed_audited("finish_loading")
            declared: list[str] = []
            if keep_untouched and self.in_reload:
                untouched = [la for la in self.readiness.untouched_layers()
                             if la not in self.readiness.partly_written]
                names = [n for layer in untouched for n in self.readiness.tensors_of_layer[layer]]
                self._refuse_if_still_missing("finish_loading", set(untouched))  # before marking anything
                if names:
                    declared = names
                    self._may_hold_meta = True
                    self._audit_unchanged(self.readiness.mark_unchanged(names))
            try:
                self._fire("finish_loading", effect, keep_untouched=keep_untouched)
            except BaseException:
                if declared:
                    self.readiness.unmark(declared)
                raise
            self._may_hold_meta = True  # the loader is done: whatever runs next may swap a tensor (see __init__)

    def _refuse_if_still_missing(self, action: str, untouched: set[str]) -> None:
        """Refuse (audited) if some layer would still be missing tensors once `untouched` layers are declared
        unchanged: a refused finish must not leave them marked. A layer partly written by an aborted or
        abandoned reload is named as such: only a complete write of it ends that."""
        blocking: dict[str, tuple[str, ...]] = {}
        partly = self.readiness.partly_written
        for layer, names in self.missing().items():
            if layer in untouched:  # declared unchanged: only META placeholders still count as missing
                names = tuple(f"{n} (META)" for n in self.readiness.tensors_of_layer[layer] if self._is_meta(n))
            elif layer in partly:
                why = self.readiness.full_write_reason(layer)
                names = tuple(f"{n} ({why}: write every tensor of it)" if "(" not in n else n for n in names)
            if names:
                blocking[layer] = names
        if blocking:
            raise self.record_refusal(action, LayersNotReadyError(action, blocking, backbone=self.name,
                                                                  state=self.state.value))

    def refresh_derived(self, effect: Callable[[], T], **log: Any) -> T:
        """Run `effect` (validate-then-write of every derived buffer) as the `refresh_derived` transition;
        then the follow-ups the table declares: under captured graphs, verify every pinned identity and return
        to GRAPH_CAPTURED."""
        with self._lock:
            self._leases.wait_until_idle()
            if self.awaiting_weights:
                # still loading: a build is refused for unready layers by naming every missing tensor (what the
                # caller must fix), else like any trigger the table does not allow, saying what comes first
                try:
                    require_all_layers_ready(self, "refresh_derived")
                except LayersNotReadyError as e:
                    self.record_refusal("refresh_derived", e)
                    raise
                self._refuse_untabled("refresh_derived", "call finalize_loading() first (it checks that every "
                                      "layer is ready and runs the load's hooks)")
            result = self._fire("refresh_derived", effect, **log)
            self.readiness.clear_dirty()  # every write since the last refresh is now in the derived buffers
            self.torn_buffers = frozenset()  # and every buffer an interrupted refresh touched was rewritten
            # the follow-ups verify pinned identities: their event says how many are pinned
            self._fire_follow_ups("refresh_derived", pinned=len(self.pinned) if self.pinned is not None else 0)
            return result  # type: ignore[return-value]

    def capture_graphs(self) -> int:
        """Pin the storage identity of everything graphs read. Returns how many tensors were pinned."""
        with self._lock:
            def pin() -> int:
                tensors = self._pinned_tensors() if self._pinned_tensors else {}
                self.pinned = PinnedStorage.snapshot({k: v for k, v in tensors.items() if v is not None})
                return len(self.pinned)

            return self._fire("capture_graphs", pin) or 0

    def release_graphs(self) -> None:
        with self._lock:
            def unpin() -> None:
                self.pinned = None

            self._fire("release_graphs", unpin)

    def abort_reload(self, reason: str, *, rollback: Rollback | None = None) -> None:
        """Quarantine: derived buffers keep their last good values; forward use is refused until a reload or
        `recover()`. Waits until no other thread is writing. `rollback`: restores every tensor written since
        `begin_reload` to its value then and returns their names; run here, after the writers finished and
        before the state changes. An exact rollback of a reload that started with current derived buffers makes
        the backbone recoverable (`recover`); a rollback that raises still quarantines (not recoverable).
        `reason` is kept (and audited, and named by `QuarantinedError`) cut at `events.STR_CAP` characters."""
        reason = clipped(str(reason), events.STR_CAP)
        with self._lock:
            self._leases.wait_until_idle()
            self._require_allowed_audited("abort_reload")
            restored: frozenset[str] | None = None
            rollback_error: str | None = None
            if rollback is not None:
                try:
                    restored = frozenset(rollback())
                except Exception as e:  # the abort itself must not fail: quarantine, not recoverable
                    rollback_error = clipped(f"{type(e).__name__}: {e}", events.STR_CAP)
            blocker = recovery_verdict(self._origin, self.readiness.dirty_tensors(), restored, rollback_error,
                                       self.torn_buffers)
            # layers this reload wrote part of, not undone by the rollback: mixed checkpoints until written in full
            partly = self.readiness.close_epoch(restored or ())

            def quarantine() -> None:
                self.quarantine_reason = reason
                self.recovery_blocker = blocker
                if blocker is None:  # every write since begin_reload was undone: nothing new to propagate
                    self.readiness.restore_dirty(self._origin.dirty)

            extra: dict[str, Any] = {"recovery_blocker": blocker} if blocker else {}
            if rollback_error:
                extra["rollback_error"] = rollback_error
            if partly:
                extra["partly_written"], extra["partly_written_more"] = capped(partly, events.LIST_CAP)
            shown, more = capped((n for names in self.missing().values() for n in names), events.LIST_CAP)
            self._fire("abort_reload", quarantine, reason=reason, missing=shown, missing_more=more,
                       rolled_back=restored is not None, restored=len(restored or ()),
                       recoverable=blocker is None, **extra)

    def recover(self) -> LifecycleState:
        """QUARANTINED -> DERIVED_REFRESHED (GRAPH_CAPTURED when graphs are still pinned), allowed only after an
        abort whose rollback restored every write exactly (`Guard.RECOVERABLE`) and with every pinned identity
        unchanged. Every tensor counts as restored unchanged in this epoch. Returns the new state."""
        with self._lock:
            def restore() -> None:
                self._may_hold_meta = True
                self.readiness.mark_unchanged(self.specs)
                self.quarantine_reason = None
                self.recovery_blocker = "recovered already"

            self._fire("recover", restore, pinned=self.graphs_pinned)
            return self.state

    def note_derived_torn(self, names: Iterable[str]) -> None:
        """Derived buffers an interrupted refresh may have written part of: the next refresh rewrites them
        fully (the backbone marks their sources dirty) and `recover` is refused until then."""
        with self._lock:
            self.torn_buffers = self.torn_buffers | frozenset(names)

    def refusal(self, trigger: str) -> LifecycleError | None:
        """The error `trigger` would raise now, or None when it would succeed (`guards.refusal`: the table, then
        the row's guards, checked quietly; a trigger's effect, such as a refresh's plan, is not foreseen)."""
        with self._lock:
            return refusal(self, trigger)

    def verify_pinned(self) -> int:
        """Check every pinned identity against the live tensors now. Returns how many were checked."""
        with self._lock:
            require_pinned_unchanged(self, "verify_pinned")
            return len(self.pinned) if self.pinned else 0

    # ---- writers --------------------------------------------------------------------------------------------------
    def ensure_loading_allowed(self) -> None:
        """Raise (audited) unless weights may be written now. A loader calls this BEFORE it writes anything:
        writing weights under refreshed derived buffers without `begin_reload()` is how values go stale."""
        with self._lock:
            self._require_allowed_audited("weights_loaded")

    def acquire_write_lease(self) -> int:
        """Raise (audited) unless weights may be written now, else take a write lease (`leases.py`) for this
        thread and return its token for `release_write_lease`. With `locked=True`, `begin_reload`,
        `finish_loading`, `refresh_derived` and `abort_reload` wait until no other thread holds a lease."""
        with self._lock:
            if "weights_loaded" not in ALLOWED_TRIGGERS[self._model.state]:
                self._fire("weights_loaded")  # raises IllegalTransitionError and records the refusal
            # unlocked, nothing ever waits for a lease: the check is all there is to it
            return self._leases.acquire() if self._locked else 0

    def release_write_lease(self, token: int) -> None:
        if self._locked:
            with self._lock:
                self._leases.release(token)

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
        """Hold the lifecycle (no trigger, no new write lease) once no other thread is writing."""
        with self._lock:
            self._leases.wait_until_idle()
            yield

    def mark_dirty(self, names: Iterable[str]) -> None:
        """Record tensors possibly written by a write that failed part way: missing until sent again in full;
        their layers count as partly written if the epoch ends first."""
        with self._lock:
            self._may_hold_meta = True
            self.readiness.mark_dirty(names)
