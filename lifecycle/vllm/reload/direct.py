"""A completed draft layer written straight into the tensors the engine serves, where processing keeps their layout.

vLLM's layerwise reload processes a layer once every element arrived (`_layerwise_process`): it materialises the
layer in fresh memory, replays the buffered loads into it, processes it and copies the result back into the kept
("kernel") tensors, the ones captured graphs read. Where processing keeps the kept tensors' layout, that is a
fresh allocation of the layer (faulted in page by page) and a second pass over its bytes for nothing: here the
buffered loads are replayed straight into the kept tensors (`write_layer`), then the layer is processed in place.
A layer qualifies (`writes_in_place`) when it is one of a draft's, not an attention layer processed at finalize,
holds no buffer, has no quant method or vLLM's unquantized linear method, and every kept parameter has exactly the
shape, dtype and strides of the placeholder vLLM loads into: the norms on every layout, every unquantized linear
on the GPU layout (on the CPU build vLLM's repack empties the kept weight: vLLM's path, which the capture of the
K/V rows and the weight checker need, stays for it, as for every quantized layer and a layer completed with its
last values, whose placeholders were materialised).

Atomicity is vLLM's: nothing is written before the layer is complete (the loads wait buffered and the kept tensors
hold the last good values: an interrupt before then rolls back exactly). The layer is recorded as written
(`WORKER.touched`) before its first write, so an interrupt inside the write leaves that layer torn and known: the
reload's failure quarantines the draft, which refuses to draft until a complete reload; never usable with a torn
layer. If processing moved a kept tensor all the same (a platform whose unquantized processing re-lays the
weight), the write fails the reload, naming the tensor, and that layer takes vLLM's path from then on
(`DraftRuntime.copied_back`), so the retry completes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ...storage import StorageIdentity
from ...torch_private import own_buffers, own_parameters, set_grad_mode, torch_function_bypassed
from ..drafts.runtime import WORKER, DraftRuntime

__all__ = ["write_layer", "writes_in_place"]


@functools.cache
def _vllm() -> tuple[Any, Any]:
    """vLLM's names `writes_in_place` reads (imported once: it runs for every layer of every push)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return is_deferred_attention_layer, UnquantizedLinearMethod


def writes_in_place(layer: nn.Module, info: Any, runtime: DraftRuntime) -> bool:
    """Whether the completed `layer` (of the draft whose runtime is `runtime`) can take its buffered loads in its
    kept tensors (module doc)."""
    is_deferred_attention_layer, UnquantizedLinearMethod = _vllm()
    if info.kernel_tensors is None or layer in runtime.copied_back or is_deferred_attention_layer(layer):
        return False
    quant = getattr(layer, "quant_method", None)
    if quant is not None and type(quant) is not UnquantizedLinearMethod:
        return False
    kept, kept_buffers = info.kernel_tensors
    if kept_buffers or any(b is not None for b in own_buffers(layer).values()):
        return False
    placeholders = {n: p for n, p in own_parameters(layer).items() if p is not None}
    if not placeholders or placeholders.keys() != kept.keys():
        return False
    with torch_function_bypassed():  # vLLM's parameters answer every attribute through __torch_function__
        for name, placeholder in placeholders.items():
            live = kept[name]
            if placeholder is live:  # never moved to META (vLLM's `bias`): written in place on either path
                continue
            if not placeholder.is_meta or live.is_meta or placeholder.shape != live.shape \
                    or placeholder.dtype != live.dtype or placeholder.stride() != live.stride():
                return False
    return True


def write_layer(layer: nn.Module, info: Any, runtime: DraftRuntime) -> None:
    """Replay `layer`'s buffered loads into its kept tensors, process it in place, end vLLM's record of it (what
    `_layerwise_process` does, without the fresh copy and the copy back). Without autograd, switched in C (this
    runs for every layer of every push: `torch.no_grad()`'s Python frames cost more than the check around it)."""
    grad = torch.is_grad_enabled()
    try:  # switched inside the try: an interrupt right after the switch must still restore the caller's mode
        set_grad_mode(False)
        _write_layer(layer, info, runtime)
    finally:
        set_grad_mode(grad)


def _write_layer(layer: nn.Module, info: Any, runtime: DraftRuntime) -> None:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, _place_kernel_tensors

    kept = info.kernel_tensors[0]
    with torch_function_bypassed():  # vLLM's parameters answer every attribute through __torch_function__
        before = {name: StorageIdentity.of(t) for name, t in kept.items()}
    WORKER.touched.add(layer)  # before the first write: an interrupt inside leaves this layer torn, and known
    _place_kernel_tensors(layer, info)  # the kept tensors back on the layer, the META placeholders dropped
    if hasattr(layer, "_already_called_process_weights_after_loading"):  # as vLLM's: processing runs again
        delattr(layer, "_already_called_process_weights_after_loading")
    for name, args in info.loaded_weights:
        param = getattr(layer, name)
        args.arguments["param"] = param
        _get_original_loader(param)(*args.args, **args.kwargs)
    quant = getattr(layer, "quant_method", None)
    if isinstance(quant, QuantizeMethodBase):
        quant.process_weights_after_loading(layer)
        update_tp_status = getattr(layer, "update_param_tp_status", None)  # as vLLM's (a module's own method)
        if callable(update_tp_status):
            update_tp_status()
    now = own_parameters(layer)
    with torch_function_bypassed():
        moved = [name for name, was in before.items()
                 if now.get(name) is not kept[name] or not was.matches(kept[name])]
    info.reset()
    if moved:
        runtime.copied_back.add(layer)
        raise RuntimeError(f"reload-lifecycle: processing {type(layer).__name__} moved its kept "
                           f"{', '.join(moved)} after an in-place write (its unquantized processing re-lays the "
                           "weight on this platform); the layer is torn and the draft refuses to draft until a "
                           "complete reload")
