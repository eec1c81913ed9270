"""A Kimi-K3 DSpark draft backbone with Multi-head Latent Attention (MLA), in plain PyTorch, with vLLM's parameter
names (vLLM's `K3DSparkModel`, `vllm/models/kimi_k3/nvidia/dspark_mla.py`, and its `MultiHeadLatentAttention`,
`vllm/models/kimi_k3/nvidia/mla.py`).

    model = K3DSparkDraft(K3DSparkConfig(), device="meta")      # parameters on META until loaded
    load_safetensors(model, "a.safetensors")                    # lifecycle: META -> ... -> FULLY_LOADED
    model.finalize_loading(); model.refresh_derived_buffers()   # -> DERIVED_REFRESHED
    h = model(input_embeds, positions, context, context_pos)    # absorbed attention over the latent KV cache

MLA caches one latent per token: `kv_c` (kv_lora_rank wide, normed by `kv_a_layernorm`) and a shared RoPE key
`k_pe`. The per-head keys and values are `kv_b_proj(kv_c)`; decoding never materialises them: vLLM absorbs
`kv_b_proj` into the query (`W_UK_T`) and into the output (`W_UV`) in `process_weights_after_loading`:

    W = kv_b_proj.weight.to(act_dtype).T.view(kv_lora_rank, heads, nope + v)    # split_kv_b_proj
    W_UK, W_UV = W.split([nope, v], dim=-1)
    W_UK_T = W_UK.permute(1, 2, 0)      # [heads, nope, kv_lora_rank]:  q_nope @ W_UK_T -> latent query
    W_UV   = W_UV.transpose(0, 1)       # [heads, kv_lora_rank, v]:     latent out @ W_UV -> per-head v

The derived state, declared instead of rebuilt after every load:
  _context_kv_weight         cat of fused_qkv_a_proj.weight[q_lora_rank:]   one GEMM: context latents of all layers
                             (vLLM: the `context_kv_proj` parameter, filled by duplicating every layer's
                             `kv_a_proj_with_mqa` tensor while loading)
  _context_kv_norm_weights   stack of kv_a_layernorm.weight                 one grouped RMSNorm (vLLM's name)
  _rope_cos_sin_cache        alias of layers.0 rotary cos/sin cache (fp32, GPT-J style: is_neox_style=False)
  _W_UK_T                    per-layer W_UK_T computed from kv_b_proj.weight, stacked   [L, heads, nope, kv_lora]
  _W_UV                      per-layer W_UV computed from kv_b_proj.weight, stacked     [L, heads, kv_lora, v]
The absorbed matrices are `stack(..., computed=True)`: evaluated one layer at a time and only for layers whose
`kv_b_proj` was written, each copied into its slice of the existing storage (vLLM: `replace_parameter(...,
prefer_copy=True)` per layer).

Names: vLLM's K3 DSpark layers have a q-LoRA front end, so the checkpoint's `q_a_proj` and
`kv_a_proj_with_mqa` are loaded as the two shards of `fused_qkv_a_proj` (rows [q_lora_rank | kv_lora_rank +
qk_rope_head_dim]); the module names here are vLLM's runtime names, as `qkv_proj` is for the DFlash drafts.
Left out: the optional output gate (`fused_qkv_a_g_proj`), the training-only `confidence_head`, quantized
`kv_b_proj` (vLLM dequantizes it before the split), YaRN scaling, paged caches and the fused CUDA kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle import DraftBackbone, alias, concat, stack
from lifecycle.testing import random_checkpoint

from .dspark_heads import DSparkMarkovHead
from .layers import (
    DecoderLayer,
    DraftConfig,
    Layers,
    RMSNorm,
    RotaryEmbedding,
    apply_rope_gptj,
    init_rope_caches,
    rms_norm,
)

__all__ = ["K3DSparkConfig", "K3DSparkDecoderLayer", "K3DSparkDraft", "MultiHeadLatentAttention", "random_weights",
           "split_kv_b_proj"]


@dataclass(frozen=True)
class K3DSparkConfig(DraftConfig):
    intermediate_size: int = 96
    num_attention_heads: int = 4
    rope_theta: float = 50_000.0
    # MLA: a q-LoRA front end, one kv latent per token, per-head keys split into a no-RoPE and a RoPE part
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # the target's hidden states and the DSpark Markov head
    target_hidden_size: int = 48
    num_target_layers: int = 2  # context_proj input is target_hidden_size * this
    vocab_size: int = 128
    draft_vocab_size: int = 128
    markov_rank: int = 8


def split_kv_b_proj(weight: torch.Tensor, act_dtype: torch.dtype, kv_lora_rank: int, num_heads: int,
                    qk_nope_head_dim: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `split_kv_b_proj` (unquantized): `W_UK` [L, N, P] and `W_UV` [L, N, V], views of the weight when
    it is already in `act_dtype`."""
    w = weight.to(act_dtype).T
    per_head = qk_nope_head_dim + v_head_dim
    if w.shape[1] % per_head:
        raise ValueError(f"kv_b_proj.weight has shape {tuple(weight.shape)}: expected [heads * {per_head}, rank] "
                         f"(configured: {num_heads} heads, rank {kv_lora_rank})")
    # heads and rank follow the weight, so a checkpoint of another layout yields (and is refused as) a new layout
    return w.view(w.shape[0], w.shape[1] // per_head, per_head).split([qk_nope_head_dim, v_head_dim], -1)


class MultiHeadLatentAttention(nn.Module):
    """K3 MLA with the q-LoRA front end and RoPE (as the DSpark draft builds it: `use_rope=True`)."""

    def __init__(self, c: K3DSparkConfig) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.act_dtype = c.dtype
        self.scale = self.qk_head_dim**-0.5
        self.fused_qkv_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim,
                                          bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.qk_rope_head_dim, c.max_position_embeddings,
                                          c.rope_theta, is_neox_style=False)  # GPT-J style, fp32

    # ---- what the derived buffers read -------------------------------------------------------------------
    def kv_a_proj_with_mqa_weight(self) -> torch.Tensor:
        """The checkpoint's `kv_a_proj_with_mqa` rows of `fused_qkv_a_proj` (a view): vLLM's `context_kv_proj`
        duplicates them for the context path."""
        return self.fused_qkv_a_proj.weight[self.q_lora_rank:]

    # vLLM's process_weights_after_loading: absorb kv_b_proj
    def absorbed_W_UK_T(self) -> torch.Tensor:
        """(L, N, P) -> (N, P, L): queries are projected into latent space by this."""
        W_UK, _ = split_kv_b_proj(self.kv_b_proj.weight, self.act_dtype, self.kv_lora_rank, self.num_heads,
                                  self.qk_nope_head_dim, self.v_head_dim)
        return W_UK.permute(1, 2, 0)

    def absorbed_W_UV(self) -> torch.Tensor:
        """(L, N, V) -> (N, L, V): the latent attention output is projected back to per-head v by this."""
        _, W_UV = split_kv_b_proj(self.kv_b_proj.weight, self.act_dtype, self.kv_lora_rank, self.num_heads,
                                  self.qk_nope_head_dim, self.v_head_dim)
        return W_UV.transpose(0, 1)

    # ---- projections ---------------------------------------------------------------------------------------
    def latent_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference (per-layer) latent cache entries: kv_c normed [n, kv_lora_rank], k_pe roped [n, rope]."""
        kv_c, k_pe = self.fused_qkv_a_proj(x)[:, self.q_lora_rank:].split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(kv_c), self.rotary_emb(positions, k_pe.unsqueeze(1)).squeeze(1)

    def _project(self, x: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q_c, kv_c, k_pe = self.fused_qkv_a_proj(x).split(
            [self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q = self.q_b_proj(self.q_a_layernorm(q_c)).view(n, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = self.rotary_emb(positions, q_pe)
        k_pe = self.rotary_emb(positions, k_pe.unsqueeze(1)).squeeze(1)
        return q_nope, q_pe, self.kv_a_layernorm(kv_c), k_pe

    # ---- attention -----------------------------------------------------------------------------------------
    def _absorbed_mqa(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                      W_UK_T: torch.Tensor, W_UV: torch.Tensor) -> torch.Tensor:
        """vLLM's decode path (forward_mqa): one latent head shared by every query head. -> [n, N, V]"""
        N = self.num_heads
        ql_nope = torch.bmm(q_nope.transpose(0, 1), W_UK_T)  # (N, n, P) x (N, P, Lkv) -> (N, n, Lkv)
        q = torch.cat((ql_nope, q_pe.transpose(0, 1)), dim=-1)  # (N, n, Lkv + R)
        k = torch.cat((kv_c, k_pe), dim=-1).unsqueeze(0).expand(N, -1, -1)  # (N, S, Lkv + R)
        latent = F.scaled_dot_product_attention(q, k, kv_c.unsqueeze(0).expand(N, -1, -1), scale=self.scale)
        return torch.bmm(latent, W_UV).transpose(0, 1)  # (N, n, Lkv) x (N, Lkv, V) -> (n, N, V)

    def _mha(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
             ) -> torch.Tensor:
        """The compute-friendly path (forward_mha): per-head K/V from kv_b_proj directly. -> [n, N, V]"""
        S, N = kv_c.shape[0], self.num_heads
        k_nope, v = self.kv_b_proj(kv_c).view(S, N, -1).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(S, N, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             scale=self.scale)
        return out.transpose(0, 1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv_c: torch.Tensor, ctx_k_pe: torch.Tensor,
                absorbed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The query block attends (non-causally, `non_causal_multi_token_decode`) to the context latents plus
        its own. `absorbed` = (W_UK_T, W_UV) of this layer: the absorbed path; None: kv_b_proj directly."""
        n = x.shape[0]
        q_nope, q_pe, kv_c, k_pe = self._project(x, positions)
        kv_c, k_pe = torch.cat((ctx_kv_c, kv_c)), torch.cat((ctx_k_pe, k_pe))  # [ctx + n, ...]
        out = (self._mha(q_nope, q_pe, kv_c, k_pe) if absorbed is None
               else self._absorbed_mqa(q_nope, q_pe, kv_c, k_pe, *absorbed))
        return self.o_proj(out.reshape(n, self.num_heads * self.v_head_dim))


class K3DSparkDecoderLayer(DecoderLayer[MultiHeadLatentAttention]):
    """Forward: `layer(h, positions, ctx_kv_c, ctx_k_pe, absorbed)`, `absorbed` = (W_UK_T, W_UV) or None."""

    def __init__(self, c: K3DSparkConfig) -> None:
        super().__init__(c, MultiHeadLatentAttention(c))


class K3DSparkDraft(DraftBackbone):
    """The draft backbone (vLLM's `K3DSparkModel`): `context_proj` + `context_norm` for the target's hidden
    states, MLA decoder layers, `final_norm`, the DSpark Markov head. Embeddings and lm_head are the target's."""

    derived_buffers = (
        concat("_context_kv_weight", sources=("self_attn.fused_qkv_a_proj.weight",),
               per_layer=lambda layer: layer.self_attn.kv_a_proj_with_mqa_weight()),
        stack("_context_kv_norm_weights", sources=("self_attn.kv_a_layernorm.weight",),
              per_layer=lambda layer: layer.self_attn.kv_a_layernorm.weight),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
        stack("_W_UK_T", sources=("self_attn.kv_b_proj.weight",),
              per_layer=lambda layer: layer.self_attn.absorbed_W_UK_T(), computed=True),
        stack("_W_UV", sources=("self_attn.kv_b_proj.weight",),
              per_layer=lambda layer: layer.self_attn.absorbed_W_UV(), computed=True),
    )
    layers: Layers[K3DSparkDecoderLayer]
    # the derived buffers, registered by the lifecycle
    _context_kv_weight: torch.Tensor
    _context_kv_norm_weights: torch.Tensor
    _rope_cos_sin_cache: torch.Tensor
    _W_UK_T: torch.Tensor
    _W_UV: torch.Tensor

    def __init__(self, config: K3DSparkConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "k3-mla-dspark", rank: int = 0) -> None:
        super().__init__()
        c = self.config = config or K3DSparkConfig()
        with torch.device(device):
            self.context_proj = nn.Linear(c.target_hidden_size * c.num_target_layers, c.hidden_size, bias=False)
            self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.layers = Layers(K3DSparkDecoderLayer(c) for _ in range(c.num_hidden_layers))
            self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.markov_head = DSparkMarkovHead(c.vocab_size, c.draft_vocab_size, c.markov_rank)
        self.to(c.dtype)
        self.init_lifecycle(name, rank=rank)

    init_rope_caches = init_rope_caches  # cold_load hook: the RoPE tables, computed once (models/layers.py)

    # ---- target hidden states -> draft context --------------------------------------------------------------
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.context_norm(self.context_proj(hidden_states))

    # ---- context latents: fused path (reads the derived buffers) --------------------------------------------
    def precompute_context_kv(self, context_states: torch.Tensor, positions: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent cache entries of the context for every layer at once: kv_c [L, n, kv_lora_rank] (normed),
        k_pe [L, n, rope] (roped). One KV-only GEMM, one grouped RMSNorm, one RoPE."""
        self.require_usable("precompute_context_kv")
        attn0 = self.layers[0].self_attn
        L, n, lkv = len(self.layers), context_states.shape[0], attn0.kv_lora_rank
        all_kv = F.linear(context_states, self._context_kv_weight).view(n, L, -1).transpose(0, 1)  # [L, n, w]
        kv_c = rms_norm(all_kv[..., :lkv], self._context_kv_norm_weights.unsqueeze(1),
                        attn0.kv_a_layernorm.variance_epsilon)
        k_pe = apply_rope_gptj(all_kv[..., lkv:].unsqueeze(-2), positions, self._rope_cos_sin_cache)
        return kv_c.contiguous(), k_pe.squeeze(-2).contiguous()

    # ---- context latents: reference path (per layer, no derived buffers) ------------------------------------
    def precompute_context_kv_reference(self, context_states: torch.Tensor, positions: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
        kv_c, k_pe = zip(*(layer.self_attn.latent_kv(context_states, positions) for layer in self.layers),
                         strict=True)
        return torch.stack(kv_c), torch.stack(k_pe)

    # ---- the draft step -----------------------------------------------------------------------------------
    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor, context_states: torch.Tensor,
                context_positions: torch.Tensor) -> torch.Tensor:
        """Absorbed attention (W_UK_T, W_UV) over the latent cache built by the fused context path."""
        kv_c, k_pe = self.precompute_context_kv(context_states, context_positions)
        return self._decode(input_embeds, positions, kv_c, k_pe, absorbed=True)

    def forward_reference(self, input_embeds: torch.Tensor, positions: torch.Tensor, context_states: torch.Tensor,
                          context_positions: torch.Tensor) -> torch.Tensor:
        """Per layer, no derived buffers: each layer's own latent projection, and K/V from kv_b_proj directly."""
        kv_c, k_pe = self.precompute_context_kv_reference(context_states, context_positions)
        return self._decode(input_embeds, positions, kv_c, k_pe, absorbed=False)

    def _decode(self, h: torch.Tensor, positions: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, *,
                absorbed: bool) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, kv_c[i], k_pe[i], (self._W_UK_T[i], self._W_UV[i]) if absorbed else None)
        return self.final_norm(h)


def random_weights(config: K3DSparkConfig, seed: int) -> dict[str, torch.Tensor]:
    """A full checkpoint of random weights (norm weights near 1), in vLLM's parameter names."""
    return random_checkpoint(K3DSparkDraft(config, device="meta"), seed)
