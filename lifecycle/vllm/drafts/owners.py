"""Which lifecycle draft owns a vLLM module, and what the rest of the plugin may ask of that draft.

vLLM reports per module: `_layerwise_process(layer, info)`, a quant method's `process_weights_after_loading(layer)`,
the per-module reload infos in `LAYERWISE_INFO`. `owner_of(module)` finds the draft whose checkpoint tensors the
module holds (`MODULE_OWNERS`, filled when the draft claims its modules); `backbones_in(model)` finds every
lifecycle draft in a model.

`VLLMDraftBackbone` is what such a draft is to the plugin: the hooks vLLM's load paths drive, the state the
wrappers, RPCs and the drafting gate share. `drafts.LifecycleDraftModel` implements it. It is declared here, low
in the package, so the modules that read a draft (`epochs`, `quantized`, `shadows`, `processing`, `patches`,
`serving`, `worker`) never import the mixin, which imports several of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from ...backbone import DraftBackbone

if TYPE_CHECKING:
    from ..settings import PartialPolicy
    from .families import VLLMDraftFamily

__all__ = ["ENGINE_MODULES", "MODULE_OWNERS", "VLLMDraftBackbone", "backbones_in", "draft_model_of",
           "note_engine_model", "owner_of", "shared_modules"]


class VLLMDraftBackbone(DraftBackbone):
    """A lifecycle-enabled draft backbone inside a vLLM model, as the plugin's wrappers and RPCs see it. The hooks
    are implemented by the mixin, `drafts.LifecycleDraftModel`, the only subclass."""

    _family: ClassVar[VLLMDraftFamily]
    #: vLLM's decoder layers (the inner model's own `nn.ModuleList`, of vLLM's modules: read as Any)
    layers: Any
    #: this reload's partial policy when the caller chose one (an RPC's `partial=`); None: the engine setting
    reload_partial: PartialPolicy | None = None
    #: steps the engine has served without this draft since it stopped being usable (None: drafting)
    drafting_paused_steps: int | None = None

    @property
    def reload_open(self) -> bool:
        """A reload epoch has begun and is not finished yet (weights may be mid-write)."""
        lc = self.lifecycle
        return lc.in_reload and lc.can("finalize_loading")

    # ---- the hooks vLLM's load paths drive (the draft class's load_weights and the patched entry points) -------
    def before_write(self) -> None:
        """A `load_weights` call is about to write."""
        raise NotImplementedError

    def after_write(self) -> None:
        """A `load_weights` call wrote its tensors."""
        raise NotImplementedError

    def note_carried(self, modules: Iterable[str]) -> None:
        """A `load_weights` call carried tensors of these optional modules (`structure.py`)."""
        raise NotImplementedError

    def on_cold_load_processed(self) -> None:
        """vLLM processed the model after its cold load (no reload epoch open)."""
        raise NotImplementedError

    def on_reload_begin(self) -> None:
        """vLLM's `initialize_layerwise_reload` is about to run on the model."""
        raise NotImplementedError


#: module -> (weak reference to its backbone, tracked tensor names of that module): how vLLM's per-module events
#: find the lifecycle (`owner_of`). The backbone is held weakly: it holds the module, and a value that held it
#: would keep its key alive, so no draft would ever be freed, not even by the cyclic collector.
MODULE_OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[VLLMDraftBackbone], list[str]]] = (
    weakref.WeakKeyDictionary()
)


def owner_of(module: nn.Module) -> tuple[VLLMDraftBackbone, list[str]] | None:
    """The backbone whose tracked tensors `module` holds, with their names (`MODULE_OWNERS`), or None."""
    entry = MODULE_OWNERS.get(module)
    if entry is None:
        return None
    backbone = entry[0]()
    return None if backbone is None else (backbone, entry[1])


def backbones_in(model: nn.Module) -> list[VLLMDraftBackbone]:
    """Every lifecycle draft backbone among `model`'s modules (none in a target)."""
    return [m for m in model.modules() if isinstance(m, VLLMDraftBackbone)]


def draft_model_of(runner: Any) -> Any:
    """The runner's draft model, unwrapped, or None. Both model runners answer `get_draft_model()`: V1 keeps the
    draft in `runner.drafter.model` (possibly inside a CUDA-graph wrapper), Model Runner V2 (vLLM's GPU default,
    the only runner for DSpark) in `runner.speculator.model`; the attributes are the fallback for a runner
    without the method."""
    get = getattr(runner, "get_draft_model", None)
    if callable(get):
        return get()
    for holder in ("drafter", "speculator"):
        model = getattr(getattr(runner, holder, None), "model", None)
        if model is not None:
            return model.unwrap() if hasattr(model, "unwrap") else model
    return None


#: modules of the models the engine loaded that hold no lifecycle draft (the target; `note_engine_model`)
ENGINE_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def note_engine_model(model: nn.Module) -> None:
    """Remember the modules of a model the engine loaded that holds no lifecycle draft (the target)."""
    if not backbones_in(model):
        ENGINE_MODULES.update(model.modules())


def shared_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules of a draft that belong to the target too: vLLM shares the embedding and LM head with a draft that
    has none of its own, and one cached rotary embedding between equal configs."""
    return [(n, m) for n, m in model.named_modules() if m in ENGINE_MODULES]
