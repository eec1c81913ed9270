"""Lifecycle-enabled versions of vLLM's DFlash-family draft classes.

vLLM's drafts build their fused buffers with `torch.cat` / `torch.stack` at the end of every `load_weights`
call (`_build_fused_kv_buffers`). Here that builder only records the precompute metadata (sizes, attention
layers); the tensors are declared derived buffers (registered, non-persistent, so level-2 sleep keeps them),
built once after the first load and refreshed in place after every reload, once every layer is ready.

One more thing differs from a plain PyTorch model: post-processing may change a source's layout. On CPU an
unquantized linear layer is repacked into a oneDNN handle and its `weight` becomes an empty (0,) parameter;
quantized layers pack their weights on GPU. So the rows a fused buffer needs are copied, in checkpoint layout,
into a per-layer shadow (`ckpt_kv_weight`) right before the layer's quant method processes them, and the fused
buffer is built from the shadows. The shadow costs one more copy of those rows (the size of the fused buffer).
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..backbone import DraftBackbone
from ..errors import LayersNotReadyError
from ..events import LIST_CAP
from ..types import capped
from .families import SHADOW, VLLMDraftFamily
from .quantized import attention_prefixes, checkpoint_layout_readable, quantized_fallback

if TYPE_CHECKING:
    from .epochs import PartialOutcome
    from .settings import PartialPolicy

__all__ = ["MODULE_OWNERS", "SHADOW_OF", "LifecycleDraftModel", "backbones_in", "lifecycle_class"]

#: module -> (backbone, tracked tensor names of that module): how vLLM's per-module events find the lifecycle.
MODULE_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[LifecycleDraftModel, list[str]]] = (
    weakref.WeakKeyDictionary()
)
#: linear module -> the name of the shadow its processing fills (a shadow is current only if its linear is).
SHADOW_OF: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


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
        sources = [family.shadow_rows(layer.self_attn) for layer in self.layers]
        quantized = {type(linear.quant_method).__name__ for linear, _ in sources
                     if not checkpoint_layout_readable(linear)}
        shadows: dict[str, torch.Tensor] = {}
        if not quantized:
            for i, ((linear, rows), layer) in enumerate(zip(sources, self.layers, strict=True)):
                shadow = torch.zeros_like(linear.weight[rows])
                layer.self_attn.register_buffer(SHADOW, shadow, persistent=False)
                shadows[f"layers.{i}.self_attn.{SHADOW}"] = shadow
                _capture_before_processing(self, linear, rows, shadow, f"layers.{i}.self_attn.{SHADOW}")
            self.derived_buffers = family.derived()
        else:
            self.derived_buffers = quantized_fallback(self, family, quantized)
        # attention layers' own parameters (quantized KV-cache scales) are vLLM's to process, and it deletes
        # them once consumed: no derived buffer reads them, so they are not checkpoint tensors of the lifecycle
        untracked = family.untracked_prefixes + attention_prefixes(self)
        tracked: dict[str, torch.Tensor] = {n: p for n, p in self.named_parameters() if not n.startswith(untracked)}
        tracked.update(shadows)
        self.init_lifecycle(name, rank=rank, tensors=tracked)
        for mod_name, module in self.named_modules():
            own = [f"{mod_name}.{leaf}" if mod_name else leaf for leaf in module._parameters]
            own = [n for n in own if n in tracked]
            if own:
                MODULE_OWNERS[module] = (self, own)

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

    # vLLM calls this at the end of every load_weights (once per bucket during a reload). Build nothing here:
    # record the metadata, and on the first (cold) load report every tracked parameter as loaded.
    def _build_fused_kv_buffers(self) -> None:
        self._family.metadata(self)
        lc = self.lifecycle
        if lc.epoch == 0 and lc.awaiting_weights:
            lc.weights_loaded([n for n in lc.specs if not n.endswith(SHADOW)])

    def precompute_and_store_context_kv(self, *args: Any, **kwargs: Any) -> None:
        slots = args[2] if len(args) > 2 else kwargs.get("context_slot_mapping")
        if slots is None and self.lifecycle.quarantined:
            # a dummy run stores nothing (vLLM runs one on data-parallel ranks whose drafter it skipped, to
            # keep them in step): skip it instead of failing the engine step
            return None
        self.require_usable("precompute_and_store_context_kv")  # quarantined or stale: refuse, never garbage
        return super().precompute_and_store_context_kv(*args, **kwargs)  # type: ignore[misc]

    # ---- driven by the patched vLLM entry points ------------------------------------------------------------
    def on_cold_load_processed(self) -> None:
        lc = self.lifecycle
        if lc.epoch == 0 and lc.can("finish_loading"):
            self.finalize_loading()
            self.refresh_derived_buffers()

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


def _capture_before_processing(backbone: LifecycleDraftModel, linear: nn.Module, rows: slice,
                               shadow: torch.Tensor, name: str) -> None:
    """Copy `linear.weight[rows]` into `shadow` (the very tensor object, wherever vLLM has moved the buffer
    registration meanwhile) right before the layer's quant method repacks or empties the weight."""
    quant_method = linear.quant_method
    original = quant_method.process_weights_after_loading

    SHADOW_OF[linear] = name

    def process_weights_after_loading(layer: nn.Module) -> Any:
        weight = layer.weight
        if not weight.is_meta and weight.dim() == 2 and weight[rows].shape == shadow.shape:
            with torch.no_grad():
                shadow.copy_(weight[rows])
            backbone.lifecycle.weights_loaded([name])
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


def backbones_in(model: nn.Module) -> list[LifecycleDraftModel]:
    return [m for m in model.modules() if isinstance(m, LifecycleDraftModel)]


# ---- building the registered classes ------------------------------------------------------------------------

_CLASSES: dict[str, type] = {}


def lifecycle_class(family: VLLMDraftFamily) -> type:
    """A subclass of the family's vLLM ForCausalLM whose backbone is lifecycle-enabled."""
    if family.name in _CLASSES:
        return _CLASSES[family.name]
    base = getattr(importlib.import_module(family.module), family.causal_lm)

    def __init__(self: nn.Module, *, vllm_config: Any, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        inner = getattr(self, family.inner_model_attr)
        inner.__class__ = _inner_class(family, type(inner))
        inner.enable_lifecycle(name=f"{family.name}-draft", rank=_rank())

    def load_weights(self: nn.Module, weights: Any) -> Any:
        # a bucket that fails inside a reload (a bad name or shape, a loader or a source that raises) ends the
        # epoch here: otherwise modules stay on META and the next reload is refused
        try:
            return base.load_weights(self, weights)
        except BaseException as e:
            from .epochs import describe, end_failed_epoch, reload_in_progress

            if reload_in_progress(self):
                end_failed_epoch(self, f"load_weights failed: {describe(e)}")
            raise

    cls = type(f"Lifecycle{family.causal_lm}", (base,), {"__init__": __init__, "load_weights": load_weights,
                                                          "__module__": __name__, "lifecycle_family": family.name})
    _CLASSES[family.name] = cls
    return cls


_INNER: dict[tuple[str, type], type] = {}


def _inner_class(family: VLLMDraftFamily, base: type) -> type:
    key = (family.name, base)
    if key not in _INNER:
        # the lifecycle mixin first, so its _build_fused_kv_buffers / precompute override vLLM's
        _INNER[key] = type(f"Lifecycle{base.__name__}", (LifecycleDraftModel, base), {"_family": family})
    return _INNER[key]


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0
