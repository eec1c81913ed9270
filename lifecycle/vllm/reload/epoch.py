"""The draft reload epoch's one boundary: where an epoch begins, finishes and fails, for every way bytes reach a
draft's weights.

Every entry point into a draft's weights is entered through `entered(model, entry)`: the offline RPC
(`reload_draft_weights`), the weight-update session's calls (the worker's `update_weights` / `finish_weight_update`,
the transfer engine's), vLLM's `initialize_layerwise_reload` / `finalize_layerwise_reload`, the draft's own
`load_weights` (outer and inner model), the loader's `process_weights_after_loading`, a derived-buffer builder called
by hand, and a parameter's weight loader called directly. Entries nest (a session's chunk runs the transfer engine,
which runs `load_weights`); only the outermost acts: a failure anywhere inside is turned into an outcome once, there
(`fail`: rolled back exactly and serving again when nothing was written, else quarantined), and re-raised. Inner
layers record what happened (readiness, the modules a copy back touched) and let the exception through.

- `begin(model, original, ...)`: vLLM's `initialize_layerwise_reload`, with each lifecycle draft of `model` beginning
  its epoch; `begin_implicit(backbone, cause)`: a write after a completed load (a plain `load_weights`, a trainer
  writing through the inner model) begins one on the draft's own modules;
- `finish(model, model_config, original, ...)`: vLLM's finalize after the partial payload is settled, then each
  draft finishes (every layer ready, reload hooks, refresh in place), or is quarantined and the error raised;
- `fail(model, reason)`: vLLM's reload unwound, then abort with an exact rollback and recover, or quarantine;
- `discard(backbone, cause)`: vLLM freed the draft's weights without a copy (a level-2 sleep): quarantined, and
  only a refill that writes every layer serves again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from ...errors import LayersNotReadyError
from ...events import LIST_CAP
from ...torch_private import non_persistent_buffers
from ...types import capped
from ...types import describe_error as describe
from .. import settings
from ..drafts.owners import VLLMDraftBackbone, drafts_of, forget_walk, modules_of, walk_once
from ..drafts.quantized import reload_blocker
from ..drafts.runtime import WORKER
from .counting import leave_out_own_buffers
from .partial import PartialOutcome, settle_partial
from .unwind import keep_shared_modules_live, layerwise_function, reload_in_progress, unwind

if TYPE_CHECKING:
    from ..settings import PartialPolicy

__all__ = [
    "OUTCOME_QUARANTINED",
    "OUTCOME_ROLLED_BACK",
    "Entry",
    "begin",
    "begin_implicit",
    "describe",
    "discard",
    "entered",
    "fail",
    "finish",
    "finish_epoch",
]

#: How a failed epoch ended (`DraftRuntime.last_outcome`).
OUTCOME_ROLLED_BACK, OUTCOME_QUARANTINED = "rolled back", "quarantined"


@dataclass
class Entry:
    """One entry point being run: whether it is the outermost (the one that acts) and how a failure inside ended."""

    outermost: bool
    outcome: str | None = None


class entered:  # lower case: used as a function: `with entered(model, entry) as here`
    """Run an entry point into `model`'s drafts (see the module doc). `entry` names it in the failure's reason;
    `drafts`: `drafts_of(model)` when the caller has it already. A class, not a generator: every `load_weights`
    call of every push enters one."""

    __slots__ = ("_drafts", "_entry", "_here", "_model", "_runtimes")

    def __init__(self, model: Any, entry: str, drafts: list[VLLMDraftBackbone] | None = None) -> None:
        self._model, self._entry, self._drafts = model, entry, drafts

    def __enter__(self) -> Entry:
        drafts = self._drafts
        if drafts is None:
            drafts = self._drafts = drafts_of(self._model) if isinstance(self._model, nn.Module) else []
        runtimes = self._runtimes = [d.lifecycle_runtime for d in drafts]
        here = self._here = Entry(outermost=bool(drafts) and not any(r.entries for r in runtimes))
        for r in runtimes:
            r.entries += 1
        return here

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        runtimes, entry = self._runtimes, self._entry
        try:
            if e is not None:  # an interrupt too: no module may stay on META, no epoch stays open
                for r in runtimes:  # the innermost entry the failure left first: the reason names where it happened
                    r.failed_in = r.failed_in or entry
                model = self._model
                if self._here.outermost and (reload_in_progress(model)
                                             or any(d.reload_open for d in self._drafts or ())):
                    self._here.outcome = fail(model, f"{runtimes[0].failed_in or entry} failed: {describe(e)}")
        finally:
            for r in runtimes:
                r.entries -= 1
                if not r.entries:
                    r.failed_in = None


def fail(model: nn.Module, reason: str) -> str | None:
    """After a failure anywhere in a draft reload of `model`: unwind vLLM's reload, then roll back exactly and
    recover (nothing was written) or quarantine (something was). Returns how it ended, None when no draft was
    mid-reload. Idempotent."""
    # what an interrupted `initialize_layerwise_reload` left half-way is put back with its buffers' persistence
    non_persistent, WORKER.initializing = WORKER.initializing, None
    drafts = drafts_of(model)
    # an entry through the inner model (a trainer's own write) unwinds the whole draft: an implicit reload also put
    # the modules the ForCausalLM holds (lm_head, d2t) in vLLM's reload
    outer = drafts[0].lifecycle_runtime.outer() if len(drafts) == 1 and drafts[0] is model else None
    written = unwind(outer if outer is not None else model, non_persistent=non_persistent)
    outcome = None
    for walked in (model, *(d.lifecycle_runtime.outer() for d in drafts)):
        if walked is not None:
            forget_walk(walked)
    for backbone in drafts:
        backbone.lifecycle_runtime.reload_partial = None
        lc = backbone.lifecycle
        if not lc.can("abort_reload"):
            continue
        exact = written == 0 and not any(lc.readiness.is_loaded(n) for n in lc.specs)
        lc.abort_reload(reason, rollback=(lambda: ()) if exact else None)
        if exact and lc.recovery_blocker is None:
            lc.recover()
        outcome = OUTCOME_ROLLED_BACK if lc.usable else OUTCOME_QUARANTINED
        backbone.lifecycle_runtime.last_outcome = outcome
    return outcome


def discard(backbone: VLLMDraftBackbone, cause: str) -> None:
    """vLLM freed the draft's weights without keeping a copy (`cause`: a level-2 sleep); what its memory holds after
    a wake is no checkpoint's. Audited (`weights_discarded`), the epoch this makes is aborted without a rollback:
    the draft is quarantined (not recoverable) and does not draft, and every layer is owed a full write, so the
    refill is its own epoch that must write all of it (a `partial='keep'` that keeps a layer is refused naming the
    cause); its refresh writes the derived buffers in place. Nothing to do for a draft never loaded."""
    lc = backbone.lifecycle
    if lc.unloaded:
        return
    lc.audit_event("weights_discarded", cause=cause, from_state=lc.state.value)
    if not backbone.reload_open and lc.can("begin_reload"):
        backbone.begin_reload()
    lc.readiness.require_full_write(list(lc.readiness.tensors_of_layer), cause)
    if lc.can("abort_reload"):
        lc.abort_reload(f"weights discarded: {cause}; a reload that writes every layer serves again")
        backbone.lifecycle_runtime.last_outcome = OUTCOME_QUARANTINED


def begin(model: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """vLLM's `initialize_layerwise_reload(model, ...)`: every lifecycle draft of `model` begins a reload epoch
    first (a reload that never reached finalize is ended as abandoned), and the modules a draft shares with the
    target stay live."""
    walk_once(model)  # the push's one walk of the model's modules (`owners.modules_of`), kept until its end
    if (why := reload_blocker(model)) is not None:
        forget_walk(model)
        raise NotImplementedError(f"reload-lifecycle: {why}")
    if reload_in_progress(model):  # the last reload never reached finalize
        fail(model, "abandoned: a new reload began before the previous one was finalized")
        walk_once(model)  # (its end forgot the walk)
    # what vLLM's initialize moves to META and back: its buffers' persistence, for an interrupted one
    WORKER.initializing = {m: set(non_persistent_buffers(m)) for _, m in modules_of(model)}
    for m in WORKER.initializing:
        WORKER.touched.discard(m)
    with entered(model, "initialize_layerwise_reload"):
        for backbone in drafts_of(model):
            if not backbone.lifecycle.unloaded:  # never before a first load
                backbone.begin_reload()
        result = original(model, *args, **kwargs)
        WORKER.initializing = None
        keep_shared_modules_live(model)  # what the draft shares with the target stays live
        leave_out_own_buffers(model)  # no checkpoint carries them (`counting.py`)
    return result


def begin_implicit(backbone: VLLMDraftBackbone, cause: str, *, layerwise: bool = True,
                   inner_only: bool = False) -> None:
    """A write is about to reach a usable or quarantined draft outside any epoch: audited (`implicit_reload`),
    an epoch begins, and (with `layerwise`) vLLM's layerwise reload starts on the draft's own modules (never on
    those it shares with the target, which keeps serving meanwhile). Until the epoch finishes the draft does not
    draft. `inner_only`: the write goes through the inner model, which cannot reach the tensors its ForCausalLM holds
    (an own lm_head, d2t): they stay out of the reload and count as unchanged."""
    lc, runtime = backbone.lifecycle, backbone.lifecycle_runtime
    lc.audit_event("implicit_reload", cause=cause, from_state=lc.state.value)
    backbone.begin_reload()
    outer = runtime.outer()
    if outer is not None:
        walk_once(outer)
    roots = runtime.roots
    if inner_only:
        inside = {id(m) for m in backbone.modules()}
        held_outside = [n for n in runtime.structure.outer_slots() if n in lc.specs]
        if held_outside:
            backbone.weights_unchanged(held_outside)
        roots = [r for r in roots if id(r) in inside]
    if layerwise:
        initialize = layerwise_function("initialize_layerwise_reload")
        for module in roots:
            initialize(module)


def finish(model: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """vLLM's `finalize_layerwise_reload(model, model_config, ...)` for a model with lifecycle drafts: settle what a
    partial payload left, vLLM's finalize, then each draft finishes its epoch (`finish_epoch`)."""
    drafts = drafts_of(model)
    model_config = args[0] if args else kwargs.get("model_config")
    try:
        return _finish(model, drafts, model_config, original, *args, **kwargs)
    finally:
        forget_walk(model)  # the push ended (or failed: `fail` forgot it already)
        outer = drafts[0].lifecycle_runtime.outer() if drafts else None
        if outer is not None:
            forget_walk(outer)


