"""Lifecycle-enabled versions of vLLM's draft classes.

vLLM's drafts build their fused buffers with `torch.cat` / `torch.stack` in a builder method that runs at the end
of every `load_weights` call (or, for Kimi K3, in the model's own `process_weights_after_loading`). Here each
builder the family declares only records the precompute metadata; the tensors are declared derived buffers
(registered, non-persistent, so level-2 sleep keeps them), built once after the first load and refreshed in place
after every reload, once every layer is ready.

How each trainer call path reaches the lifecycle:
- `initialize_layerwise_reload` ... `load_weights` ... `finalize_layerwise_reload` (and vLLM's transfer engines,
  which call the same functions): the wrapped functions in `patches.py` begin and finish the reload epoch.
- a plain `load_weights` after a completed load (no `initialize_layerwise_reload`): the first write begins a reload
  epoch, audited (`implicit_reload`, then `begin_reload`), and starts vLLM's own layerwise reload on the draft's
  own layers (the modules shared with the target keep serving), so each layer is materialised, processed once
  and copied back into its original storage as in the explicit path; whichever
  `process_weights_after_loading` runs next (the loader's, `model_loader.utils`' or the model's own hook) finishes
  it. Until then the draft refuses to draft: it never runs on buffers derived from older weights.

Post-processing may change a source's layout: on CPU an unquantized linear layer is repacked into a oneDNN handle
and its `weight` becomes an empty (0,) parameter; quantized layers pack their weights. Where the fused K/V buffer
reads its rows then (the live weight, per-layer shadows that are views of the buffer, or vLLM's own non-fused path
for a quantized projection) is decided per projection at construction (`shadows.py`): never a second copy.
A load_weights call that fails inside a reload ends the epoch (`epochs.py`).
"""

from __future__ import annotations

import contextvars
import importlib
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..backbone import DraftBackbone
from ..errors import LayersNotReadyError
from ..events import LIST_CAP
from ..types import capped
from .families import SHADOW, VLLMDraftFamily
from .quantized import attention_prefixes
from .shadows import SHADOW_OF, Capture, plan_shadows

if TYPE_CHECKING:
    from .epochs import PartialOutcome
    from .settings import PartialPolicy

__all__ = ["IN_VLLM_RELOAD", "MODULE_OWNERS", "SHADOW_OF", "LifecycleDraftModel", "backbones_in", "lifecycle_class",
           "owner_of"]

#: module -> (weak reference to its backbone, tracked tensor names of that module): how vLLM's per-module events
#: find the lifecycle (`owner_of`). The backbone is held weakly: it holds the module, and a value that held it
#: would keep its key alive, so no draft would ever be freed, not even by the cyclic collector.
MODULE_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[LifecycleDraftModel], list[str]]] = (
    weakref.WeakKeyDictionary()
)
#: True while vLLM's own reload machinery (`_layerwise_process`, `finalize_layerwise_reload`) processes layers.
IN_VLLM_RELOAD: contextvars.ContextVar[bool] = contextvars.ContextVar("reload_lifecycle_in_vllm_reload",
                                                                      default=False)
IMPLICIT_CAUSE = "load_weights after a completed load, outside initialize_layerwise_reload"
#: why a cold load the draft's load_weights never saw leaves every layer to be written in full
LOADER_VALUES = ("holds what vLLM's loader put there without load_weights (load_format='dummy': random values), "
                 "not a checkpoint's")


# ---- the backbone mixin ------------------------------------------------------------------------------------


