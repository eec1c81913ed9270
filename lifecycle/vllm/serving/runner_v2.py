"""Model Runner V2 (vLLM's GPU default since 0.29, the only runner for DSpark): its drafting gate (Gemma4 DSpark's
own embeddings there: `drafts.own_heads`).

**The gate.** V2 has no `_input_fits_in_drafter`: `GPUModelRunner.sample_tokens` (vllm/v1/worker/gpu/
model_runner.py) calls `self.speculator.propose(..., num_speculative_tokens=...)` after every sampled step whenever
a speculator exists, masks the positions past the scheduler's count with -1 and stores the result in
`req_states.draft_tokens`, which the next step verifies. Every lifecycle family drafts through
`DFlashSpeculator.propose` (DSpark, DFlash2, LiLiCorr and 0.33's XPress speculators inherit it; read in 0.32 and
0.33); V2's draft-model speculator (`StandaloneARSpeculator`, `method="draft_model"`, vLLM #43091: a separate small
LM drafting autoregressively) is gated by the same wrapper, so whichever of them holds a lifecycle draft, it drafts
only while the draft is usable. While a lifecycle draft of the speculator is not usable, a real step returns the
speculator's own `draft_tokens[:num_reqs]` zeroed without running the draft model: what V1 does when its gate says
no (the target verifies the zeros, so the output is exactly the target's). Where the speculator keeps the draft's
logits for probabilistic rejection sampling (`draft_sample_method="probabilistic"`), each request's rows become
one-hot at token 0 (the distribution the zeros were drawn from: speculative sampling stays exact, as V1's gated step
with no draft probabilities is); adaptive verification sees zero confidence. `dummy_run=True` calls (profiling,
warm-up, CUDA-graph capture, an idle data-parallel rank's lock-step) always run the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .gate import drafting_allowed_for

__all__ = ["skip_draft", "wrap_propose"]



def skip_draft(speculator: Any, input_batch: Any) -> Any:
    """This step's draft tokens when the draft may not run: the speculator's own buffer, zeroed (and, for
    probabilistic rejection sampling, the draft distribution of those rows one-hot at token 0)."""
    n = input_batch.num_reqs
    tokens = speculator.draft_tokens[:n]
    tokens.zero_()
    logits = getattr(speculator, "draft_logits", None)
    if logits is not None and n:
        rows = input_batch.idx_mapping[:n]  # draft logits are kept per request state, not per batch row
        logits.index_fill_(0, rows, float("-inf"))
        logits[rows, :, 0] = 0.0
    confidence = getattr(speculator, "draft_token_confidence_probs", None)
    if confidence is not None:
        confidence[:n].zero_()
    return tokens


def _position(original: Callable[..., Any], name: str) -> int | None:
    """Where `name` comes among the arguments after `self` (vLLM passes `dummy_run` by keyword; a positional one
    is read too), from the original's own signature: the gate follows vLLM if the order changes."""
    names = list(inspect.signature(original).parameters)
    return names.index(name) - 1 if name in names[1:] else None


def wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    dummy_at, batch_at = _position(original, "dummy_run"), _position(original, "input_batch")

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int | None, default: Any) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[at] if at is not None and len(args) > at else default

    def propose(speculator: Any, *args: Any, **kwargs: Any) -> Any:
        if argument(args, kwargs, "dummy_run", dummy_at, False) or drafting_allowed_for(
                getattr(speculator, "model", None)):
            return original(speculator, *args, **kwargs)
        return skip_draft(speculator, argument(args, kwargs, "input_batch", batch_at, None))

    return propose