def _finish(model: nn.Module, drafts: list[VLLMDraftBackbone], model_config: Any, original: Callable[..., Any],
            *args: Any, **kwargs: Any) -> Any:
    with entered(model, "finalize_layerwise_reload"):
        if not hasattr(model_config, "dtype"):  # vLLM reads it only after processing every other layer
            raise TypeError("finalize_layerwise_reload(model, model_config): model_config must be the draft's "
                            f"ModelConfig, got {type(model_config).__name__}")
        policies = {b: settings.check_partial(b.lifecycle_runtime.reload_partial, "partial") for b in drafts}
        outcomes = settle_partial(model, policies.__getitem__)
        with WORKER.flag("in_vllm_reload"):
            result = original(model, *args, **kwargs)
        errors = []
        for backbone in drafts:
            backbone.lifecycle_runtime.reload_partial = None
            try:
                finish_epoch(backbone, outcomes.get(backbone), policies[backbone])
            except Exception as e:  # the draft is quarantined; the others still finish
                errors.append(e)
        if errors:
            raise errors[0]
    return result


def finish_epoch(backbone: VLLMDraftBackbone, outcome: PartialOutcome | None = None,
                 policy: PartialPolicy = "refuse") -> None:
    """After vLLM's finalize: finish the draft's open epoch (every layer ready; with `keep`, tensors that received
    nothing count as unchanged), run the reload hooks and refresh in place. Any failure quarantines the draft (its
    last good derived buffers kept) and is raised. Nothing to do when no load of the draft is in progress."""
    lc = backbone.lifecycle
    if not lc.can("finalize_loading"):
        return
    try:
        if outcome is not None and outcome.unfilled:
            raise _partly_sent(backbone, outcome, policy)
        # with `keep`, what this epoch did not write keeps its last values: tensors vLLM's reload got nothing for
        # (it put their kept tensors back, bit for bit), and every one an epoch of direct writes did not write
        untouched = set(outcome.untouched) if outcome is not None else set()
        if outcome is None or not outcome.layerwise:
            untouched.update(lc.specs)
        kept = [n for n in untouched if not lc.readiness.is_loaded(n)] if policy == "keep" else []
        if kept:
            lc.weights_unchanged(kept)
            shown, more = capped(sorted(kept), LIST_CAP)
            lc.audit_event("partial_reload", policy=policy, kept=shown, kept_more=more,
                           completed_with_last_values=sorted(outcome.filled) if outcome is not None else [])
        backbone.finalize_loading()
        backbone.refresh_derived_buffers()
        backbone.lifecycle_runtime.serving_epoch, backbone.lifecycle_runtime.serving_version = lc.epoch, None
    except BaseException as e:  # an interrupt too: never left FINALIZED or mid-finish, where no reload begins
        # fail closed: the draft keeps its last good derived buffers and refuses to run until a good reload
        if lc.can("abort_reload"):
            lc.abort_reload(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
            backbone.lifecycle_runtime.last_outcome = OUTCOME_QUARANTINED
        raise


def _partly_sent(backbone: VLLMDraftBackbone, outcome: PartialOutcome, policy: PartialPolicy
                 ) -> LayersNotReadyError:
    """The refusal for tensors that received only part of their elements and could not be completed, each named
    with why (recorded on the draft's lifecycle)."""
    lc = backbone.lifecycle
    missing: dict[str, list[str]] = {}
    for name, why in outcome.unfilled.items():
        missing.setdefault(lc.readiness.layer_of_name[name], []).append(f"{name} ({why})")
    err = LayersNotReadyError(f"finalize_loading (partial={policy!r})", missing, backbone=lc.name,
                              state=lc.state.value)
    lc.record_refusal("finalize_loading", err)
    return err
