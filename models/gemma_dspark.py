"""A Gemma4-DSpark draft backbone in plain PyTorch, with vLLM's parameter names.

    model = GemmaDSparkDraft(GemmaDSparkConfig())               # parameters on META until loaded
    load_safetensors(model, "a.safetensors"); model.finalize_loading(); model.refresh_derived_buffers()
    k, v = model.precompute_context_kv(context, positions)      # one K GEMM for every layer; V = v_norm(K)
    h = model(input_ids, positions, context_states, context_positions)

Gemma4 DSpark (vLLM's `Gemma4DSparkModel`) is a self-contained draft: its own `embed_tokens` (scaled by the
`normalizer` buffer, sqrt(hidden)), Gemma4 MTP decoder layers whose attention owns its K/V, and the DSpark
Markov / confidence heads. Its attention has K = V ("attention_k_eq_v"): one `k_proj`, no `v_proj`; K is
k-normed and rotated, V is the same projection through a weightless `v_norm`. So the context path projects
K once for all layers and derives V from it.

Derived state, as vLLM's `Gemma4DSparkModel._build_context_kv_buffers()` builds it, declared instead of rebuilt:
  _fused_k_weight      cat over layers of self_attn.k_proj.weight    one GEMM projects context K for all layers
  _k_norm_weights      stack of self_attn.k_norm.weight              grouped K RMSNorm
  _v_norm_weights      ones [layers, head_dim], NO weight source     grouped V RMSNorm (v_norm has no scale)
  _rope_cos_sin_cache  alias of layers.0 rotary cos/sin cache
  _hidden_norm_weight  alias of hidden_norm.weight
  _markov_confidence_logits   the DSpark confidence precompute (ours, see models/qwen3_dspark.py)

`_v_norm_weights` is a constant: vLLM reallocates it with `torch.ones` at every `load_weights` call (once per
bucket during a reload), moving it under captured graphs; here it is a `custom` buffer with no dependencies,
built once and never rewritten or reallocated. `normalizer` is not derived from weights: a non-persistent
buffer computed by a cold_load hook, never replaced on reload (captured graphs read it).

Simplifications against vLLM: every layer is full attention with K = V and the same head_dim / KV heads (vLLM's
fused precompute asserts uniform K = V layers too); no attention bias (so no `_fused_k_bias`); RoPE is neox over
the whole head_dim with `rope_theta` (vLLM takes Gemma4's per-layer-type RoPE parameters from the config); no
logit soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle import DraftBackbone, Phase, alias, concat, custom, post_load_hook, stack

from .qwen3_dflash import RMSNorm, RotaryEmbedding, apply_rope, rms_norm
from .qwen3_dspark import MARKOV_CONFIDENCE, DSparkHeads


@dataclass(frozen=True)
class GemmaDSparkConfig:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 256
    num_target_features: int = 2  # len(dspark_target_layer_ids): fc input is hidden * this
    vocab_size: int = 96
    draft_vocab_size: int | None = None
    markov_rank: int = 8
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    dtype: torch.dtype = torch.float32


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype)


class UnweightedRMSNorm(nn.Module):
    """vLLM's `RMSNorm(has_weight=False)`: no parameter, nothing in the checkpoint."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_unweighted(x, self.variance_epsilon)


