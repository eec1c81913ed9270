"""`BackboneLifecycle`: one `transitions` state machine per backbone, built from the table in `states.py`.

>>> import torch; from lifecycle.events import configure_audit; _ = configure_audit(console=False)
>>> lc = BackboneLifecycle("toy", {"layers.0.w": TensorSpec((2,), torch.float32)})
>>> lc.weights_loaded(["layers.0.w"]), lc.state
(['layers.0'], <LifecycleState.FULLY_LOADED: 'FULLY_LOADED'>)
>>> try:
...     lc.capture_graphs()
... except IllegalTransitionError as e:
...     print(e.reason)
trigger 'capture_graphs' is not allowed from state FULLY_LOADED; it is allowed from: DERIVED_REFRESHED

The machine holds the state and picks conditional destinations; guards named in the table raise with the full
reason before the state changes; the effect of a trigger (a refresh) runs after the guards and before the
state changes, so a refused trigger leaves both state and buffers as they were. Per-tensor bookkeeping is a
plain counter update in `LayerReadiness`; the machine fires per layer completion and per phase.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

import torch
from transitions import Machine, MachineError
from transitions.extensions import LockedMachine

from . import events
from .errors import (
    IllegalTransitionError,
    LayersNotReadyError,
    RecoveryError,
    StorageDriftError,
    UnknownWeightError,
)
from .readiness import LayerReadiness, layer_of
from .states import INITIAL_STATE, TRANSITIONS, LifecycleState, allowed_sources, allowed_triggers
from .storage import PinnedStorage
from .types import TensorSpec

T = TypeVar("T")
Resolver = Callable[[str], "torch.Tensor | None"]
PinnedTensors = Callable[[], Mapping[str, "torch.Tensor | None"]]
Rollback = Callable[[], Iterable[str]]

#: States whose derived buffers match the weights.
USABLE_STATES = (LifecycleState.DERIVED_REFRESHED, LifecycleState.GRAPH_CAPTURED)
MetaScan = Callable[[], "set[str]"]


class _Model:
    """What `transitions` binds to: it holds `state` and the trigger methods, nothing else."""

    state: LifecycleState


class BackboneLifecycle:
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
        self.name = name
        self.rank = rank
        self.specs = dict(tensor_specs)
        self.readiness = LayerReadiness(self.specs, layer_key)
        self.pinned: PinnedStorage | None = None
        self.quarantine_reason: str | None = None
        self.recent_events: deque[dict[str, Any]] = deque(maxlen=recent_events)
        #: Number of the last info-level audit event of this lifecycle (1, 2, ...): the auditor sees a deleted,
        #: duplicated or reordered line as a gap or a step back, and a restart (seq 1 again) as a new lifecycle.
        self._seq = 0
        self._resolve = resolve
        self._pinned_tensors = pinned_tensors
        self._meta_scan = meta_scan
        self._lock: AbstractContextManager[Any] = threading.RLock() if locked else nullcontext()
        # write leases (thread id -> depth): transitions that end or abort loading wait until no other thread is
        # between its "may I write?" check and its `weights_loaded` report (locked lifecycles only)
        self._cond: threading.Condition | None = threading.Condition(self._lock) if locked else None  # type: ignore[arg-type]
        self._writers: dict[int, int] = {}
        # what `recover` needs: the reload's origin, the dirty set then, and whether an abort rolled back exactly
        self._origin_current = False
        self._dirty_at_begin: frozenset[str] = frozenset()
        self.recovery_blocker: str | None = "no reload was aborted"
        self.torn_buffers: frozenset[str] = frozenset()
        self._model = _Model()
        machine_cls = LockedMachine if locked else Machine
        self._machine = machine_cls(
            model=self._model,
            states=LifecycleState,
            initial=INITIAL_STATE,
            transitions=[self._machine_row(t) for t in TRANSITIONS],
            auto_transitions=False,
            send_event=True,
        )

    def _machine_row(self, t: Any) -> dict[str, Any]:
        guards = [self._guard_callback(g) for g in t.guards]
        row: dict[str, Any] = {
            "trigger": t.trigger,
            "source": list(t.sources),
            "dest": t.dest,
            "before": [*guards, _run_effect],
        }
        if t.condition:
            cond = getattr(self, t.condition)
            row["conditions"] = [lambda _event, cond=cond: cond()]
        return row

    def _guard_callback(self, guard: str) -> Callable[[Any], None]:
        check = getattr(self, guard)
        return lambda event: check(event.event.name)

    # ---- properties -------------------------------------------------------------------------------------------
    @property
    def state(self) -> LifecycleState:
        return self._model.state

    @property
    def epoch(self) -> int:
        return self.readiness.epoch

    @property
    def graphs_pinned(self) -> bool:
        return self.pinned is not None

    @property
    def in_reload(self) -> bool:
        return self.epoch > 0

    def bind(self, *, resolve: Resolver | None = None, pinned_tensors: PinnedTensors | None = None,
             meta_scan: MetaScan | None = None) -> None:
        if resolve is not None:
            self._resolve = resolve
        if pinned_tensors is not None:
            self._pinned_tensors = pinned_tensors
        if meta_scan is not None:
            self._meta_scan = meta_scan

    # ---- conditions and guards (named by the table) -----------------------------------------------------------
    def _is_meta(self, name: str) -> bool:
        if self._resolve is None:
            return False
        t = self._resolve(name)
        return t is None or t.is_meta

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

    def all_layers_ready(self) -> bool:
        return self.readiness.counts_complete() and not self.missing()

    def require_all_layers_ready(self, action: str) -> None:
        missing = self.missing()
        if missing:
            raise LayersNotReadyError(action, missing, backbone=self.name, state=self.state.value)

    def has_pinned_graphs(self) -> bool:
        return self.pinned is not None

    def require_recoverable(self, action: str) -> None:
        if self.recovery_blocker is not None:
            raise RecoveryError(f"{action} refused: {self.recovery_blocker}; reload instead (begin_reload, load, "
                                "finalize_loading, refresh_derived_buffers)", backbone=self.name,
                                state=self.state.value)

    def require_pinned(self, action: str) -> None:
        if self.pinned is None:
            raise IllegalTransitionError(action, backbone=self.name, state=self.state.value,
                                         allowed_from=["DERIVED_REFRESHED with graphs captured"])

    def require_pinned_unchanged(self, action: str) -> None:
        if self.pinned is None:
            return
        problems = self.pinned_changes()
        shown, more = events.capped(problems)
        self._audit("storage_check", action=action, checked=len(self.pinned) if self.pinned else 0,
                    ok=not problems, problems=shown, problems_more=more)
        if problems:
            raise StorageDriftError(problems, backbone=self.name, state=self.state.value)

    def pinned_changes(self) -> list[str]:
        if self.pinned is None or self._pinned_tensors is None:
            return []
        return self.pinned.changes(self._pinned_tensors())

    # ---- firing -----------------------------------------------------------------------------------------------
    def _require_allowed(self, trigger: str) -> None:
        if trigger not in allowed_triggers(self.state):
            raise IllegalTransitionError(trigger, backbone=self.name, state=self.state.value,
                                         allowed_from=[s.value for s in allowed_sources(trigger)])

    def _fire(self, trigger: str, effect: Callable[[], T] | None = None, **log: Any) -> T | None:
        """Fire `trigger`: guards, then `effect`, then the state change; one audit event either way."""
        src = self.state
        t0 = time.perf_counter()
        holder: dict[str, Any] = {"effect": effect}
        try:
            self._require_allowed(trigger)
            try:
                fired = self._model.trigger(trigger, holder=holder)  # type: ignore[attr-defined]
            except MachineError as e:  # the table check above should make this unreachable
                raise IllegalTransitionError(trigger, backbone=self.name, state=src.value,
                                             allowed_from=[s.value for s in allowed_sources(trigger)]) from e
            if not fired:
                raise IllegalTransitionError(trigger, backbone=self.name, state=src.value,
                                             allowed_from=["(no row's condition held)"])
        except Exception as e:  # guards' refusals and effects' failures alike: audited, state unchanged
            self._audit("refused", trigger=trigger, src=src.value, error=type(e).__name__,
                        reason=getattr(e, "reason", str(e)), duration_ms=_ms(t0), **self._readiness_fields(),
                        **_missing_fields(e))
            raise
        self._audit("transition", trigger=trigger, src=src.value, dst=self.state.value, duration_ms=_ms(t0),
                    **self._readiness_fields(), **log)
        return holder.get("result")

    def _readiness_fields(self) -> dict[str, Any]:
        return {"layers_ready": self.readiness.layers_ready, "layers_total": self.readiness.layers_total}

    def _audit(self, event: str, *, level: str = "info", **fields: Any) -> None:
        if level == "debug":  # per-bucket detail: not numbered, a log at info level has no gaps in `seq`
            events.emit(event, level=level, backbone=self.name, rank=self.rank, epoch=self.epoch, **fields)
            return
        self._seq += 1
        self.recent_events.append({"event": event, "backbone": self.name, "rank": self.rank, "epoch": self.epoch,
                                   "seq": self._seq, **fields})
        events.emit(event, level=level, backbone=self.name, rank=self.rank, epoch=self.epoch, seq=self._seq,
                   **fields)

    # ---- triggers ---------------------------------------------------------------------------------------------
    def weights_loaded(self, names: Iterable[str]) -> list[str]:
        """Record that tensors were written (one bucket; one tensor is fine). Unknown names are refused and
        nothing is recorded. Returns the layers that completed with this bucket."""
        names = list(names)
        with self._lock:
            self._require_allowed_audited("weights_loaded")
            unknown = self.readiness.unknown(names)
            if unknown:
                err = UnknownWeightError(unknown, backbone=self.name, state=self.state.value)
                self.record_refusal("weights_loaded", err)
                raise err
            completed = self.readiness.mark_loaded(names)
            for layer in completed:
                self._audit("layer_ready", layer=layer, **self._readiness_fields())
            if completed or self.state is LifecycleState.META:
                self._fire("weights_loaded", tensors=len(names))
            return completed

    def weights_unchanged(self, names: Iterable[str]) -> None:
        """Declare tensors restored unchanged in this epoch (ready, but nothing derived from them is dirty)."""
        names = list(names)
        with self._lock:
            self._require_allowed_audited("weights_loaded")
            unknown = self.readiness.unknown(names)
            if unknown:
                err = UnknownWeightError(unknown, backbone=self.name, state=self.state.value)
                self.record_refusal("weights_loaded", err)
                raise err
            completed = self.readiness.mark_unchanged(names)
            if completed:
                shown, more = events.capped(completed)
                self._audit("layers_unchanged", layers=shown, layers_more=more, **self._readiness_fields())
                self._fire("weights_loaded", tensors=0, unchanged=len(names))

    def begin_reload(self) -> int:
        """Start a reload epoch. Graph pinning (if any) stays in force. Returns the new epoch."""
        with self._lock:
            self._quiesce()
            src = self.state
            self._require_allowed_audited("begin_reload")
            # derived buffers match the weights at the start of this reload: a rollback to here can be recovered
            self._origin_current = src in USABLE_STATES or (
                src is LifecycleState.QUARANTINED and self.recovery_blocker is None)
            self._dirty_at_begin = self.readiness.dirty_tensors()
            self.readiness.new_epoch()
            self.quarantine_reason = None
            self._fire("begin_reload", pinned=self.graphs_pinned, from_state=src.value)
            return self.epoch

    def _require_allowed_audited(self, trigger: str) -> None:
        """Refuse (audited) before any bookkeeping when the table does not allow `trigger` now."""
        if trigger not in allowed_triggers(self.state):
            self._fire(trigger)  # raises IllegalTransitionError and records the refusal

    def finish_loading(self, *, keep_untouched: bool = False) -> None:
        """The loader is done. Every layer must be ready; with `keep_untouched`, layers that received nothing
        in this reload are declared unchanged first (a selective reload). LayersNotReadyError otherwise."""
        with self._lock:
            self._quiesce()
            self._require_allowed_audited("finish_loading")
            if keep_untouched and self.in_reload:
                untouched = self.readiness.untouched_layers()
                names = [n for layer in untouched for n in self.readiness.tensors_of_layer[layer]]
                if names:
                    self._refuse_if_still_missing("finish_loading", set(untouched))  # before marking anything
                    completed = self.readiness.mark_unchanged(names)
                    shown, more = events.capped(completed)
                    self._audit("layers_unchanged", layers=shown, layers_more=more, **self._readiness_fields())
            self._fire("finish_loading", keep_untouched=keep_untouched)

    def _refuse_if_still_missing(self, action: str, untouched: set[str]) -> None:
        """Refuse (audited) if some layer would still be missing tensors once `untouched` layers are declared
        unchanged: a refused finish must not leave them marked."""
        blocking: dict[str, tuple[str, ...]] = {}
        for layer, names in self.missing().items():
            if layer in untouched:  # declared unchanged: only META placeholders still count as missing
                names = tuple(f"{n} (META)" for n in self.readiness.tensors_of_layer[layer] if self._is_meta(n))
            if names:
                blocking[layer] = names
        if blocking:
            err = LayersNotReadyError(action, blocking, backbone=self.name, state=self.state.value)
            self._audit("refused", trigger=action, src=self.state.value, error=type(err).__name__,
                        reason=err.reason, **self._readiness_fields(), **_missing_fields(err))
            raise err

    def refresh_derived(self, effect: Callable[[], T], **log: Any) -> T:
        """Run `effect` (validate-then-write of every derived buffer) as the `refresh_derived` transition;
        then, under captured graphs, verify every pinned identity and return to GRAPH_CAPTURED."""
        with self._lock:
            self._quiesce()
            if self.state in (LifecycleState.META, LifecycleState.PARTIALLY_LOADED):
                # the build is refused for unready layers before anything else: name every missing tensor
                try:
                    self.require_all_layers_ready("refresh_derived")
                except LayersNotReadyError as e:
                    self._audit("refused", trigger="refresh_derived", src=self.state.value,
                                error=type(e).__name__, reason=e.reason, **self._readiness_fields(),
                                **_missing_fields(e))
                    raise
            result = self._fire("refresh_derived", effect, **log)
            self.readiness.clear_dirty()  # every write since the last refresh is now in the derived buffers
            self.torn_buffers = frozenset()  # and every buffer an interrupted refresh touched was rewritten
            if self.pinned is not None:
                self._fire("graphs_verified", pinned=len(self.pinned))
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
        the backbone recoverable (`recover`); a rollback that raises still quarantines (not recoverable)."""
        with self._lock:
            self._quiesce()
            self._require_allowed_audited("abort_reload")
            restored: frozenset[str] | None = None
            rollback_error: str | None = None
            if rollback is not None:
                try:
                    restored = frozenset(rollback())
                except Exception as e:  # the abort itself must not fail: quarantine, not recoverable
                    rollback_error = f"{type(e).__name__}: {e}"
            blocker = self._recovery_verdict(restored, rollback_error)

            def quarantine() -> None:
                self.quarantine_reason = reason
                self.recovery_blocker = blocker
                if blocker is None:  # every write since begin_reload was undone: nothing new to propagate
                    self.readiness.restore_dirty(self._dirty_at_begin)

            extra: dict[str, Any] = {"recovery_blocker": blocker} if blocker else {}
            if rollback_error:
                extra["rollback_error"] = rollback_error
            shown, more = events.capped(n for names in self.missing().values() for n in names)
            self._fire("abort_reload", quarantine, reason=reason, missing=shown, missing_more=more,
                       rolled_back=restored is not None, restored=len(restored or ()),
                       recoverable=blocker is None, **extra)

    def _recovery_verdict(self, restored: frozenset[str] | None, rollback_error: str | None) -> str | None:
        """Why `recover` would be wrong after this abort; None when the last good derived buffers match the
        weights again."""
        if not self._origin_current:
            return ("this load did not start from refreshed derived buffers (a cold load, or a reload begun from "
                    "a state whose derived buffers were stale), so there is nothing to return to")
        if rollback_error is not None:
            return f"the rollback failed ({rollback_error})"
        if restored is None:
            return "the aborted reload was not rolled back: the weights may hold part of it"
        outside = sorted(self.readiness.dirty_tensors() - self._dirty_at_begin - restored)
        if outside:
            shown, more = events.capped(outside)
            return (f"{len(outside)} tensor(s) were written outside the rollback snapshot: {', '.join(shown)}"
                    + (f" ... and {more} more" if more else ""))
        if self.torn_buffers:
            return f"derived buffer(s) {', '.join(sorted(self.torn_buffers))} were interrupted mid-write"
        return None

    def recover(self) -> LifecycleState:
        """QUARANTINED -> DERIVED_REFRESHED (GRAPH_CAPTURED when graphs are still pinned), allowed only after an
        abort whose rollback restored every write exactly (`require_recoverable`) and with every pinned identity
        unchanged. Every tensor counts as restored unchanged in this epoch. Returns the new state."""
        with self._lock:
            def restore() -> None:
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

    def verify_pinned(self) -> int:
        """Check every pinned identity against the live tensors now. Returns how many were checked."""
        with self._lock:
            self.require_pinned_unchanged("verify_pinned")
            return len(self.pinned) if self.pinned else 0

    def record_refusal(self, trigger: str, error: Exception) -> None:
        """Audit a refusal decided outside the machine (the loader's checks of names, shapes, files)."""
        self._audit("refused", trigger=trigger, src=self.state.value, error=type(error).__name__,
                    reason=getattr(error, "reason", str(error)), **self._readiness_fields())

    def audit_event(self, event: str, *, level: str = "info", **fields: Any) -> None:
        """Emit an event in this backbone's context (used by the backbone, loader and hooks)."""
        self._audit(event, level=level, **fields)

    def ensure_loading_allowed(self) -> None:
        """Raise (audited) unless weights may be written now. A loader calls this BEFORE it writes anything:
        writing weights under refreshed derived buffers without `begin_reload()` is how values go stale."""
        with self._lock:
            self._require_allowed_audited("weights_loaded")

    @contextmanager
    def loading(self) -> Iterator[None]:
        """A write lease: raise (audited) unless weights may be written now, else hold the lease while writing
        and reporting one bucket. With `locked=True`, `begin_reload`, `finish_loading`, `refresh_derived` and
        `abort_reload` wait until no other thread holds a lease, so a write is either reported before such a
        transition or refused after it, never lost in between."""
        tid = threading.get_ident()
        with self._lock:
            self._require_allowed_audited("weights_loaded")
            self._writers[tid] = self._writers.get(tid, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                depth = self._writers[tid] - 1
                if depth:
                    self._writers[tid] = depth
                else:
                    del self._writers[tid]
                if self._cond is not None:
                    self._cond.notify_all()

    def _quiesce(self) -> None:
        """Holding the lock: wait until no other thread holds a write lease (its own lease never blocks)."""
        if self._cond is None:
            return
        me = threading.get_ident()
        self._cond.wait_for(lambda: all(t == me for t in self._writers))

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        """Hold the lifecycle (no trigger, no new write lease) once no other thread is writing."""
        with self._lock:
            self._quiesce()
            yield

    def mark_dirty(self, names: Iterable[str]) -> None:
        """Record tensors possibly written by a write that failed part way (not loaded: send them again)."""
        with self._lock:
            self.readiness.mark_dirty(names)


def _run_effect(event: Any) -> None:
    holder = event.kwargs.get("holder")
    if holder is not None and holder.get("effect") is not None:
        holder["result"] = holder["effect"]()


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def _missing_fields(e: Exception) -> dict[str, Any]:
    if not isinstance(e, LayersNotReadyError):
        return {}
    flat = [n for names in e.missing.values() for n in names]
    shown, more = events.capped(flat)
    return {"missing": shown, "missing_more": more}
