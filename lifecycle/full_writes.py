"""Layers that must be written in full before any tensor of them may be kept (declared unchanged).

A layer is owed a full write when an epoch ended with some of its tensors written and not all, or with a write of
one failed part way (it mixes two checkpoints), and when it holds values no checkpoint gave (`require`: a vLLM
draft's dummy load). Until a load writes every tensor of it, nothing of it may be declared unchanged, and the
refusal says why.

>>> owed = FullWrites()
>>> owed.mark_partly_written({"layers.1"}), owed.reason("layers.1")
(['layers.1'], 'layer partly written by a reload that was aborted or abandoned')
>>> owed.require(["layers.2"], "values from a dummy load"); sorted(owed.layers), owed.reason("layers.2")
(['layers.1', 'layers.2'], 'values from a dummy load')
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FullWrites"]

#: Why a layer is owed a full write when no other reason was given.
PARTLY_WRITTEN = "layer partly written by a reload that was aborted or abandoned"


class FullWrites:
    """The layers of one backbone that are owed a full write, and why (see the module doc). `layers` is one set for
    the object's life (changed in place), so the hot path may hold it."""

    def __init__(self) -> None:
        self.layers: set[str] = set()
        #: layer -> why it must be written in full, for the layers `require` put in (the others: `PARTLY_WRITTEN`)
        self.reasons: dict[str, str] = {}

    def require(self, layers: Iterable[str], why: str) -> None:
        """`layers` hold values no checkpoint gave (`why` says where they came from)."""
        for layer in layers:
            self.layers.add(layer)
            self.reasons[layer] = why

    def mark_partly_written(self, layers: Iterable[str]) -> list[str]:
        """An ended epoch wrote `layers` in part. Returns those newly owed a full write, sorted."""
        new = set(layers) - self.layers
        self.layers.update(new)
        for layer in new:
            self.reasons.pop(layer, None)
        return sorted(new)

    def reason(self, layer: str) -> str:
        """Why `layer` (one of `layers`) must be written in full before anything of it may be kept."""
        return self.reasons.get(layer, PARTLY_WRITTEN)

    def keep_only(self, layers: Iterable[str]) -> None:
        """Stop tracking every layer but `layers` (a backbone that stops tracking some tensors)."""
        self.layers.intersection_update(layers)
