"""`DraftBackbone`: the nn.Module mixin that owns a lifecycle and its derived buffers.

A draft model declares what it derives and calls `init_lifecycle()` at the end of `__init__`:

    class MyDraft(DraftBackbone):
        derived_buffers = (
            concat("_fused_kv_weight", sources=("self_attn.qkv_proj.weight",),
                   per_layer=lambda layer: layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:]),
            alias("_hidden_norm_weight", source="hidden_norm.weight"),
        )

        def __init__(self, config):
            super().__init__()
            ...
            self.init_lifecycle("my-draft")

Then: load (the loader reports `weights_loaded`), `finalize_loading()` (finish + phase hooks),
`refresh_derived_buffers()`, `capture_graphs()`; for a reload, `begin_reload()` first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from operator import attrgetter
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch import nn

from .derived import DerivedSpec, apply_refresh, current_buffer, plan_refresh, resolve_tensor
from .derived.reuse import PlanMemory
from .errors import LayersNotReadyError, QuarantinedError, RefreshInterruptedError, StorageReallocationError
from .hooks import Hook, Phase, collect_hooks, declared_writes, may_write, run_hooks, unmatched_writes
from .loading import Writer
from .machine import BackboneLifecycle
from .session import ReloadSession
from .slots import Slots
from .states import LifecycleState
from .torch_private import BUFFERS_OF, PARAMETERS_OF, own_buffers, own_parameters, own_tensor
from .types import RefreshReport, TensorSpec

__all__ = ["DraftBackbone"]

_IS_META = attrgetter("is_meta")
#: The checkpoint slots as `meta_or_absent` scans them: (modules, leaves) of those in a parameter table, then of those
#: in a buffer table.
_ScanColumns = tuple[list[nn.Module], list[str], list[nn.Module], list[str]]
#: The modes of a refresh plan that write a buffer (or give it new storage).
_WRITTEN = frozenset({"cold", "alias", "in_place"})
R = TypeVar("R")


def _weakly(method: Callable[..., R]) -> Callable[..., R]:
    """`method` (bound to a backbone), called through a weak reference to the backbone: what the backbone owns
    (its lifecycle, its slot table) must not refer back to it, or dropping the backbone would leave a cycle that
    holds every weight until the cyclic collector happens to run (rarely, in a trainer's large heap)."""
    ref = weakref.WeakMethod(method)
    what = method.__qualname__  # the name, not the method: the closure must not hold the backbone either

    def call(*args: Any) -> R:
        bound = ref()
        if bound is None:
            raise ReferenceError(f"{what}: the backbone this lifecycle belonged to was dropped")
        return bound(*args)

    return call


class DraftBackbone(nn.Module):
    """Mixin for draft backbones whose derived buffers must follow a guarded reload lifecycle."""

    derived_buffers: ClassVar[tuple[DerivedSpec, ...]] = ()

    def init_lifecycle(self, name: str | None = None, *, rank: int = 0, locked: bool = False,
                       tensors: Mapping[str, torch.Tensor] | None = None,
                       slots: Mapping[str, tuple[nn.Module, str]] | None = None) -> BackboneLifecycle:
        """Register every derived buffer as an (empty) non-persistent buffer and build the state machine from
        the checkpoint tensors this module expects: its state_dict (parameters and persistent buffers), or
        `tensors` when the caller knows better (vLLM drafts share their embeddings with the target). `slots`:
        name -> (module, attribute) of tracked tensors held outside this module (a vLLM draft's lm_head)."""
        # the class declares every buffer; this backbone keeps those its `enabled=` predicates accept
        self.derived_buffers = tuple(  # type: ignore[misc]  # the class's declarations, narrowed for this instance
            s for s in self.derived_buffers if s.is_enabled(self))
        for spec in self.derived_buffers:
            self.register_buffer(spec.name, None, persistent=False)
        tracked = self.state_dict(keep_vars=True) if tensors is None else tensors
        tensor_specs = {n: TensorSpec.of(t) for n, t in tracked.items()}
        # name -> (owning module, attribute): modules stay put while their tensors are replaced, so a lookup is two
        # dict hits instead of a walk of the module tree. Shared tensors keep every name (an alias and its source
        # are pinned separately: either moving is drift).
        # The backbone's own tensors are reached through a weak proxy: a table it owns that named it would be a
        # cycle (see `_weakly`).
        owner = cast(DraftBackbone, weakref.proxy(self))  # stands for the backbone, attribute for attribute
        self._tensor_slots: dict[str, tuple[nn.Module, str]] = {
            f"{mod_name}.{leaf}" if mod_name else leaf: (owner if mod is self else mod, leaf)
            for mod_name, mod in self.named_modules(remove_duplicate=False)
            for leaf in (*own_parameters(mod), *own_buffers(mod))
        }
        self._tensor_slots.update(slots or {})
        self._slots = Slots(self._tensor_slots, partial(resolve_tensor, owner))  # read in bulk: pin checks, plans
        self._slot_names = list(self._tensor_slots)
        # the checkpoint tensors with their slots, in one list: the readiness check walks it once per scan
        self._checkpoint_slots: list[tuple[str, nn.Module | None, str]] = [
            (n, *self._tensor_slots.get(n, (None, ""))) for n in tensor_specs]
        self._scan = self._scan_columns()
        self._check_declared_sources()
        self._lifecycle = BackboneLifecycle(
            name or type(self).__name__,
            tensor_specs,
            rank=rank,
            resolve=_weakly(self.live_tensor),
            pinned_tensors=_weakly(self._pinned_view),
            meta_scan=_weakly(self.meta_or_absent),
            locked=locked,
        )
        self._lifecycle.constant_tensors = _weakly(self.constant_derived_buffers)
        self._runtime_hooks: list[Hook] = []
        self._derived_fallbacks: dict[str, str] = {}
        self._plan_memory = PlanMemory()  # the last validated plans of its alias, concat, stack buffers
        self._check_hook_writes(collect_hooks(type(self)))
        return self._lifecycle

    def _check_declared_sources(self) -> None:
        """A declaration naming a tensor this backbone lacks (a typo, a `*` pattern over the wrong list) is refused
        here, at construction, not at the first refresh. Aliases are exempt: their source may be a buffer a hook
        registers later."""
        unknown = {spec.name: bad for spec in self.derived_buffers if spec.kind != "alias"
                   if (bad := [n for n in spec.source_names(self) if self.live_tensor(n) is None])}
        if unknown:
            raise ValueError(f"{type(self).__name__}: derived buffers read tensors this backbone does not have: "
                             + "; ".join(f"{b} <- {', '.join(ns[:5])}" + (f" (+{len(ns) - 5} more)" if len(ns) > 5
                                                                             else "") for b, ns in unknown.items()))
        backed_by: dict[str, str] = {}  # a tensor can be a view of one place only
        for spec in self.derived_buffers:
            for n in spec.source_names(self) if spec.backed else ():
                if n in backed_by:
                    raise ValueError(f"{type(self).__name__}: {n} is a source of two backed buffers ({backed_by[n]}, "
                                     f"{spec.name}); a tensor can be a view of one of them only")
                backed_by[n] = spec.name

    def freeze_structure(self, modules: Mapping[str, bool], absent: Iterable[str]) -> None:
        """The first load decided which optional submodules this backbone has (`modules`: name -> present):
        the lifecycle records it (once, in epoch 0) and stops tracking and pinning the tensors of the absent ones
        (`absent`)."""
        absent = set(absent)
        self.lifecycle.freeze_structure(modules, absent)
        for name in absent:
            self._tensor_slots.pop(name, None)
        self._slots.changed()
        self._slot_names = list(self._tensor_slots)
        self._checkpoint_slots = [s for s in self._checkpoint_slots if s[0] not in absent]
        self._scan = self._scan_columns()  # else the scan in C reads the untracked tensors and always falls back

    def _scan_columns(self) -> _ScanColumns | None:
        """The checkpoint slots as four parallel lists, for `meta_or_absent`'s scan in C: the modules and leaves
        of those found in a parameter table, then of those found in a buffer table; None when some tensor has no
        slot."""
        slotted = [(mod, leaf) for _, mod, leaf in self._checkpoint_slots if mod is not None]
        if not slotted or len(slotted) != len(self._checkpoint_slots):
            return None
        params = [(mod, leaf) for mod, leaf in slotted if leaf in own_parameters(mod)]
        buffers = [(mod, leaf) for mod, leaf in slotted if leaf not in own_parameters(mod)]
        return ([m for m, _ in params], [leaf for _, leaf in params], [m for m, _ in buffers],
                [leaf for _, leaf in buffers])

    # ---- accessors --------------------------------------------------------------------------------------------
    @property
    def lifecycle(self) -> BackboneLifecycle:
        try:
            lc: BackboneLifecycle = self.__dict__["_lifecycle"]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} did not call init_lifecycle() in __init__") from None
        return lc

    @property
    def derived_fallbacks(self) -> dict[str, str]:
        """Buffers disabled because a source was not in the builder's layout -> why (the model must take its
        declared fallback path for these)."""
        return dict(self._derived_fallbacks)

    def derived_usable(self, name: str) -> bool:
        return current_buffer(self, name) is not None and name not in self._derived_fallbacks

    def live_tensor(self, name: str) -> torch.Tensor | None:
        """The parameter or buffer called `name` as it is now (None when absent)."""
        return self._slots.live(name)

    def tensor_slot(self, name: str) -> tuple[nn.Module, str]:
        """Where the tracked tensor `name` lives: (owning module, attribute name); KeyError for an untracked name."""
        return self._tensor_slots[name]

    def meta_or_absent(self) -> set[str]:
        """Names of checkpoint tensors that are absent or on META now: `live_tensor` for each, in one loop. The
        common answer (none) is found in C: each slot's table read by a C getter (`PARAMETERS_OF`, `BUFFERS_OF`),
        the tensor with `dict.get`, `is_meta` with an attrgetter; anything unusual (a tensor absent or moved between
        a module's parameters and buffers) falls back to the loop."""
        if self._scan is not None:
            p_modules, p_leaves, b_modules, b_leaves = self._scan
            try:
                if not any(map(_IS_META, map(dict.get, map(PARAMETERS_OF, p_modules), p_leaves))) \
                        and not any(map(_IS_META, map(dict.get, map(BUFFERS_OF, b_modules), b_leaves))):
                    return set()
            except AttributeError:  # a None: absent from the table it was in
                pass
        out = set()
        for name, mod, leaf in self._checkpoint_slots:
            t = self.live_tensor(name) if mod is None else own_tensor(mod, leaf)
            if t is None or t.is_meta:
                out.add(name)
        return out

    def graph_visible_tensors(self) -> dict[str, torch.Tensor | None]:
        """What captured graphs read: every derived buffer, parameter and buffer, under every name it has
        (pinned at capture)."""
        return dict(zip(self._slot_names, self._slots.gather(self._slot_names), strict=True))

    def _pinned_view(self) -> Mapping[str, torch.Tensor | None]:
        """What the lifecycle pins and verifies: `graph_visible_tensors`, as a live view that a pin verification
        reads in bulk (`slots.LiveSlots.tensors_at`), unless a subclass redefines what graphs read."""
        return self._slots.view() if self._pins_read_slots() else self.graph_visible_tensors()

    def _pins_read_slots(self) -> bool:  # a refresh's plan reads the same slots: pins it verified hold for it too
        cls, base = type(self), DraftBackbone
        return cls.graph_visible_tensors is base.graph_visible_tensors and cls.live_tensor is base.live_tensor

    def derived_buffer_names(self) -> list[str]:
        return [s.name for s in self.derived_buffers]

    def constant_derived_buffers(self) -> dict[str, torch.Tensor | None]:
        """The derived buffers no reload writes, as they are now: an alias of a tensor that is no checkpoint
        tensor (the RoPE table a cold-load hook computes), a custom buffer with no dependencies. Under captured
        graphs their content is pinned too (`verify_pinned`)."""
        specs = self.lifecycle.specs
        out: dict[str, torch.Tensor | None] = {}
        for spec in self.derived_buffers:
            names = spec.source_names(self)
            if (spec.kind == "alias" and not any(n in specs for n in names)) or (spec.kind == "custom" and not names):
                out[spec.name] = current_buffer(self, spec.name)
        return out

    # ---- hooks ------------------------------------------------------------------------------------------------
    def register_post_load_hook(self, fn: Callable[[DraftBackbone], Any], *phases: Phase | str,
                                name: str | None = None, writes: Iterable[str] | None = None) -> None:
        """Add a hook at run time (besides methods decorated with `@post_load_hook`); `writes` as there."""
        if not phases:
            raise ValueError("register_post_load_hook needs at least one phase (cold_load and/or reload)")
        label: str = getattr(fn, "__name__", repr(fn))
        hook = Hook(name or label, frozenset(Phase(p) for p in phases), fn, declared_writes(writes))
        self._check_hook_writes([hook])
        self._runtime_hooks.append(hook)

    def _check_hook_writes(self, hooks: list[Hook]) -> None:
        """A hook declaring it writes a tensor the checkpoint does not hold (a typo) is refused, naming it."""
        if bad := unmatched_writes(hooks, self.lifecycle.specs):
            named = "; ".join(f"{h}: {', '.join(map(repr, ws))}" for h, ws in bad.items())
            raise ValueError(f"{type(self).__name__}: post-load hooks declare writes to no tracked tensor: {named} "
                             "(writes= names the checkpoint's tensors a hook may change; a buffer the hook makes "
                             "needs no declaration)")

    def post_load_hooks(self, phase: Phase) -> list[Hook]:
        return collect_hooks(type(self), phase) + [h for h in self._runtime_hooks if phase in h.phases]

    def _hook_phase(self) -> Phase:
        """The phase of this epoch's hooks: `cold_load` until a finalize completed it (in epoch 0, or in the
        reload that retries an aborted cold load), and for the rest of the epoch in which it did; else `reload`."""
        cold_epoch = self.__dict__.get("_cold_load_epoch")
        return Phase.COLD_LOAD if cold_epoch is None or cold_epoch == self.lifecycle.epoch else Phase.RELOAD

    def _run_hooks(self, phase: Phase) -> list[str]:
        """Run this phase's hooks that have not completed yet (`hooks.run_hooks`); what they wrote of the tracked
        tensors is dirty (`BackboneLifecycle.note_changed`)."""
        lc = self.lifecycle
        done = self.__dict__.setdefault("_hooks_done", {})

        def tracked(hooks: Sequence[Hook]) -> tuple[list[str], tuple[torch.Tensor | None, ...]]:
            # read slot by slot, not with `gather`: compiling the list costs more than one read of it, and the
            # hooks of a cold load register buffers (the slots change) between the two snapshots
            names = may_write(hooks, lc.specs)
            return names, tuple(map(self._slots.live, names))

        return run_hooks(self, self.post_load_hooks(phase), phase, lc.epoch, done, lc.audit_event, tracked,
                         lc.note_changed)

    # ---- lifecycle steps --------------------------------------------------------------------------------------
    def begin_reload(self) -> int:
        return self.lifecycle.begin_reload()

    def finalize_loading(self, *, keep_untouched: bool = False) -> list[str]:
        """The loader is done: check every layer is ready (FINALIZED), running the hooks of the epoch's phase
        on the way (`cold_load` on the first load, `reload` afterwards), each at most once per epoch: a second
        finalize in the same epoch runs none. A hook that raises refuses the finish (the state stays; a retry
        runs only the hooks that did not complete). Returns the names of the hooks that ran."""
        lc = self.lifecycle
        phase = self._hook_phase()
        ran: list[str] = []

        def run_hooks() -> None:
            ran.extend(self._run_hooks(phase))
            if phase is Phase.COLD_LOAD:
                self._cold_load_epoch = lc.epoch
            elif ran:  # a reload's own hooks may write anything: what is constant from here on
                lc.pin_content()

        lc.finalize_loading(keep_untouched=keep_untouched, effect=run_hooks)
        return ran

    def weights_unchanged(self, names: Iterable[str]) -> None:
        """Declare single tensors unchanged in this reload (a selective reload that sends some tensors of a
        layer): they count as loaded, nothing derived from them is rewritten. Refused (`LayersNotReadyError`,
        nothing marked) for a tensor of a layer that an aborted or abandoned reload left partly written, or
        whose write failed part way. `finalize_loading(keep_untouched=True)` does this for whole layers."""
        self.lifecycle.weights_unchanged(names)

    def refresh_derived_buffers(self, *, full: bool = False, rebuild: bool = False) -> RefreshReport:
        """Build (first time) or refresh in place every derived buffer. All buffers are validated before any
        is written. `full`: rewrite every slice, not only those whose sources changed in this epoch.
        `rebuild`: allow new storage (only when no graphs are captured)."""
        lc = self.lifecycle

        def refresh() -> RefreshReport:
            if rebuild and lc.graphs_pinned:  # refused by the trigger, so audited like any refusal
                raise StorageReallocationError(
                    ["rebuild=True would give derived buffers new storage while captured graphs pin it: "
                     "release_graphs() before begin_reload(), then rebuild"], backbone=lc.name, state=lc.state.value)
            # a buffer leaving fallback kept values from before it was disabled, and one an interrupted refresh
            # touched may be torn: every slice of either is stale
            stale = set(self._derived_fallbacks) | lc.torn_buffers
            dirty = lc.readiness.dirty_tensors() | {
                n for spec in self.derived_buffers if spec.name in stale for n in spec.source_names(self)}
            plan = plan_refresh(
                self, self.derived_buffers, tensor_specs=lc.specs, dirty=dirty,
                context={"backbone": lc.name, "state": lc.state.value}, full=full,
                pinned=lc.graphs_pinned, allow_realloc=rebuild, resolve=self.live_tensor, memory=self._plan_memory,
                gather=self._slots.gather, verified=lc.verified_pins if self._pins_read_slots() else None)
            # every buffer it will write no longer holds the last good values from before its first write until the
            # refresh's transition is done (`refresh_derived` clears them): an interrupt (any BaseException)
            # anywhere in between leaves them torn, so no rollback can be taken for exact; a write that fails
            # says what it touched
            torn = lc.torn_buffers
            lc.note_derived_torn(bp.spec.name for bp in plan.buffers if bp.mode in _WRITTEN)
            try:
                report = apply_refresh(self, plan)
            except RefreshInterruptedError as e:
                lc.set_derived_torn(torn | set(e.touched))
                raise
            for b in report.buffers:
                if b.mode == "fallback":
                    self._derived_fallbacks[b.name] = b.reason
                elif b.mode != "skipped":
                    self._derived_fallbacks.pop(b.name, None)
            fields = cast("dict[str, Any]", report.audit_fields())  # event fields: none named `level`
            lc.audit_event("refresh", **fields, duration_ms=round(report.duration_ms, 3))
            return report

        return lc.refresh_derived(refresh)

    def capture_graphs(self) -> int:
        return self.lifecycle.capture_graphs()

    def release_graphs(self) -> None:
        self.lifecycle.release_graphs()

    def abort_reload(self, reason: str) -> None:
        """Quarantine without a rollback (the weights keep what the aborted reload wrote; not recoverable).
        A `reload_session(rollback=True)` aborts with an exact rollback instead."""
        self.lifecycle.abort_reload(reason)

    def recover(self) -> LifecycleState:
        """Leave QUARANTINED without a reload, once an aborted reload was rolled back exactly (see
        `reload_session(rollback=True)`): back to DERIVED_REFRESHED, or GRAPH_CAPTURED while graphs are pinned.
        `RecoveryError` says why not otherwise. Returns the new state."""
        return self.lifecycle.recover()

    def reload_session(self, *, rollback: bool = False, finite_check: bool = False, keep_untouched: bool = False,
                       device: torch.device | str = "cpu", writer: Writer | None = None) -> ReloadSession:
        """A transactional reload: `with backbone.reload_session() as s: s.load(path); s.commit()`. An exception
        inside, `s.abort(reason)`, or leaving without `commit()` quarantines the backbone (last good derived
        buffers kept, reason audited). `rollback=True` snapshots each tensor before its first write (memory:
        the bytes of the tensors the reload touches) so an abort restores them exactly and `recover()` works.
        See `lifecycle.session.ReloadSession`."""
        return ReloadSession(self, rollback=rollback, finite_check=finite_check, keep_untouched=keep_untouched,
                             device=device, writer=writer)

    def require_usable(self, what: str = "forward") -> None:
        """Refuse fused use unless derived buffers are current (DERIVED_REFRESHED or GRAPH_CAPTURED):
        `QuarantinedError` (naming why the reload was aborted and the way out) or `LayersNotReadyError`."""
        lc = self.lifecycle
        if lc.quarantined:
            way_out = ("call recover() (the reload was rolled back exactly) or reload" if lc.refusal("recover") is None
                       else "reload (begin_reload, load, finalize_loading, refresh_derived_buffers)")
            raise QuarantinedError(f"{what} refused: quarantined after {lc.quarantine_reason!r}; {way_out}",
                                   backbone=lc.name, state=lc.state.value, quarantine_reason=lc.quarantine_reason)
        if not lc.usable:
            missing = lc.missing() or {"(derived buffers)": ("not refreshed since the last load",)}
            raise LayersNotReadyError(what, missing, backbone=lc.name, state=lc.state.value)
