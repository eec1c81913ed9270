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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..backbone import DraftBackbone
from ..derived import DerivedSpec, alias, concat, custom, stack

SHADOW = "ckpt_kv_weight"

#: module -> (backbone, tracked tensor names of that module): how vLLM's per-module events find the lifecycle.
MODULE_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[LifecycleDraftModel, list[str]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class VLLMDraftFamily:
    """What one vLLM draft family derives, and where its fused buffers read from."""

    name: str
    architectures: tuple[str, ...]  # vLLM registry names this class serves
    module: str
    causal_lm: str
    inner_model_attr: str  # the attribute of the ForCausalLM holding the backbone ("model")
    shadow_rows: Callable[[nn.Module], tuple[nn.Module, slice]]  # attention -> (linear, rows in checkpoint layout)
    derived: Callable[[], tuple[DerivedSpec, ...]]
    metadata: Callable[[nn.Module], None]  # sets vLLM's non-tensor precompute attributes
    untracked_prefixes: tuple[str, ...] = ("embed_tokens.", "mask_embedding", "lm_head.")


# ---- per-family declarations -------------------------------------------------------------------------------


def _qkv_kv_rows(attn: nn.Module) -> tuple[nn.Module, slice]:
    return attn.qkv_proj, slice(attn.q_size, None)


def _dflash_derived() -> tuple[DerivedSpec, ...]:
    return (
        concat("_fused_kv_weight", sources=(f"self_attn.{SHADOW}",),
               per_layer=lambda layer: getattr(layer.self_attn, SHADOW)),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
        alias("_hidden_norm_weight", source="hidden_norm.weight"),
    )


def _common_metadata(model: nn.Module) -> None:
    attns = [layer.self_attn for layer in model.layers]
    a0 = attns[0]
    model._rope_head_size = a0.rotary_emb.head_size
    model._rope_is_neox = a0.rotary_emb.is_neox_style
    model._num_attn_layers = len(attns)
    model._kv_size = a0.kv_size
    model._head_dim = a0.head_dim
    model._num_kv_heads = a0.num_kv_heads
    model._rms_norm_eps = a0.q_norm.variance_epsilon
    model._attn_layers = [a.attn for a in attns]


def _dflash_metadata(model: nn.Module) -> None:
    _common_metadata(model)
    attns = [layer.self_attn for layer in model.layers]
    model._context_qkv_projs = [a.qkv_proj for a in attns]
    model._context_q_sizes = [a.q_size for a in attns]
    model._fused_kv_bias = None  # Qwen3 DFlash attention has no bias; a biased variant would declare it


def _gemma_derived() -> tuple[DerivedSpec, ...]:
    return (
        concat("_fused_k_weight", sources=(f"self_attn.{SHADOW}",),
               per_layer=lambda layer: getattr(layer.self_attn, SHADOW)),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
        # v_norm has no learnable scale: a constant, built once, never rewritten
        custom("_v_norm_weights", build=lambda m: torch.ones(
            len(m.layers), m.layers[0].self_attn.head_dim, dtype=m.layers[0].self_attn.k_norm.weight.dtype,
            device=m.layers[0].self_attn.k_norm.weight.device)),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
        alias("_hidden_norm_weight", source="hidden_norm.weight"),
    )


def _gemma_metadata(model: nn.Module) -> None:
    _common_metadata(model)
    model._fused_k_bias = None


def _laguna_derived() -> tuple[DerivedSpec, ...]:
    return (
        stack("_kv_weights", sources=(f"self_attn.{SHADOW}",),
              per_layer=lambda layer: getattr(layer.self_attn, SHADOW)),
        stack("_input_layernorm_weights", sources=("input_layernorm.weight",),
              per_layer=lambda layer: layer.input_layernorm.weight),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
    )


def _laguna_metadata(model: nn.Module) -> None:
    _common_metadata(model)
    model._kv_biases = None


FAMILIES: tuple[VLLMDraftFamily, ...] = (
    VLLMDraftFamily("dflash", ("DFlashDraftModel", "DFlashMuseGlimmerAssistantModel", "MuseGlimmerAssistantModel"),
                    "vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM", "model",
                    _qkv_kv_rows, _dflash_derived, _dflash_metadata),
    VLLMDraftFamily("dflash2", ("DFlash2DraftModel",), "vllm.model_executor.models.qwen3_dflash2",
                    "DFlash2Qwen3ForCausalLM", "model", _qkv_kv_rows, _dflash_derived, _dflash_metadata),
    VLLMDraftFamily("qwen3_dspark", ("Qwen3DSparkModel", "Qwen3OmniDSparkModel"),
                    "vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM", "model",
                    _qkv_kv_rows, _dflash_derived, _dflash_metadata),
    VLLMDraftFamily("gemma4_dspark", ("Gemma4DSparkModel",), "vllm.model_executor.models.gemma4_dspark",
                    "Gemma4DSparkForCausalLM", "model", lambda attn: (attn.k_proj, slice(None)),
                    _gemma_derived, _gemma_metadata),
    VLLMDraftFamily("laguna_dflash", ("DFlashLagunaForCausalLM",), "vllm.model_executor.models.laguna_dflash",
                    "DFlashLagunaForCausalLM", "model", _qkv_kv_rows, _laguna_derived, _laguna_metadata),
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
        if lc.epoch == 0 and lc.state.value in ("META", "PARTIALLY_LOADED"):
            lc.weights_loaded([n for n in lc.specs if not n.endswith(SHADOW)])

    def precompute_and_store_context_kv(self, *args: Any, **kwargs: Any) -> None:
        self.require_usable("precompute_and_store_context_kv")  # quarantined or stale: refuse, never garbage
        return super().precompute_and_store_context_kv(*args, **kwargs)  # type: ignore[misc]

    # ---- driven by the patched vLLM entry points ------------------------------------------------------------
    def on_cold_load_processed(self) -> None:
        lc = self.lifecycle
        if lc.epoch == 0 and lc.state.value in ("PARTIALLY_LOADED", "FULLY_LOADED"):
            self.finalize_loading()
            self.refresh_derived_buffers()

    def on_reload_begin(self) -> None:
        if self.lifecycle.state.value != "META":
            self.begin_reload()

    def on_reload_finalized(self) -> None:
        lc = self.lifecycle
        if lc.state.value not in ("PARTIALLY_LOADED", "FULLY_LOADED"):
            return
        try:
            self.finalize_loading()
            self.refresh_derived_buffers()
        except Exception as e:
            # fail closed: the draft keeps its last good derived buffers and refuses to run until a good reload
            if lc.state.value in ("PARTIALLY_LOADED", "FULLY_LOADED"):
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


def families_by_architecture() -> dict[str, VLLMDraftFamily]:
    return {arch: fam for fam in FAMILIES for arch in fam.architectures}


def lifecycle_architectures() -> Iterable[str]:
    return families_by_architecture().keys()
