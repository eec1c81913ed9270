"""Wrap vLLM's reload entry points where vLLM looks them up, so every load path drives the lifecycle.

  initialize_layerwise_reload(model)   -> each lifecycle draft in `model` begins a reload epoch, then vLLM's
  _layerwise_process(layer, info)       -> a draft's layer is processed only once every tensor and every shard
                                           of a fused parameter arrived (`shards.py`; vLLM's element count can add
                                           up without them); after vLLM processed it, the owning draft records
                                           that layer's tensors as loaded
  finalize_layerwise_reload(model, c)   -> vLLM's finalize first, then each draft finishes (every layer ready?),
                                           runs its reload hooks and refreshes in place; a draft whose reload is
                                           incomplete is quarantined and the error is raised to the caller
  process_weights_after_loading(...)    -> after a cold load: vLLM's processing first, then each draft builds
  (base_loader's and model_loader.utils')  its derived buffers from ready layers; during a reload epoch (a plain
                                           `load_weights` after the cold load began one): the epoch is finished
                                           as `finalize_layerwise_reload` would, never by replaying cold-load
                                           processing over layers the reload already processed

  GPUModelRunner._input_fits_in_drafter -> False while a draft is not usable (quarantined, mid-reload): vLLM
                                           then runs the step without the drafter (the target's tokens only)
  DFlashSpeculator.propose (Model        -> the same gate on Model Runner V2 (`runner_v2.py`): zero draft
  Runner V2)                               tokens without running the draft model

`reload_weights`, the native weight-transfer engines and RL trainers all call these names, so one set of
wrappers covers cold load, target reload, draft reload and the transfer sessions. A reference taken before the
plugin wrapped a name still reaches the lifecycle: the draft classes' own `load_weights` and
`process_weights_after_loading` (`classes.py`) do the same.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from .. import settings
from ..drafts.owners import backbones_in, note_engine_model, owner_of
from ..drafts.processing import IN_VLLM_RELOAD, TOUCHED
from ..drafts.quantized import reload_blocker
from .epochs import (
    describe,
    end_failed_epoch,
    finish_epoch,
    keep_shared_modules_live,
    reload_in_progress,
    settle_partial,
)
from .shards import COMPLETING, missing_parts

_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"

__all__ = ["wrap_copy_back", "wrap_finalize", "wrap_initialize", "wrap_layerwise_process",
           "wrap_process_weights_after_loading"]

def _require_module(model: Any, function: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function}(model, ...): model must be a torch.nn.Module, got {type(model).__name__}; "
                        "nothing was changed")


def _in_vllm_reload(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one of vLLM's reload steps with `IN_VLLM_RELOAD` set: a draft's `load_weights` called from inside it is
    part of vLLM's layerwise reload, not a plain write after a completed load (trainer path iv)."""
    token = IN_VLLM_RELOAD.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        IN_VLLM_RELOAD.reset(token)


def wrap_initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
        _require_module(model, "initialize_layerwise_reload")
        backbones = backbones_in(model)
        if not backbones:  # the target, or a model without lifecycle drafts: vLLM's reload as it is
            return original(model, *args, **kwargs)
        if (why := reload_blocker(model)) is not None:
            raise NotImplementedError(f"reload-lifecycle: {why}")
        if reload_in_progress(model):  # the last reload never reached finalize
            end_failed_epoch(model, "abandoned: a new reload began before the previous one was finalized")
        # what vLLM's initialize moves to META and back: its buffers' persistence, for an interrupted one
        non_persistent = {m: set(m._non_persistent_buffers_set) for m in model.modules()}
        TOUCHED.difference_update(non_persistent)
        try:
            for backbone in backbones:
                backbone.on_reload_begin()
            result = original(model, *args, **kwargs)
            keep_shared_modules_live(model)  # what the draft shares with the target stays live
        except BaseException as e:  # an interrupt too: no module may stay on META, the epoch ends here
            end_failed_epoch(model, f"initialize_layerwise_reload failed: {describe(e)}",
                             non_persistent=non_persistent)
            raise
        return result

    return initialize_layerwise_reload


def wrap_finalize(original: Callable[..., Any]) -> Callable[..., Any]:
    def finalize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
        _require_module(model, "finalize_layerwise_reload")
        backbones = backbones_in(model)
        if not backbones:
            return _in_vllm_reload(original, model, *args, **kwargs)
        model_config = args[0] if args else kwargs.get("model_config")
        try:
            if not hasattr(model_config, "dtype"):  # vLLM reads it only after processing every other layer
                raise TypeError("finalize_layerwise_reload(model, model_config): model_config must be the draft's "
                                f"ModelConfig, got {type(model_config).__name__}")
            policies = {b: settings.check_partial(b.reload_partial, "partial") for b in backbones}
            outcomes = settle_partial(model, policies.__getitem__)
            result = _in_vllm_reload(original, model, *args, **kwargs)
        except BaseException as e:
            end_failed_epoch(model, f"finalize_layerwise_reload failed: {describe(e)}")
            raise
        errors = []
        for backbone in backbones:
            backbone.reload_partial = None
            try:
                finish_epoch(backbone, outcomes.get(backbone), policies[backbone])
            except Exception as e:
                errors.append(e)
            except BaseException as e:  # interrupted: the drafts not finished yet are quarantined, not left open
                end_failed_epoch(model, f"finalize_layerwise_reload interrupted: {describe(e)}")
                raise
        if errors:
            raise errors[0]
        return result

    return finalize_layerwise_reload


def wrap_layerwise_process(original: Callable[..., Any]) -> Callable[..., Any]:
    def layerwise_process(layer: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
        owner = owner_of(layer)
        completing = COMPLETING.get()  # `epochs.settle_partial` completes it with last values, and marks it
        # vLLM processes a layer once its copied elements add up, so a shard sent twice can stand in for one
        # never sent: a draft's layer in a reload is processed only once every tensor and shard arrived
        # (`shards.py`); until then it keeps buffering, and the finalize decides (`epochs.settle_partial`)
        if owner is not None and info.kernel_tensors is not None and not completing and missing_parts(layer, info):
            return None
        # vLLM also processes layers that got only part of their elements (at finalize, with the rest
        # uninitialised); only a layer that received everything counts as loaded
        complete = not completing and info.load_numel_total is not None \
            and info.load_numel >= info.load_numel_total > 0
        result = _in_vllm_reload(original, layer, info, *args, **kwargs)
        TOUCHED.discard(layer)  # processed and copied back whole: the reload wrote it (it no longer waits)
        if complete and owner is not None:
            backbone, names = owner
            if backbone.lifecycle.can("weights_loaded"):
                backbone.lifecycle.weights_loaded(names)
        return result

    return layerwise_process


def wrap_copy_back(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM copies a processed layer into its live (kernel) tensors one by one: recorded before the first copy, so
    # an interrupt part way is known to have written the layer (`epochs.unwind` cannot undo it)
    def copy_back(layer: Any, *args: Any, **kwargs: Any) -> Any:
        TOUCHED.add(layer)
        return original(layer, *args, **kwargs)

    return copy_back


def wrap_process_weights_after_loading(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
        backbones = backbones_in(model)
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

