"""When a draft layer's post-load processing may run, and the K/V rows captured right before it.

vLLM processes a layer (`quant_method.process_weights_after_loading(layer)`: on CPU an unquantized linear layer is
repacked and its `weight` emptied; a quantized one packs its weights) at the end of a cold load, and, during a
layerwise reload, as each layer completes or at finalize. Each module a draft owns gets its quant method's
processing wrapped (`guard_processing`):
- right before a load's processing repacks or empties the weight, the shadowed rows (`shadows.py`) are copied in
  checkpoint layout;
- in the middle of a reload, processing that does not come from vLLM's reload machinery
  (`WorkerRuntime.in_vllm_reload`, set by the patched `_layerwise_process` and `finalize_layerwise_reload`) is
  skipped: a cold-load pass through a reference to `process_weights_after_loading` taken before the plugin wrapped
  it would otherwise process a META placeholder. The reload processes each layer once, when it completes or at finalize.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..compat.patching import wrap_instance
from .runtime import WORKER

if TYPE_CHECKING:
    from .families import VLLMModule
    from .owners import VLLMDraftBackbone
    from .shadows import Capture

__all__ = ["ProcessingObserver", "guard_processing", "observe_processing"]

#: Called right before a draft layer is processed: (the layer, (the K/V shadow's name, the shadow, the rows of the
#: layer's weight it holds) just captured, or None); what it returns (if not None) is called right after processing.
#: The outside view registers itself here at activation (the weight checker's digests of what processing empties);
#: this layer never imports it.
ProcessingObserver = Callable[[nn.Module, "tuple[str, torch.Tensor, slice] | None"], "Callable[[], None] | None"]
_OBSERVERS: list[ProcessingObserver] = []


def observe_processing(observer: ProcessingObserver) -> None:
    """Call `observer` right before every draft layer's processing (once per observer, however often asked)."""
    if observer not in _OBSERVERS:
        _OBSERVERS.append(observer)

def guard_processing(backbone: VLLMDraftBackbone, module: VLLMModule, capture: Capture | None) -> None:
    """Wrap `module`'s quant method's `process_weights_after_loading` (the very object, wherever vLLM moves the
    parameters meanwhile): capture the shadowed rows before processing, skip processing that comes from outside
    vLLM's reload machinery while a reload is open. A module without such a method is left as it is."""
    quant_method: Any = getattr(module, "quant_method", None)  # vLLM's QuantizeMethodBase, typed only there
    if getattr(quant_method, "process_weights_after_loading", None) is None:
        return
    backbone_ref = weakref.ref(backbone)  # the module's quant method must not hold its backbone (a cycle)
    del backbone

    def guarded(vllm_processing: Callable[..., Any]) -> Callable[..., Any]:
        # `vllm_processing`: an earlier per-instance wrapper, else the class's method as it is when called (a
        # process-wide replacement, such as a test's simulated GPU layout, then applies to this layer too)
        def process_weights_after_loading(layer: VLLMModule) -> Any:
            backbone = backbone_ref()
            if backbone is None:  # the draft was dropped: vLLM's processing as it is
                return vllm_processing(layer)
            lc = backbone.lifecycle
            if backbone.reload_open and not WORKER.in_vllm_reload:
                return None
            captured = None
            if capture is not None and lc.can("weights_loaded"):
                rows, shadow, name = capture
                weight = layer.weight
                if not weight.is_meta and weight.dim() == 2 and weight[rows].shape == shadow.shape:
                    WORKER.touched.add(layer)
                    with torch.no_grad():
                        shadow.copy_(weight[rows])
                    lc.weights_loaded([name])
                    captured = (name, shadow, rows)
            after = [done for observer in _OBSERVERS if (done := observer(layer, captured)) is not None]
            result = vllm_processing(layer)
            for done in after:
                done()
            return result

        return process_weights_after_loading

    wrap_instance("QuantizeMethodBase.process_weights_after_loading", quant_method, guarded)
