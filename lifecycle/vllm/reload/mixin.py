"""The lifecycle mixin of vLLM's draft models: how each load path of a vLLM draft drives its state machine.

vLLM's drafts build their fused buffers with `torch.cat` / `torch.stack` in a builder method that runs at the end
of every `load_weights` call (or, for Kimi K3, in the model's own `process_weights_after_loading`). In the
lifecycle-enabled classes (`classes.py`) each builder the family declares only records the precompute metadata
(`_record_metadata`); the tensors are declared derived buffers (registered, non-persistent, so level-2 sleep keeps
them), built once after the first load and refreshed in place after every reload, once every layer is ready.

How each trainer call path reaches the lifecycle:
- `initialize_layerwise_reload` ... `load_weights` ... `finalize_layerwise_reload` (and vLLM's transfer engines,
  which call the same functions): the wrapped functions in `patches.py` begin and finish the reload epoch.
- a plain `load_weights` after a completed load (no `initialize_layerwise_reload`): the first write begins a reload
  epoch, audited (`implicit_reload`, then `begin_reload`), and starts vLLM's own layerwise reload on the draft's
  own layers (the modules shared with the target keep serving), so each layer is materialised, processed once
  and copied back into its original storage as in the explicit path; whichever
  `process_weights_after_loading` runs next (the loader's, `model_loader.utils`' or the model's own hook) finishes
  it. Until then the draft refuses to draft: it never runs on buffers derived from older weights.

Post-processing may change a source's layout: on CPU an unquantized linear layer is repacked into a oneDNN handle
and its `weight` becomes an empty (0,) parameter; quantized layers pack their weights. Where the fused K/V buffer
reads its rows then (the live weight, per-layer shadows that are views of the buffer, or vLLM's own non-fused path
for a quantized projection) is decided per projection at construction (`shadows.py`): never a second copy.
Each claimed module's processing is guarded (`processing.py`); a reload epoch ends in `epochs.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import raise_unheld
from ...torch_private import own_parameters
from ...types import RefreshReport
from ..drafts.families import SHADOW
from ..drafts.owners import VLLMDraftBackbone, claim
from ..drafts.processing import guard_processing
from ..drafts.quantized import attention_prefixes
from ..drafts.runtime import WORKER
from ..drafts.shadows import plan_shadows
from ..drafts.submodules import bind, prepare
from .epoch import begin_implicit
from .writes import builder_called, guard_weight_loaders

if TYPE_CHECKING:
    from ..drafts.structure import DraftStructure

__all__ = ["IMPLICIT_CAUSE", "LOADER_VALUES", "LifecycleDraftModel"]

#: why a `load_weights` call began a reload epoch by itself (the `implicit_reload` event's cause)
IMPLICIT_CAUSE = "load_weights after a completed load, outside initialize_layerwise_reload"
#: why a cold load the draft's load_weights never saw leaves every layer to be written in full
LOADER_VALUES = ("holds what vLLM's loader put there without load_weights (load_format='dummy': random values), "
                 "not a checkpoint's")


class LifecycleDraftModel(VLLMDraftBackbone):
    """Mixed into vLLM's inner draft model class (DFlashQwen3Model and its relatives) at construction
    (`classes.py`); implements the hooks of `owners.VLLMDraftBackbone`."""

    def enable_lifecycle(self, *, name: str, rank: int) -> None:
        """Declare the draft's derived buffers and checkpoint tensors, claim the modules holding them
        (`DraftRuntime.owned`), guard each one's processing and its parameters' weight loaders."""
        family = self._family
        prepare(self)  # a submodule's derived state (LiLiCorr's head): the backbone's buffers, before any load
        plan = plan_shadows(self)  # the fused K/V buffer: live weight rows, backed shadows, or vLLM's non-fused path
        self.derived_buffers = plan.derived  # type: ignore[misc]  # the class's declarations, as planned for this draft
        # attention layers' own parameters (quantized KV-cache scales) are vLLM's to process, and it deletes
        # them once consumed: no derived buffer reads them, so they are not checkpoint tensors of the lifecycle
        untracked = family.untracked_prefixes + attention_prefixes(self)
        tracked: dict[str, torch.Tensor] = {n: p for n, p in self.named_parameters() if not n.startswith(untracked)}
        tracked.update(plan.shadows)
        self.init_lifecycle(name, rank=rank, tensors=tracked)
        owned: list[nn.Module] = []
        for mod_name, module in self.named_modules():
            names = [f"{mod_name}.{leaf}" if mod_name else leaf for leaf in own_parameters(module)]
            names = [n for n in names if n in tracked]
            if names:
                claim(self, module, names)
                owned.append(module)
                guard_processing(self, module, plan.captures.get(module))
                guard_weight_loaders(self, module, names)
        # the outermost modules holding the draft's own checkpoint tensors: what an implicit reload hands to vLLM's
        # layerwise reload (never the modules shared with the target, nor the RoPE cache vLLM shares between models)
        inner = {id(d) for m in owned for d in m.modules() if d is not m}
        self.lifecycle_runtime.roots = [m for m in owned if id(m) not in inner]
        WORKER.drafts.add(self)

    def meta_or_absent(self) -> set[str]:
        """As the core's, except a parameter slot its quant method emptied after processing (the CPU int8
        oneDNN kernel keeps the weight in its own handle and sets `weight` to None): that tensor is held by the
        kernel, not missing. vLLM reports each such layer when it processed all of it."""
        out = set()
        for name in super().meta_or_absent():
            module, leaf = self._tensor_slots.get(name, (None, ""))
            if module is None or leaf not in own_parameters(module) or own_parameters(module)[leaf] is not None:
                out.add(name)
        return out

    def refresh_derived_buffers(self, *, full: bool = False, rebuild: bool = False) -> RefreshReport:
        """The core's refresh; then each declared submodule points at the buffers (a no-op once it does)."""
        report = super().refresh_derived_buffers(full=full, rebuild=rebuild)
        bind(self)
        return report

    def _record_metadata(self) -> None:
        """What each declared builder sets besides its tensors: the non-tensor precompute metadata. vLLM calls the
        builder at the end of every `load_weights` call; after the cold load (which decides the structure) the
        geometry it reads is fixed, so a reload records it once per epoch, not once per call."""
        lc, runtime = self.lifecycle, self.lifecycle_runtime
        if lc.epoch > 0 and runtime.metadata_epoch == lc.epoch:
            return
        self._family.set_metadata(self)
        runtime.metadata_epoch = lc.epoch

    def _derived_builder(self) -> None:
        """Each declared builder of vLLM's class (`_build_fused_kv_buffers` and the like): `writes.builder_called`."""
        builder_called(self)

    def precompute_and_store_context_kv(self, *args: Any, **kwargs: Any) -> Any:
        slots = args[2] if len(args) > 2 else kwargs.get("context_slot_mapping")
        if slots is None and self.lifecycle.quarantined:
            # a dummy run stores nothing (vLLM runs one on data-parallel ranks whose drafter it skipped, to
            # keep them in step): skip it instead of failing the engine step
            return None
        self.require_usable("precompute_and_store_context_kv")  # quarantined or stale: refuse, never garbage
        # vLLM's method, after this mixin in the class `classes.py` makes
        return super().precompute_and_store_context_kv(*args, **kwargs)  # type: ignore[misc]  # not in a base mypy sees

    # ---- driven by the draft's load_weights and the patched vLLM entry points -------------------------------
    def before_write(self, cause: str = IMPLICIT_CAUSE, *, inner_only: bool = False) -> None:
        """A `load_weights` call is about to write. After a completed load (and outside a reload vLLM began),
        that write begins a reload epoch, audited, and starts vLLM's layerwise reload on the modules holding the
        draft's own checkpoint tensors (not on those it shares with the target, which keeps serving meanwhile).
        A call the frozen structure refused (`structure.admit`) raises here, before anything is written."""
        lc, runtime = self.lifecycle, self.lifecycle_runtime
        if runtime.structure_refusal is not None:
            refusal, runtime.structure_refusal = runtime.structure_refusal, None
            raise_unheld(lc.record_refusal("weights_loaded", refusal))
        if lc.usable or lc.quarantined:
            begin_implicit(self, cause, inner_only=inner_only)

    def after_write(self) -> None:
        """A `load_weights` call wrote. During the cold load (epoch 0): the tensors it wrote count as loaded."""
        # vLLM's loader (DefaultModelLoader.load_weights) hands the whole checkpoint to one load_weights call, which
        # writes every tracked parameter in place (an optional module's only if the call carried it). Every engine
        # start from a checkpoint comes here; only a dummy start never does (`on_cold_load_processed`).
        lc = self.lifecycle
        if lc.epoch == 0 and lc.awaiting_weights:
            self.lifecycle_runtime.cold_load_written = True
            lc.weights_loaded(self._structure.loaded_at_cold(n for n in lc.specs if not n.endswith(SHADOW)))

    def on_cold_load_processed(self) -> None:
        """After vLLM processed the cold-loaded model: finish the cold load and build the derived buffers (from
        the loader's own values when no load_weights call wrote them)."""
        lc = self.lifecycle
        if lc.epoch == 0 and lc.awaiting_weights and not self.lifecycle_runtime.cold_load_written:
            self._adopt_loader_values()
        if lc.epoch == 0 and lc.can("finalize_loading"):
            self.finalize_loading()
            self.refresh_derived_buffers()

    def _adopt_loader_values(self) -> None:
        """The cold load never called load_weights (vLLM's dummy loader, as veRL starts its rollout engine, or a
        loader that writes parameters itself): its values count as the cold load's, the structure is what vLLM
        built, and the first reload must write every layer in full (never completed or kept with them)."""
        lc, structure = self.lifecycle, self._structure
        structure.seen.update(structure.modules)  # present iff vLLM built it: no load decided otherwise
        self._record_metadata()  # what vLLM's builder would have set at the end of load_weights
        lc.audit_event("loaded_without_load_weights", cause=LOADER_VALUES)
        lc.weights_loaded(structure.loaded_at_cold(n for n in lc.specs if not n.endswith(SHADOW)))
        self.lifecycle_runtime.loader_values = True

    # ---- the frozen structure (`structure.py`): optional submodules decided by the first load --------------------
    @property
    def _structure(self) -> DraftStructure:
        return self.lifecycle_runtime.structure  # made by the class's __init__ before the lifecycle

    def init_lifecycle(self, name: str | None = None, **kwargs: Any) -> Any:
        """Track the optional modules' tensors too (those outside this module through slots), until the first
        load decides which exist."""
        structure = self._structure
        kwargs["tensors"] = {**(kwargs.get("tensors") or {}), **structure.tensors()}
        return super().init_lifecycle(name, slots=structure.outer_slots(), **kwargs)

    def claim_structure(self) -> None:
        """Claim the tracked optional tensors like the layers' (`DraftRuntime.owned`, guarded processing and
        weight loaders, the modules an implicit reload hands to vLLM's layerwise reload); run again once the first
        load froze the structure, which releases the absent ones."""
        structure, specs, runtime = self._structure, self.lifecycle.specs, self.lifecycle_runtime
        owned, roots = runtime.owned, runtime.roots
        for module in structure.modules:
            for name, owner, _ in structure.slots[module]:
                entry = owned.get(owner)
                names = [n for n in (entry or []) if n != name] + ([name] if name in specs else [])
                if names:
                    claim(self, owner, names)
                    if entry is None:  # not claimed with the layers: process and load it as they are
                        guard_processing(self, owner, None)
                        guard_weight_loaders(self, owner, names)
                elif entry is not None:
                    del owned[owner]
                # roots: never a module holding this backbone (the ForCausalLM, which holds d2t)
                if names and owner not in roots and not any(m is self for m in owner.modules()) \
                        and not any(owner in r.modules() for r in roots):
                    roots.append(owner)
        roots[:] = [r for r in roots if any(m in owned for m in r.modules())]

    def begin_reload(self) -> int:
        """Begin a reload epoch; optional modules the draft shares with the target since its load (the proposer
        replaced an own copy equal to the target's) are kept: a reload may not write them."""
        epoch = super().begin_reload()
        shared = self._structure.shared_now()
        if shared:
            self.weights_unchanged(n for m in sorted(shared) for n in self._structure.names_of(m))
        if self.lifecycle_runtime.loader_values:  # the cold load's values are nothing to keep
            self.lifecycle_runtime.loader_values = False
            readiness = self.lifecycle.readiness
            readiness.require_full_write(readiness.untouched_layers(), LOADER_VALUES)
        return epoch

    def finalize_loading(self, *, keep_untouched: bool = False) -> list[str]:
        """Before a load finishes: the first load freezes the structure; every load runs vLLM's whole-checkpoint
        checks once, over what it wrote and kept."""
        structure = self._structure
        if structure.frozen is None and self.lifecycle.can("weights_loaded"):
            structure.freeze(self)
            self.claim_structure()
        structure.validate(self.lifecycle, keep_untouched=keep_untouched)
        return super().finalize_loading(keep_untouched=keep_untouched)

    def note_carried(self, modules: Iterable[str]) -> None:
        """After a later call: the optional tensors it carried count as loaded once off META (d2t sits on the
        ForCausalLM, outside the layers an implicit reload hands to vLLM's layerwise reload, which reports the
        rest as each layer completes)."""
        lc = self.lifecycle
        if not (lc.in_reload and lc.can("weights_loaded")):
            return
        names = [n for m in modules for n in self._structure.names_of(m)
                 if n in lc.specs and (t := self.live_tensor(n)) is not None and not t.is_meta]
        if names:
            lc.weights_loaded(names)
