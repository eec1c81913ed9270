"""Which tensors are written together: a load's buckets, planned from the checkpoint's names before any is read.

>>> from lifecycle.readiness import layer_of
>>> plan_buckets(["layers.0.a", "layers.1.a", "layers.0.b", "norm.weight"], layer_of)
[['layers.0.a', 'layers.0.b'], ['layers.1.a'], ['norm.weight']]
>>> plan_buckets(["a", "b", "c"], layer_of, bucket_by=2)
[['a', 'b'], ['c']]
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ..readiness import LayerReadiness

__all__ = ["BucketBy", "check_plan", "plan_buckets", "whole_layer_plan"]

#: One bucket per layer, or this many tensors per bucket.
BucketBy = Literal["layer"] | int


def check_plan(bucket_by: object, duplicates: object) -> None:
    """Refuse (ValueError, before anything is read) a plan that cannot be made."""
    if bucket_by != "layer" and (type(bucket_by) is not int or bucket_by < 1):
        raise ValueError(f"bucket_by must be 'layer' or a positive int, got {bucket_by!r:.80}")
    if type(duplicates) is not int or duplicates < 0:
        raise ValueError(f"duplicates must be an int >= 0, got {duplicates!r:.80}")


def plan_buckets(names: Sequence[str], layer_key: Callable[[str], str], *, bucket_by: BucketBy = "layer",
                 shuffle: bool = False, seed: int = 0, duplicates: int = 0) -> list[list[str]]:
    """Group tensor names into buckets: one per layer, or `bucket_by` tensors each; optionally shuffled;
    `duplicates` tensors are sent a second time in a later bucket (as trainers sometimes do)."""
    check_plan(bucket_by, duplicates)
    rng = random.Random(seed)
    names = list(names)
    if bucket_by == "layer":
        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(layer_key(n), []).append(n)
        buckets = list(groups.values())
        if shuffle:
            rng.shuffle(buckets)
            for b in buckets:
                rng.shuffle(b)
    else:
        if shuffle:
            rng.shuffle(names)
        buckets = [names[i:i + bucket_by] for i in range(0, len(names), bucket_by)]
    for n in rng.sample(names, min(duplicates, len(names))):
        # strictly after the bucket that first sends `n`; a fixed-size plan gets the resend as its own bucket
        # so no bucket exceeds `bucket_by` (bucket_by=1 stays one tensor at a time)
        first = next(i for i, b in enumerate(buckets) if n in b)
        later = rng.randrange(first + 1, len(buckets) + 1)
        if bucket_by == "layer" and later < len(buckets):
            buckets[later].append(n)
        else:
            buckets.insert(later, [n])
    return buckets


def whole_layer_plan(readiness: LayerReadiness, buckets: list[list[str]]) -> list[str] | None:
    """Each bucket's layer, when each is every tracked tensor of one layer (a plan by layer of a checkpoint with
    every tracked tensor: one bucket per layer by construction; `LayerReadiness.fresh_layers` checks again that
    none comes twice): read while the plan's names are in the caches. Else None."""
    layer_of_name, tensors_of = readiness.layer_of_name, readiness.tensors_of_layer
    layers = [layer_of_name[b[0]] for b in buckets]
    if any(len(b) != len(tensors_of[la]) for la, b in zip(layers, buckets, strict=True)):
        return None
    return layers
