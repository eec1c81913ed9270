"""Gemma4 DSpark's own embeddings on Model Runner V2.

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

from collections.abc import Mapping
from typing import Any

__all__ = ["OWN_HEADS_FLAG", "declare_own_heads"]

#: vLLM's class attribute that says a draft's embedding and lm_head are its own (Gemma4DSparkForCausalLM)
OWN_HEADS_FLAG = "dspark_shares_target_embeddings"
#: optional module (`families.OptionalModule.name`) -> vLLM's flag that keeps the draft's own copy on V2
_OWN_FLAGS = {"embed_tokens": "has_own_embed_tokens", "lm_head": "has_own_lm_head"}


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
