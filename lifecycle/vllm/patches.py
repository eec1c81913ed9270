"""Wrap vLLM's reload entry points where vLLM looks them up, so every load path drives the lifecycle.

  initialize_layerwise_reload(model)   -> each lifecycle draft in `model` begins a reload epoch, then vLLM's
  _layerwise_process(layer, info)       -> after vLLM processed a layer that received ALL its elements, the
                                           owning draft records that layer's tensors as loaded
  finalize_layerwise_reload(model, c)   -> vLLM's finalize first, then each draft finishes (every layer ready?),
                                           runs its reload hooks and refreshes in place; a draft whose reload is
                                           incomplete is quarantined and the error is raised to the caller
  process_weights_after_loading(...)    -> after a cold load: vLLM's processing first, then each draft builds
  (base_loader's and model_loader.utils')  its derived buffers from ready layers; during a reload epoch (a plain
                                           `load_weights` after the cold load began one): the epoch is finished
                                           as `finalize_layerwise_reload` would, never by replaying cold-load
                                           processing over layers the reload already processed

`reload_weights`, the native weight-transfer engines and RL trainers all call these names, so one set of
wrappers covers cold load, target reload, draft reload and the transfer sessions. A reference taken before the
plugin wrapped a name still reaches the lifecycle: the draft classes' own `load_weights` and
`process_weights_after_loading` (`drafts.py`) do the same.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from .drafts import IN_VLLM_RELOAD, MODULE_OWNERS, backbones_in

__all__ = ["ENGINE_NAMES", "PATCH_POINTS", "install"]

_MARK = "__reload_lifecycle_wrapped__"


def _wrap(module_name: str, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    module = importlib.import_module(module_name)
    original = getattr(module, attr, None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    wrapper.__wrapped_original__ = original  # type: ignore[attr-defined]
    setattr(module, attr, wrapper)
    return True


def _initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
        for backbone in backbones_in(model):
            backbone.on_reload_begin()
        return original(model, *args, **kwargs)

    return initialize_layerwise_reload


def _finalize(original: Callable[..., Any]) -> Callable[..., Any]:
    def finalize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
        token = IN_VLLM_RELOAD.set(True)
        try:
            result = original(model, *args, **kwargs)
        finally:
            IN_VLLM_RELOAD.reset(token)
        errors = []
        for backbone in backbones_in(model):
            try:
                backbone.on_reload_finalized()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return result

    return finalize_layerwise_reload


def _layerwise_process(original: Callable[..., Any]) -> Callable[..., Any]:
    def layerwise_process(layer: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM also processes layers that got only part of their elements (at finalize, with the rest
        # uninitialised); only a layer that received everything counts as loaded
        complete = info.load_numel_total is not None and info.load_numel >= info.load_numel_total > 0
        token = IN_VLLM_RELOAD.set(True)
        try:
            result = original(layer, info, *args, **kwargs)
        finally:
            IN_VLLM_RELOAD.reset(token)
        owner = MODULE_OWNERS.get(layer)
        if complete and owner is not None:
            backbone, names = owner
            if backbone.lifecycle.can("weights_loaded"):
                backbone.lifecycle.weights_loaded(names)
        return result

    return layerwise_process


def _process_weights_after_loading(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
        backbones = backbones_in(model)
        if any(b.reload_open for b in backbones):
            model_config = args[0] if args else kwargs["model_config"]
            finalize = importlib.import_module(_LAYERWISE).finalize_layerwise_reload  # the wrapped one
            return finalize(model, model_config)
        result = original(model, *args, **kwargs)
        for backbone in backbones:
            backbone.on_cold_load_processed()
        return result

    return process_weights_after_loading


_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"

#: (vLLM module, function, wrapper maker): every name the plugin wraps, where vLLM looks it up.
PATCH_POINTS: tuple[tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    (_LAYERWISE, "_layerwise_process", _layerwise_process),
    (_LAYERWISE, "initialize_layerwise_reload", _initialize),
    (_LAYERWISE, "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload", _initialize),
    ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.reload.inplace", "initialize_layerwise_reload", _initialize),
    ("vllm.model_executor.model_loader.reload.inplace", "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.reload.torchao_decorator", "initialize_layerwise_reload", _initialize),
    ("vllm.model_executor.model_loader.reload.torchao_decorator", "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading",
     _process_weights_after_loading),
    ("vllm.model_executor.model_loader.utils", "process_weights_after_loading", _process_weights_after_loading),
)

#: (vLLM module, name, who uses it): the other vLLM names the plugin relies on (checked with PATCH_POINTS).
ENGINE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.load_numel", "patches._layerwise_process"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.load_numel_total",
     "patches._layerwise_process"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase.process_weights_after_loading",
     "drafts (shadows, deferred processing)"),
    ("vllm.model_executor.models.registry", "ModelRegistry", "plugin (draft class registration)"),
    ("vllm.model_executor.models.registry", "_ModelRegistry.register_model", "plugin (draft class registration)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_draft_model", "worker RPCs (Model Runner V1)"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.get_draft_model", "worker RPCs (Model Runner V2)"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.set_weight_update_target",
     "transfer (draft sessions)"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.register_engine", "transfer"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory._registry", "transfer"),
)


def install() -> list[str]:
    """Install every wrapper (idempotent). Returns `module.attr` for each patched name."""
    return [f"{m}.{a}" for m, a, make in PATCH_POINTS if _wrap(m, a, make)]

