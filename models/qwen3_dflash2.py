"""A Qwen3-DFlash2 draft backbone: DFlash layers wrapped in grouped local convolutions, plus a candidate selector.

    model = DFlash2Qwen3Draft(DFlash2Config())                 # parameters on META until loaded
    load_safetensors(model, "a.safetensors"); model.finalize_loading(); model.refresh_derived_buffers()
    h = model(input_embeds, positions, context_states, context_positions)   # fused context K/V, then the block
    scores = model.score_candidates(candidate_ids, unary_logits, h, anchor_token_ids)

DFlash2 (vLLM's `DFlash2Qwen3Model`) keeps DFlash's context path and changes the query-block pass: around the
attention and around the MLP of every layer, a grouped causal convolution over the rows of each query block
(`DFlashGroupedConv`: a learned per-channel `base_kernel` plus per-row, per-group deltas from a
`kernel_projection` of the same rows). A `candidate_selector` then scores top-k candidate chains with two
token codebooks. Parameter names as in vLLM:
  layers.N.attention_conv.base_kernel              [2, taps, hidden]   side 0 before the attention, side 1 after
  layers.N.attention_conv.kernel_projection.weight [2 * taps * groups, hidden]
  layers.N.mlp_conv.{base_kernel, kernel_projection.weight}
  candidate_selector.{predecessor_codebook, successor_codebook}   [vocab, r]
  candidate_selector.hidden_projection.weight                     [r, hidden]

Derived state: exactly what DFlash derives (inherited: `_fused_kv_weight`, `_k_norm_weights`, `_rope_cos_sin_cache`,
`_hidden_norm_weight`), as in vLLM. The convolution weights derive nothing: each layer's convolution runs inside
that layer's sequential block pass on that layer's own rows (nothing to fuse across layers), and vLLM's Triton
kernel reads `base_kernel[side]` as it is. So a reload that changes only convolution or selector weights writes
no derived buffer, and the block pass reads the new weights directly.

Simplifications against vLLM: the convolution is vLLM's non-CUDA path (`_grouped_conv`), not its Triton kernel;
`input_embedding_scale` and the candidate logits processor act on embeddings and `lm_head`, which live outside the
backbone; the selector is not compiled separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle.testing import random_checkpoint

from .qwen3_dflash import DFlashConfig, DFlashQwen3DecoderLayer, DFlashQwen3Draft

__all__ = ["CandidateSelector", "DFlash2Config", "DFlash2Qwen3DecoderLayer", "DFlash2Qwen3Draft",
           "DFlashGroupedConv", "grouped_conv", "random_weights", "score_edges"]


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 3  # dflash_config["conv_kernel_size"]: taps
    conv_group_size: int = 16  # dflash_config["conv_group_size"]: channels per delta group
    num_speculative_tokens: int = 3  # a query block is the bonus token + the mask tokens
    vocab_size: int = 96
    selector_rank: int = 8
    selector_top_k: int = 4

    @property
    def block_size(self) -> int:
        return 1 + self.num_speculative_tokens


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, num_groups: int,
                 group_size: int, taps: int) -> torch.Tensor:
    """vLLM's non-CUDA `_grouped_conv`. x: [n, hidden], rows grouped in blocks of `block_size`; delta:
    [n, taps, groups]; base: [taps, hidden]. Row r of a block mixes rows r, r-1, ... r-taps+1 of that block:
    out[r] = sum_t (base[t] + delta[r, t, group]) * x[r - t]."""
    blocks = x.unflatten(-1, (num_groups, group_size))
    coefficients = base.view(1, taps, num_groups, group_size) + delta.unsqueeze(-1)
    output = coefficients[:, 0] * blocks
    position = torch.arange(x.shape[0], device=x.device) % block_size
    for tap in range(1, taps):
        shifted = F.pad(blocks[:-tap], (0, 0, 0, 0, tap, 0))
        output += coefficients[:, tap] * shifted * (position >= tap).view(-1, 1, 1)
    return output.flatten(-2)


class DFlashGroupedConv(nn.Module):
    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size}.")
        self.block_size = block_size
        self.taps = taps
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size), requires_grad=False)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        return grouped_conv(x, delta, self.base_kernel[side], self.block_size, self.num_groups, self.group_size,
                            self.taps)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve the input (side 0); return it with the side-1 deltas for `finish`."""
        coefficients = self.kernel_projection(x).reshape(x.shape[0], 2, self.taps, self.num_groups)
        return self._convolve(x, coefficients[:, 0], 0), coefficients[:, 1]

    def finish(self, x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, coefficients, 1)


