"""How a draft reload epoch ends inside vLLM: when something fails, and when the payload did not send everything.

vLLM's layerwise reload (`initialize_layerwise_reload`) moves every module's tensors to META and keeps the live
("kernel") tensors aside; a module that received all its elements is materialised, processed and copied back into
its kernel tensors; `finalize_layerwise_reload` puts the kernel tensors back for modules that received nothing and
processes the rest, a module that received part of its elements with the remainder UNINITIALISED. A failure in
between (a bad bucket, a loader that raises, a checkpoint that changed) used to leave modules on META
("Tensor on device cpu is not on the expected device meta!") and the draft in PARTIALLY_LOADED, where a retry
is refused: only a restart recovered.

- `unwind(model)` gives every module still waiting for elements its kernel tensors back, untouched (what was
  buffered for it is dropped), and resets vLLM's bookkeeping. Each module then holds either the values this
  reload wrote (it completed) or its last values; nothing is left on META or half-written.
- `end_failed_epoch(model, reason)` unwinds, then ends each lifecycle draft's epoch: when no module of the
  reload was written, the unwind restored the last good weights exactly, so the draft is aborted with that exact
  rollback and recovered (it serves again; audited as `abort_reload` + `recover`); otherwise it is quarantined
  with the reason. Either way a correct retry of the same call starts a new epoch.
- `settle_partial(model, policy)` runs at finalize, before vLLM's own, on modules that received only part of
  their elements: with `keep`, when the module's kept tensors are in the checkpoint layout (unquantized and not
  repacked: the GPU layout) and its layer may keep its values (not partly written by an aborted reload, not a
  dummy start's), it is completed with its last values and processed; otherwise (and always with
  `refuse`) it gets its kernel tensors back unchanged and is reported as not loaded, with why. It also records
  which tensors received nothing (vLLM puts their kernel tensors back: last values, bit for bit), which the
  draft declares unchanged under `keep`.
- `finish_epoch(backbone, outcome, policy)` runs after vLLM's finalize, per draft: a tensor left unloaded by
  `settle_partial` refuses the finish (quarantine, each one named); otherwise the epoch finishes (under `keep` the
  untouched tensors count as unchanged), the reload hooks run and the derived buffers are refreshed in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import LayersNotReadyError
from ...events import LIST_CAP
from ...types import capped
from ...types import describe_error as describe
from ..compat.patching import write_private
from ..drafts.owners import VLLMDraftBackbone, backbones_in, owner_of, shared_modules
from ..drafts.processing import TOUCHED
from ..drafts.shadows import SHADOW_OF
from .shards import COMPLETING, missing_parts

if TYPE_CHECKING:
    from ..settings import PartialPolicy

__all__ = ["PartialOutcome", "describe", "end_failed_epoch", "finish_epoch", "keep_shared_modules_live",
           "reload_in_progress", "settle_partial", "unwind"]




@dataclass
class PartialOutcome:
    """What `settle_partial` found in one draft: names received nothing (kept by vLLM), completed with
    their last values, or left unloaded (name -> why)."""

    untouched: list[str] = field(default_factory=list)
    filled: list[str] = field(default_factory=list)
    unfilled: dict[str, str] = field(default_factory=dict)


def _infos(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, vLLM's reload info) for every module of `model` that is in a reload now."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = []
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load() and info.kernel_tensors is not None:
            out.append((module, info))
    return out


def reload_in_progress(model: nn.Module) -> bool:
    """Whether vLLM's layerwise reload of `model` was initialised and not finalised (modules wait on META, or
    an interrupted initialize left some half-way)."""
    return bool(_infos(model)) or bool(_half_initialized(model))


def _put_back(module: nn.Module, info: Any) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors

    _place_kernel_tensors(module, info)
    info.reset()


def _half_initialized(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """Modules whose kept tensors vLLM took aside but which it never made loadable: an interrupted
    `initialize_layerwise_reload` (their tensors may be on META, or gone)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return [(m, info) for m in model.modules() if (info := LAYERWISE_INFO.get(m)) is not None
            and info.kernel_tensors is not None and not info.can_load()]


