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

import functools
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from . import front_view, runner_v2, sessions, settings, weight_checker
from .epochs import (
    describe,
    end_failed_epoch,
    finish_epoch,
    keep_shared_modules_live,
    reload_in_progress,
    settle_partial,
)
from .owners import backbones_in, note_engine_model, owner_of
from .processing import IN_VLLM_RELOAD, TOUCHED
from .quantized import reload_blocker
from .serving import drafting_allowed
from .shards import COMPLETING, missing_parts

__all__ = ["ENGINE_NAMES", "PATCH_POINTS", "install"]

_MARK = "__reload_lifecycle_wrapped__"
#: the wrapper's attribute holding what it wraps (set with setattr: a function's own attributes are untyped)
_ORIGINAL = "__wrapped_original__"


def _wrap(module_name: str, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")  # "Class.method" wraps a method on its class
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    original = getattr(owner, name, None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(wrapper, _ORIGINAL, original)
    setattr(owner, name, wrapper)
    return True


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


def _initialize(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _finalize(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _layerwise_process(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _copy_back(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM copies a processed layer into its live (kernel) tensors one by one: recorded before the first copy, so
    # an interrupt part way is known to have written the layer (`epochs.unwind` cannot undo it)
    def copy_back(layer: Any, *args: Any, **kwargs: Any) -> Any:
        TOUCHED.add(layer)
        return original(layer, *args, **kwargs)

    return copy_back


def _drafting_gate(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's own way to run a step without the drafter: when this says False the runner zeroes the step's draft
    # tokens (the target verifies them, so the output is unchanged) and never calls into the draft model
    def _input_fits_in_drafter(runner: Any, *args: Any, **kwargs: Any) -> bool:
        return drafting_allowed(runner) and bool(original(runner, *args, **kwargs))

    return _input_fits_in_drafter


def _process_weights_after_loading(original: Callable[..., Any]) -> Callable[..., Any]:
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


_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"

#: (vLLM module, function, wrapper maker): every name the plugin wraps, where vLLM looks it up.
PATCH_POINTS: tuple[tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    (_LAYERWISE, "_layerwise_process", _layerwise_process),
    (_LAYERWISE, "_copy_and_restore_kernel_tensors", _copy_back),
    (_LAYERWISE, "_reload_attention_scales", _copy_back),
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
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._input_fits_in_drafter", _drafting_gate),
    *runner_v2.PATCH_POINTS,
    *sessions.PATCH_POINTS,  # vLLM's weight-update session in step with the draft's epoch (sessions.py)
    *weight_checker.PATCH_POINTS,  # the draft in vLLM's /weight_checker (weight_checker.py)
)

#: (vLLM module, name, who uses it): the other vLLM names the plugin relies on (checked with PATCH_POINTS).
ENGINE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.load_numel", "patches._layerwise_process"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.load_numel_total",
     "patches._layerwise_process"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.loaded_weights",
     "shards (what each layer received, per shard)"),
    ("vllm.model_executor.model_loader.reload.utils", "get_layer_tensors", "shards"),
    ("vllm.model_executor.model_loader.reload.utils", "get_tensor_load_numel", "shards"),
    ("vllm.model_executor.model_loader.reload.meta", "SKIP_LOAD_TENSORS", "shards"),
    ("vllm.model_executor.layers.linear", "QKVParallelLinear", "shards (the shards of a fused parameter)"),
    ("vllm.model_executor.layers.linear", "MergedColumnParallelLinear", "shards"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase.process_weights_after_loading",
     "processing (shadow capture, deferred processing)"),
    ("vllm.model_executor.models.registry", "ModelRegistry", "plugin (draft class registration)"),
    ("vllm.model_executor.models.registry", "_ModelRegistry.register_model", "plugin (draft class registration)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_draft_model", "worker RPCs (Model Runner V1)"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.get_draft_model", "worker RPCs (Model Runner V2)"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.set_weight_update_target",
     "transfer (draft sessions)"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.register_engine", "transfer"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory._registry", "transfer"),
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO", "epochs (unwinding a failed reload)"),
    ("vllm.model_executor.model_loader.reload.layerwise", "_place_kernel_tensors", "epochs (unwinding)"),
    ("vllm.model_executor.model_loader.reload.meta", "materialize_layer", "epochs (partial policy keep)"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.kernel_tensors", "epochs"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.can_load", "epochs"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo.reset", "epochs"),
    ("vllm.model_executor.layers.attention", "is_deferred_attention_layer", "quantized, epochs"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", "quantized, epochs (checkpoint layout)"),
    ("vllm.v1.executor.abstract", "Executor.__init__", "nodes (a Ray executor checks every worker's node)"),
    ("vllm.v1.executor.abstract", "Executor.collective_rpc", "nodes (the per-node probe)"),
    *runner_v2.ENGINE_NAMES,
    *front_view.ENGINE_NAMES,
    *sessions.ENGINE_NAMES,
    *weight_checker.ENGINE_NAMES,
)


def install() -> list[str]:
    """Install every wrapper (idempotent). Returns `module.attr` for each patched name."""
    return [f"{m}.{a}" for m, a, make in PATCH_POINTS if _wrap(m, a, make)]

