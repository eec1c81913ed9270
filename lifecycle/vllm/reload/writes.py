"""Writes that reach a draft's weights without passing vLLM's reload entry points, each made an entry point of the
epoch boundary (`epoch.entered`), so none leaves a draft usable with derived buffers older than its weights.

- The inner model's own `load_weights` (`inner_load_weights`): verl-speco's worker writes through
  `draft_model.model.load_weights(...)`. A trainer's call (no other entry around it) takes the path of the outer
  model's: the frozen structure first, then, after a completed load, an implicit epoch with vLLM's layerwise reload
  on the draft's own modules inside the inner model (what the ForCausalLM holds, an own lm_head or d2t, the inner
  model cannot write: it keeps its values). vLLM's own call from inside the outer model's `load_weights` passes through.
- A derived-buffer builder called by hand (`builder_called`, what each family's builder, such as
  `_build_fused_kv_buffers`, does in the lifecycle class): verl-speco calls it right after its write. Inside an
  entry point (vLLM's call at the end of `load_weights`, the model's own processing) it records the precompute
  metadata, as always. Called by hand while a write opened an epoch, it finishes that epoch as vLLM's finalize
  would (every layer ready, refreshed in place at the pinned addresses, or quarantined and raised); on a usable
  draft it has nothing to rebuild; otherwise it refuses, naming the call.
- A parameter's weight loader called directly (`guard_weight_loaders`): outside any entry point, a write into a
  usable draft begins an epoch (without vLLM's layerwise machinery: the writer holds the live parameter) and the
  draft does not draft until the epoch finishes (the builder by hand, the loader's processing, a reload). A loader
  that raises before writing leaves the draft as it was (rolled back exactly).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..compat.patching import wrap_instance
from .epoch import begin_implicit, entered
from .unwind import layerwise_function

if TYPE_CHECKING:
    from ..drafts.owners import VLLMDraftBackbone

__all__ = ["BUILDER_BY_HAND", "DIRECT_WRITE", "INNER_WRITE", "builder_called", "guard_weight_loaders",
           "inner_load_weights"]

#: why a write began a reload epoch by itself (the `implicit_reload` event's cause), per way in
INNER_WRITE = "load_weights of the draft's inner model after a completed load, outside vLLM's reload entry points"
DIRECT_WRITE = "a parameter's weight_loader called directly after a completed load, outside any load_weights"
#: the entry's name in a failure's reason
BUILDER_BY_HAND = "a derived-buffer builder called by hand"

Weights = Iterable[tuple[str, torch.Tensor]]


def inner_load_weights(vllm_load: Callable[[Any, Weights], Any]) -> Callable[[Any, Weights], Any]:
    """The inner model's `load_weights` in the lifecycle class (for a vLLM inner class that defines one)."""

    def load_weights(self: VLLMDraftBackbone, weights: Weights) -> Any:
        runtime = self.lifecycle_runtime
        if runtime.entries:  # vLLM's own call, from the outer model's load_weights (AutoWeightsLoader)
            return vllm_load(self, weights)
        with entered(self, "load_weights of the draft's inner model"):
            weights, refusal = runtime.structure.admit(weights, self.lifecycle)
            runtime.structure_refusal = refusal
            self.before_write(cause=INNER_WRITE, inner_only=True)
            result = vllm_load(self, weights)
            self.after_write()
            self.note_carried(runtime.structure.carried(weights))
        return result

    return load_weights


def builder_called(backbone: VLLMDraftBackbone) -> None:
    """What a declared builder of vLLM's class does in the lifecycle class (see the module doc)."""
    runtime = backbone.lifecycle_runtime
    if not runtime.entries:  # called by hand, outside every entry point
        with entered(backbone, BUILDER_BY_HAND):
            if backbone.reload_open:
                outer = runtime.outer()
                finalize = layerwise_function("finalize_layerwise_reload")  # the plugin's wrapper
                finalize(outer if outer is not None else backbone, runtime.model_config)
            else:
                backbone.require_usable(f"{BUILDER_BY_HAND} ({type(backbone).__name__})")
    backbone._record_metadata()


def guard_weight_loaders(backbone: VLLMDraftBackbone, module: torch.nn.Module, names: list[str]) -> None:
    """Make each of `module`'s tracked parameters' `weight_loader` an entry point (see the module doc)."""
    ref = weakref.ref(backbone)  # a parameter must not hold its draft (a cycle through every weight)
    del backbone
    leaves = {n.rpartition(".")[2]: n for n in names}
    for leaf, param in module.named_parameters(recurse=False):
        name = leaves.get(leaf)
        if name is None or getattr(param, "weight_loader", None) is None:
            continue
        wrap_instance("BasevLLMParameter.weight_loader", param, _direct(ref, name))


def _direct(ref: weakref.ref[VLLMDraftBackbone], name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(loader: Callable[..., Any]) -> Callable[..., Any]:
        def weight_loader(*args: Any, **kwargs: Any) -> Any:
            backbone = ref()
            if backbone is None or backbone.lifecycle_runtime.entries:  # inside an entry point: vLLM's loading
                return loader(*args, **kwargs)
            with entered(backbone, f"weight_loader of {name} called directly"):
                lc = backbone.lifecycle
                if lc.usable or lc.quarantined:
                    begin_implicit(backbone, DIRECT_WRITE, layerwise=False)
                result = loader(*args, **kwargs)
                if lc.can("weights_loaded"):
                    lc.weights_loaded([name])
            return result

        return weight_loader

    return make
