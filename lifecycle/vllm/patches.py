"""Wrap vLLM's reload entry points where vLLM looks them up, so every load path drives the lifecycle.

  initialize_layerwise_reload(model)   -> each lifecycle draft in `model` begins a reload epoch, then vLLM's
  _layerwise_process(layer, info)       -> after vLLM processed a layer that received ALL its elements, the
                                           owning draft records that layer's tensors as loaded
  finalize_layerwise_reload(model, c)   -> vLLM's finalize first, then each draft finishes (every layer ready?),
                                           runs its reload hooks and refreshes in place; a draft whose reload is
                                           incomplete is quarantined and the error is raised to the caller
  process_weights_after_loading(...)    -> vLLM's cold-load processing first, then each draft builds its
                                           derived buffers (cold) from ready layers

`reload_weights`, the native weight-transfer engines and RL trainers all call these names, so one set of
wrappers covers cold load, target reload, draft reload and the transfer sessions.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from .drafts import MODULE_OWNERS, backbones_in

__all__ = ["PATCH_POINTS", "install"]

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
        result = original(model, *args, **kwargs)
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
        result = original(layer, info, *args, **kwargs)
        owner = MODULE_OWNERS.get(layer)
        if complete and owner is not None:
            backbone, names = owner
            if backbone.lifecycle.can("weights_loaded"):
                backbone.lifecycle.weights_loaded(names)
        return result

    return layerwise_process


def _process_weights_after_loading(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(model, *args, **kwargs)
        for backbone in backbones_in(model):
            backbone.on_cold_load_processed()
        return result

    return process_weights_after_loading


PATCH_POINTS: tuple[tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    ("vllm.model_executor.model_loader.reload.layerwise", "_layerwise_process", _layerwise_process),
    ("vllm.model_executor.model_loader.reload.layerwise", "initialize_layerwise_reload", _initialize),
    ("vllm.model_executor.model_loader.reload.layerwise", "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload", _initialize),
    ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.reload.inplace", "initialize_layerwise_reload", _initialize),
    ("vllm.model_executor.model_loader.reload.inplace", "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.reload.torchao_decorator", "initialize_layerwise_reload", _initialize),
    ("vllm.model_executor.model_loader.reload.torchao_decorator", "finalize_layerwise_reload", _finalize),
    ("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading",
     _process_weights_after_loading),
)


def install() -> list[str]:
    """Install every wrapper (idempotent). Returns `module.attr` for each patched name."""
    return [f"{m}.{a}" for m, a, make in PATCH_POINTS if _wrap(m, a, make)]