class Gemma4DSparkAttention(nn.Module):
    """Gemma4 attention owning its K/V, with K = V: `k_proj` only; scaling 1.0 (q_norm does the scaling)."""

    def __init__(self, c: GemmaDSparkConfig) -> None:
        super().__init__()
        self.head_dim = c.head_dim
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = 1.0
        self.q_proj = nn.Linear(c.hidden_size, self.q_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_size, bias=False)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.v_norm = UnweightedRMSNorm(c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, c.max_position_embeddings, c.rope_theta)

    def _kv_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed K (before RoPE) and V from one projection: [n, nkv, hd] each."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return self.k_norm(k), self.v_norm(k)

    def context_kv(self, normed_context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference (per-layer) context K/V: [n, nkv, hd] each."""
        k, v = self._kv_proj(normed_context)
        return self.rotary_emb(positions, k), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        n = x.shape[0]
        q = self.rotary_emb(positions, self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim)))
        k, v = self._kv_proj(x)
        k = self.rotary_emb(positions, k)
        k, v = torch.cat((ctx_k, k)), torch.cat((ctx_v, v))
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             scale=self.scaling)
        return self.o_proj(out.transpose(0, 1).reshape(n, self.q_size))


class Gemma4MLP(nn.Module):
    def __init__(self, c: GemmaDSparkConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)  # gelu_pytorch_tanh


class Gemma4DSparkDecoderLayer(nn.Module):
    """Gemma4 MTP layer: sandwich norms around attention and MLP, then the per-layer `layer_scalar`."""

    def __init__(self, c: GemmaDSparkConfig) -> None:
        super().__init__()
        self.self_attn = Gemma4DSparkAttention(c)
        self.mlp = Gemma4MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # persistent: in the checkpoint

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


def _v_norm_weights(m: nn.Module) -> torch.Tensor:
    k_norm = m.layers[0].self_attn.k_norm.weight
    return torch.ones(len(m.layers), m.layers[0].self_attn.head_dim, dtype=k_norm.dtype, device=k_norm.device)


class GemmaDSparkDraft(DSparkHeads, DraftBackbone):
    """The draft backbone (vLLM's `Gemma4DSparkModel`); lm_head stays on the causal-LM wrapper."""

    derived_buffers = (
        concat("_fused_k_weight", sources=("self_attn.k_proj.weight",),
               per_layer=lambda layer: layer.self_attn.k_proj.weight),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
        custom("_v_norm_weights", build=_v_norm_weights, depends_on=()),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
        alias("_hidden_norm_weight", source="hidden_norm.weight"),
        MARKOV_CONFIDENCE,
    )

    def __init__(self, config: GemmaDSparkConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "gemma-dspark", rank: int = 0) -> None:
        super().__init__()
        c = self.config = config or GemmaDSparkConfig()
        with torch.device(device):
            embed = torch.empty(c.vocab_size, c.hidden_size)  # given as _weight: no random init, the load writes it
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=embed)
            self.register_buffer("normalizer", torch.empty((), dtype=c.dtype), persistent=False)
            self.fc = nn.Linear(c.hidden_size * c.num_target_features, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.layers = nn.ModuleList(Gemma4DSparkDecoderLayer(c) for _ in range(c.num_hidden_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.to(c.dtype)
            dropped = self.build_dspark_heads(c)
        if dropped:
            self.derived_buffers = tuple(s for s in type(self).derived_buffers if s not in dropped)
        self.init_lifecycle(name, rank=rank)

    # One-time cold-start work: tables computed, not loaded. Replaying either on reload would give it new storage
    # under what captured graphs read, so both opt into cold_load only.
    @post_load_hook(Phase.COLD_LOAD)
    def init_rope_caches(self) -> None:
        device = self.hidden_norm.weight.device
        for layer in self.layers:
            rot = layer.self_attn.rotary_emb
            rot.register_buffer("cos_sin_cache", rot.compute_cos_sin_cache(device), persistent=False)

    @post_load_hook(Phase.COLD_LOAD)
    def init_normalizer(self) -> None:
        c = self.config
        self.register_buffer("normalizer", torch.tensor(c.hidden_size**0.5, dtype=c.dtype,
                                                        device=self.hidden_norm.weight.device), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden)

    # ---- context K/V: fused path (reads the derived buffers) -------------------------------------------------
    def precompute_context_kv(self, context_states: torch.Tensor, positions: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the context for every layer at once: [L, n, nkv, hd] each. One GEMM, grouped norms."""
        self.require_usable("precompute_context_kv")
        attn0 = self.layers[0].self_attn
        L, n, nkv, hd = len(self.layers), context_states.shape[0], attn0.num_kv_heads, attn0.head_dim
        x = rms_norm(context_states, self._hidden_norm_weight, self.hidden_norm.variance_epsilon)
        k = F.linear(x, self._fused_k_weight).view(n, L, nkv, hd).permute(1, 0, 2, 3)  # raw K, [L, n, nkv, hd]
        v = rms_norm(k, self._v_norm_weights.view(L, 1, 1, hd), attn0.v_norm.variance_epsilon)
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
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context_states: torch.Tensor,
                context_positions: torch.Tensor) -> torch.Tensor:
        ctx_k, ctx_v = self.precompute_context_kv(context_states, context_positions)
        return self.draft_block(self.embed_input_ids(input_ids), positions, ctx_k, ctx_v)

    def draft_block(self, input_embeds: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                    ctx_v: torch.Tensor) -> torch.Tensor:
        h = input_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, ctx_k[i], ctx_v[i])
        return self.norm(h)


def random_weights(config: GemmaDSparkConfig, seed: int) -> dict[str, torch.Tensor]:
    from lifecycle.testing import random_checkpoint

    return random_checkpoint(GemmaDSparkDraft(config, device="meta"), seed)
