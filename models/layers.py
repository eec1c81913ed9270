"""The layers the draft families share, in plain PyTorch with vLLM's parameter names.

  DraftConfig            the config fields every family has (tiny defaults: tests, demo, benchmarks)
  rms_norm / RMSNorm     RMSNorm in float32, cast back; `has_weight=False` is Gemma's weightless v_norm
  rope_cos_sin_cache     the RoPE table, rows [cos | sin], computed in float64 and stored as float32
  apply_rope             neox rotation of the first `rotary_dim` channels (partial rotary: the rest pass through)
  apply_rope_gptj        GPT-J rotation (channel pairs 2i, 2i+1), in float32
  RotaryEmbedding        vLLM's RotaryEmbedding: the table as a non-persistent buffer, made by `init_rope_caches`
  init_rope_caches       the cold_load hook that computes every RotaryEmbedding's table once
  GatedMLP               merged gate_up_proj, act(gate) * up, down_proj (Qwen3, Kimi: SiLU; Gemma4: tanh GELU)
  attend_to_context      DFlash's attention: a query block attends, non-causally, to the context K/V plus its own
  DFlashAttention        the DFlash draft attention on Qwen3's layout (Qwen3 DFlash, Laguna DFlash)
  DecoderLayer           pre-norm: h + attn(norm(h)), then h + mlp(norm(h)) (Qwen3 DFlash, Laguna DFlash, Kimi-K3)
  Layers                 an `nn.ModuleList` of one layer class, typed as such (torch types its items as Module)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle import Phase, post_load_hook

__all__ = [
    "DFlashAttention",
    "DecoderLayer",
    "DraftConfig",
    "GatedMLP",
    "Layers",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rope",
    "apply_rope_gptj",
    "attend_to_context",
    "init_rope_caches",
    "rms_norm",
    "rope_cos_sin_cache",
]


@dataclass(frozen=True)
class DraftConfig:
    """What every draft family's config has (Hugging Face / vLLM field names). The defaults are tiny, for tests,
    the demo and benchmarks; a family's config adds its own fields and may change these defaults."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 256
    dtype: torch.dtype = torch.float32


# ---- RMSNorm -------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, cast back to x's dtype, then scaled by `weight` (None: unscaled)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(var + eps)).to(x.dtype)
    return normed if weight is None else normed * weight


