"""What each vLLM draft family derives, as data: the classes it serves, where its fused buffers read from, and
the non-tensor precompute attributes vLLM's own builder would set. `drafts.py` turns each into a class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..derived import DerivedSpec, alias, concat, custom, stack

__all__ = ["FAMILIES", "SHADOW", "VLLMDraftFamily"]

#: The per-layer buffer holding a source's rows in checkpoint layout, captured before post-processing.
SHADOW = "ckpt_kv_weight"


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
    #: vLLM's class runs each attention projection through its quant method when the fused weight is None
    #: (DFlash's `_build_context_kv_buffers`); without it a quantized draft is refused at load
    quantized_fallback: bool = False


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
                    _qkv_kv_rows, _dflash_derived, _dflash_metadata, quantized_fallback=True),
    VLLMDraftFamily("dflash2", ("DFlash2DraftModel",), "vllm.model_executor.models.qwen3_dflash2",
                    "DFlash2Qwen3ForCausalLM", "model", _qkv_kv_rows, _dflash_derived, _dflash_metadata,
                    quantized_fallback=True),
    VLLMDraftFamily("qwen3_dspark", ("Qwen3DSparkModel", "Qwen3OmniDSparkModel"),
                    "vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM", "model",
                    _qkv_kv_rows, _dflash_derived, _dflash_metadata, quantized_fallback=True),
    VLLMDraftFamily("gemma4_dspark", ("Gemma4DSparkModel",), "vllm.model_executor.models.gemma4_dspark",
                    "Gemma4DSparkForCausalLM", "model", lambda attn: (attn.k_proj, slice(None)),
                    _gemma_derived, _gemma_metadata),
    VLLMDraftFamily("laguna_dflash", ("DFlashLagunaForCausalLM",), "vllm.model_executor.models.laguna_dflash",
                    "DFlashLagunaForCausalLM", "model", _qkv_kv_rows, _laguna_derived, _laguna_metadata),
)

