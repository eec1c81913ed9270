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
and its `weight` becomes an empty (0,) parameter; quantized layers pack their weights on GPU. So the rows a fused
buffer needs are copied, in checkpoint layout, into a per-layer shadow (`ckpt_kv_weight`) right before the layer's
quant method processes them, and the fused buffer is built from the shadows (one more copy of those rows).
"""

from __future__ import annotations

import contextvars
import importlib
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ..backbone import DraftBackbone
from .families import SHADOW, VLLMDraftFamily
from .structure import DraftStructure

__all__ = ["IN_VLLM_RELOAD", "MODULE_OWNERS", "LifecycleDraftModel", "backbones_in", "lifecycle_class"]

#: module -> (backbone, tracked tensor names of that module): how vLLM's per-module events find the lifecycle.
MODULE_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[LifecycleDraftModel, list[str]]] = (
    weakref.WeakKeyDictionary()
)
#: True while vLLM's own reload machinery (`_layerwise_process`, `finalize_layerwise_reload`) processes layers.
IN_VLLM_RELOAD: contextvars.ContextVar[bool] = contextvars.ContextVar("reload_lifecycle_in_vllm_reload",
                                                                      default=False)
IMPLICIT_CAUSE = "load_weights after a completed load, outside initialize_layerwise_reload"


# ---- the backbone mixin ------------------------------------------------------------------------------------


class LifecycleDraftModel(DraftBackbone):
    """Mixed into vLLM's inner draft model class (DFlashQwen3Model and its relatives) at construction."""

    _family: ClassVar[VLLMDraftFamily]

    def enable_lifecycle(self, *, name: str, rank: int, structure: DraftStructure) -> None:
        family = self._family
        shadows: dict[str, torch.Tensor] = {}
        shadow_of: dict[nn.Module, tuple[slice, torch.Tensor, str]] = {}
        if family.shadow is not None:
            for i, layer in enumerate(self.layers):
                linear, rows = family.shadow.of(layer.self_attn)
                shadow = torch.zeros_like(linear.weight[rows])
                layer.self_attn.register_buffer(SHADOW, shadow, persistent=False)
                shadows[f"layers.{i}.self_attn.{SHADOW}"] = shadow
                shadow_of[linear] = (rows, shadow, f"layers.{i}.self_attn.{SHADOW}")
        self.derived_buffers = family.derived()
        tracked: dict[str, torch.Tensor] = {
            n: p for n, p in self.named_parameters() if not n.startswith(family.untracked_prefixes)
        }
        tracked.update(shadows)
        tracked.update(structure.tensors())  # optional modules, until the first load decides which exist
        self.__dict__["_structure"] = structure
        self.init_lifecycle(name, rank=rank, tensors=tracked, slots=structure.outer_slots())
        for module in self._claim_modules():
            _guard_processing(self, module, shadow_of.get(module))

    def _claim_modules(self) -> list[nn.Module]:
        """Record which modules hold which tracked tensors (`MODULE_OWNERS`: how vLLM's per-layer events find the
        lifecycle) and the outermost ones (what an implicit reload hands to vLLM's layerwise reload: never the
        ForCausalLM itself, nor the modules shared with the target, nor the RoPE cache vLLM shares between
        models). Run again once the first load froze the structure. Returns the modules claimed."""
        tracked = self.lifecycle.specs
        own: dict[int, tuple[nn.Module, list[str]]] = {}
        for n, (module, leaf) in self._tensor_slots.items():
            if n in tracked and leaf in module._parameters:
                own.setdefault(id(module), (module, []))[1].append(n)
        for module, _ in list(MODULE_OWNERS.items()):
            if MODULE_OWNERS[module][0] is self and id(module) not in own:
                del MODULE_OWNERS[module]
        for module, names in own.values():
            MODULE_OWNERS[module] = (self, names)
        owned = [m for m, _ in own.values()]
        # a module holding this backbone (the ForCausalLM, which holds d2t) would hand the target's modules too
        rootable = [m for m in owned if not any(d is self for d in m.modules())]
        inner = {id(d) for m in rootable for d in m.modules() if d is not m}
        self.__dict__["_own_roots"] = [m for m in rootable if id(m) not in inner]
        return owned

    @property
    def reload_open(self) -> bool:
        """A reload epoch has begun and is not finished yet (weights may be mid-write)."""
        lc = self.lifecycle
        return lc.in_reload and lc.can("finish_loading")

    def _record_metadata(self) -> None:
        """What each declared builder does instead of vLLM's: set the non-tensor precompute metadata."""
        self._family.set_metadata(self)

    def precompute_and_store_context_kv(self, *args: Any, **kwargs: Any) -> None:
        self.require_usable("precompute_and_store_context_kv")  # quarantined or stale: refuse, never garbage
        return super().precompute_and_store_context_kv(*args, **kwargs)  # type: ignore[misc]

    # ---- driven by the draft's load_weights and the patched vLLM entry points -------------------------------
    def before_write(self) -> None:
        """A `load_weights` call is about to write. After a completed load (and outside a reload vLLM began),
        that write begins a reload epoch, audited, and starts vLLM's layerwise reload on the modules holding the
        draft's own checkpoint tensors (not on those it shares with the target, which keeps serving meanwhile)."""
        lc = self.lifecycle
        if not (lc.usable or lc.quarantined):
            return
        lc.audit_event("implicit_reload", cause=IMPLICIT_CAUSE, from_state=lc.state.value)
        self._begin_epoch()
        initialize = _reload_function("initialize_layerwise_reload")
        for module in self.__dict__["_own_roots"]:
            initialize(module)

    def after_write(self, modules: Iterable[str] = ()) -> None:
        """A `load_weights` call returned. The cold load writes every tracked parameter in place (the optional
        modules' only if it carried them); afterwards, the optional tensors the call carried that are off META
        count as loaded (d2t sits on the ForCausalLM itself, outside the layers an implicit reload hands to
        vLLM's layerwise reload, which reports the rest)."""
        lc = self.lifecycle
        structure: DraftStructure = self.__dict__["_structure"]
        if lc.epoch == 0 and lc.awaiting_weights:
            lc.weights_loaded(structure.loaded_at_cold(n for n in lc.specs if not n.endswith(SHADOW)))
        elif lc.in_reload and lc.can("weights_loaded"):
            names = [n for m in modules for n in structure.names_of(m) if n in lc.specs
                     and (t := self.live_tensor(n)) is not None and not t.is_meta]
            if names:
                lc.weights_loaded(names)

    def _finish_epoch(self) -> None:
        """Before a load finishes: the first load freezes the structure; every load runs vLLM's whole-checkpoint
        checks once, over what it wrote and kept."""
        structure: DraftStructure = self.__dict__["_structure"]
        if structure.frozen is None:
            structure.freeze(self)
            self._claim_modules()
        structure.validate(self.lifecycle)

    def _begin_epoch(self) -> None:
        """Begin a reload epoch; modules the draft shares with the target since its load are kept as they are."""
        self.begin_reload()
        shared = self.__dict__["_structure"].shared_now()
        if shared:
            self.weights_unchanged(n for m in sorted(shared) for n in self.__dict__["_structure"].names_of(m))

    def on_cold_load_processed(self) -> None:
        lc = self.lifecycle
        if lc.epoch == 0 and lc.can("finish_loading"):
            self._finish_epoch()
            self.finalize_loading()
            self.refresh_derived_buffers()

    def on_reload_begin(self) -> None:
        if not self.lifecycle.unloaded:
            self._begin_epoch()

    def on_reload_finalized(self) -> None:
        lc = self.lifecycle
        if not lc.can("finish_loading"):  # no load of this draft in progress: nothing to finish
            return
        try:
            self._finish_epoch()
            self.finalize_loading()
            self.refresh_derived_buffers()
        except Exception as e:
            # fail closed: the draft keeps its last good derived buffers and refuses to run until a good reload
            if lc.can("abort_reload"):
                lc.abort_reload(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
            raise


def _guard_processing(backbone: LifecycleDraftModel, module: nn.Module,
                      shadow: tuple[slice, torch.Tensor, str] | None) -> None:
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

    def process_weights_after_loading(layer: nn.Module) -> Any:
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


def _refuse_structure(backbones: list[LifecycleDraftModel], structure: DraftStructure,
                      bad: dict[str, list[str]]) -> None:
    lc = backbones[0].lifecycle
    err = structure.refusal(lc, bad)
    lc.record_refusal("weights_loaded", err)
    raise err


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
        self.__dict__["_lifecycle_structure"] = structure = DraftStructure(self, inner, family)
        inner.enable_lifecycle(name=f"{family.name}-draft", rank=_rank(), structure=structure)

    def load_weights(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        backbones = backbones_in(self)
        structure: DraftStructure = self.__dict__["_lifecycle_structure"]
        weights = structure.admit(weights, lambda bad: _refuse_structure(backbones, structure, bad))
        carried = {m for n, _ in weights if (m := structure.module_of(n))} if isinstance(weights, list) else ()
        for b in backbones:
            b.before_write()
        with structure.within_call():  # structure-preserving: vLLM's per-call decisions and checks neutralized
            result = base.load_weights(self, weights)
        for b in backbones:
            b.after_write(carried)
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
