"""Which lifecycle draft owns a vLLM module, and what the rest of the plugin may ask of that draft.

vLLM reports per module: `_layerwise_process(layer, info)`, a quant method's `process_weights_after_loading(layer)`,
the per-module reload infos in `LAYERWISE_INFO`. `owner_of(module)` finds the draft whose checkpoint tensors the
module holds (its `DraftRuntime.owned`, filled when the draft claims its modules); `backbones_in(model)` finds every
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
from .runtime import WORKER, DraftRuntime

if TYPE_CHECKING:
    from .families import VLLMDraftFamily

__all__ = ["VLLMDraftBackbone", "backbones_in", "claim", "draft_model_of", "drafts_of", "forget_walk", "modules_of",
           "note_engine_model", "owner_of", "shared_modules", "walk_once"]


class VLLMDraftBackbone(DraftBackbone):
    """A lifecycle-enabled draft backbone inside a vLLM model, as the plugin's wrappers and RPCs see it. The hooks
    are implemented by the mixin, `drafts.LifecycleDraftModel`, the only subclass."""

    _family: ClassVar[VLLMDraftFamily]
    #: vLLM's decoder layers (the inner model's own `nn.ModuleList`, of vLLM's modules: read as Any)
    layers: Any
    #: what the plugin keeps for this draft (`runtime.DraftRuntime`), set at construction (`reload.classes`)
    lifecycle_runtime: DraftRuntime

    @property
    def reload_open(self) -> bool:
        """A reload epoch has begun and is not finished yet (weights may be mid-write)."""
        lc = self.lifecycle
        return lc.in_reload and lc.can("finalize_loading")

    # ---- the hooks vLLM's load paths drive (the draft class's load_weights and the patched entry points) -------
    def before_write(self, cause: str = "", *, inner_only: bool = False) -> None:
        """A `load_weights` call is about to write (`cause`: why it may begin an epoch, for the audit)."""
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

    def _record_metadata(self) -> None:
        """Set what vLLM's builders set besides the derived buffers (the precompute metadata)."""
        raise NotImplementedError


def claim(backbone: VLLMDraftBackbone, module: nn.Module, names: list[str]) -> None:
    """`backbone`'s tracked tensors `names` live in `module` (`DraftRuntime.owned`). Every claimer is indexed:
    vLLM shares some modules between the engines of one process (`get_rope` caches one rotary embedding per
    configuration), so a module outlives the draft that claimed it first."""
    backbone.lifecycle_runtime.owned[module] = names
    claimers = [r for r in WORKER.owners.get(module, ()) if (b := r()) is not None and b is not backbone]
    WORKER.owners[module] = (*claimers, weakref.ref(backbone))


def owner_of(module: nn.Module) -> tuple[VLLMDraftBackbone, list[str]] | None:
    """The live draft whose tracked tensors `module` holds, with their names, or None (`DraftRuntime.owned`): of
    the drafts that claimed it, the newest that is live, enabled (in `WORKER.drafts`) and still lists it."""
    try:
        claimers = WORKER.owners.get(module)
    except TypeError:  # not weakly referenceable: no draft claimed it
        return None
    for ref in reversed(claimers or ()):
        backbone = ref()
        # a draft whose enabling did not finish owns nothing; a claim `claim_structure` released names nothing
        if backbone is not None and backbone in WORKER.drafts:
            names = backbone.lifecycle_runtime.owned.get(module)
            if names is not None:
                return backbone, names
    return None


def drafts_of(model: nn.Module) -> list[VLLMDraftBackbone]:
    """`backbones_in(model)`, cached per model (the drafting gate and every entry point ask, per step or call)."""
    refs = WORKER.backbones.get(model)
    found: list[VLLMDraftBackbone] = [b for r in refs if isinstance(b := r(), VLLMDraftBackbone)] if refs else []
    if refs is None or len(found) != len(refs):
        found = backbones_in(model)
        WORKER.backbones[model] = tuple(weakref.ref(b) for b in found)
    return found


def backbones_in(model: nn.Module) -> list[VLLMDraftBackbone]:
    """Every lifecycle draft backbone among `model`'s modules (none in a target)."""
    return [m for _, m in modules_of(model) if isinstance(m, VLLMDraftBackbone)]


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


def note_engine_model(model: nn.Module) -> None:
    """Remember the modules of a model the engine loaded that holds no lifecycle draft (the target)."""
    if not backbones_in(model):
        for module in model.modules():
            WORKER.engine_modules.add(module)


def shared_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules of a draft that belong to the target too: vLLM shares the embedding and LM head with a draft that
    has none of its own, and one cached rotary embedding between equal configs."""
    return [(n, m) for n, m in modules_of(model) if m in WORKER.engine_modules]


def walk_once(model: nn.Module) -> None:
    """A push of `model` begins: its modules are walked now, and every look of the push at them reads this walk
    (`modules_of`) until `forget_walk` (its epoch ended). vLLM's reload moves tensors, never modules."""
    WORKER.walked[model] = [(n, weakref.ref(m)) for n, m in model.named_modules() if m is not model]


def forget_walk(model: nn.Module) -> None:
    WORKER.walked.pop(model, None)


def modules_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`model.named_modules()`: the push's walk (`walk_once`) while one is open, else walked now."""
    walked = WORKER.walked.get(model)
    if walked is not None:
        out = [(n, m) for n, r in walked if (m := r()) is not None]
        if len(out) == len(walked):
            return [("", model), *out]
    return list(model.named_modules())
