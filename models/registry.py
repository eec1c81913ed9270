"""The draft families, each with what the generic tools (demo, tests, benchmarks) need to drive it:
a tiny config, a builder, example inputs, and its fused path next to its per-layer reference path.

A family's two paths are one step function `step(model, inputs, reference)`: `reference=False` reads the derived
buffers (the fused path), `reference=True` computes the same outputs layer by layer without them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from lifecycle import DraftBackbone
from lifecycle.testing import random_checkpoint

from .gemma_dspark import GemmaDSparkConfig, GemmaDSparkDraft
from .kimi_k3_mla_dspark import K3DSparkConfig, K3DSparkDraft
from .laguna_dflash import DFlashLagunaDraft, LagunaDFlashConfig
from .qwen3_dflash import DFlashConfig, DFlashQwen3Draft
from .qwen3_dflash2 import DFlash2Config, DFlash2Qwen3Draft
from .qwen3_dspark import DSparkConfig, Qwen3DSparkDraft

__all__ = ["FAMILIES", "DraftFamily", "get_family"]

Inputs = dict[str, torch.Tensor]
Outputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class DraftFamily:
    name: str
    summary: str
    derives: str
    config: Callable[..., Any]  # tiny config; keyword overrides (num_hidden_layers=...)
    build: Callable[..., DraftBackbone]  # (config, *, device="meta", name=..., rank=0) -> backbone
    example_inputs: Callable[[Any, int, str], Inputs]  # (config, seed, device)
    fused: Callable[[DraftBackbone, Inputs], Outputs]  # reads the derived buffers
    reference: Callable[[DraftBackbone, Inputs], Outputs]  # per layer, no derived buffers

    def random_weights(self, config: Any, seed: int) -> dict[str, torch.Tensor]:
        return random_checkpoint(self.build(config, device="meta"), seed)


# ---- example inputs ----------------------------------------------------------------------------------------------


def _query_inputs(cfg: Any, seed: int, device: str, n_q: int = 4) -> Inputs:
    """Context states at positions 0, 3, 6, ..., then a query block after them: its embeddings, its token ids (for
    a draft that embeds its own) and the previously sampled token of every position (for the DSpark heads)."""
    g = torch.Generator().manual_seed(seed)
    n_ctx = 6
    x = {"context_states": torch.randn(n_ctx, cfg.hidden_size, generator=g),
         "context_positions": torch.arange(n_ctx) * 3,
         "input_embeds": torch.randn(n_q, cfg.hidden_size, generator=g)}
    if hasattr(cfg, "vocab_size"):
        x |= {"input_ids": torch.randint(cfg.vocab_size, (n_q,), generator=g),
              "prev_token_ids": torch.randint(cfg.vocab_size, (n_q,), generator=g)}
    x["positions"] = torch.arange(n_q) + 3 * n_ctx
    return {k: v.to(device) for k, v in x.items()}


def _dflash2_inputs(cfg: DFlash2Config, seed: int, device: str) -> Inputs:
    """A full query block, then the candidate selector's top-k candidates, their logits and the anchor token."""
    x = _query_inputs(cfg, seed, device, n_q=cfg.block_size)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (1, cfg.block_size, cfg.selector_top_k)
    extra = {"candidate_ids": torch.randint(cfg.vocab_size, shape, generator=g),
             "unary_logits": torch.randn(shape, generator=g),
             "anchor_token_ids": torch.randint(cfg.vocab_size, (1,), generator=g)}
    return x | {k: v.to(device) for k, v in extra.items()}


# ---- the steps ---------------------------------------------------------------------------------------------------


def _context_kv(m: Any, x: Inputs, reference: bool) -> Outputs:
    """Every layer's context K/V (or MLA latents)."""
    project = m.precompute_context_kv_reference if reference else m.precompute_context_kv
    return project(x["context_states"], x["context_positions"])


def _context_then_step(m: Any, x: Inputs, reference: bool) -> Outputs:
    """The context projection and the full draft step (`forward` / `forward_reference`)."""
    step = m.forward_reference if reference else m
    return (*_context_kv(m, x, reference),
            step(x["input_embeds"], x["positions"], x["context_states"], x["context_positions"]))


def _block_step(m: Any, x: Inputs, reference: bool, embeds: torch.Tensor | None = None) -> Outputs:
    """Context K/V, then the parallel pass over the query block that reads them (DFlash's `draft_block`)."""
    k, v = _context_kv(m, x, reference)
    return k, v, m.draft_block(x["input_embeds"] if embeds is None else embeds, x["positions"], k, v)