class RMSNorm(nn.Module):
    """vLLM's `RMSNorm`. `has_weight=False` (vLLM's name): no parameter, nothing in the checkpoint."""

    def __init__(self, dim: int, eps: float, *, has_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if has_weight else None
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


# ---- RoPE ----------------------------------------------------------------------------------------------------


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, device: torch.device) -> torch.Tensor:
    """The RoPE table, rows [cos | sin] of width rotary_dim / 2 each, computed in float64, stored as float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=torch.float32)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of the first `rotary_dim` channels (the cache's width); the rest pass through.
    x: [..., n, heads, head_dim] with positions [n]; cache rows are [cos | sin]."""
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial rotary
        return torch.cat((apply_rope(x[..., :rotary_dim], positions, cos_sin_cache), x[..., rotary_dim:]), dim=-1)
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [n, rotary_dim / 2] each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_gptj(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """GPT-J-style rotation (`is_neox_style=False`: channel pairs 2i, 2i+1), in fp32 as vLLM's K3 kernels do.
    x: [..., n, heads, rope_dim] with positions [n]; cache rows are [cos | sin]."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [n, rope/2] each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """vLLM's `RotaryEmbedding` (`get_rope(head_size, rotary_dim, max_position, base, is_neox_style)`).

    The cos/sin table is a NON-persistent buffer: not in the checkpoint, computed once at cold load by
    `init_rope_caches`. `rotary_dim < head_size` rotates the first `rotary_dim` channels (partial rotary, neox)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float, *,
                 is_neox_style: bool = True) -> None:
        super().__init__()
        if rotary_dim > head_size or (not is_neox_style and rotary_dim != head_size):
            raise ValueError(f"rotary_dim={rotary_dim} with head_size={head_size}: partial rotary is neox-style only "
                             "and rotary_dim may not exceed head_size")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.is_neox_style = is_neox_style
        self.register_buffer("cos_sin_cache", torch.empty(max_position, rotary_dim), persistent=False)

    cos_sin_cache: torch.Tensor  # the buffer registered above (torch types a buffer as `Tensor | Module`)

    def compute_cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        return rope_cos_sin_cache(self.rotary_dim, self.max_position, self.base, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rotate = apply_rope if self.is_neox_style else apply_rope_gptj
        return rotate(x, positions, self.cos_sin_cache)


@post_load_hook(Phase.COLD_LOAD, writes=())
def init_rope_caches(backbone: nn.Module) -> None:
    """Compute every RotaryEmbedding's table once, on the device of the loaded weights. A family binds it as a
    method (`init_rope_caches = init_rope_caches` in its class body). Cold load only: replayed on reload it would
    give the table new storage under the alias (`_rope_cos_sin_cache`) that captured graphs read."""
    device = next(backbone.parameters()).device
    for module in backbone.modules():
        if isinstance(module, RotaryEmbedding):
            module.register_buffer("cos_sin_cache", module.compute_cos_sin_cache(device), persistent=False)


# ---- MLP -------------------------------------------------------------------------------------------------------


class GatedMLP(nn.Module):
    """vLLM's Qwen3 / Kimi MLP (and Gemma4's, with tanh GELU): one merged `gate_up_proj`, then `down_proj`."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)


# ---- DFlash attention ------------------------------------------------------------------------------------------


def attend_to_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """A query block attends, non-causally (DFlash drafts a block in one pass), to the context K/V plus its own.
    q [n, heads, hd]; k, v [n, kv_heads, hd]; ctx_k, ctx_v [n_ctx, kv_heads, hd] -> [n, heads, hd]."""
    k, v = torch.cat((ctx_k, k)), torch.cat((ctx_v, v))  # [n_ctx + n, kv_heads, hd]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale)
    return out.transpose(0, 1)


class DFlashAttention(nn.Module):
    """The DFlash draft attention on Qwen3's layout (vLLM's `DFlashQwen3Attention`; Laguna's adds a gate): one
    fused `qkv_proj`, per-head `q_norm` / `k_norm`, RoPE over `rotary_dim` channels (default: all of head_dim).
    `config` needs hidden_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta and
    max_position_embeddings."""

    def __init__(self, config: Any, *, rotary_dim: int | None = None) -> None:
        super().__init__()
        c = config
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
        self.rotary_emb = RotaryEmbedding(self.head_dim, rotary_dim or self.head_dim, c.max_position_embeddings,
                                          c.rope_theta)

    def context_kv(self, normed_context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference (per-layer) context K/V: [n, nkv, hd] each."""
        n = normed_context.shape[0]
        kv = self.qkv_proj(normed_context)[:, self.q_size:].view(n, 2, self.num_kv_heads, self.head_dim)
        k = self.rotary_emb(positions, self.k_norm(kv[:, 0]))
        return k, kv[:, 1]

    def attend(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
               ) -> torch.Tensor:
        """The query block's own Q/K/V, then attention to the context plus itself: [n, heads, hd]."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary_emb(positions, self.q_norm(q.view(n, self.num_heads, self.head_dim)))
        k = self.rotary_emb(positions, self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return attend_to_context(q, k, v, ctx_k, ctx_v, self.scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        return self.o_proj(self.attend(x, positions, ctx_k, ctx_v).reshape(x.shape[0], self.q_size))


# ---- decoder layer ---------------------------------------------------------------------------------------------

Attention = TypeVar("Attention", bound=nn.Module, covariant=True)
Layer = TypeVar("Layer", covariant=True)


class DecoderLayer(nn.Module, Generic[Attention]):
    """The pre-norm residual layer of Qwen3, Laguna and Kimi: `h + self_attn(input_layernorm(h), ...)`, then
    `h + mlp(post_attention_layernorm(h))`. `mlp` defaults to `GatedMLP(hidden_size, intermediate_size)` (SiLU).
    The arguments after `positions` (the layer's context K/V, or MLA latents) go to the attention as they are.
    Generic in its attention's class (`DecoderLayer[DFlashAttention]`), for the type checker."""

    def __init__(self, config: Any, self_attn: Attention, mlp: nn.Module | None = None) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn: Attention = self_attn
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = mlp if mlp is not None else GatedMLP(c.hidden_size, c.intermediate_size)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, *context: Any) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, *context)
        return h + self.mlp(self.post_attention_layernorm(h))


class Layers(nn.ModuleList, Generic[Layer]):
    """An `nn.ModuleList` of a backbone's decoder layers, typed by what they are (a layer class, or a protocol of
    what the backbone reads from them): torch types `layers[i]` as a bare `Module`, every attribute of which a
    type checker then reads as `Tensor | Module`. At run time it is the `nn.ModuleList` it subclasses: the
    declarations below are for the type checker only."""

    if TYPE_CHECKING:
        def __init__(self, modules: Iterable[Layer]) -> None: ...

        # [override]: narrower than ModuleList's `Module`, which the checker cannot see `Layer` is when `Layer` is a
        # protocol of what the backbone reads from its layers (a protocol cannot subclass `Module`)
        @overload  # type: ignore[override]  # items narrower than Module: see the comment above
        def __getitem__(self, idx: int) -> Layer: ...

        @overload
        def __getitem__(self, idx: slice) -> Layers[Layer]: ...

        def __getitem__(self, idx: int | slice) -> Layer | Layers[Layer]: ...

        def __iter__(self) -> Iterator[Layer]: ...  # type: ignore[override]  # as for __getitem__
