"""Unwinding vLLM's layerwise reload of a draft: every module still waiting gets its kept ("kernel") tensors back.

vLLM's layerwise reload (`initialize_layerwise_reload`) moves every module's tensors to META and keeps the live
("kernel") tensors aside; a module that received all its elements is materialised, processed and copied back into
its kernel tensors; `finalize_layerwise_reload` puts the kernel tensors back for modules that received nothing and
processes the rest. A failure in between (a bad bucket, a loader that raises, a checkpoint that changed) used to
leave modules on META ("Tensor on device cpu is not on the expected device meta!") and the draft in
PARTIALLY_LOADED, where a retry is refused: only a restart recovered. `unwind(model)` gives every module still
waiting for elements its kernel tensors back, untouched (what was buffered for it is dropped), and resets vLLM's
bookkeeping: each module then holds either the values this reload wrote (it completed) or its last values; nothing
is left on META or half-written. `epoch.fail` decides from its count what the draft's epoch became.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from ..compat.patching import write_private
from ..drafts.owners import modules_of, shared_modules
from ..drafts.runtime import WORKER

__all__ = ["infos", "keep_shared_modules_live", "layerwise_function", "put_back", "reload_in_progress", "unwind"]


def layerwise_function(name: str) -> Callable[..., Any]:
    """vLLM's layerwise reload function `name`, looked up now (so the plugin's wrapper, once installed)."""
    function: Callable[..., Any] = getattr(
        importlib.import_module("vllm.model_executor.model_loader.reload.layerwise"), name)
    return function


def infos(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, vLLM's reload info) for every module of `model` that is in a reload now."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = []
    for _, module in modules_of(model):
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load() and info.kernel_tensors is not None:
            out.append((module, info))
    return out


def reload_in_progress(model: nn.Module) -> bool:
    """Whether vLLM's layerwise reload of `model` was initialised and not finalised (modules wait on META, or
    an interrupted initialize left some half-way)."""
    return bool(infos(model)) or bool(_half_initialized(model))


def put_back(module: nn.Module, info: Any) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors

    _place_kernel_tensors(module, info)
    info.reset()


def _half_initialized(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """Modules whose kept tensors vLLM took aside but which it never made loadable: an interrupted
    `initialize_layerwise_reload` (their tensors may be on META, or gone)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return [(m, info) for _, m in modules_of(model) if (info := LAYERWISE_INFO.get(m)) is not None
            and info.kernel_tensors is not None and not info.can_load()]


def unwind(model: nn.Module, *, non_persistent: dict[nn.Module, set[str]] | None = None) -> int:
    """Give every module still in the reload its kept tensors back and end vLLM's reload of `model`. Returns
    how many of its modules this reload had written (0: the model holds exactly its weights from before).
    `non_persistent`: each module's non-persistent buffer names before `initialize_layerwise_reload` ran, for
    the modules an interrupted initialize left half-way (`_half_initialized`)."""
    waiting = infos(model)
    half = _half_initialized(model)
    modules = [m for _, m in modules_of(model)]
    touched = [m for m in modules if m in WORKER.touched]
    for m in touched:
        WORKER.touched.discard(m)
    if not waiting and not half:
        return len(touched)
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    skip = {id(m) for m, _ in waiting} | {id(m) for _, m in shared_modules(model)}
    # initialize_layerwise_reload put every module of `model` in the reload (but the shared ones, taken out by
    # keep_shared_modules_live): one that no longer waits was processed (written into its kernel tensors); one
    # that still waits may have been written in part (`WORKER.touched`: an interrupted copy back)
    written = 0 if half else sum(1 for m in modules if id(m) not in skip and m in LAYERWISE_INFO)
    written += sum(1 for m in touched if id(m) in skip)
    for module, info in half:
        if non_persistent is not None and module in non_persistent:
            info.kernel_non_persistent_buffers = non_persistent[module]
        put_back(module, info)
    for module, info in waiting:
        put_back(module, info)
    if hasattr(model, "_original_do_torchao_reload"):
        write_private("model._do_torchao_reload", model, model._original_do_torchao_reload)
    return written


def keep_shared_modules_live(model: nn.Module) -> list[str]:
    """Take the modules a draft shares with the target out of the draft's reload: otherwise the TARGET's
    tensors sit on META until finalize, and the engine cannot serve while a reload is open (between the calls of
    a weight-transfer session, or after a trainer died mid-reload). A payload that carries tensors of them is refused
    before anything is written (the draft's structure, frozen at cold load, shares them: `structure.py`), so the
    target's weights are never written by a draft reload. Returns their names."""
    waiting = {id(m): info for m, info in infos(model)}
    taken = []
    for name, module in shared_modules(model):
        if id(module) in waiting:
            put_back(module, waiting[id(module)])
            taken.append(name)
    return taken
