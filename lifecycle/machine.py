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
were. What the writers report (`weights_loaded`, write leases) is `load_tracking.LoadTracking`'s, the numbered
events `event_trail.AuditTrail`'s. Here: what each other trigger does, and what the table says about the
current state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from . import events
from .errors import IllegalTransitionError, LayersNotReadyError, LifecycleError, SessionStateError, StorageDriftError
from .firing import MetaScan, PinnedTensors, Resolver
from .guards import ReloadOrigin, recovery_verdict, refusal, require_all_layers_ready, require_pinned_unchanged
from .load_tracking import LoadTracking
from .readiness import LayerReadiness, layer_of
from .states import INITIAL_STATE, QUARANTINE_STATE, USABLE_STATES, LifecycleState
from .storage import PinnedContent, PinnedStorage
from .types import TensorSpec, capped, clipped

__all__ = ["BackboneLifecycle"]

T = TypeVar("T")
#: Restores every tensor written since `begin_reload` and returns their names (`abort_reload`).
Rollback = Callable[[], Iterable[str]]


class BackboneLifecycle(LoadTracking):
    """The reload lifecycle of one draft backbone.

    `tensor_specs`: every checkpoint tensor the backbone expects (name -> shape/dtype).
    `resolve`: finds the live tensor for a name (to see META placeholders); `pinned_tensors` lists what graphs
    read (derived buffers and parameters) for pinning; `meta_scan` (optional) returns, in one pass, the names of
    every checkpoint tensor that is absent or on META now: the full readiness check then needs no per-name
    resolve (it runs at every layer-complete load, finish and refresh). The backbone mixin wires all three.
    """

    #: the constant derived buffers (name -> live tensor), whose content is pinned at capture (`PinnedContent`);
    #: the backbone mixin sets it
    constant_tensors: Callable[[], Mapping[str, Any]] | None = None
    pinned_content: PinnedContent | None = None

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
                         recent_events=recent_events, resolve=resolve, pinned_tensors=pinned_tensors,
                         meta_scan=meta_scan)
        self.quarantine_reason: str | None = None
        # what `recover` needs beside `recovery_blocker`: where the current reload began
        self._origin = ReloadOrigin()
        self.torn_buffers: frozenset[str] = frozenset()
        self._session: weakref.ref[object] | None = None  # the open reload session (`open_session`)
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

    # ---- triggers ---------------------------------------------------------------------------------------------
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

    def begin_reload(self) -> int:
        """Start a reload epoch. Graph pinning (if any) stays in force. Returns the new epoch."""
        with self._lock:
            self._quiesce("begin_reload")
            src = self.state
            self._require_allowed_audited("begin_reload")
            # derived buffers match the weights at the start of this reload: a rollback to here can be recovered
            self._origin = ReloadOrigin(
                current=self.usable or (self.quarantined and self.recovery_blocker is None),
                dirty_parts=self.readiness.dirty_parts())
            self.readiness.new_epoch()
            self._meta_possible = False
            self.quarantine_reason = None
            self._fire("begin_reload", pinned=self.graphs_pinned, from_state=src.value)
            return self.epoch

    def finalize_loading(self, *, keep_untouched: bool = False, effect: Callable[[], Any] | None = None) -> None:
        """The loader is done. Every layer must be ready; with `keep_untouched`, layers that received nothing
        in this reload are declared unchanged first (a selective reload; never a layer an aborted reload left
        partly written). LayersNotReadyError otherwise. `effect` (the backbone's post-load hooks) runs once the
        guard passed, before the state changes: if it raises, the finish is refused and the layers declared
        unchanged are unmarked again."""
        with self._lock:
            self._quiesce("finalize_loading")
            self._require_allowed_audited("finalize_loading")
            declared: list[str] = []
            if keep_untouched and self.in_reload:
                untouched = [la for la in self.readiness.untouched_layers()
                             if la not in self.readiness.partly_written]
                names = [n for layer in untouched for n in self.readiness.tensors_of_layer[layer]]
                self._refuse_if_still_missing("finalize_loading", set(untouched))  # before marking anything
                if names:
                    declared = names
                    self._meta_possible = True
                    self._audit_unchanged(self.readiness.mark_unchanged(names))
            try:
                self._fire("finalize_loading", effect, keep_untouched=keep_untouched)
            except BaseException:
                if declared:
                    self.readiness.unmark(declared)
                raise
            self._meta_possible = True  # the loader is done: whatever runs next may swap a tensor (see __init__)

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
            self._quiesce("refresh_derived")
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
            return result

    def capture_graphs(self) -> int:
        """Pin the storage identity of everything graphs read. Returns how many tensors were pinned."""
        with self._lock:
            def pin() -> int:
                tensors = self._pinned_tensors() if self._pinned_tensors else {}
                self.pinned = PinnedStorage.snapshot({k: v for k, v in tensors.items() if v is not None})
                self.pin_content()
                return len(self.pinned)

            return self._fire("capture_graphs", pin) or 0

    def release_graphs(self) -> None:
        with self._lock:
            def unpin() -> None:
                self.pinned = None
                self.pinned_content = None

            self._fire("release_graphs", unpin)

    def abort_reload(self, reason: str, *, rollback: Rollback | None = None) -> None:
        """Quarantine: derived buffers keep their last good values; forward use is refused until a reload or
        `recover()`. Waits until no other thread is writing. `rollback`: restores every tensor written since
        `begin_reload` to its value then and returns their names; run here, after the writers finished and
        before the state changes. An exact rollback of a reload that started with current derived buffers makes
        the backbone recoverable (`recover`); a rollback that raises or is interrupted (any `BaseException`)
        still quarantines, as "rollback incomplete": not recoverable, every layer the reload wrote owed a full
        write; then what stopped it is raised.
        `reason` is kept (and audited, and named by `QuarantinedError`) cut at `events.STR_CAP` characters."""
        reason = clipped(str(reason), events.STR_CAP)
        with self._lock:
            self._quiesce("abort_reload")
            self._require_allowed_audited("abort_reload")
            restored: frozenset[str] | None = None
            rollback_error: str | None = None
            stopped: BaseException | None = None  # what stopped the rollback: raised once quarantined
            if rollback is not None:
                try:
                    restored = frozenset(rollback())
                except BaseException as e:  # an error or an interrupt: quarantine, not recoverable, then raise it
                    rollback_error = clipped(f"{type(e).__name__}: {e}", events.STR_CAP)
                    stopped = e
            blocker = recovery_verdict(self._origin, self.readiness.dirty_tensors(), restored, rollback_error,
                                       self.torn_buffers)
            # layers this reload wrote part of, not undone by the rollback: mixed checkpoints until written in full
            # (a rollback stopped part way may have restored any part of any layer the reload wrote)
            partly = self.readiness.close_epoch(restored or (), every_written=stopped is not None)

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
            if stopped is not None:
                try:
                    raise stopped
                finally:
                    del stopped  # this frame is in its traceback (see `errors`)

    def recover(self) -> LifecycleState:
        """QUARANTINED -> DERIVED_REFRESHED (GRAPH_CAPTURED when graphs are still pinned), allowed only after an
        abort whose rollback restored every write exactly (`Guard.RECOVERABLE`) and with every pinned identity
        unchanged. Every tensor counts as restored unchanged in this epoch. Returns the new state."""
        with self._lock:
            def restore() -> None:
                self._meta_possible = True
                self.readiness.mark_unchanged(self.specs)
                self.quarantine_reason = None
                self.recovery_blocker = "recovered already"

            self._fire("recover", restore, pinned=self.graphs_pinned)
            return self.state

    def note_changed(self, names: Iterable[str]) -> None:
        """Tensors written without a load (by a post-load hook): dirty, so the next refresh rewrites what reads
        them; outside any rollback snapshot, so an abort after it is not recoverable unless the rollback restored
        them too. Audited (`changed_by_hooks`)."""
        names = list(names)
        with self._lock:
            self.readiness.mark_changed(names)
            self._meta_possible = True
            shown, more = capped(names, events.LIST_CAP)
            self._audit("changed_by_hooks", tensors=len(names), names=shown, names_more=more)

    def open_session(self, session: object) -> None:
        """Register `session` as this backbone's open reload session. Refused (audited, `SessionStateError`) while
        another is open and its load is in progress: sessions do not nest (an inner commit would leave the outer
        nothing to roll back). One whose load ended without it (the backbone is usable or quarantined: an
        interrupt stopped its commit or abort part way) is closed (audited, `session_abandoned`). Held weakly: a
        session dropped without commit or abort holds nothing."""
        with self._lock:
            current = self._session() if self._session is not None else None
            if current is not None and current is not session:
                if not self.usable and not self.quarantined:
                    raise self.record_refusal("begin_reload", SessionStateError(
                        "begin refused: another reload session of this backbone is open and its load is in "
                        "progress (sessions do not nest); commit or abort it first (its abort(), or this backbone's "
                        "abort_reload())", backbone=self.name, state=self.state.value))
                self._audit("session_abandoned", state=self.state.value)
            self._session = weakref.ref(session)

    def session_open(self, session: object) -> bool:
        """Whether `session` is this backbone's open reload session (see `open_session`)."""
        return self._session is not None and self._session() is session

    def close_session(self, session: object) -> None:
        """`session` committed or aborted (see `open_session`)."""
        with self._lock:
            if self.session_open(session):
                self._session = None

    def note_derived_torn(self, names: Iterable[str]) -> None:
        """Derived buffers an interrupted refresh may have written part of: the next refresh rewrites them
        fully (the backbone marks their sources dirty) and `recover` is refused until then. The backbone notes
        every buffer a refresh will write before its first write, and narrows it once it knows
        (`set_derived_torn`)."""
        with self._lock:
            self.torn_buffers = self.torn_buffers | frozenset(names)

    def set_derived_torn(self, names: Iterable[str]) -> None:
        """The torn derived buffers are `names` (see `note_derived_torn`)."""
        with self._lock:
            self.torn_buffers = frozenset(names)

    def refusal(self, trigger: str) -> LifecycleError | None:
        """The error `trigger` would raise now, or None when it would succeed (`guards.refusal`: the table, then
        the row's guards, checked quietly; a trigger's effect, such as a refresh's plan, is not foreseen)."""
        with self._lock:
            return refusal(self, trigger)

    def verify_pinned(self) -> int:
        """Check every pinned identity against the live tensors now, and the content of every constant derived
        buffer against its digest at capture (`StorageDriftError` naming each). Returns how many identities
        were checked."""
        with self._lock:
            require_pinned_unchanged(self, "verify_pinned")
            if self.pinned_content is not None and self.constant_tensors is not None:
                problems = self.pinned_content.changes(self.constant_tensors())
                if problems:
                    raise self.record_refusal("verify_pinned", StorageDriftError(problems, backbone=self.name,
                                                                                 state=self.state.value))
            return len(self.pinned) if self.pinned else 0

    def pin_content(self) -> None:
        """Pin the content of the constant derived buffers now (at capture; again after a reload's own hooks,
        which may write anything), while graphs are pinned."""
        if self.pinned is not None and self.constant_tensors is not None:
            self.pinned_content = PinnedContent.snapshot(self.constant_tensors())
