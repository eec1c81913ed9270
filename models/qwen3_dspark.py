"""A Qwen3-DSpark draft backbone: the DFlash backbone plus DSpark's Markov and confidence heads.

    model = Qwen3DSparkDraft(DSparkConfig())                        # parameters on META until loaded
    load_safetensors(model, "a.safetensors"); model.finalize_loading(); model.refresh_derived_buffers()
    k, v = model.precompute_context_kv(context, positions)          # the inherited fused context K/V
    conf = model.compute_confidence(hidden, prev_token_ids)         # reads _markov_confidence_logits

DSpark (vLLM's `Qwen3DSparkModel`) drafts a block in one parallel DFlash pass, then a sequential stage samples
left to right with the Markov and confidence heads of `models/dspark_heads.py` (shared with Gemma4 DSpark).

Derived state. vLLM's DSpark builds nothing beyond what it inherits from DFlash (`_build_fused_kv_buffers`:
fused KV weight, stacked k-norm weights, RoPE and hidden-norm aliases), and neither do we. One precompute is ours,
not vLLM's: `_markov_confidence_logits`, the confidence head's Markov half per token (see `dspark_heads.py`),
declared with `enabled=` so that it exists only when the config has a Markov-fed confidence head.

Simplifications against vLLM: no quantized Markov head (vLLM keeps NVFP4 weights aside for the gathered bias; that
is quantization state, not modelled); `lm_head` and the `d2t` map live on the causal-LM wrapper, not here; whether
the confidence head exists follows the config (vLLM also drops it at load when the checkpoint lacks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lifecycle.testing import random_checkpoint

from .dspark_heads import MARKOV_CONFIDENCE, DSparkHeads, DSparkHeadsConfig
from .qwen3_dflash import DFlashConfig, DFlashQwen3Draft

__all__ = ["DSparkConfig", "Qwen3DSparkDraft", "random_weights"]


@dataclass(frozen=True)
class DSparkConfig(DSparkHeadsConfig, DFlashConfig):
    """DFlash's config plus the heads' (vocab_size, draft_vocab_size, markov_rank, confidence head switches)."""


class Qwen3DSparkDraft(DSparkHeads, DFlashQwen3Draft):
    """vLLM's `Qwen3DSparkModel`: the DFlash Qwen3 backbone + DSpark Markov / confidence heads."""

    derived_buffers = (*DFlashQwen3Draft.derived_buffers, MARKOV_CONFIDENCE)

    def __init__(self, config: DSparkConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "dspark", rank: int = 0) -> None:
        super().__init__(config or DSparkConfig(), device=device, name=name, rank=rank)

    def build_heads(self, c: DSparkConfig) -> None:
        self.build_dspark_heads(c)


def random_weights(config: DSparkConfig, seed: int) -> dict[str, torch.Tensor]:
    return random_checkpoint(Qwen3DSparkDraft(config, device="meta"), seed)
