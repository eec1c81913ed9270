"""The draft families, each with what the generic tools (demo, tests, benchmarks) need to drive it:
a tiny config, a builder, example inputs, and its fused path next to its per-layer reference path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lifecycle import DraftBackbone

Inputs = dict[str, torch.Tensor]


def random_checkpoint(model: nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights for every checkpoint tensor of `model` (META is fine): norm weights near 1, others
    scaled by 1/sqrt(fan_in). Deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        else:
            value = torch.randn(t.shape, generator=gen) / max(t.shape[-1], 1) ** 0.5 if t.dim() else torch.randn(())
        out[name] = value.to(t.dtype if t.dtype.is_floating_point else dtype).contiguous()
    return out


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


FAMILIES: dict[str, DraftFamily] = {f.name: f for f in (_dflash(),)}


def get_family(name: str) -> DraftFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown draft family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None