class LifecycleDraftModel(DraftBackbone):
    """Mixed into vLLM's inner draft model class (DFlashQwen3Model and its relatives) at construction."""

    _family: ClassVar[VLLMDraftFamily]
    #: this reload's partial policy when the caller chose one (an RPC's `partial=`); None: the engine setting
    reload_partial: PartialPolicy | None = None
    #: steps the engine has served without this draft since it stopped being usable (None: drafting)
    drafting_paused_steps: int | None = None

    def enable_lifecycle(self, *, name: str, rank: int) -> None:
        family = self._family
        plan = plan_shadows(self)  # the fused K/V buffer: live weight rows, backed shadows, or vLLM's non-fused path
        self.derived_buffers = plan.derived
        # attention layers' own parameters (quantized KV-cache scales) are vLLM's to process, and it deletes
        # them once consumed: no derived buffer reads them, so they are not checkpoint tensors of the lifecycle
        untracked = family.untracked_prefixes + attention_prefixes(self)
        tracked: dict[str, torch.Tensor] = {n: p for n, p in self.named_parameters() if not n.startswith(untracked)}
        tracked.update(plan.shadows)
        self.init_lifecycle(name, rank=rank, tensors=tracked)
        owned: list[nn.Module] = []
        for mod_name, module in self.named_modules():
            own = [f"{mod_name}.{leaf}" if mod_name else leaf for leaf in module._parameters]
            own = [n for n in own if n in tracked]
            if own:
                MODULE_OWNERS[module] = (weakref.ref(self), own)
                owned.append(module)
                _guard_processing(self, module, plan.captures.get(module))
        # the outermost modules holding the draft's own checkpoint tensors: what an implicit reload hands to vLLM's
        # layerwise reload (never the modules shared with the target, nor the RoPE cache vLLM shares between models)
        inner = {id(d) for m in owned for d in m.modules() if d is not m}
        self.__dict__["_own_roots"] = [m for m in owned if id(m) not in inner]

    def meta_or_absent(self) -> set[str]:
        """As the core's, except a parameter slot its quant method emptied after processing (the CPU int8
        oneDNN kernel keeps the weight in its own handle and sets `weight` to None): that tensor is held by the
        kernel, not missing. vLLM reports each such layer when it processed all of it."""
        out = set()
        for name in super().meta_or_absent():
            module, leaf = self._tensor_slots.get(name, (None, ""))
            if module is None or leaf not in module._parameters or module._parameters[leaf] is not None:
                out.add(name)
        return out

    @property
    def reload_open(self) -> bool:
        """A reload epoch has begun and is not finished yet (weights may be mid-write)."""
        lc = self.lifecycle
        return lc.in_reload and lc.can("finish_loading")

    def _record_metadata(self) -> None:
        """What each declared builder does instead of vLLM's: set the non-tensor precompute metadata."""
        self._family.set_metadata(self)

    def precompute_and_store_context_kv(self, *args: Any, **kwargs: Any) -> None:
        slots = args[2] if len(args) > 2 else kwargs.get("context_slot_mapping")
        if slots is None and self.lifecycle.quarantined:
            # a dummy run stores nothing (vLLM runs one on data-parallel ranks whose drafter it skipped, to
            # keep them in step): skip it instead of failing the engine step
            return None
        self.require_usable("precompute_and_store_context_kv")  # quarantined or stale: refuse, never garbage
        return super().precompute_and_store_context_kv(*args, **kwargs)  # type: ignore[misc]

    # ---- driven by the draft's load_weights and the patched vLLM entry points -------------------------------
    def before_write(self) -> None:
        """A `load_weights` call is about to write. After a completed load (and outside a reload vLLM began),
        that write begins a reload epoch, audited, and starts vLLM's layerwise reload on the modules holding the
        draft's own checkpoint tensors (not on those it shares with the target, which keeps serving meanwhile).
        A call the frozen structure refused (`structure.admit`) raises here, before anything is written."""
        refusal = self.__dict__.pop("_structure_refusal", None)
        lc = self.lifecycle
        if refusal is not None:
            try:
                raise lc.record_refusal("weights_loaded", refusal)
            finally:
                del refusal  # see `lifecycle.errors`: a local holding the raised error keeps its frames alive
        if not (lc.usable or lc.quarantined):
            return
        lc.audit_event("implicit_reload", cause=IMPLICIT_CAUSE, from_state=lc.state.value)
        self.begin_reload()
        initialize = _reload_function("initialize_layerwise_reload")
        for module in self.__dict__["_own_roots"]:
            initialize(module)

    def after_write(self) -> None:
        # the cold load writes every tracked parameter in place, in one load_weights call (an optional module's
        # only if the call carried it)
        lc = self.lifecycle
        if lc.epoch == 0 and lc.awaiting_weights:
            self.__dict__["_cold_load_called"] = True
            lc.weights_loaded(self._structure.loaded_at_cold(n for n in lc.specs if not n.endswith(SHADOW)))

    def on_cold_load_processed(self) -> None:
        lc = self.lifecycle
        if lc.epoch == 0 and lc.awaiting_weights and not self.__dict__.get("_cold_load_called"):
            self._adopt_loader_values()
        if lc.epoch == 0 and lc.can("finish_loading"):
            self.finalize_loading()
            self.refresh_derived_buffers()

    def _adopt_loader_values(self) -> None:
        """The cold load never called load_weights (vLLM's dummy loader, as veRL starts its rollout engine, or a
        loader that writes parameters itself): its values count as the cold load's, the structure is what vLLM
        built, and the first reload must write every layer in full (never completed or kept with them)."""
        lc, structure = self.lifecycle, self._structure
        structure.seen.update(structure.modules)  # present iff vLLM built it: no load decided otherwise
        self._record_metadata()  # what vLLM's builder would have set at the end of load_weights
        lc.audit_event("loaded_without_load_weights", cause=LOADER_VALUES)
        lc.weights_loaded(structure.loaded_at_cold(n for n in lc.specs if not n.endswith(SHADOW)))
        self.__dict__["_loader_values"] = True

    def on_reload_begin(self) -> None:
        if not self.lifecycle.unloaded:
            self.begin_reload()

    def on_reload_finalized(self, outcome: PartialOutcome | None = None, policy: PartialPolicy = "refuse") -> None:
        """After vLLM's finalize: finish (every layer ready; with `keep`, tensors that received nothing count
        as unchanged), run the reload hooks and refresh in place. Any failure quarantines the draft (its last
        good derived buffers kept) and is raised."""
        lc = self.lifecycle
        if not lc.can("finish_loading"):  # no load of this draft in progress: nothing to finish
            return
        try:
            if outcome is not None and outcome.unfilled:
                raise _partly_sent(lc, outcome, policy)
            if policy == "keep" and outcome is not None and outcome.untouched:
                kept = [n for n in outcome.untouched if not lc.readiness.is_loaded(n)]
                lc.weights_unchanged(kept)
                shown, more = capped(sorted(kept), LIST_CAP)
                lc.audit_event("partial_reload", policy=policy, kept=shown, kept_more=more,
                               completed_with_last_values=sorted(outcome.filled))
            self.finalize_loading()
            self.refresh_derived_buffers()
        except Exception as e:
            # fail closed: the draft keeps its last good derived buffers and refuses to run until a good reload
            if lc.can("abort_reload"):
                lc.abort_reload(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
            raise

    # ---- the frozen structure (`structure.py`): optional submodules decided by the first load --------------------
    @property
    def _structure(self) -> Any:
        return self.__dict__["_structure"]

    def init_lifecycle(self, name: str | None = None, **kwargs: Any) -> Any:
        """Track the optional modules' tensors too (those outside this module through slots), until the first
        load decides which exist."""
        structure = self._structure
        kwargs["tensors"] = {**(kwargs.get("tensors") or {}), **structure.tensors()}
        return super().init_lifecycle(name, slots=structure.outer_slots(), **kwargs)

    def claim_structure(self) -> None:
        """Claim the tracked optional tensors like the layers' (`MODULE_OWNERS`, guarded processing, the modules
        an implicit reload hands to vLLM's layerwise reload); run again once the first load froze the structure,
        which releases the absent ones."""
        structure, specs = self._structure, self.lifecycle.specs
        roots: list[nn.Module] = self.__dict__["_own_roots"]
        for module in structure.modules:
            for name, owner, _ in structure.slots[module]:
                entry = MODULE_OWNERS.get(owner)
                names = [n for n in (entry[1] if entry else []) if n != name] + ([name] if name in specs else [])
                if names:
                    MODULE_OWNERS[owner] = (weakref.ref(self), names)
                    if entry is None:  # not claimed with the layers: process it as they are
                        _guard_processing(self, owner, None)
                elif entry is not None:
                    del MODULE_OWNERS[owner]
                # roots: never a module holding this backbone (the ForCausalLM, which holds d2t)
                if names and owner not in roots and not any(m is self for m in owner.modules()) \
                        and not any(owner in r.modules() for r in roots):
                    roots.append(owner)
        roots[:] = [r for r in roots if any(m in MODULE_OWNERS for m in r.modules())]

    def begin_reload(self) -> int:
        """Begin a reload epoch; optional modules the draft shares with the target since its load (the proposer
        replaced an own copy equal to the target's) are kept: a reload may not write them."""
        epoch = super().begin_reload()
        shared = self._structure.shared_now()
        if shared:
            self.weights_unchanged(n for m in sorted(shared) for n in self._structure.names_of(m))
        if self.__dict__.pop("_loader_values", False):  # the cold load's values are nothing to keep
            readiness = self.lifecycle.readiness
            readiness.require_full_write(readiness.untouched_layers(), LOADER_VALUES)
        return epoch

    def finalize_loading(self, *, keep_untouched: bool = False) -> list[str]:
        """Before a load finishes: the first load freezes the structure; every load runs vLLM's whole-checkpoint
        checks once, over what it wrote and kept."""
        structure = self._structure
        if structure.frozen is None and self.lifecycle.can("weights_loaded"):
            structure.freeze(self)
            self.claim_structure()
        structure.validate(self.lifecycle, keep_untouched=keep_untouched)
        return super().finalize_loading(keep_untouched=keep_untouched)

    def note_carried(self, modules: Iterable[str]) -> None:
        """After a later call: the optional tensors it carried count as loaded once off META (d2t sits on the
        ForCausalLM, outside the layers an implicit reload hands to vLLM's layerwise reload, which reports the
        rest as each layer completes)."""
        lc = self.lifecycle
        if not (lc.in_reload and lc.can("weights_loaded")):
            return
        names = [n for m in modules for n in self._structure.names_of(m)
                 if n in lc.specs and (t := self.live_tensor(n)) is not None and not t.is_meta]
        if names:
            lc.weights_loaded(names)


def _structure_preserving(load: Any) -> Any:
    """Wrap a draft class's `load_weights`: its tensors pass the frozen structure first (`structure.admit`; a
    refusal is raised by the backbone's `before_write`, so a call inside a reload fails like any bad bucket);
    vLLM's per-call decisions and checks are neutralized around the call (`structure.within_call`)."""

    def load_weights(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        structure = self.__dict__["_lifecycle_structure"]
        backbones = backbones_in(self)
        weights, refusal = structure.admit(weights, backbones[0].lifecycle if backbones else None)
        for b in backbones:
            if refusal is not None:
                b.__dict__["_structure_refusal"] = refusal
        with structure.within_call():
            result = load(self, weights)
        carried = structure.carried(weights)
        for b in backbones:
            b.note_carried(carried)
        return result

    return load_weights


def _guard_processing(backbone: LifecycleDraftModel, module: nn.Module,
                      shadow: Capture | None) -> None:
    """Wrap the module's quant method's `process_weights_after_loading` (the very object, wherever vLLM moves the
    parameters meanwhile):
    - right before a load's processing repacks or empties the weight, copy the shadowed rows in checkpoint layout;
    - in the middle of a reload, processing that does not come from vLLM's reload machinery (a cold-load pass
      through a reference to `process_weights_after_loading` taken before the plugin wrapped it) is skipped:
      the reload processes each layer once, when it completes or at finalize, never a META placeholder."""
    quant_method = getattr(module, "quant_method", None)
    if getattr(quant_method, "process_weights_after_loading", None) is None:
        return
    # an earlier per-instance wrapper, else the class's method as it is when called (a process-wide replacement,
    # such as a test's simulated GPU layout, then applies to this layer too)
    own = quant_method.__dict__.get("process_weights_after_loading")

    def original(layer: nn.Module) -> Any:
        return own(layer) if own is not None else type(quant_method).process_weights_after_loading(quant_method, layer)

    backbone_ref = weakref.ref(backbone)  # the module's quant method must not hold its backbone (a cycle)
    del backbone

    def process_weights_after_loading(layer: nn.Module) -> Any:
        backbone = backbone_ref()
        if backbone is None:  # the draft was dropped: vLLM's processing as it is
            return original(layer)
        lc = backbone.lifecycle
        if backbone.reload_open and not IN_VLLM_RELOAD.get():
            return None
        if shadow is not None and lc.can("weights_loaded"):
            rows, buf, name = shadow
            weight = layer.weight
            if not weight.is_meta and weight.dim() == 2 and weight[rows].shape == buf.shape:
                with torch.no_grad():
                    buf.copy_(weight[rows])
                lc.weights_loaded([name])
        return original(layer)

    quant_method.process_weights_after_loading = process_weights_after_loading


def _partly_sent(lc: Any, outcome: PartialOutcome, policy: PartialPolicy) -> LayersNotReadyError:
    """Tensors that received only part of their elements and could not be completed: named with why."""
    missing: dict[str, list[str]] = {}
    for name, why in outcome.unfilled.items():
        missing.setdefault(lc.readiness.layer_of_name[name], []).append(f"{name} ({why})")
    err = LayersNotReadyError(f"finish_loading (partial={policy!r})", missing, backbone=lc.name,
                              state=lc.state.value)
    lc.record_refusal("finish_loading", err)
    return err


def owner_of(module: nn.Module) -> tuple[LifecycleDraftModel, list[str]] | None:
    """The backbone whose tracked tensors `module` holds, with their names (`MODULE_OWNERS`), or None."""
    entry = MODULE_OWNERS.get(module)
    if entry is None:
        return None
    backbone = entry[0]()
    return None if backbone is None else (backbone, entry[1])


def backbones_in(model: nn.Module) -> list[LifecycleDraftModel]:
    return [m for m in model.modules() if isinstance(m, LifecycleDraftModel)]


def _reload_function(name: str) -> Any:
    """vLLM's layerwise reload function `name`, looked up now (so the plugin's wrapper, once installed)."""
    return getattr(importlib.import_module("vllm.model_executor.model_loader.reload.layerwise"), name)


# ---- building the registered classes ------------------------------------------------------------------------

_CLASSES: dict[str, type] = {}


def lifecycle_class(family: VLLMDraftFamily) -> type:
    """A subclass of the family's vLLM ForCausalLM whose backbone is lifecycle-enabled."""
    if family.name in _CLASSES:
        return _CLASSES[family.name]
    base = getattr(importlib.import_module(family.module), family.causal_lm)
    base_hook = getattr(base, "process_weights_after_loading", None)

    def __init__(self: nn.Module, *, vllm_config: Any, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        spec = getattr(vllm_config, "speculative_config", None)
        self._lifecycle_model_config = getattr(spec, "draft_model_config", None) or vllm_config.model_config
        inner = getattr(self, family.inner_model_attr)
        inner.__class__ = _inner_class(family, type(inner))
        from .structure import DraftStructure

        inner.__dict__["_structure"] = self.__dict__["_lifecycle_structure"] = DraftStructure(self, inner, family)
        inner.enable_lifecycle(name=f"{family.name}-draft", rank=_rank())
        inner.claim_structure()

    def load_weights(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        backbones = backbones_in(self)
        # a bucket that fails inside a reload (a bad name or shape, a loader or a source that raises) ends the
        # epoch here: otherwise modules stay on META and the next reload is refused
        try:
            for b in backbones:
                b.before_write()
            result = base.load_weights(self, weights)
        except BaseException as e:
            from .epochs import describe, end_failed_epoch, reload_in_progress

            if reload_in_progress(self):
                end_failed_epoch(self, f"load_weights failed: {describe(e)}")
            raise
        for b in backbones:
            b.after_write()
        return result

    def process_weights_after_loading(self: nn.Module) -> None:
        """vLLM's `process_weights_after_loading` calls this last, whichever reference to it ran: it finishes
        an open reload epoch (as `finalize_layerwise_reload` would), or builds the buffers after a cold load."""
        if base_hook is not None:
            base_hook(self)
        backbones = backbones_in(self)
        if any(b.reload_open for b in backbones):
            _reload_function("finalize_layerwise_reload")(self, self._lifecycle_model_config)
            return
        for b in backbones:
            b.on_cold_load_processed()

    cls = type(f"Lifecycle{family.causal_lm}", (base,), {
        "__init__": __init__, "load_weights": load_weights,
        "process_weights_after_loading": process_weights_after_loading,
        "__module__": __name__, "lifecycle_family": family.name})
    cls.load_weights = _structure_preserving(cls.load_weights)  # type: ignore[attr-defined]
    _CLASSES[family.name] = cls
    return cls


_INNER: dict[tuple[str, type], type] = {}


def _inner_class(family: VLLMDraftFamily, base: type) -> type:
    key = (family.name, base)
    if key not in _INNER:
        # the lifecycle mixin first, so its precompute override wins; the family's builders record metadata only
        builders = {name: LifecycleDraftModel._record_metadata for name in family.builders}
        _INNER[key] = type(f"Lifecycle{base.__name__}", (LifecycleDraftModel, base), {"_family": family, **builders})
    return _INNER[key]


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0
