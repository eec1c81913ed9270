"""DSpark's sequential-stage heads, shared by the DSpark drafts (Qwen3, Gemma4, Kimi-K3), as in vLLM.

DSpark drafts a block in one parallel pass, then samples it left to right with two small heads (parameter names
as in vLLM's `qwen3_dspark.py`):
  markov_head.markov_w1.weight        [vocab, r]          embeds the previously sampled token
  markov_head.markov_w2.weight        [draft_vocab, r]    projects it to a transition bias on the draft logits
  confidence_head.proj.{weight,bias}  [1, hidden + r], [1]   per-position acceptance estimate (float32)

One derived buffer is ours, not vLLM's: the confidence head's Markov half depends only on the previous token, so

  _markov_confidence_logits = markov_w1.weight @ proj.weight[0, hidden:] + proj.bias      [vocab], float32

turns a concat plus an (hidden + r)-dot per drafted position into a hidden-size dot plus one gather. It reads two
modules' weights, so it is a `custom` buffer with dependencies, refreshed in place through an `into=` writer
(no vocab-sized temporary), and skipped when a reload touches neither head. It exists only when the config has a
confidence head that takes the Markov embedding (vLLM's `confidence_head_with_markov`): `enabled=` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle import custom

__all__ = ["MARKOV_CONFIDENCE", "DSparkConfidenceHead", "DSparkHeads", "DSparkHeadsConfig", "DSparkMarkovHead"]


@dataclass(frozen=True)
class DSparkHeadsConfig:
    """The heads' part of a DSpark config (vLLM's field names)."""

    vocab_size: int = 96
    draft_vocab_size: int | None = None  # a pruned draft vocab (None: the full vocab)
    markov_rank: int = 8
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    @property
    def has_markov_confidence_table(self) -> bool:
        """A confidence head fed by the Markov embedding: `_markov_confidence_logits` is derived."""
        return self.enable_confidence_head and self.confidence_head_with_markov


class DSparkMarkovHead(nn.Module):
    """Sequential transition-bias head, low rank: vocab x r (an embedding), r x draft_vocab (an LM head)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, markov_rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank, _weight=torch.empty(vocab_size, markov_rank))  # no init
        self.markov_w2 = nn.Linear(markov_rank, draft_vocab_size, bias=False)  # vLLM: ParallelLMHead, weight [V, r]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """Draft-vocab transition bias: [B, r] -> [B, draft_vocab]."""
        return self.markov_w2(markov_embed)

    def apply_bias_gathered(self, markov_embed: torch.Tensor, logits: torch.Tensor, values: torch.Tensor,
                            index: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The bias on selected candidates only (vLLM's unquantized path): `values` + scale * bias[index],
        scattered into `logits` (pre-filled with -inf by the caller)."""
        weight = self.markov_w2.weight[index]  # [B, k, r]
        corrected = values.unsqueeze(-1).clone()
        corrected.baddbmm_(weight, markov_embed.unsqueeze(-1), beta=1.0, alpha=scale)
        return logits.scatter_(1, index, corrected.squeeze(-1))


class DSparkConfidenceHead(nn.Module):
    """Acceptance-confidence logit from the draft hidden state (and the Markov embedding). float32, as vLLM."""

    def __init__(self, input_dim: int, with_markov: bool) -> None:
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = (torch.cat([hidden, markov_embed], dim=-1) if self.with_markov else hidden).float()
        return self.proj(x).squeeze(-1)


# ---- the confidence table: the one derived buffer of the heads ---------------------------------------------------


def _write_markov_confidence(m: DSparkHeads, out: torch.Tensor | None) -> torch.Tensor:
    """out[t] = markov_w1[t] . proj.weight[0, hidden:] + proj.bias, in float32, written into `out` (None: into a
    new tensor, the cold build)."""
    w1 = m.markov_head.markov_w1.weight
    proj = m._confidence_head().proj
    w_markov = proj.weight[0, m.config.hidden_size:]
    if out is None:
        out = torch.empty(w1.shape[0], dtype=torch.float32, device=w1.device)
    # float32 weights: one GEMV straight into `out`. Lower precision: upcast row blocks a quarter of `out`'s size.
    rows = w1.shape[0] if w1.dtype == out.dtype else max(1, out.numel() // (4 * w1.shape[1]))
    for start in range(0, w1.shape[0], rows):
        torch.mv(w1[start:start + rows].to(out.dtype), w_markov, out=out[start:start + rows])
    return out.add_(proj.bias)


def _build_markov_confidence(m: DSparkHeads) -> torch.Tensor:
    # the cold build runs the same writer as the in-place refresh: a warm reload equals a cold load bit for bit
    return _write_markov_confidence(m, None)


MARKOV_CONFIDENCE = custom(
    "_markov_confidence_logits",
    build=_build_markov_confidence,
    into=_write_markov_confidence,
    depends_on=("markov_head.markov_w1.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"),
    enabled=lambda m: m.config.has_markov_confidence_table,
)


# ---- the sequential-stage API of a DSpark backbone ----------------------------------------------------------


class DSparkHeads:
    """The DSpark sequential-stage API, mixed into a backbone whose `config` is a `DSparkHeadsConfig`."""

    markov_head: DSparkMarkovHead
    confidence_head: DSparkConfidenceHead | None
    config: Any
    _markov_confidence_logits: torch.Tensor  # the derived buffer (MARKOV_CONFIDENCE), registered by the lifecycle

    if TYPE_CHECKING:  # the backbone this is mixed into has it (DraftBackbone)
        def require_usable(self, what: str = "forward") -> None: ...

    def build_dspark_heads(self, c: Any) -> None:
        """Add the heads, in the dtypes vLLM keeps them in (the confidence head is always float32)."""
        self.markov_head = DSparkMarkovHead(c.vocab_size, c.draft_vocab_size or c.vocab_size, c.markov_rank).to(c.dtype)
        self.confidence_head = None
        if c.enable_confidence_head:
            in_dim = c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0)
            self.confidence_head = DSparkConfidenceHead(in_dim, c.confidence_head_with_markov)

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_head.embed(token_ids)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.markov_head.bias(markov_embed)

    # ---- confidence: fused path (reads _markov_confidence_logits) ------------------------------------------
    def compute_confidence(self, head_hidden: torch.Tensor, prev_token_ids: torch.Tensor) -> torch.Tensor:
        """Acceptance probability per drafted position; `prev_token_ids` are the tokens sampled before them."""
        self.require_usable("compute_confidence")
        head = self._confidence_head()
        if not self.config.has_markov_confidence_table:
            return torch.sigmoid(head.proj(head_hidden.float()).squeeze(-1))
        w_hidden = head.proj.weight[:, :self.config.hidden_size]
        logit = F.linear(head_hidden.float(), w_hidden).squeeze(-1)
        return torch.sigmoid(logit + self._markov_confidence_logits[prev_token_ids])

    # ---- confidence: reference path (vLLM's formula, no derived buffer) --------------------------------------
    def compute_confidence_reference(self, head_hidden: torch.Tensor, prev_token_ids: torch.Tensor
                                     ) -> torch.Tensor:
        return torch.sigmoid(self._confidence_head()(head_hidden, self.markov_embed(prev_token_ids)))

    def _confidence_head(self) -> DSparkConfidenceHead:
        if self.confidence_head is None:
            raise RuntimeError("this DSpark draft has no confidence head (enable_confidence_head=False)")
        return self.confidence_head
