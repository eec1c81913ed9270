"""The lifecycle-enabled versions of vLLM's draft classes, made per family on first use.

`lifecycle_class(family)` subclasses the family's vLLM ForCausalLM. Its `__init__` swaps the inner model's class for
one mixing in `mixin.LifecycleDraftModel` (the family's builders replaced: `writes.builder_called`; the inner
model's own `load_weights` made an entry point: `writes.inner_load_weights`), gives the draft its runtime
(`drafts.runtime.DraftRuntime`) and enables the lifecycle; its `load_weights` and `process_weights_after_loading`
are entry points of the epoch boundary (`epoch.entered`) driving the mixin's hooks, so a caller holding a
reference taken before the plugin wrapped vLLM's functions (`hooks.py`) still reaches the lifecycle.
`registered.py` hands these classes to vLLM's model registry by family name.
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any

from torch import nn

from ..compat.patching import swap_class
from ..drafts.families import VLLMDraftFamily
from ..drafts.owners import drafts_of
from ..drafts.runtime import DraftRuntime
from ..drafts.structure import DraftStructure, Weights
from .epoch import entered
from .mixin import LifecycleDraftModel
from .unwind import layerwise_function
from .writes import inner_load_weights

__all__ = ["lifecycle_class"]

#: family name -> its lifecycle-enabled ForCausalLM (one class per family and process)
_CAUSAL_LM_CLASSES: dict[str, type] = {}
#: (family name, vLLM's inner model class) -> that class with the lifecycle mixed in
_INNER_CLASSES: dict[tuple[str, type], type] = {}


def lifecycle_class(family: VLLMDraftFamily) -> type:
    """A subclass of the family's vLLM ForCausalLM whose backbone is lifecycle-enabled."""
    if family.name in _CAUSAL_LM_CLASSES:
        return _CAUSAL_LM_CLASSES[family.name]
    base = getattr(importlib.import_module(family.module), family.causal_lm)
    base_hook = getattr(base, "process_weights_after_loading", None)

    def __init__(self: nn.Module, *, vllm_config: Any, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        spec = getattr(vllm_config, "speculative_config", None)
        inner = getattr(self, family.inner_model_attr)
        swap_class("inner_model.__class__", inner, _inner_class(family, type(inner)))
        inner.lifecycle_runtime = DraftRuntime(
            outer=weakref.ref(self), structure=DraftStructure(self, inner, family),
            model_config=getattr(spec, "draft_model_config", None) or vllm_config.model_config)
        inner.enable_lifecycle(name=f"{family.name}-draft", rank=_rank())
        inner.claim_structure()

    def load_weights(self: nn.Module, weights: Weights) -> Any:
        # one wrapper, run for every bucket of every push: the call's tensors pass the frozen structure first
        # (`structure.admit`; a refusal is raised by the backbone's `before_write`, so a call inside a reload fails
        # like any bad bucket); vLLM's per-call decisions and checks are neutralized around the call
        # (`structure.within_call`); and the call is an entry point of the epoch boundary: a bucket that fails
        # inside a reload (a bad name or shape, a loader or a source that raises) ends the epoch (else modules stay
        # on META and the next reload is refused)
        backbones = drafts_of(self)
        structure = backbones[0].lifecycle_runtime.structure
        weights, refusal = structure.admit(weights, backbones[0].lifecycle)
        for b in backbones:
            b.lifecycle_runtime.structure_refusal = refusal
        with structure.within_call():
            with entered(self, "load_weights", backbones):
                for b in backbones:
                    b.before_write()
                result = base.load_weights(self, weights)
            for b in backbones:
                b.after_write()
        carried = structure.carried(weights)
        if carried:
            for b in backbones:
                b.note_carried(carried)
        return result

    def process_weights_after_loading(self: nn.Module) -> None:
        """vLLM's `process_weights_after_loading` calls this last, whichever reference to it ran: it finishes
        an open reload epoch (as `finalize_layerwise_reload` would), or builds the buffers after a cold load."""
        backbones = drafts_of(self)
        with entered(self, "process_weights_after_loading"):
            if base_hook is not None:
                base_hook(self)  # a builder it calls (Kimi K3's) records metadata: inside an entry point
            if any(b.reload_open for b in backbones):
                layerwise_function("finalize_layerwise_reload")(self, backbones[0].lifecycle_runtime.model_config)
                return
            for b in backbones:
                b.on_cold_load_processed()

    cls = type(f"Lifecycle{family.causal_lm}", (base,), {
        "__init__": __init__, "load_weights": load_weights,
        "process_weights_after_loading": process_weights_after_loading,
        "__module__": __name__, "lifecycle_family": family.name})
    _CAUSAL_LM_CLASSES[family.name] = cls
    return cls


def _inner_class(family: VLLMDraftFamily, base: type) -> type:
    key = (family.name, base)
    if key not in _INNER_CLASSES:
        # the lifecycle mixin first, so its overrides win; the family's builders record metadata only inside an entry
        # point and finish an open epoch when called by hand (`writes.builder_called`); an inner model's own
        # load_weights is an entry point too
        methods: dict[str, Any] = {name: LifecycleDraftModel._derived_builder for name in family.builders}
        vllm_load = getattr(base, "load_weights", None)
        if callable(vllm_load):
            methods["load_weights"] = inner_load_weights(vllm_load)
        _INNER_CLASSES[key] = type(f"Lifecycle{base.__name__}", (LifecycleDraftModel, base),
                                   {"_family": family, **methods})
    return _INNER_CLASSES[key]


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0
