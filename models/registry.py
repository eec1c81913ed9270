"""The draft families, each with what the generic tools (demo, tests, benchmarks) need to drive it:
a tiny config, a builder, example inputs, and its fused path next to its per-layer reference path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lifecycle import DraftBackbone
from lifecycle.testing import random_checkpoint

Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DraftFamily:
    name: str
    summary: str
    derives: str
    config: Callable[..., Any]  # tiny config; keyword overrides (num_hidden_layers=...)
    build: Callable[..., DraftBackbone]  # (config, *, device="meta", name=..., rank=0) -> backbone
    example_inputs: Callable[[Any, int, str], Inputs]  # (config, seed, device)
    fused: Callable[[DraftBackbone, Inputs], tuple[torch.Tensor, ...]]  # reads the derived buffers
    reference: Callable[[DraftBackbone, Inputs], tuple[torch.Tensor, ...]]  # per layer, no derived buffers

    def random_weights(self, config: Any, seed: int) -> dict[str, torch.Tensor]:
        return random_checkpoint(self.build(config, device="meta"), seed)


def _dflash() -> DraftFamily:
    from .qwen3_dflash import DFlashConfig, DFlashQwen3Draft

    def inputs(cfg: DFlashConfig, seed: int, device: str) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return {"context_states": torch.randn(6, cfg.hidden_size, generator=g).to(device),
                "positions": (torch.arange(6) * 3).to(device)}

    return DraftFamily(
        name="dflash",
        summary="Qwen3 DFlash draft (vLLM DFlashQwen3Model)",
        derives="`_fused_kv_weight` (cat of qkv_proj K/V rows), `_k_norm_weights` (stack), "
                "`_rope_cos_sin_cache` (alias), `_hidden_norm_weight` (alias)",
        config=DFlashConfig,
        build=DFlashQwen3Draft,
        example_inputs=inputs,
        fused=lambda m, x: m.precompute_context_kv(x["context_states"], x["positions"]),
        reference=lambda m, x: m.precompute_context_kv_reference(x["context_states"], x["positions"]),
    )


def _draft_step_inputs(hidden_size: int, seed: int, device: str) -> Inputs:
    """Context states and positions for the context K/V, plus a query block for the draft step."""
    g = torch.Generator().manual_seed(seed)
    return {"context_states": torch.randn(6, hidden_size, generator=g).to(device),
            "context_positions": (torch.arange(6) * 3).to(device),
            "input_embeds": torch.randn(4, hidden_size, generator=g).to(device),
            "positions": torch.arange(18, 22).to(device)}


def _context_then_step(m: Any, x: Inputs, reference: bool) -> tuple[torch.Tensor, ...]:
    """The context projection (K/V, or MLA latents) and the full draft step, by the fused or the reference path."""
    args = (x["input_embeds"], x["positions"], x["context_states"], x["context_positions"])
    if reference:
        a, b = m.precompute_context_kv_reference(x["context_states"], x["context_positions"])
        return a, b, m.forward_reference(*args)
    a, b = m.precompute_context_kv(x["context_states"], x["context_positions"])
    return a, b, m(*args)


def _laguna_dflash() -> DraftFamily:
    from .laguna_dflash import DFlashLagunaDraft, LagunaDFlashConfig

    return DraftFamily(
        name="laguna-dflash",
        summary="Laguna DFlash draft (vLLM DFlashLagunaModel)",
        derives="`_kv_weights` (stack of qkv_proj K/V rows, one bmm), `_input_layernorm_weights` (stack), "
                "`_k_norm_weights` (stack), `_rope_cos_sin_cache` (alias); `mask_embedding` is a non-persistent "
                "buffer made once at cold load",
        config=LagunaDFlashConfig,
        build=DFlashLagunaDraft,
        example_inputs=lambda cfg, seed, device: _draft_step_inputs(cfg.hidden_size, seed, device),
        fused=lambda m, x: _context_then_step(m, x, reference=False),
        reference=lambda m, x: _context_then_step(m, x, reference=True),
    )


def _kimi_k3_mla() -> DraftFamily:
    from .kimi_k3_mla_dspark import K3DSparkConfig, K3DSparkDraft

    return DraftFamily(
        name="kimi-k3-mla",
        summary="Kimi-K3 MLA DSpark draft (vLLM K3DSparkModel)",
        derives="`_context_kv_weight` (cat of the kv_a_proj_with_mqa rows of fused_qkv_a_proj), "
                "`_context_kv_norm_weights` (stack of kv_a_layernorm), `_rope_cos_sin_cache` (alias), "
                "`_W_UK_T` / `_W_UV` (MLA-absorbed matrices computed per layer from kv_b_proj.weight, stacked)",
        config=K3DSparkConfig,
        build=K3DSparkDraft,
        example_inputs=lambda cfg, seed, device: _draft_step_inputs(cfg.hidden_size, seed, device),
        fused=lambda m, x: _context_then_step(m, x, reference=False),
        reference=lambda m, x: _context_then_step(m, x, reference=True),
    )


def _query_inputs(cfg: Any, seed: int, device: str, n_q: int = 4) -> Inputs:
    """Context states and positions, then a query block after them (its embeddings, or token ids when the draft
    embeds its own, and the previously sampled token of every position)."""
    g = torch.Generator().manual_seed(seed)
    n_ctx = 6
    x = {"context_states": torch.randn(n_ctx, cfg.hidden_size, generator=g),
         "context_positions": torch.arange(n_ctx) * 3,
         "input_embeds": torch.randn(n_q, cfg.hidden_size, generator=g),
         "input_ids": torch.randint(cfg.vocab_size, (n_q,), generator=g),
         "positions": torch.arange(n_q) + 3 * n_ctx,
         "prev_token_ids": torch.randint(cfg.vocab_size, (n_q,), generator=g)}
    return {k: v.to(device) for k, v in x.items()}


def _dspark_step(m: Any, x: Inputs, reference: bool, own_embeddings: bool = False) -> tuple[torch.Tensor, ...]:
    """Context K/V, the parallel block pass, then the sequential stage's Markov bias and confidence.
    `own_embeddings`: the draft embeds the query tokens itself (Gemma); otherwise they come embedded."""
    if reference:
        k, v = m.precompute_context_kv_reference(x["context_states"], x["context_positions"])
    else:
        k, v = m.precompute_context_kv(x["context_states"], x["context_positions"])
    embeds = m.embed_input_ids(x["input_ids"]) if own_embeddings else x["input_embeds"]
    h = m.draft_block(embeds, x["positions"], k, v)
    prev = x["prev_token_ids"]
    conf = m.compute_confidence_reference(h, prev) if reference else m.compute_confidence(h, prev)
    return k, v, h, conf, m.markov_bias(m.markov_embed(prev))


def _dspark() -> DraftFamily:
    from .qwen3_dspark import DSparkConfig, Qwen3DSparkDraft

    return DraftFamily(
        name="dspark",
        summary="Qwen3 DSpark draft (vLLM Qwen3DSparkModel): DFlash backbone + Markov / confidence heads",
        derives="DFlash's four (inherited) + `_markov_confidence_logits` (custom, in place via `into=`: "
                "markov_w1 @ confidence weights + bias; ours, not vLLM's)",
        config=DSparkConfig,
        build=Qwen3DSparkDraft,
        example_inputs=_query_inputs,
        fused=lambda m, x: _dspark_step(m, x, reference=False),
        reference=lambda m, x: _dspark_step(m, x, reference=True),
    )


def _dflash2_step(m: Any, x: Inputs, reference: bool) -> tuple[torch.Tensor, ...]:
    """Context K/V, the block pass through the grouped convolutions, then the candidate selector's scores."""
    if reference:
        k, v = m.precompute_context_kv_reference(x["context_states"], x["context_positions"])
    else:
        k, v = m.precompute_context_kv(x["context_states"], x["context_positions"])
    h = m.draft_block(x["input_embeds"], x["positions"], k, v)
    scores = m.score_candidates(x["candidate_ids"], x["unary_logits"], h.unsqueeze(0), x["anchor_token_ids"])
    return k, v, h, scores


