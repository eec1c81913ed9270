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
  _markov_confidence_logits   the DSpark confidence precompute (ours, see models/dspark_heads.py)

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

from lifecycle import Phase, alias, concat, custom, post_load_hook, stack
from lifecycle.testing import random_checkpoint

from .dspark_heads import MARKOV_CONFIDENCE, DSparkHeads, DSparkHeadsConfig
from .layers import GatedMLP, Layers, RMSNorm, RotaryEmbedding, attend_to_context, rms_norm
from .qwen3_dflash import DFlashConfig, DFlashQwen3Draft

__all__ = ["Gemma4DSparkAttention", "Gemma4DSparkDecoderLayer", "GemmaDSparkConfig", "GemmaDSparkDraft", "gelu_tanh",
           "random_weights"]


@dataclass(frozen=True)
class GemmaDSparkConfig(DSparkHeadsConfig, DFlashConfig):
    """The Gemma4 DSpark fields modelled here: DFlash's sizes (vLLM's `Gemma4DSparkModel` subclasses
    `DFlashQwen3Model`) and the DSpark heads'; `num_target_features` is `len(dspark_target_layer_ids)`."""


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Gemma4's `gelu_pytorch_tanh`."""
    return F.gelu(x, approximate="tanh")


class Gemma4DSparkAttention(nn.Module):
    """vLLM's `Gemma4DSparkAttention` (a `Gemma4MTPAttention` with `attention_k_eq_v`): it owns its K/V, with
    K = V, so there is a `k_proj` and no `v_proj`; scaling 1.0 (q_norm does the scaling)."""

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
        self.v_norm = RMSNorm(self.head_dim, c.rms_norm_eps, has_weight=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, self.head_dim, c.max_position_embeddings, c.rope_theta)

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
        out = attend_to_context(q, self.rotary_emb(positions, k), v, ctx_k, ctx_v, self.scaling)
        return self.o_proj(out.reshape(n, self.q_size))


class Gemma4DSparkDecoderLayer(nn.Module):
    """Gemma4 MTP layer: sandwich norms around attention and MLP, then the per-layer `layer_scalar`."""

    def __init__(self, c: GemmaDSparkConfig) -> None:
        super().__init__()
        self.self_attn = Gemma4DSparkAttention(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, activation=gelu_tanh)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # persistent: in the checkpoint

    layer_scalar: torch.Tensor  # the buffer registered above

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


def _v_norm_weights(m: GemmaDSparkDraft) -> torch.Tensor:
    k_norm = m.layers[0].self_attn.k_norm.weight
    assert k_norm is not None  # k_norm has its weight (v_norm is the weightless one)
    return torch.ones(len(m.layers), m.layers[0].self_attn.head_dim, dtype=k_norm.dtype, device=k_norm.device)


class GemmaDSparkDraft(DSparkHeads, DFlashQwen3Draft):
    """The draft backbone (vLLM's `Gemma4DSparkModel`, a `DFlashQwen3Model` with its own modules): Gemma4 layers,
    its own `embed_tokens`, the DSpark heads; lm_head stays on the causal-LM wrapper. Inherited from DFlash: the
    per-layer reference path, the block pass, `combine_hidden_states` and the RoPE hook."""

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
    layers: Layers[Gemma4DSparkDecoderLayer]
    normalizer: torch.Tensor  # a buffer (registered in __init__, computed by init_normalizer)
    # the derived buffers of its own, registered by the lifecycle
    _fused_k_weight: torch.Tensor
    _v_norm_weights: torch.Tensor

    def __init__(self, config: GemmaDSparkConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "gemma-dspark", rank: int = 0) -> None:
        nn.Module.__init__(self)  # as vLLM's Gemma4DSparkModel: DFlash's methods, its own modules
        c = self.config = config or GemmaDSparkConfig()
        with torch.device(device):
            embed = torch.empty(c.vocab_size, c.hidden_size)  # given as _weight: no random init, the load writes it
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=embed)
            self.register_buffer("normalizer", torch.empty((), dtype=c.dtype), persistent=False)
            self.fc = nn.Linear(c.hidden_size * c.num_target_features, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.layers = Layers(Gemma4DSparkDecoderLayer(c) for _ in range(c.num_hidden_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.to(c.dtype)
            self.build_dspark_heads(c)
        self.init_lifecycle(name, rank=rank)

    # One-time cold-start work besides the inherited RoPE tables (`init_rope_caches`): computed, not loaded.
    # Replayed on reload it would give the buffer new storage under captured graphs, so it opts into cold_load only.
    @post_load_hook(Phase.COLD_LOAD, writes=())
    def init_normalizer(self) -> None:
        c = self.config
        self.register_buffer("normalizer", torch.tensor(c.hidden_size**0.5, dtype=c.dtype,
                                                        device=self.fc.weight.device), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    # ---- context K/V: the inherited fused path over one K projection --------------------------------------
    def _project_context_kv(self, context_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw K of every layer from one GEMM over `_fused_k_weight`; V = v_norm(K) through the grouped constant
        `_v_norm_weights` (K = V). The inherited `precompute_context_kv` then k-norms and rotates K."""
        attn0 = self.layers[0].self_attn
        L, n, nkv, hd = len(self.layers), context_states.shape[0], attn0.num_kv_heads, attn0.head_dim
        x = rms_norm(context_states, self._hidden_norm_weight, self.hidden_norm.variance_epsilon)
        k = F.linear(x, self._fused_k_weight).view(n, L, nkv, hd).permute(1, 0, 2, 3)  # [L, n, nkv, hd]
        return k, rms_norm(k, self._v_norm_weights.view(L, 1, 1, hd), attn0.v_norm.variance_epsilon)

    # ---- the draft step: the query block comes as token ids, embedded by the draft itself ---------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context_states: torch.Tensor,
                context_positions: torch.Tensor) -> torch.Tensor:
        return super().forward(self.embed_input_ids(input_ids), positions, context_states, context_positions)


def random_weights(config: GemmaDSparkConfig, seed: int) -> dict[str, torch.Tensor]:
    return random_checkpoint(GemmaDSparkDraft(config, device="meta"), seed)
