"""The wrappers of vLLM's reload functions (records of `compat/registry.py`): each hands the draft's part to the
epoch boundary (`epoch.py`) and leaves a model without lifecycle drafts (the target) to vLLM as it is.

  initialize_layerwise_reload(model)   -> `epoch.begin`: each lifecycle draft in `model` begins a reload epoch,
                                           then vLLM's
  _layerwise_process(layer, info)       -> a draft's layer is processed only once every tensor and every shard
                                           of a fused parameter arrived (`shards.py`; vLLM's element count can add
                                           up without them), written straight into its kept tensors where
                                           processing keeps their layout (`direct.py`), else by vLLM; then the
                                           owning draft records that layer's tensors as loaded
  _copy_and_restore_kernel_tensors      -> the layer is recorded as written before vLLM copies it back
  finalize_layerwise_reload(model, c)   -> `epoch.finish`: the partial payload settled, vLLM's finalize, then each
                                           draft finishes (every layer ready, reload hooks, refresh in place) or is
                                           quarantined and the error raised to the caller
  process_weights_after_loading(...)    -> after a cold load: vLLM's processing, then each draft builds its
  (base_loader's and model_loader.utils')  derived buffers from ready layers; while a reload epoch is open (a write
                                           after the cold load began one): the epoch is finished as
                                           `finalize_layerwise_reload` would, never by replaying cold-load
                                           processing over layers the reload already processed

`reload_weights`, the native weight-transfer engines and RL trainers all call these names, so one set of wrappers
covers cold load, target reload, draft reload and the transfer sessions. A reference taken before the plugin
wrapped a name still reaches the lifecycle: the draft classes' own `load_weights` and
`process_weights_after_loading` (`classes.py`) do the same.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from ..drafts.owners import drafts_of, note_engine_model, owner_of
from ..drafts.runtime import WORKER
from . import direct
from .epoch import begin, finish
from .shards import missing_parts

_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"

__all__ = ["wrap_copy_back", "wrap_finalize", "wrap_initialize", "wrap_layerwise_process",
           "wrap_process_weights_after_loading"]

def _require_module(model: Any, function: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function}(model, ...): model must be a torch.nn.Module, got {type(model).__name__}; "
                        "nothing was changed")


def wrap_initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
        _require_module(model, "initialize_layerwise_reload")
        if not drafts_of(model):  # the target, or a model without lifecycle drafts: vLLM's reload as it is
            return original(model, *args, **kwargs)
        return begin(model, original, *args, **kwargs)

    return initialize_layerwise_reload


def wrap_finalize(original: Callable[..., Any]) -> Callable[..., Any]:
    def finalize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
        _require_module(model, "finalize_layerwise_reload")
        if not drafts_of(model):
            with WORKER.flag("in_vllm_reload"):
                return original(model, *args, **kwargs)
        return finish(model, original, *args, **kwargs)

    return finalize_layerwise_reload


def wrap_layerwise_process(original: Callable[..., Any]) -> Callable[..., Any]:
    def layerwise_process(layer: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
        owner = owner_of(layer)
        completing = WORKER.completing  # `partial.settle_partial` completes it with last values, and marks it
        # vLLM processes a layer once its copied elements add up, so a shard sent twice can stand in for one
        # never sent: a draft's layer in a reload is processed only once every tensor and shard arrived
        # (`shards.py`); until then it keeps buffering, and the finalize decides (`partial.settle_partial`)
        if owner is not None and info.kernel_tensors is not None and not completing and missing_parts(layer, info):
            return None
        # vLLM also processes layers that got only part of their elements (at finalize, with the rest
        # uninitialised); only a layer that received everything counts as loaded
        complete = not completing and info.load_numel_total is not None \
            and info.load_numel >= info.load_numel_total > 0
        was = WORKER.in_vllm_reload  # `WORKER.flag`, inline: this runs for every layer of every push
        try:
            WORKER.in_vllm_reload = True
            runtime = owner[0].lifecycle_runtime if owner is not None else None
            if runtime is not None and not completing and direct.writes_in_place(layer, info, runtime):
                direct.write_layer(layer, info, runtime)
                result = None  # as vLLM's `_layerwise_process`
            else:
                result = vllm_process(original, layer, info, *args, **kwargs)
        finally:
            WORKER.in_vllm_reload = was
        WORKER.touched.discard(layer)  # processed and copied back whole: the reload wrote it (it no longer waits)
        if complete and owner is not None:
            backbone, names = owner
            if backbone.lifecycle.can("weights_loaded"):
                backbone.lifecycle.weights_loaded(names)
        return result

    return layerwise_process


def vllm_process(original: Callable[..., Any], layer: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's own `_layerwise_process` of a layer (materialise, load, process, copy back): one name a profiler
    (`benchmarks.engine_steps`) can time apart from the plugin's checks around it."""
    return original(layer, info, *args, **kwargs)


def wrap_copy_back(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM copies a processed layer into its live (kernel) tensors one by one: recorded before the first copy, so
    # an interrupt part way is known to have written the layer (`unwind.unwind` cannot undo it)
    def copy_back(layer: Any, *args: Any, **kwargs: Any) -> Any:
        WORKER.touched.add(layer)
        return original(layer, *args, **kwargs)

    return copy_back


def wrap_process_weights_after_loading(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
        backbones = drafts_of(model)
        if any(b.reload_open for b in backbones):  # a plain load_weights after the cold load opened an epoch
            model_config = args[0] if args else kwargs["model_config"]
            finalize = importlib.import_module(_LAYERWISE).finalize_layerwise_reload  # the wrapped one
            return finalize(model, model_config)
        result = original(model, *args, **kwargs)
        note_engine_model(model)  # the target: a draft reload must leave the modules they share live
        for backbone in backbones:
            backbone.on_cold_load_processed()
        return result

    return process_weights_after_loading