def _dflash2() -> DraftFamily:
    from .qwen3_dflash2 import DFlash2Config, DFlash2Qwen3Draft

    def inputs(cfg: DFlash2Config, seed: int, device: str) -> Inputs:
        x = _query_inputs(cfg, seed, device, n_q=cfg.block_size)
        g = torch.Generator().manual_seed(seed + 1)
        shape = (1, cfg.block_size, cfg.selector_top_k)
        extra = {"candidate_ids": torch.randint(cfg.vocab_size, shape, generator=g),
                 "unary_logits": torch.randn(shape, generator=g),
                 "anchor_token_ids": torch.randint(cfg.vocab_size, (1,), generator=g)}
        return x | {k: v.to(device) for k, v in extra.items()}

    return DraftFamily(
        name="dflash2",
        summary="Qwen3 DFlash2 draft (vLLM DFlash2Qwen3Model): grouped local convolutions + candidate selector",
        derives="DFlash's four, inherited (`_fused_kv_weight`, `_k_norm_weights`, `_rope_cos_sin_cache`, "
                "`_hidden_norm_weight`); the convolution and selector weights derive nothing",
        config=DFlash2Config,
        build=DFlash2Qwen3Draft,
        example_inputs=inputs,
        fused=lambda m, x: _dflash2_step(m, x, reference=False),
        reference=lambda m, x: _dflash2_step(m, x, reference=True),
    )


def _gemma_dspark() -> DraftFamily:
    from .gemma_dspark import GemmaDSparkConfig, GemmaDSparkDraft

    return DraftFamily(
        name="gemma-dspark",
        summary="Gemma4 DSpark draft (vLLM Gemma4DSparkModel): K=V attention, own embeddings, DSpark heads",
        derives="`_fused_k_weight` (cat of k_proj), `_k_norm_weights` (stack), `_v_norm_weights` (constant ones, "
                "no sources: built once), `_rope_cos_sin_cache` / `_hidden_norm_weight` (aliases), "
                "`_markov_confidence_logits` (custom, ours); `normalizer` buffer from a cold_load hook",
        config=GemmaDSparkConfig,
        build=GemmaDSparkDraft,
        example_inputs=_query_inputs,
        fused=lambda m, x: _dspark_step(m, x, reference=False, own_embeddings=True),
        reference=lambda m, x: _dspark_step(m, x, reference=True, own_embeddings=True),
    )


FAMILIES: dict[str, DraftFamily] = {f.name: f for f in (
    _dflash(),
    _dspark(),
    _dflash2(),
    _gemma_dspark(),
    _laguna_dflash(),
    _kimi_k3_mla(),
)}


def get_family(name: str) -> DraftFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown draft family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None