def unwind(model: nn.Module, *, non_persistent: dict[nn.Module, set[str]] | None = None) -> int:
    """Give every module still in the reload its kept tensors back and end vLLM's reload of `model`. Returns
    how many of its modules this reload had written (0: the model holds exactly its weights from before).
    `non_persistent`: each module's non-persistent buffer names before `initialize_layerwise_reload` ran, for
    the modules an interrupted initialize left half-way (`_half_initialized`)."""
    waiting = _infos(model)
    half = _half_initialized(model)
    touched = [m for m in model.modules() if m in TOUCHED]
    TOUCHED.difference_update(touched)
    if not waiting and not half:
        return len(touched)
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    skip = {id(m) for m, _ in waiting} | {id(m) for _, m in shared_modules(model)}
    # initialize_layerwise_reload put every module of `model` in the reload (but the shared ones, taken out by
    # keep_shared_modules_live): one that no longer waits was processed (written into its kernel tensors); one
    # that still waits may have been written in part (`TOUCHED`: an interrupted copy back)
    written = 0 if half else sum(1 for m in model.modules() if id(m) not in skip and m in LAYERWISE_INFO)
    written += sum(1 for m in touched if id(m) in skip)
    for module, info in half:
        if non_persistent is not None and module in non_persistent:
            info.kernel_non_persistent_buffers = non_persistent[module]
        _put_back(module, info)
    for module, info in waiting:
        _put_back(module, info)
    if hasattr(model, "_original_do_torchao_reload"):
        write_private("model._do_torchao_reload", model, model._original_do_torchao_reload)
    return written


def keep_shared_modules_live(model: nn.Module) -> list[str]:
    """Take the modules a draft shares with the target out of the draft's reload: otherwise the TARGET's
    tensors sit on META until finalize, and the engine cannot serve while a reload is open (between the calls of
    a weight-transfer session, or after a trainer died mid-reload). A payload that carries tensors of them is refused
    before anything is written (the draft's structure, frozen at cold load, shares them: `structure.py`), so the
    target's weights are never written by a draft reload. Returns their names."""
    waiting = {id(m): info for m, info in _infos(model)}
    taken = []
    for name, module in shared_modules(model):
        if id(module) in waiting:
            _put_back(module, waiting[id(module)])
            taken.append(name)
    return taken


