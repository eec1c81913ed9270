"""What a vLLM layer received during a layerwise reload: per tensor, and per shard of a fused parameter.

vLLM's layerwise reload decides that a layer is complete when the elements its weight loaders copied add up to
the layer's size (`online_process_loader`: `load_numel >= load_numel_total`), then processes it at once and drops
every later load into it ("Excessive loading"). The count cannot tell one shard sent twice from two shards: a
trainer's retry that resends `q_proj` in a second call and never sends `k_proj` adds up exactly with 2 query heads
and 1 KV head (q + q = q + k + v), and the fused `qkv_proj` is processed with K rows that were never written
(uninitialised memory), on every weight layout. (Within one `load_weights` call vLLM's DFlash keeps the last
tensor of a name, so a duplicate needs two calls.)

Here readiness is decided from what vLLM buffered for the layer (`info.loaded_weights`: each load's parameter
name and its loader's bound arguments): every loadable tensor of the layer received a load, and a fused
parameter received every one of its shards (`loaded_shard_id`: 'q'/'k'/'v' for `QKVParallelLinear`, 0..n-1 for
`MergedColumnParallelLinear` and its relatives; None is the whole fused tensor, as checkpoints with a fused
`qkv_proj` send it). A layer that is not complete by this account is never processed early: it keeps
buffering, and the finalize decides (`epochs.settle_partial`: refused naming the missing shard, or with
`partial="keep"` completed with its last values where the layout allows).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from torch import nn

from ...torch_private import torch_function_bypassed

__all__ = ["expected_shards", "missing_parts", "received"]

_SHARD_ARG = "loaded_shard_id"  # the name in every vLLM linear weight loader (v1 and v2)


@functools.cache
def _vllm() -> tuple[Any, ...]:
    """vLLM's names read here (imported once: `missing_parts` runs for every layer of every push)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors, get_tensor_load_numel

    return QKVParallelLinear, MergedColumnParallelLinear, SKIP_LOAD_TENSORS, get_layer_tensors, get_tensor_load_numel


def expected_shards(layer: nn.Module) -> tuple[Any, ...] | None:
    """The shard ids a fused parameter of `layer` is loaded by, in order; None for a layer without shards."""
    QKVParallelLinear, MergedColumnParallelLinear = _vllm()[:2]
    if isinstance(layer, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedColumnParallelLinear):  # gate_up_proj, K3's fused q_a/kv_a(/gate): 0..n-1
        return tuple(range(len(layer.output_sizes)))
    return None


def received(info: Any) -> dict[str, list[Any]]:
    """Parameter name -> the shard id of each load it received, in order (None: the whole tensor)."""
    out: dict[str, list[Any]] = {}
    for name, args in info.loaded_weights:
        shard = args.arguments.get(_SHARD_ARG)
        out.setdefault(name, []).extend(shard if isinstance(shard, tuple) else [shard])
    return out


def missing_parts(layer: nn.Module, info: Any, names: dict[str, str] | None = None) -> dict[str, str]:
    """What `layer` did not receive in this reload: tensor -> what is missing (empty: complete). `names`: the
    layer's own tensor names -> their lifecycle names (the keys then are those)."""
    _, _, SKIP_LOAD_TENSORS, get_layer_tensors, get_tensor_load_numel = _vllm()
    got = received(info)
    shards = expected_shards(layer)
    out: dict[str, str] = {}
    with torch_function_bypassed():  # vLLM's parameters answer `numel()` through __torch_function__
        loadable = [leaf for leaf, tensor in get_layer_tensors(layer).items()
                    if leaf not in SKIP_LOAD_TENSORS and get_tensor_load_numel(tensor) != 0]
    for leaf in loadable:
        shown = (names or {}).get(leaf, leaf)
        loads = got.get(leaf)
        if not loads:
            out[shown] = "never sent"
            continue
        if shards is None or None in loads:  # a plain tensor, or the whole fused tensor at once
            continue
        counts = Counter(loads)
        absent = [s for s in shards if s not in counts]
        if absent:
            twice = [f"{s!r} {n} times" for s, n in counts.items() if n > 1]
            out[shown] = (f"shard {', '.join(_shard(shown, s) for s in absent)} never sent"
                          + (f" (sent {', '.join(twice)}: vLLM's element count adds up, the rows do not)"
                             if twice else ""))
    return out


#: fused parameter -> its shard ids -> the checkpoint tensor trainers send for each
_CHECKPOINT_OF: dict[str, dict[Any, str]] = {"qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
                                             "gate_up_proj": {0: "gate_proj", 1: "up_proj"},
                                             "fused_wqa_wkv": {0: "wq_a", 1: "wkv"}}  # DeepSeek-V4 attention


def _shard(fused_name: str, shard: Any) -> str:
    """A shard named as the checkpoint tensor trainers send for it, where the fused name is a known one."""
    stem, _, leaf = fused_name.rpartition(".")
    owner, _, proj = stem.rpartition(".")
    ckpt = _CHECKPOINT_OF.get(proj, {}).get(shard)
    return f"{shard!r} ({owner}.{ckpt}.{leaf})" if ckpt and owner else repr(shard)
