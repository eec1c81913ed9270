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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle import DraftBackbone, Phase, alias, concat, post_load_hook, stack


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 256
    num_target_features: int = 2  # len(dflash_config.target_layer_ids): fc input is hidden * this
    dtype: torch.dtype = torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation. x: [..., n, heads, head_dim] with positions [n]; cache rows are [cos | sin]."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [n, hd/2] each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, device: torch.device) -> torch.Tensor:
    """The RoPE table, rows [cos | sin] of width rotary_dim / 2 each, computed in float64, stored as float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table as a NON-persistent buffer: not in the checkpoint, computed once at cold load."""

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        self.head_size = head_dim
        self.max_position = max_position
        self.base = base
        self.is_neox_style = True
        self.register_buffer("cos_sin_cache", torch.empty(max_position, head_dim), persistent=False)

    def compute_cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        return rope_cos_sin_cache(self.head_size, self.max_position, self.base, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, positions, self.cos_sin_cache)


class DFlashQwen3Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.head_dim = c.head_dim
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, c.max_position_embeddings, c.rope_theta)

    def context_kv(self, normed_context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference (per-layer) context K/V: [n, nkv, hd] each."""
        n = normed_context.shape[0]
        kv = self.qkv_proj(normed_context)[:, self.q_size:].view(n, 2, self.num_kv_heads, self.head_dim)
        k = self.rotary_emb(positions, self.k_norm(kv[:, 0]))
        return k, kv[:, 1]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        """Query tokens attend (non-causally, as DFlash does) to the context K/V plus their own K/V."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary_emb(positions, self.q_norm(q.view(n, self.num_heads, self.head_dim)))
        k = self.rotary_emb(positions, self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        k, v = torch.cat((ctx_k, k)), torch.cat((ctx_v, v))  # [ctx + n, nkv, hd]
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             scale=self.scaling)
        return self.o_proj(out.transpose(0, 1).reshape(n, self.q_size))


class Qwen3MLP(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DFlashQwen3DecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashQwen3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Qwen3MLP(c)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashQwen3Draft(DraftBackbone):
    """The draft backbone (vLLM's `DFlashQwen3Model`): decoder layers, `fc` + `hidden_norm` for the target's
    hidden states, final `norm`. Embeddings and lm_head are shared from the target and not part of it."""

    derived_buffers = (
        concat("_fused_kv_weight", sources=("self_attn.qkv_proj.weight",),
               per_layer=lambda layer: layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:]),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
        alias("_hidden_norm_weight", source="hidden_norm.weight"),
    )

    decoder_layer_cls: ClassVar[Callable[[Any], nn.Module]] = DFlashQwen3DecoderLayer  # as in vLLM: subclasses swap it

    def __init__(self, config: DFlashConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "dflash", rank: int = 0, locked: bool = False) -> None:
        super().__init__()
        c = self.config = config or DFlashConfig()
        with torch.device(device):
            self.layers = nn.ModuleList(self.decoder_layer_cls(c) for _ in range(c.num_hidden_layers))
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

    # A one-time cold-start transform: the RoPE tables are computed once. Replaying this on reload would give
    # the cache new storage under the alias that captured graphs read, so it opts into cold_load only.
    @post_load_hook(Phase.COLD_LOAD)
    def init_rope_caches(self) -> None:
        device = self.hidden_norm.weight.device
        for layer in self.layers:
            rot = layer.self_attn.rotary_emb
            rot.register_buffer("cos_sin_cache", rot.compute_cos_sin_cache(device), persistent=False)

    # ---- target hidden states -> draft context --------------------------------------------------------------
    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden)

    # ---- context K/V: fused path (reads the derived buffers) -------------------------------------------------
    def precompute_context_kv(self, context_states: torch.Tensor, positions: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the context for every layer at once: [L, n, nkv, hd] each. One GEMM, one grouped norm."""
        self.require_usable("precompute_context_kv")
        attn0 = self.layers[0].self_attn
        L, n, nkv, hd = len(self.layers), context_states.shape[0], attn0.num_kv_heads, attn0.head_dim
        x = rms_norm(context_states, self._hidden_norm_weight, self.hidden_norm.variance_epsilon)
        kv = F.linear(x, self._fused_kv_weight).view(n, L, 2, nkv, hd).permute(2, 1, 0, 3, 4)
        k, v = kv[0], kv[1]  # [L, n, nkv, hd]
        k = rms_norm(k, self._k_norm_weights.view(L, 1, 1, hd), attn0.k_norm.variance_epsilon)
        k = apply_rope(k, positions, self._rope_cos_sin_cache)
        return k.contiguous(), v.contiguous()

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
    from lifecycle.testing import random_checkpoint

    return random_checkpoint(DFlashQwen3Draft(config, device="meta"), seed)