def end_failed_epoch(model: nn.Module, reason: str, *,
                     non_persistent: dict[nn.Module, set[str]] | None = None) -> None:
    """After a failure anywhere in a draft reload of `model` (an interrupt too): unwind vLLM's reload, then roll
    back exactly and recover (nothing was written) or quarantine (something was). Idempotent; never raises for a
    draft that is not mid-reload. `non_persistent`: see `unwind`."""
    written = unwind(model, non_persistent=non_persistent)
    for backbone in backbones_in(model):
        backbone.reload_partial = None
        lc = backbone.lifecycle
        if not lc.can("abort_reload"):
            continue
        exact = written == 0 and not any(lc.readiness.is_loaded(n) for n in lc.specs)
        lc.abort_reload(reason, rollback=(lambda: ()) if exact else None)
        if exact and lc.recovery_blocker is None:
            lc.recover()


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
        if policy == "keep" and outcome is not None and outcome.untouched:
            kept = [n for n in outcome.untouched if not lc.readiness.is_loaded(n)]
            lc.weights_unchanged(kept)
            shown, more = capped(sorted(kept), LIST_CAP)
            lc.audit_event("partial_reload", policy=policy, kept=shown, kept_more=more,
                           completed_with_last_values=sorted(outcome.filled))
        backbone.finalize_loading()
        backbone.refresh_derived_buffers()
    except BaseException as e:  # an interrupt too: never left FINALIZED or mid-finish, where no reload begins
        # fail closed: the draft keeps its last good derived buffers and refuses to run until a good reload
        if lc.can("abort_reload"):
            lc.abort_reload(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
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


# ---- a payload that did not send everything ------------------------------------------------------------------


def settle_partial(model: nn.Module, policy_of: Callable[[VLLMDraftBackbone], PartialPolicy]
                   ) -> dict[VLLMDraftBackbone, PartialOutcome]:
    """Before vLLM's finalize: per lifecycle draft in `model`, what received nothing, and for each module that
    received part of its elements, complete it with its last values (`keep`, checkpoint layout) or put its
    kernel tensors back unchanged (see the module docstring)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    outcomes: dict[VLLMDraftBackbone, PartialOutcome] = {}
    waiting = _infos(model)
    for module, info in waiting:
        owner = owner_of(module)
        if owner is None or is_deferred_attention_layer(module):
            continue
        backbone, names = owner
        out = outcomes.setdefault(backbone, PartialOutcome())
        shadow = SHADOW_OF.get(module)
        if info.load_numel <= 0:
            out.untouched.extend(names)
            if shadow is not None:
                out.untouched.append(shadow)
            continue
        parts = missing_parts(module, info, _leaf_names(names))  # per tensor and shard (`shards.py`)
        sent = f"{info.load_numel} of {info.load_numel_total} elements were sent"
        why = (_must_be_written(backbone, names) or _not_fillable(module, info)) if policy_of(backbone) == "keep" \
            else "partial='refuse'"
        if why is None:
            _complete_with_last_values(module, info)
            out.filled.extend(names)
            backbone.lifecycle.weights_loaded(names)
            continue
        _put_back(module, info)  # never process the unsent remainder uninitialised
        for n in names + ([shadow] if shadow else []):
            missing = f"; {parts[n]}" if n in parts else ""
            out.unfilled[n] = f"{sent}; kept unchanged, the sent part dropped ({why}){missing}"
    for backbone in backbones_in(model):
        outcomes.setdefault(backbone, PartialOutcome())
    return outcomes


def _must_be_written(backbone: VLLMDraftBackbone, names: list[str]) -> str | None:
    """Why the layer of `names` may keep nothing of its last values, or None: it holds values no checkpoint gave
    (a dummy start), or an aborted reload wrote part of it (`LayerReadiness.partly_written`)."""
    readiness = backbone.lifecycle.readiness
    layer = readiness.layer_of_name.get(names[0]) if names else None
    if layer is None or layer not in readiness.partly_written:
        return None
    return f"its layer {readiness.full_write_reason(layer)}: send all of it"


def _not_fillable(module: nn.Module, info: Any) -> str | None:
    """Why `module` cannot be completed with its last values, or None when it can: every kept tensor must be
    in the checkpoint layout (shape and dtype of the placeholder) and the module's processing must keep it so."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    quant = getattr(module, "quant_method", None)
    if quant is not None and not isinstance(quant, UnquantizedLinearMethod):
        return f"its quant method {type(quant).__name__} keeps a processed layout, not the checkpoint's"
    params, buffers = info.kernel_tensors
    for name, placeholder in {**module._parameters, **module._buffers}.items():
        kept = params.get(name, buffers.get(name))
        if placeholder is None or kept is None:
            continue
        if tuple(kept.shape) != tuple(placeholder.shape) or kept.dtype != placeholder.dtype:
            return (f"its processed {name} is {tuple(kept.shape)} {kept.dtype}, not the checkpoint layout "
                    f"{tuple(placeholder.shape)} {placeholder.dtype} (repacked after loading)")
    return None


@torch.no_grad()
def _complete_with_last_values(module: nn.Module, info: Any) -> None:
    """Materialise the module with its kept values, then let vLLM replay the buffered loads over them, process
    the module and copy it back into its kernel tensors (`_layerwise_process` materialises only what is still
    META)."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.meta import materialize_layer

    materialize_layer(module, info)
    params, buffers = info.kernel_tensors
    for name, kept in {**params, **buffers}.items():
        live = getattr(module, name, None)
        if isinstance(live, torch.Tensor) and not live.is_meta and live.shape == kept.shape:
            live.copy_(kept)
    token = COMPLETING.set(True)  # the shards never sent hold their last values now: process it
    try:
        layerwise._layerwise_process(module, info)
    finally:
        COMPLETING.reset(token)


def _leaf_names(names: list[str]) -> dict[str, str]:
    """A module's own tensor leaves -> their lifecycle names (`names`, from `owner_of`)."""
    return {n.rpartition(".")[2]: n for n in names}
