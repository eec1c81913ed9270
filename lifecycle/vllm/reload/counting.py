"""How many elements a buffered load will write, remembered for the loaders whose answer depends on shapes alone.

vLLM's layerwise reload buffers each load until its layer is complete and counts, per load, the elements the loader
would copy by running it once on the layer's META placeholder under a dispatch mode (`meta.get_numel_loaded`): a
dry run of the loader, about 0.1 ms per tensor, the largest fixed cost of a push after the reads and copies (a
quarter of a push of the suite's tiny draft). For a loader of an unquantized layer (vLLM's unquantized linear and
embedding methods, or the default loader of a plain parameter), that count is a function of the loader, the
placeholder's shape and the arguments' shapes and values alone, and the dry run on META changes nothing: the first
push counts by the dry run and remembers the answer per (loader, arguments); every later load with the same
arguments reuses it (`WORKER.load_counts`, per loader: dropped with its parameter). Anything else (quantized layers,
whose loaders may set attributes on the placeholder; an argument that is neither a tensor nor a plain value; a
loader that returns something) is counted by vLLM's dry run every time.

vLLM's total per module (`get_layer_size`, what a layer's loads must add up to) counts every buffer as loadable,
the plugin's own too: the derived buffers on a draft's model module and the K/V shadows on its attention modules,
which no checkpoint carries. A module that holds only those waits for elements no push sends, and vLLM's finalize
then logged "Failed to load weights" for it on every push (and put its tensors back, which is right). Their elements
are left out of the module's total when a reload begins (`leave_out_own_buffers`); a load into the module would
count them again (vLLM recomputes the total on each load), and none comes: they hold no checkpoint tensor.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...torch_private import torch_function_bypassed
from ..compat.patching import write_private
from ..drafts.families import SHADOW
from ..drafts.owners import drafts_of
from ..drafts.runtime import WORKER
from .unwind import infos

__all__ = ["COUNTS_KEPT", "leave_out_own_buffers", "wrap_numel_loaded"]

_PLAIN = (str, int, float, bool, type(None))
#: counts remembered per loader function (a fused linear's loader sees one argument set per shard; a trainer that
#: sends ever new shapes gets vLLM's dry run for each beyond these, not a table that grows with every push)
COUNTS_KEPT = 64


@functools.cache
def _vllm() -> tuple[Callable[..., Any], tuple[type, ...]]:
    """vLLM's default loader and its unquantized methods (imported once: read for every load of every push)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return default_weight_loader, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def _countable(loader: Callable[..., Any]) -> bool:
    """Whether the counts of `loader` (vLLM's, unwrapped) depend on shapes and plain values alone (module doc)."""
    default_loader, unquantized = _vllm()
    layer = getattr(loader, "__self__", None)
    if layer is None:
        return loader is default_loader
    return isinstance(layer, nn.Module) and type(getattr(layer, "quant_method", None)) in unquantized


def wrap_numel_loaded(original: Callable[..., tuple[int, Any]]) -> Callable[..., tuple[int, Any]]:
    def get_numel_loaded(weight_loader: Callable[..., Any], args: inspect.BoundArguments) -> tuple[int, Any]:
        slot = _slot(weight_loader, args)
        if slot is None:
            return original(weight_loader, args)
        table, key = slot
        numel = table.get(key)
        if numel is not None:
            return numel, None
        numel, ret = original(weight_loader, args)
        if ret is None and len(table) < COUNTS_KEPT:
            table[key] = numel
        return numel, ret

    return get_numel_loaded


def _slot(weight_loader: Callable[..., Any], args: inspect.BoundArguments) -> tuple[dict[Any, int], Any] | None:
    """Where the count of this load is remembered, and its key; None: dry-run it every time (module doc)."""
    loader = inspect.unwrap(weight_loader)  # through the plugin's guard (`reload.writes`) to vLLM's loader
    # a layer's loader is a bound method, made anew at each look: its counts are kept by the layer, per function
    holder, function = (loader.__self__, loader.__func__) if inspect.ismethod(loader) else (loader, loader)
    try:
        tables = WORKER.load_counts.get(holder)
        if tables is None:
            tables = WORKER.load_counts[holder] = {}
    except TypeError:  # a loader that cannot be referenced weakly (a builtin): dry-run it
        return None
    if function not in tables:
        tables[function] = {} if _countable(loader) else None
    table = tables[function]
    if table is None:
        return None
    key: list[Any] = []
    with torch_function_bypassed():  # vLLM's parameters answer every attribute through __torch_function__
        for name, value in args.arguments.items():
            if isinstance(value, torch.Tensor):
                if name == "param" and not value.is_meta:
                    return None  # not a placeholder: the loader would write, not count
                key.append((name, type(value), value.dtype, tuple(value.shape), value.stride(), value.device.type))
            elif isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, int) for v in value)):
                key.append((name, value))
            else:
                return None
    if not isinstance(args.arguments.get("param"), torch.Tensor):
        return None
    return table, tuple(key)


def leave_out_own_buffers(model: nn.Module) -> None:
    """The plugin's own buffers out of vLLM's total of each module of `model` in a reload (module doc)."""
    derived = {id(b): {SHADOW, *b.derived_buffer_names()} for b in drafts_of(model)}
    for module, info in infos(model):
        names = derived.get(id(module), (SHADOW,))
        own = sum(t.numel() for n, t in info.kernel_tensors[1].items() if n in names)
        if own:
            write_private("LayerReloadingInfo.load_numel_total", info, info.load_numel_total - own)
