"""Derived-buffer digests of two engines, compared as what the weights decide.

`lifecycle_derived_digests` hashes every derived buffer. All but one kind are functions of the draft's weights, so
two engines on one checkpoint hold them bit for bit. An alias of state vLLM computes when an engine starts (the RoPE
cos/sin table, `_rope_cos_sin_cache`) is not: on an Intel Xeon host about 1 engine start in 40 computed a table up
to 1.5e-4 off the usual one, before any push (one process's table never changed afterwards, and no push writes it:
the pinned address and content of a constant derived buffer are verified at every refresh under captured graphs).
Engines are compared on the others; a test about that table compares it within one engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ENGINE_STATE", "weight_derived"]

#: derived buffers that alias engine start-up state, not a checkpoint tensor (`DraftBackbone.constant_derived_buffers`)
ENGINE_STATE = frozenset({"_rope_cos_sin_cache"})


def weight_derived(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`lifecycle_derived_digests` answers (one per rank) without the buffers in `ENGINE_STATE`."""
    return [{**a, "backbones": {b: {n: d for n, d in bufs.items() if n not in ENGINE_STATE}
                                for b, bufs in a.get("backbones", {}).items()}} for a in answers]
