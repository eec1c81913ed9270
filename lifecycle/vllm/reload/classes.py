"""The lifecycle-enabled versions of vLLM's draft classes, made per family on first use.

`lifecycle_class(family)` subclasses the family's vLLM ForCausalLM. Its `__init__` swaps the inner model's class for
one mixing in `drafts.LifecycleDraftModel` (the family's builders replaced by one that records metadata only) and
enables the lifecycle; its `load_weights` and `process_weights_after_loading` drive the mixin's hooks, so a caller
holding a reference taken before the plugin wrapped vLLM's functions (`patches.py`) still reaches the lifecycle.
`registered.py` hands these classes to vLLM's model registry by family name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from ..compat.patching import swap_class
from ..drafts.families import VLLMDraftFamily
from ..drafts.owners import backbones_in
from ..drafts.structure import DraftStructure, Weights
from .epochs import describe, end_failed_epoch, reload_in_progress
from .mixin import LifecycleDraftModel, layerwise_function

__all__ = ["lifecycle_class"]

LoadWeights = Callable[[nn.Module, Weights], Any]

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
        self._lifecycle_model_config = getattr(spec, "draft_model_config", None) or vllm_config.model_config
        inner = getattr(self, family.inner_model_attr)
        swap_class("inner_model.__class__", inner, _inner_class(family, type(inner)))
        inner.__dict__["_structure"] = self.__dict__["_lifecycle_structure"] = DraftStructure(self, inner, family)
        inner.enable_lifecycle(name=f"{family.name}-draft", rank=_rank())
        inner.claim_structure()

    def load_weights(self: nn.Module, weights: Weights) -> Any:
        backbones = backbones_in(self)
        # a bucket that fails inside a reload (a bad name or shape, a loader or a source that raises) ends the
        # epoch here: otherwise modules stay on META and the next reload is refused
        try:
            for b in backbones:
                b.before_write()
            result = base.load_weights(self, weights)
        except BaseException as e:  # an interrupt too
            if reload_in_progress(self) or any(b.reload_open for b in backbones):
                end_failed_epoch(self, f"load_weights failed: {describe(e)}")
            raise
        for b in backbones:
            b.after_write()
        return result

    def process_weights_after_loading(self: nn.Module) -> None:
        """vLLM's `process_weights_after_loading` calls this last, whichever reference to it ran: it finishes
        an open reload epoch (as `finalize_layerwise_reload` would), or builds the buffers after a cold load."""
        if base_hook is not None:
            base_hook(self)
        backbones = backbones_in(self)
        if any(b.reload_open for b in backbones):
            layerwise_function("finalize_layerwise_reload")(self, self._lifecycle_model_config)
            return
        for b in backbones:
            b.on_cold_load_processed()

    cls = type(f"Lifecycle{family.causal_lm}", (base,), {
        "__init__": __init__, "load_weights": _structure_preserving(load_weights),
        "process_weights_after_loading": process_weights_after_loading,
        "__module__": __name__, "lifecycle_family": family.name})
    _CAUSAL_LM_CLASSES[family.name] = cls
    return cls


def _structure_preserving(load: LoadWeights) -> LoadWeights:
    """Wrap a draft class's `load_weights`: its tensors pass the frozen structure first (`structure.admit`; a
    refusal is raised by the backbone's `before_write`, so a call inside a reload fails like any bad bucket);
    vLLM's per-call decisions and checks are neutralized around the call (`structure.within_call`)."""

    def load_weights(self: nn.Module, weights: Weights) -> Any:
        structure = self.__dict__["_lifecycle_structure"]
        backbones = backbones_in(self)
        weights, refusal = structure.admit(weights, backbones[0].lifecycle if backbones else None)
        for b in backbones:
            if refusal is not None:
                b.__dict__["_structure_refusal"] = refusal
        with structure.within_call():
            result = load(self, weights)
        carried = structure.carried(weights)
        for b in backbones:
            b.note_carried(carried)
        return result

    return load_weights


def _inner_class(family: VLLMDraftFamily, base: type) -> type:
    key = (family.name, base)
    if key not in _INNER_CLASSES:
        # the lifecycle mixin first, so its precompute override wins; the family's builders record metadata only
        builders = {name: LifecycleDraftModel._record_metadata for name in family.builders}
        _INNER_CLASSES[key] = type(f"Lifecycle{base.__name__}", (LifecycleDraftModel, base),
                                   {"_family": family, **builders})
    return _INNER_CLASSES[key]


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0
