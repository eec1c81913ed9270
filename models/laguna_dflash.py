"""A Laguna-DFlash draft backbone in plain PyTorch, with vLLM's parameter names (vLLM's `DFlashLagunaModel`).

    model = DFlashLagunaDraft(LagunaDFlashConfig(), device="meta")   # parameters on META until loaded
    load_safetensors(model, "a.safetensors")                         # lifecycle: META -> ... -> FULLY_LOADED
    model.finalize_loading(); model.refresh_derived_buffers()        # -> DERIVED_REFRESHED
    k, v = model.precompute_context_kv(context, positions)           # the fused path reads the derived buffers

Laguna differs from the Qwen3 DFlash draft where the context K/V are made: every layer normalises the context
with its OWN `input_layernorm` (not one shared `hidden_norm`) and projects it with its own K/V rows, so vLLM
stacks per-layer tensors and runs one batched GEMM (`torch.bmm`) instead of concatenating into one wide GEMM.
The derived state is what vLLM's `DFlashLagunaModel._build_context_kv_buffers()` (plus the RoPE part of
`_build_fused_kv_buffers()`) builds, declared instead of rebuilt with `torch.stack` after every `load_weights`:
  _kv_weights               stack of qkv_proj.weight[q_size:]   [L, 2*kv_size, hidden]   one bmm for all layers
  _input_layernorm_weights  stack of input_layernorm.weight      [L, hidden]              one grouped RMSNorm
  _k_norm_weights           stack of k_norm.weight               [L, head_dim]            one grouped RMSNorm
  _rope_cos_sin_cache       alias of layers.0 rotary cos/sin cache (partial rotary: [max_pos, rotary_dim])

`mask_embedding` is, as in vLLM, a NON-persistent zero buffer: not in the checkpoint (so the loader never
writes it and readiness does not track it), materialised once by a cold_load hook, and read by
`apply_mask_embedding` only when a separate mask embedding is in use, which vLLM's Laguna loader never turns on
(it does not read `mask_embedding.pt`; the Qwen3 DFlash loader does). Captured graphs still pin it, so a hook
that re-created it on reload would be caught as storage drift: it opts into cold_load only.

Left out (vLLM has them, the lifecycle does not depend on them): MoE layers (the drafter's MLP is dense), the
optional `attention_bias` (`_kv_biases`), sliding-window attention and attention sinks, YaRN RoPE scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle import Phase, alias, post_load_hook, stack
from lifecycle.testing import random_checkpoint

from .layers import DecoderLayer, DFlashAttention, Layers, RMSNorm, rms_norm
from .qwen3_dflash import DFlashConfig, DFlashQwen3Draft

__all__ = ["DFlashLagunaDraft", "LagunaAttention", "LagunaDFlashConfig", "LagunaDecoderLayer", "LagunaMLP",
           "random_weights"]


@dataclass(frozen=True)
class LagunaDFlashConfig(DFlashConfig):
    """DFlash's fields with Laguna's sizes, plus Laguna's own. Inherited `num_target_features`
    (len(dflash_config.target_layer_ids)): one `aux_hidden_norm` per target feature."""

    intermediate_size: int = 96
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 500_000.0
    partial_rotary_factor: float = 0.5  # RoPE on the first head_dim * factor channels of each head
    gating: bool | str = True  # True / "per-head": one softplus gate per head; "per-element": per channel
    target_hidden_size: int = 48  # the verifier's hidden size (vllm_config.model_config.get_hidden_size())
    mask_token_id: int | None = None  # dflash_config.mask_token_id


class LagunaAttention(DFlashAttention):
    """DFlash attention with partial rotary and Laguna's softplus output gate (`g_proj`: per head or per channel)."""

    def __init__(self, c: LagunaDFlashConfig) -> None:
        super().__init__(c, rotary_dim=int(c.head_dim * c.partial_rotary_factor))
        self.gate_per_head = c.gating is True or c.gating == "per-head"
        self.g_proj = (nn.Linear(c.hidden_size, self.num_heads if self.gate_per_head else self.q_size, bias=False)
                       if c.gating else None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        n = x.shape[0]
        out = self.attend(x, positions, ctx_k, ctx_v)  # [n, heads, hd]
        if self.g_proj is not None:
            gate = F.softplus(self.g_proj(x).float()).type_as(out)
            out = out * (gate.unsqueeze(-1) if self.gate_per_head else gate.view(n, self.num_heads, self.head_dim))
        return self.o_proj(out.reshape(n, self.q_size))


class LagunaMLP(nn.Module):
    """Dense MLP; vLLM keeps gate_proj and up_proj separate for Laguna (NVFP4 global scales)."""

    def __init__(self, c: LagunaDFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LagunaDecoderLayer(DecoderLayer[LagunaAttention]):
    def __init__(self, c: LagunaDFlashConfig) -> None:
        super().__init__(c, LagunaAttention(c), LagunaMLP(c))


class DFlashLagunaDraft(DFlashQwen3Draft):
    """The draft backbone (vLLM's `DFlashLagunaModel`, a `DFlashQwen3Model` with its own modules): Laguna
    decoder layers, per-feature `aux_hidden_norms` + `fc` + `hidden_norm` for the verifier's hidden states, final
    `norm`. Embeddings and lm_head are the target's. Inherited from DFlash: the fused path's k-norm and RoPE, the
    draft step and the RoPE hook."""

    derived_buffers = (
        stack("_kv_weights", sources=("self_attn.qkv_proj.weight",),
              per_layer=lambda layer: layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:]),
        stack("_input_layernorm_weights", sources=("input_layernorm.weight",),
              per_layer=lambda layer: layer.input_layernorm.weight),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
        alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache"),
    )
    layers: Layers[LagunaDecoderLayer]
    mask_embedding: torch.Tensor  # a buffer (registered in __init__, computed by init_mask_embedding)
    # the derived buffers of its own, registered by the lifecycle
    _kv_weights: torch.Tensor
    _input_layernorm_weights: torch.Tensor

    def __init__(self, config: LagunaDFlashConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "laguna-dflash", rank: int = 0) -> None:
        nn.Module.__init__(self)  # as vLLM's DFlashLagunaModel: DFlash's methods, its own modules
        c = self.config = config or LagunaDFlashConfig()
        self.mask_token_id = c.mask_token_id
        self.has_separate_mask_embedding = False  # vLLM's Laguna loader never sets it
        with torch.device(device):
            self.register_buffer("mask_embedding", torch.zeros(c.hidden_size), persistent=False)
            self.layers = Layers(LagunaDecoderLayer(c) for _ in range(c.num_hidden_layers))
            self.aux_hidden_norms = nn.ModuleList(
                RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.num_target_features))
            self.fc = nn.Linear(c.target_hidden_size * c.num_target_features, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.to(c.dtype)
        self.init_lifecycle(name, rank=rank)

    # A one-time cold-start buffer besides the inherited RoPE tables (`init_rope_caches`), not in the checkpoint.
    # Replayed on reload it would give the buffer new storage under captured graphs: cold_load only.
    @post_load_hook(Phase.COLD_LOAD, writes=())
    def init_mask_embedding(self) -> None:
        if self.mask_embedding.is_meta:
            self.register_buffer("mask_embedding", torch.zeros(self.config.hidden_size, dtype=self.config.dtype,
                                                               device=self.fc.weight.device), persistent=False)

    # ---- verifier hidden states -> draft context (vLLM: DFlashLagunaForCausalLM.combine_hidden_states) ---------
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        n = hidden_states.shape[0]
        slices = hidden_states.view(n, len(self.aux_hidden_norms), -1)
        normed = torch.stack([norm(slices[:, i]) for i, norm in enumerate(self.aux_hidden_norms)], dim=1)
        return self.hidden_norm(self.fc(normed.reshape(n, -1)))

    def apply_mask_embedding(self, input_embeds: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's `embed_input_ids` after the (shared) embedding lookup: masked slots take `mask_embedding` only
        when a separate one is in use."""
        if self.has_separate_mask_embedding and self.mask_token_id is not None:
            is_mask = (input_ids == self.mask_token_id).unsqueeze(-1)
            return torch.where(is_mask, self.mask_embedding.to(input_embeds.dtype), input_embeds)
        return input_embeds

    # ---- context K/V: the inherited fused path over per-layer norms and one bmm ------------------------------
    def _project_context_kv(self, context_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before its norm and RoPE) and V of every layer, [L, n, nkv, hd] each: one grouped per-layer norm of
        the context, one bmm. The inherited `precompute_context_kv` then k-norms K and rotates it (partially)."""
        attn0 = self.layers[0].self_attn
        L, (n, hidden), nkv, hd = len(self.layers), context_states.shape, attn0.num_kv_heads, attn0.head_dim
        eps = self.layers[0].input_layernorm.variance_epsilon
        x = rms_norm(context_states.unsqueeze(0).expand(L, n, hidden), self._input_layernorm_weights.unsqueeze(1),
                     eps)
        kv = torch.bmm(x, self._kv_weights.transpose(1, 2)).view(L, n, 2, nkv, hd).permute(2, 0, 1, 3, 4)
        return kv[0], kv[1]

    # ---- context K/V: reference path (per layer, no derived buffers) ----------------------------------------
    def precompute_context_kv_reference(self, context_states: torch.Tensor, positions: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = zip(*(layer.self_attn.context_kv(layer.input_layernorm(context_states), positions)
                       for layer in self.layers), strict=True)
        return torch.stack(ks), torch.stack(vs)

    # ---- the draft step (`forward` and `draft_block` inherited) ------------------------------------------------
    def forward_reference(self, input_embeds: torch.Tensor, positions: torch.Tensor, context_states: torch.Tensor,
                          context_positions: torch.Tensor) -> torch.Tensor:
        ctx_k, ctx_v = self.precompute_context_kv_reference(context_states, context_positions)
        return self.draft_block(input_embeds, positions, ctx_k, ctx_v)


def random_weights(config: LagunaDFlashConfig, seed: int) -> dict[str, torch.Tensor]:
    """A full checkpoint of random weights (norm weights near 1), in vLLM's parameter names."""
    return random_checkpoint(DFlashLagunaDraft(config, device="meta"), seed)
