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
from typing import Any, ClassVar

import torch
from torch import nn

from ..backbone import DraftBackbone
from .families import SHADOW, VLLMDraftFamily

__all__ = ["MODULE_OWNERS", "LifecycleDraftModel", "backbones_in", "lifecycle_class"]

#: module -> (backbone, tracked tensor names of that module): how vLLM's per-module events find the lifecycle.
MODULE_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[LifecycleDraftModel, list[str]]] = (
    weakref.WeakKeyDictionary()
)


# ---- the backbone mixin ------------------------------------------------------------------------------------


class LifecycleDraftModel(DraftBackbone):
    """Mixed into vLLM's inner draft model class (DFlashQwen3Model and its relatives) at construction."""

    _family: ClassVar[VLLMDraftFamily]

    def enable_lifecycle(self, *, name: str, rank: int) -> None:
        family = self._family
        shadows: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            linear, rows = family.shadow_rows(attn)
            shadow = torch.zeros_like(linear.weight[rows])
            attn.register_buffer(SHADOW, shadow, persistent=False)
            shadows[f"layers.{i}.self_attn.{SHADOW}"] = shadow
            _capture_before_processing(self, linear, rows, shadow, f"layers.{i}.self_attn.{SHADOW}")
        self.derived_buffers = family.derived()
        tracked: dict[str, torch.Tensor] = {
            n: p for n, p in self.named_parameters() if not n.startswith(family.untracked_prefixes)
        }
        tracked.update(shadows)
        self.init_lifecycle(name, rank=rank, tensors=tracked)
        for mod_name, module in self.named_modules():
            own = [f"{mod_name}.{leaf}" if mod_name else leaf for leaf in module._parameters]
            own = [n for n in own if n in tracked]
            if own:
                MODULE_OWNERS[module] = (self, own)

    # vLLM calls this at the end of every load_weights (once per bucket during a reload). Build nothing here:
    # record the metadata, and on the first (cold) load report every tracked parameter as loaded.
    def _build_fused_kv_buffers(self) -> None:
        self._family.metadata(self)
        lc = self.lifecycle
        if lc.epoch == 0 and lc.awaiting_weights:
            lc.weights_loaded([n for n in lc.specs if not n.endswith(SHADOW)])

    def precompute_and_store_context_kv(self, *args: Any, **kwargs: Any) -> None:
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

    def on_reload_finalized(self) -> None:
        lc = self.lifecycle
        if not lc.can("finish_loading"):  # no load of this draft in progress: nothing to finish
            return
        try:
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

    def process_weights_after_loading(layer: nn.Module) -> Any:
        weight = layer.weight
        if not weight.is_meta and weight.dim() == 2 and weight[rows].shape == shadow.shape:
            with torch.no_grad():
                shadow.copy_(weight[rows])
            backbone.lifecycle.weights_loaded([name])
        return original(layer)

    quant_method.process_weights_after_loading = process_weights_after_loading


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

    cls = type(f"Lifecycle{family.causal_lm}", (base,), {"__init__": __init__, "__module__": __name__,
                                                          "lifecycle_family": family.name})
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
