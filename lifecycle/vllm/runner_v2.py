"""Model Runner V2 (vLLM's GPU default since 0.29, the only runner for DSpark): its drafting gate, and Gemma4
DSpark's embeddings there.

**The gate.** V2 has no `_input_fits_in_drafter`: `GPUModelRunner.sample_tokens` (vllm/v1/worker/gpu/
model_runner.py) calls `self.speculator.propose(..., num_speculative_tokens=...)` after every sampled step whenever
a speculator exists, masks the positions past the scheduler's count with -1 and stores the result in
`req_states.draft_tokens`, which the next step verifies. Every lifecycle family drafts through
`DFlashSpeculator.propose` (DSpark, DFlash2, LiLiCorr and 0.33's XPress speculators inherit it; read in 0.32 and
0.33). While a lifecycle draft of the speculator is not usable, a real step returns the speculator's own
`draft_tokens[:num_reqs]` zeroed without running the draft model: what V1 does when its gate says no (the target
verifies the zeros, so the output is exactly the target's). Where the speculator keeps the draft's logits for
probabilistic rejection sampling (`draft_sample_method="probabilistic"`), each request's rows become one-hot at
token 0 (the distribution the zeros were drawn from: speculative sampling stays exact, as V1's gated step with no
draft probabilities is); adaptive verification sees zero confidence. `dummy_run=True` calls (profiling, warm-up,
CUDA-graph capture, an idle data-parallel rank's lock-step) always run the original.

**Gemma4 DSpark's embeddings.** vLLM's `Gemma4DSparkForCausalLM` is "a self-contained draft checkpoint" and says
`dspark_shares_target_embeddings = False`, but nothing reads that, and the class sets neither
`has_own_embed_tokens` nor `has_own_lm_head`; so V2's loader (`load_dspark_model`: `maybe_share_target_embed`,
`_should_share`) replaces the draft's own embedding and lm_head with the target's, whatever their values. The
lifecycle then sees modules shared with the target since the first load, and refuses every push that carries
them (a Gemma4 DSpark checkpoint always does). Decided: the class's declaration holds. When a draft class says
`dspark_shares_target_embeddings = False`, its first load sets vLLM's own flags for the modules it carried
(`declare_own_heads`), so V2's loader keeps the draft's own copies unless they equal the target's (vLLM's rule for
every draft that declares its own, as EAGLE and DFlash drafts do through `process_eagle_weight`). Where they are
equal V2 shares them, as it does for those drafts, and a push must leave them out (it keeps them: they are the
target's); one that sends them is refused, naming them, before anything is written.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .serving import drafting_allowed_for

__all__ = ["ENGINE_NAMES", "OWN_HEADS_FLAG", "PATCH_POINTS", "declare_own_heads", "skip_draft"]

_DFLASH_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"
_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.speculator"
#: vLLM's class attribute that says a draft's embedding and lm_head are its own (Gemma4DSparkForCausalLM)
OWN_HEADS_FLAG = "dspark_shares_target_embeddings"
#: optional module (`families.OptionalModule.name`) -> vLLM's flag that keeps the draft's own copy on V2
_OWN_FLAGS = {"embed_tokens": "has_own_embed_tokens", "lm_head": "has_own_lm_head"}


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


def _v2_drafting_gate(original: Callable[..., Any]) -> Callable[..., Any]:
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


def declare_own_heads(outer: Any, present: Mapping[str, bool]) -> list[str]:
    """After the first load froze the structure: for a draft class that says `dspark_shares_target_embeddings =
    False`, set vLLM's `has_own_embed_tokens` / `has_own_lm_head` for each of the two its first load carried, so
    V2's loader keeps them unless they equal the target's. Returns the flags set."""
    if getattr(type(outer), OWN_HEADS_FLAG, True) is not False:
        return []
    done = []
    for module, flag in _OWN_FLAGS.items():
        if present.get(module):
            setattr(outer, flag, True)
            done.append(flag)
    return done


#: (vLLM module, function, wrapper maker): joined to `patches.PATCH_POINTS`
PATCH_POINTS: tuple[tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    (_DFLASH_SPECULATOR, "DFlashSpeculator.propose", _v2_drafting_gate),
)

#: (vLLM module, name, who uses it): joined to `patches.ENGINE_NAMES`
ENGINE_NAMES: tuple[tuple[str, str, str], ...] = (
    (_SPECULATOR, "DraftModelSpeculator.draft_tokens", "runner_v2 (the V2 gate)"),
    (_SPECULATOR, "DraftModelSpeculator.draft_logits", "runner_v2 (the V2 gate)"),
    (_SPECULATOR, "DraftModelSpeculator.draft_token_confidence_probs", "runner_v2 (the V2 gate)"),
    (_SPECULATOR, "DraftModelSpeculator.model", "runner_v2 (the V2 gate)"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.idx_mapping", "runner_v2 (the V2 gate)"),
    ("vllm.v1.worker.gpu.spec_decode.dspark.utils", "load_dspark_model", "runner_v2 (Gemma4 DSpark's own heads)"),
    ("vllm.v1.worker.gpu.spec_decode.eagle.utils", "maybe_share_target_embed", "runner_v2 (own heads)"),
    ("vllm.v1.worker.gpu.spec_decode.eagle.utils", "_should_share", "runner_v2 (own heads)"),
    ("vllm.model_executor.models.gemma4_dspark", f"Gemma4DSparkForCausalLM.{OWN_HEADS_FLAG}", "runner_v2 (own heads)"),
)
