"""A Qwen3-DFlash-style draft backbone in plain PyTorch, with vLLM's parameter names.

    model = DFlashQwen3Draft(DFlashConfig(), device="meta")   # parameters on META until loaded
    load_safetensors(model, "a.safetensors")                   # lifecycle: META -> ... -> FULLY_LOADED
    model.finalize_loading(); model.refresh_derived_buffers()  # -> DERIVED_REFRESHED
    k, v = model.precompute_context_kv(context, positions)     # the fused path reads the derived buffers

The derived state is what vLLM's `DFlashQwen3Model._build_fused_kv_buffers()` builds, declared instead of
rebuilt with `torch.cat` after every `load_weights` call:
  _fused_kv_weight     cat over layers of qkv_proj.weight[q_size:]   one GEMM projects context K/V for all layers
  _k_norm_weights      stack of k_norm.weight                        one grouped RMSNorm over all layers
  _rope_cos_sin_cache  alias of layers.0 rotary cos/sin cache        shared RoPE table
  _hidden_norm_weight  alias of hidden_norm.weight
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle import DerivedSpec, DraftBackbone, alias, concat, stack
from lifecycle.testing import random_checkpoint

from .layers import (
    DecoderLayer,
    DFlashAttention,
    DraftConfig,
    Layers,
    RMSNorm,
    apply_rope,
    init_rope_caches,
    rms_norm,
)

__all__ = ["ContextAttention", "ContextLayer", "DFlashConfig", "DFlashQwen3DecoderLayer", "DFlashQwen3Draft",
           "random_weights"]


@dataclass(frozen=True)
class DFlashConfig(DraftConfig):
    num_key_value_heads: int = 1
    head_dim: int = 32
    num_target_features: int = 2  # len(dflash_config.target_layer_ids): fc input is hidden * this


class DFlashQwen3DecoderLayer(DecoderLayer[DFlashAttention]):
    """vLLM's `DFlashQwen3DecoderLayer`: Qwen3's pre-norm layer whose attention also reads the context K/V."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__(c, DFlashAttention(c))


class ContextAttention(Protocol):
    """What the DFlash backbone's own methods read from a layer's attention (the families built on it, Laguna's
    and Gemma's, bring attentions of their own)."""

    @property
    def head_dim(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def k_norm(self) -> RMSNorm: ...

    def context_kv(self, normed_context: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ContextLayer(Protocol):
    """What the DFlash backbone's own methods use of a decoder layer: its attention, and the layer itself."""

    @property
    def self_attn(self) -> ContextAttention: ...

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                 ) -> torch.Tensor: ...


class DFlashQwen3Draft(DraftBackbone):
    """The draft backbone (vLLM's `DFlashQwen3Model`): decoder layers, `fc` + `hidden_norm` for the target's
    hidden states, final `norm`. Embeddings and lm_head are shared from the target and not part of it."""

    derived_buffers: ClassVar[tuple[DerivedSpec, ...]] = (
        concat("_fused_kv_weight", sources=("self_attn.qkv_proj.weight",),
               per_layer=lambda layer: (attn := layer.self_attn).qkv_proj.weight[attn.q_size:]),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
        alias("_hidden_norm_weight", source="hidden_norm.weight"),
    )

    # as in vLLM: subclasses swap it
    decoder_layer_cls: ClassVar[type[DFlashQwen3DecoderLayer]] = DFlashQwen3DecoderLayer
    layers: Layers[ContextLayer]
    # the derived buffers, registered by the lifecycle
    _fused_kv_weight: torch.Tensor
    _k_norm_weights: torch.Tensor
    _rope_cos_sin_cache: torch.Tensor
    _hidden_norm_weight: torch.Tensor

    def __init__(self, config: DFlashConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "dflash", rank: int = 0, locked: bool = False) -> None:
        super().__init__()
        c = self.config = config or DFlashConfig()
        with torch.device(device):
            self.layers = Layers(self.decoder_layer_cls(c) for _ in range(c.num_hidden_layers))
            self.fc = nn.Linear(c.hidden_size * c.num_target_features, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.to(c.dtype)
        with torch.device(device):
            self.build_heads(c)
        self.init_lifecycle(name, rank=rank, locked=locked)  # locked: loaded from several threads

    def build_heads(self, config: Any) -> None:
        """Subclasses add their extra modules here (DSpark's Markov head, DFlash2's candidate selector), in the
        dtypes they need, before the lifecycle reads the checkpoint tensors."""

    init_rope_caches = init_rope_caches  # cold_load hook: the RoPE tables, computed once (models/layers.py)

    # ---- target hidden states -> draft context --------------------------------------------------------------
    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden)

    # ---- context K/V: fused path (reads the derived buffers) -------------------------------------------------
    def precompute_context_kv(self, context_states: torch.Tensor, positions: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the context for every layer at once: [L, n, nkv, hd] each. One projection for all layers
        (`_project_context_kv`), one grouped k-norm, one RoPE."""
        self.require_usable("precompute_context_kv")
        k, v = self._project_context_kv(context_states)
        attn0 = self.layers[0].self_attn
        k = rms_norm(k, self._k_norm_weights.view(len(self.layers), 1, 1, attn0.head_dim),
                     attn0.k_norm.variance_epsilon)
        k = apply_rope(k, positions, self._rope_cos_sin_cache)
        return k.contiguous(), v.contiguous()

    def _project_context_kv(self, context_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's `_project_context_kv`: K (before its norm and RoPE) and V of every layer, [L, n, nkv, hd] each,
        from one GEMM over the hidden-normed context. The families built on DFlash override this."""
        attn0 = self.layers[0].self_attn
        L, n, nkv, hd = len(self.layers), context_states.shape[0], attn0.num_kv_heads, attn0.head_dim
        x = rms_norm(context_states, self._hidden_norm_weight, self.hidden_norm.variance_epsilon)
        kv = F.linear(x, self._fused_kv_weight).view(n, L, 2, nkv, hd).permute(2, 1, 0, 3, 4)
        return kv[0], kv[1]

    # ---- context K/V: reference path (per layer, no derived buffers) ----------------------------------------
    def precompute_context_kv_reference(self, context_states: torch.Tensor, positions: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.hidden_norm(context_states)
        ks, vs = zip(*(layer.self_attn.context_kv(x, positions) for layer in self.layers), strict=True)
        return torch.stack(ks), torch.stack(vs)

    # ---- the draft step -----------------------------------------------------------------------------------
    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor, context_states: torch.Tensor,
                context_positions: torch.Tensor) -> torch.Tensor:
        ctx_k, ctx_v = self.precompute_context_kv(context_states, context_positions)
        return self.draft_block(input_embeds, positions, ctx_k, ctx_v)

    def draft_block(self, input_embeds: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                    ctx_v: torch.Tensor) -> torch.Tensor:
        """The parallel pass over one query block, given every layer's context K/V ([L, n_ctx, nkv, hd])."""
        h = input_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, ctx_k[i], ctx_v[i])
        return self.norm(h)


def random_weights(config: DFlashConfig, seed: int) -> dict[str, torch.Tensor]:
    """A full checkpoint of random weights (norm weights near 1), in vLLM's parameter names."""
    return random_checkpoint(DFlashQwen3Draft(config, device="meta"), seed)