def _dspark_step(m: Any, x: Inputs, reference: bool, own_embeddings: bool = False) -> Outputs:
    """The block step, then the sequential stage's confidence and Markov bias. `own_embeddings`: the draft embeds
    the query tokens itself (Gemma); otherwise they come embedded."""
    k, v, h = _block_step(m, x, reference, m.embed_input_ids(x["input_ids"]) if own_embeddings else None)
    prev = x["prev_token_ids"]
    conf = m.compute_confidence_reference(h, prev) if reference else m.compute_confidence(h, prev)
    return k, v, h, conf, m.markov_bias(m.markov_embed(prev))


def _dflash2_step(m: Any, x: Inputs, reference: bool) -> Outputs:
    """The block step (through the grouped convolutions), then the candidate selector's scores."""
    k, v, h = _block_step(m, x, reference)
    return k, v, h, m.score_candidates(x["candidate_ids"], x["unary_logits"], h.unsqueeze(0), x["anchor_token_ids"])


def _family(name: str, summary: str, derives: str, config: Callable[..., Any], build: Callable[..., DraftBackbone],
            example_inputs: Callable[[Any, int, str], Inputs], step: Callable[..., Outputs]) -> DraftFamily:
    return DraftFamily(name, summary, derives, config, build, example_inputs,
                       fused=partial(step, reference=False), reference=partial(step, reference=True))


FAMILIES: dict[str, DraftFamily] = {f.name: f for f in (
    _family("dflash", "Qwen3 DFlash draft (vLLM DFlashQwen3Model)",
            "`_fused_kv_weight` (cat of qkv_proj K/V rows), `_k_norm_weights` (stack), "
            "`_rope_cos_sin_cache` (alias), `_hidden_norm_weight` (alias)",
            DFlashConfig, DFlashQwen3Draft, _query_inputs, _block_step),
    _family("dspark", "Qwen3 DSpark draft (vLLM Qwen3DSparkModel): DFlash backbone + Markov / confidence heads",
            "DFlash's four (inherited) + `_markov_confidence_logits` (custom, in place via `into=`: "
            "markov_w1 @ confidence weights + bias; ours, not vLLM's)",
            DSparkConfig, Qwen3DSparkDraft, _query_inputs, _dspark_step),
    _family("dflash2", "Qwen3 DFlash2 draft (vLLM DFlash2Qwen3Model): grouped local convolutions + candidate selector",
            "DFlash's four, inherited (`_fused_kv_weight`, `_k_norm_weights`, `_rope_cos_sin_cache`, "
            "`_hidden_norm_weight`); the convolution and selector weights derive nothing",
            DFlash2Config, DFlash2Qwen3Draft, _dflash2_inputs, _dflash2_step),
    _family("gemma-dspark", "Gemma4 DSpark draft (vLLM Gemma4DSparkModel): K=V attention, own embeddings, DSpark heads",
            "`_fused_k_weight` (cat of k_proj), `_k_norm_weights` (stack), `_v_norm_weights` (constant ones, "
            "no sources: built once), `_rope_cos_sin_cache` / `_hidden_norm_weight` (aliases), "
            "`_markov_confidence_logits` (custom, ours); `normalizer` buffer from a cold_load hook",
            GemmaDSparkConfig, GemmaDSparkDraft, _query_inputs, partial(_dspark_step, own_embeddings=True)),
    _family("laguna-dflash", "Laguna DFlash draft (vLLM DFlashLagunaModel)",
            "`_kv_weights` (stack of qkv_proj K/V rows, one bmm), `_input_layernorm_weights` (stack), "
            "`_k_norm_weights` (stack), `_rope_cos_sin_cache` (alias); `mask_embedding` is a non-persistent "
            "buffer made once at cold load",
            LagunaDFlashConfig, DFlashLagunaDraft, _query_inputs, _context_then_step),
    _family("kimi-k3-mla", "Kimi-K3 MLA DSpark draft (vLLM K3DSparkModel)",
            "`_context_kv_weight` (cat of the kv_a_proj_with_mqa rows of fused_qkv_a_proj), "
            "`_context_kv_norm_weights` (stack of kv_a_layernorm), `_rope_cos_sin_cache` (alias), "
            "`_W_UK_T` / `_W_UV` (MLA-absorbed matrices computed per layer from kv_b_proj.weight, stacked)",
            K3DSparkConfig, K3DSparkDraft, _query_inputs, _context_then_step),
)}


def get_family(name: str) -> DraftFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown draft family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None
