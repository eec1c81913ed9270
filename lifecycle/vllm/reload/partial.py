"""A payload that did not send everything: what each module that received part of its elements becomes, at
finalize, before vLLM's own finalize processes it with the rest uninitialised.

`settle_partial(model, policy)`: with `keep`, when the module's kept tensors are in the checkpoint layout
(unquantized and not repacked: the GPU layout) and its layer may keep its values (not partly written by an aborted
reload, not a dummy start's), it is completed with its last values and processed; otherwise (and always with
`refuse`) it gets its kernel tensors back unchanged and is reported as not loaded, with why. It also records which
tensors received nothing (vLLM puts their kernel tensors back: last values, bit for bit), which the draft declares
unchanged under `keep` (`epoch.finish_epoch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...torch_private import own_buffers, own_parameters
from ..drafts.owners import VLLMDraftBackbone, drafts_of, owner_of
from ..drafts.runtime import WORKER
from .shards import missing_parts
from .unwind import infos, put_back

if TYPE_CHECKING:
    from ..settings import PartialPolicy

__all__ = ["PartialOutcome", "settle_partial"]


@dataclass
class PartialOutcome:
    """What `settle_partial` found in one draft: names received nothing (kept by vLLM), completed with
    their last values, or left unloaded (name -> why)."""

    untouched: list[str] = field(default_factory=list)
    filled: list[str] = field(default_factory=list)
    unfilled: dict[str, str] = field(default_factory=dict)
    layerwise: bool = False  # vLLM's layerwise reload still held modules of the draft (else: direct writes only)


def settle_partial(model: nn.Module, policy_of: Callable[[VLLMDraftBackbone], PartialPolicy]
                   ) -> dict[VLLMDraftBackbone, PartialOutcome]:
    """Before vLLM's finalize: per lifecycle draft in `model`, what received nothing, and for each module that
    received part of its elements, complete it with its last values (`keep`, checkpoint layout) or put its
    kernel tensors back unchanged (see the module docstring)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    outcomes: dict[VLLMDraftBackbone, PartialOutcome] = {}
    waiting = infos(model)
    for module, info in waiting:
        owner = owner_of(module)
        if owner is None or is_deferred_attention_layer(module):
            continue
        backbone, names = owner
        out = outcomes.setdefault(backbone, PartialOutcome())
        out.layerwise = True
        shadow = backbone.lifecycle_runtime.shadow_of.get(module)
        if info.load_numel <= 0:
            out.untouched.extend(names)
            if shadow is not None:
                out.untouched.append(shadow)
            continue
        parts = missing_parts(module, info, _leaf_names(names))  # per tensor and shard (`shards.py`)
        sent = f"{info.load_numel} of {info.load_numel_total} elements were sent"
        why = (_must_be_written(backbone, names) or _not_fillable(module, info)) if policy_of(backbone) == "keep" \
            else "partial='refuse'"
        if why is None:
            _complete_with_last_values(module, info)
            out.filled.extend(names)
            backbone.lifecycle.weights_loaded(names)
            continue
        put_back(module, info)  # never process the unsent remainder uninitialised
        for n in names + ([shadow] if shadow else []):
            missing = f"; {parts[n]}" if n in parts else ""
            out.unfilled[n] = f"{sent}; kept unchanged, the sent part dropped ({why}){missing}"
    for backbone in drafts_of(model):
        outcomes.setdefault(backbone, PartialOutcome())
    return outcomes


def _must_be_written(backbone: VLLMDraftBackbone, names: list[str]) -> str | None:
    """Why the layer of `names` may keep nothing of its last values, or None: it holds values no checkpoint gave
    (a dummy start), or an aborted reload wrote part of it (`LayerReadiness.partly_written`)."""
    readiness = backbone.lifecycle.readiness
    layer = readiness.layer_of_name.get(names[0]) if names else None
    if layer is None or layer not in readiness.partly_written:
        return None
    return f"its layer {readiness.full_write_reason(layer)}: send all of it"


def _not_fillable(module: nn.Module, info: Any) -> str | None:
    """Why `module` cannot be completed with its last values, or None when it can: every kept tensor must be
    in the checkpoint layout (shape and dtype of the placeholder) and the module's processing must keep it so."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    quant = getattr(module, "quant_method", None)
    if quant is not None and not isinstance(quant, UnquantizedLinearMethod):
        return f"its quant method {type(quant).__name__} keeps a processed layout, not the checkpoint's"
    params, buffers = info.kernel_tensors
    for name, placeholder in {**own_parameters(module), **own_buffers(module)}.items():
        kept = params.get(name, buffers.get(name))
        if placeholder is None or kept is None:
            continue
        if tuple(kept.shape) != tuple(placeholder.shape) or kept.dtype != placeholder.dtype:
            return (f"its processed {name} is {tuple(kept.shape)} {kept.dtype}, not the checkpoint layout "
                    f"{tuple(placeholder.shape)} {placeholder.dtype} (repacked after loading)")
    return None


@torch.no_grad()
def _complete_with_last_values(module: nn.Module, info: Any) -> None:
    """Materialise the module with its kept values, then let vLLM replay the buffered loads over them, process
    the module and copy it back into its kernel tensors (`_layerwise_process` materialises only what is still
    META)."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.meta import materialize_layer

    materialize_layer(module, info)
    params, buffers = info.kernel_tensors
    for name, kept in {**params, **buffers}.items():
        live = getattr(module, name, None)
        if isinstance(live, torch.Tensor) and not live.is_meta and live.shape == kept.shape:
            live.copy_(kept)
    with WORKER.flag("completing"):  # the shards never sent hold their last values now: process it
        layerwise._layerwise_process(module, info)


def _leaf_names(names: list[str]) -> dict[str, str]:
    """A module's own tensor leaves -> their lifecycle names (`names`, from `owner_of`)."""
    return {n.rpartition(".")[2]: n for n in names}