class DFlash2Qwen3DecoderLayer(DFlashQwen3DecoderLayer):
    def __init__(self, c: DFlash2Config) -> None:
        super().__init__(c)
        conv = dict(hidden_size=c.hidden_size, taps=c.conv_kernel_size, group_size=c.conv_group_size,
                    block_size=c.block_size)
        self.attention_conv = DFlashGroupedConv(**conv)
        self.mlp_conv = DFlashGroupedConv(**conv)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
                ) -> torch.Tensor:
        x, coefficients = self.attention_conv.prepare(self.input_layernorm(h))
        x = self.self_attn(x, positions, ctx_k, ctx_v)
        h = h + self.attention_conv.finish(x, coefficients)
        x, coefficients = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), coefficients)


def score_edges(predecessor_table: torch.Tensor, successor_table: torch.Tensor, candidate_ids: torch.Tensor,
                unary_logits: torch.Tensor, hidden: torch.Tensor, anchor_token_ids: torch.Tensor, top_k: int
                ) -> torch.Tensor:
    """vLLM's `_score_edges`: [B, L, k] candidates -> [B, L, k(predecessor), k(candidate)] chain scores."""
    successors = successor_table[candidate_ids]
    predecessor_ids = torch.cat((anchor_token_ids[:, None, None].expand(-1, 1, top_k), candidate_ids[:, :-1]), dim=1)
    predecessors = predecessor_table[predecessor_ids]
    return unary_logits[:, :, None] + torch.einsum("blpr,blcr->blpc", predecessors * hidden[:, :, None], successors)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank), requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank), requires_grad=False)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def forward(self, candidate_ids: torch.Tensor, unary_logits: torch.Tensor, hidden_states: torch.Tensor,
                anchor_token_ids: torch.Tensor) -> torch.Tensor:
        return score_edges(self.predecessor_codebook, self.successor_codebook, candidate_ids, unary_logits,
                           self.hidden_projection(hidden_states), anchor_token_ids, self.top_k)


class DFlash2Qwen3Draft(DFlashQwen3Draft):
    """vLLM's `DFlash2Qwen3Model`: DFlash2 decoder layers and the candidate selector; derived buffers inherited."""

    decoder_layer_cls = DFlash2Qwen3DecoderLayer

    def __init__(self, config: DFlash2Config | None = None, *, device: str | torch.device = "meta",
                 name: str = "dflash2", rank: int = 0) -> None:
        super().__init__(config or DFlash2Config(), device=device, name=name, rank=rank)

    def build_heads(self, c: DFlash2Config) -> None:
        self.candidate_selector = CandidateSelector(c.hidden_size, c.vocab_size, c.selector_rank,
                                                    c.selector_top_k).to(c.dtype)

    def score_candidates(self, candidate_ids: torch.Tensor, unary_logits: torch.Tensor, hidden_states: torch.Tensor,
                         anchor_token_ids: torch.Tensor) -> torch.Tensor:
        return self.candidate_selector(candidate_ids, unary_logits, hidden_states, anchor_token_ids)


def random_weights(config: DFlash2Config, seed: int) -> dict[str, torch.Tensor]:
    return random_checkpoint(DFlash2Qwen3Draft(config, device="meta"), seed)
