"""Optional submodules of vLLM's drafts, decided once by the first load and frozen: structure-preserving reloads.

vLLM's draft classes decide inside `load_weights`, from the tensors of the CURRENT call, which optional
submodules exist: Qwen3 and Gemma4 DSpark drop the confidence head (`self.model.confidence_head = None`) in any
call without its tensors; `process_eagle_weight` sets `has_own_embed_tokens` / `has_own_lm_head` from the call's
names; Qwen3 DSpark refuses every call of a reduced-vocabulary draft that lacks `lm_head` or `d2t`. A bucketed or
one-tensor-at-a-time reload calls `load_weights` many times, so those decisions flip. For each family's declared
`optional` modules and `checks` (`families.py`):

- the first load (every call of epoch 0) decides: a module is present iff one of its tensors arrived (and vLLM
  built it); `freeze` records that in the lifecycle (`structure_frozen`, `lifecycle.structure`) and stops
  tracking the absent modules' tensors. The present ones are tracked and pinned like any other tensor, so a
  reload must write or keep them, and one that moved their storage fails closed;
- every later call is structure-preserving (`admit`, `within_call`): a tensor for an absent module, or for one
  the draft shares with the target since its load (the proposer replaces an own copy equal to the target's), is
  refused before anything is written (`FrozenStructureError`, raised by the backbone's `before_write`, so inside
  a reload it fails like any bad bucket); a present module missing from the call is simply not in it (vLLM's
  per-call drop is undone when the call returns);
- vLLM's whole-checkpoint checks are suspended during each call (`check_view`) and run once per epoch at
  finalize (`validate`) over what the epoch wrote plus what it kept, with vLLM's own message
  (`IncompleteCheckpointError`, a `ValueError` as vLLM's was).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError, FrozenStructureError, IncompleteCheckpointError, LoadRefusedError
from ...torch_private import own_parameters
from ..compat.version import installed_version
from .families import HandWrite, OptionalModule, VLLMDraftFamily
from .families import family as family_named
from .own_heads import declare_own_heads

__all__ = ["DraftStructure", "observe"]

Weights = Iterable[tuple[str, torch.Tensor]]

_UNKNOWN = object()
_MODULE_OF_KEPT = 1 << 16  # names whose module is remembered: far more than any draft's checkpoint holds
_NOTHING: AbstractContextManager[None] = nullcontext()


def _resolve(root: nn.Module, path: str) -> Any:
    try:
        return operator.attrgetter(path)(root)
    except AttributeError:
        return None


class DraftStructure:
    """The optional submodules of one draft (a vLLM ForCausalLM and its lifecycle-enabled inner model)."""

    def __init__(self, outer: nn.Module, inner: nn.Module, family: VLLMDraftFamily) -> None:
        self.family = family
        self._outer = outer
        inner_prefix = f"{family.inner_model_attr}."
        self.modules: dict[str, OptionalModule] = {m.name: m for m in family.optional}
        #: module -> (lifecycle name, owning module, attribute) of each of its tensors at construction
        self.slots: dict[str, list[tuple[str, nn.Module, str]]] = {}
        #: module -> the object vLLM built (an own copy the proposer later replaces with the target's differs)
        self.built: dict[str, Any] = {}
        for m in family.optional:
            obj = _resolve(outer, m.path)
            self.built[m.name] = obj
            owner_path, _, attr = m.path.rpartition(".")
            entries: list[tuple[str, nn.Module, str]] = []
            if isinstance(obj, nn.Module):
                for mod_name, mod in obj.named_modules():
                    for leaf, t in own_parameters(mod).items():
                        if t is not None:
                            full = ".".join(p for p in (m.path, mod_name, leaf) if p)
                            entries.append((full.removeprefix(inner_prefix), mod, leaf))
            elif isinstance(obj, torch.Tensor):
                owner = _resolve(outer, owner_path) if owner_path else outer
                entries.append((m.path.removeprefix(inner_prefix), owner, attr))
            self.slots[m.name] = entries
        self.seen: set[str] = set()  # modules a call of the first load carried tensors for
        self.frozen: dict[str, bool] | None = None
        #: checkpoint name -> the shape the first load's calls carried under it (whole checkpoint tensors, as vLLM
        #: hands every rank; `reload.expected` holds a reload's payload to them exactly)
        self.cold_shapes: dict[str, tuple[int, ...]] = {}
        #: `reload.expected`'s lookup of `cold_shapes` by each form of their names, made once they are final
        self.cold_lookup: dict[str, tuple[int, ...]] | None = None
        #: checkpoint tensors this vLLM's load_weights writes outside a weight loader (vLLM #57800)
        self.hand_writes: tuple[HandWrite, ...] = _hand_writes(family)
        #: checkpoint name -> its optional module (`module_of`, asked for every tensor of every push), bounded
        self._module_of: dict[str, str | None] = {}
        #: nothing to neutralize around a call: no module vLLM drops per call, no whole-checkpoint check
        self._neutral = not any(m.dropped_per_call for m in family.optional) \
            and not (family.check_view is not None and family.checks)

    # ---- what the lifecycle tracks -----------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every optional module's tensors, under their lifecycle names (inner-relative, else the outer path)."""
        return {name: getattr(owner, attr) for entries in self.slots.values() for name, owner, attr in entries}

    def outer_slots(self) -> dict[str, tuple[nn.Module, str]]:
        """The tracked tensors held outside the inner model (lm_head, d2t): name -> (module, attribute)."""
        inner = _resolve(self._outer, self.family.inner_model_attr)
        inside = {id(m) for m in inner.modules()}
        return {name: (owner, attr) for entries in self.slots.values() for name, owner, attr in entries
                if id(owner) not in inside}

    def names_of(self, module: str) -> list[str]:
        return [name for name, _, _ in self.slots.get(module, ())]

    def loaded_at_cold(self, names: Iterable[str]) -> list[str]:
        """Of `names` (the tracked tensors), those the first load wrote so far: optional ones only if their module
        arrived."""
        unseen = {n for m in self.modules if m not in self.seen for n in self.names_of(m)}
        return [n for n in names if n not in unseen]

    # ---- one load_weights call ---------------------------------------------------------------------------------
    def module_of(self, name: str) -> str | None:
        known = self._module_of.get(name, _UNKNOWN) if type(name) is str else _UNKNOWN
        if known is not _UNKNOWN:
            return known  # type: ignore[return-value]  # only str | None is stored
        module = None if "t2d" in name else next((m.name for m in self.modules.values() if m.marker in name), None)
        if type(name) is str and len(self._module_of) < _MODULE_OF_KEPT:  # a hostile caller's names cannot grow it
            self._module_of[name] = module
        return module

    def admit(self, weights: Weights, lifecycle: Any) -> tuple[Weights, LoadRefusedError | None]:
        """The call's tensors as vLLM should see them, and the refusal to raise before anything is written (or
        None). During the first load: passed through, noting the modules they belong to. Afterwards: collected
        (vLLM's drafts collect them too) and refused if one belongs to a module the frozen structure lacks or
        the draft shares with the target, or is one this vLLM writes by hand (`hand_written`)."""
        if self.frozen is None:
            return self._noting(weights), None
        items = list(weights)
        refused = self.hand_written(items, lifecycle)
        if refused is not None:
            return items, refused
        optional = [(name, module) for name, _ in items if (module := self.module_of(name)) is not None]
        if not optional:  # a layer's tensors: nothing the structure decides
            return items, None
        bad: dict[str, list[str]] = {}
        shared = self.shared_now()
        for name, module in optional:
            if not self.frozen.get(module, False):
                bad.setdefault(f"{module} (absent since the first load)", []).append(name)
            elif module in shared:
                bad.setdefault(f"{module} (shared with the target since the first load: writing it would "
                               "change the target)", []).append(name)
        if not bad:
            return items, None
        return items, FrozenStructureError(bad, backbone=getattr(lifecycle, "name", "?"),
                                           state=lifecycle.state.value if lifecycle is not None else "?")

    def hand_written(self, items: list[tuple[str, torch.Tensor]], lifecycle: Any) -> CheckpointError | None:
        """After the first load, a tensor vLLM's load_weights writes with a bare copy_ instead of its weight loader
        (vLLM #57800): vLLM's layerwise reload drops that write (it lands in a placeholder) and no readiness count
        sees it, so the draft would serve the old value as current. Refused before anything of the call is
        written; a push without it keeps its value (`partial='keep'`) or is refused naming it (`refuse`)."""
        if not self.hand_writes:
            return None
        names = [n for n, _ in items if any(w.name in n for w in self.hand_writes)]
        if not names:
            return None
        return CheckpointError(
            f"bucket refused: vLLM's {self.family.name} load_weights writes {', '.join(names[:8])} with a bare "
            "copy_ outside its weight loader (vLLM #57800), which a reload drops, leaving the old value; nothing of "
            "it was written. Push without it, or restart the engine to load it",
            backbone=getattr(lifecycle, "name", "?"), state=lifecycle.state.value if lifecycle is not None else "?")

    def carried(self, weights: Weights) -> set[str]:
        """The optional modules a collected call carried tensors for."""
        if not isinstance(weights, list):
            return set()
        return {m for name, _ in weights if (m := self.module_of(name)) is not None}

    def _noting(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            module = self.module_of(name)
            if module is not None:
                self.seen.add(module)
            shape = getattr(t, "shape", None)
            if shape is not None:
                self.cold_shapes[name] = tuple(shape)
            yield name, t

    def within_call(self) -> AbstractContextManager[None]:
        """Around vLLM's `load_weights`: its whole-checkpoint checks see `check_view` (they run at finalize);
        a module vLLM drops in a call that lacks its tensors is put back when the call returns."""
        return _NOTHING if self._neutral else self._within_call()

    @contextmanager
    def _within_call(self) -> Iterator[None]:
        outer, fam = self._outer, self.family
        kept = {m.path: obj for m in self.modules.values() if m.dropped_per_call
                if (obj := _resolve(outer, m.path)) is not None}
        view = dict(fam.check_view(outer)) if fam.check_view is not None and fam.checks else {}
        saved = {k: outer.__dict__[k] for k in view if k in outer.__dict__}
        outer.__dict__.update(view)
        try:
            yield
        finally:
            for k in view:
                if k in saved:
                    outer.__dict__[k] = saved[k]
                else:
                    outer.__dict__.pop(k, None)
            for path, obj in kept.items():
                owner_path, _, attr = path.rpartition(".")
                owner = _resolve(outer, owner_path) if owner_path else outer
                if getattr(owner, attr, None) is not obj:
                    setattr(owner, attr, obj)

    # ---- the first load decides ------------------------------------------------------------------------------------
    def decide(self) -> dict[str, bool]:
        """Module -> present: one of its tensors arrived during the first load, and vLLM built it."""
        return {m: m in self.seen and self.built[m] is not None for m in self.modules}

    def freeze(self, backbone: Any) -> dict[str, bool]:
        """Record the structure in the lifecycle (once, at the first load's finish) and stop tracking the absent
        modules' tensors. A module vLLM drops when its tensors are absent is dropped now, as vLLM's load would."""
        present = self.decide()
        absent = [n for m, p in present.items() if not p for n in self.names_of(m)]
        backbone.freeze_structure(present, absent)
        for m, p in present.items():
            module = self.modules[m]
            if not p and module.dropped_per_call:
                owner_path, _, attr = module.path.rpartition(".")
                setattr(_resolve(self._outer, owner_path) if owner_path else self._outer, attr, None)
        self.frozen = present
        declare_own_heads(self._outer, present)  # Model Runner V2 keeps what the draft class says is its own
        return present

    def shared_now(self) -> set[str]:
        """Present modules the draft no longer holds its own copy of (the proposer gave it the target's)."""
        if self.frozen is None:
            return set()
        return {m for m, p in self.frozen.items() if p and self.modules[m].shareable
                and _resolve(self._outer, self.modules[m].path) is not self.built[m]}

    # ---- once per epoch, at finalize ---------------------------------------------------------------------------
    def validate(self, lifecycle: Any, *, keep_untouched: bool = False) -> None:
        """vLLM's whole-checkpoint checks over this epoch: a needed module counts if every one of its tensors was
        written or kept (declared unchanged; with `keep_untouched`, in a layer that received nothing)."""
        readiness = lifecycle.readiness
        untouched = set(readiness.untouched_layers()) - readiness.partly_written if keep_untouched else set()

        def has(module: str) -> bool:
            names = [n for n in self.names_of(module) if n in lifecycle.specs]
            return bool(names) and all(readiness.is_loaded(n) or readiness.layer_of_name[n] in untouched
                                       for n in names)

        for check in self.family.checks:
            if check.applies(self._outer) and not has(check.needs):
                raise IncompleteCheckpointError(check.message, backbone=lifecycle.name,
                                                state=lifecycle.state.value, needs=self.names_of(check.needs))


def observe(outer: nn.Module) -> dict[str, Any]:
    """The draft's optional submodules as they are now (plain data): for each declared module, whether the draft
    holds it (its own copy, for shareable ones) and the storage of its tensors."""
    name: str = getattr(outer, "lifecycle_family")  # noqa: B009  # the lifecycle class's own attribute (typed Any)
    inner = getattr(outer, family_named(name).inner_model_attr)
    structure: DraftStructure = inner.lifecycle_runtime.structure
    out: dict[str, Any] = {}
    for name, module in structure.modules.items():
        obj = _resolve(outer, module.path)
        holds = obj is not None and (not module.shareable or obj is structure.built[name])
        out[name] = {"present": holds, "tensors": {n: getattr(owner, attr).data_ptr() if holds else None
                                                   for n, owner, attr in structure.slots[name]}}
    return out


def _hand_writes(family: VLLMDraftFamily) -> tuple[HandWrite, ...]:
    """The family's hand writes this vLLM makes (a release that fixed one loads it through its weight loader)."""
    if not family.written_by_hand:
        return ()
    try:
        parts = installed_version().split("+")[0].split(".")
        series: tuple[int, int] | None = (int(parts[0]), int(parts[1]))
    except Exception:  # no vLLM distribution or an unparsable version: assume every declared hand write
        series = None
    return tuple(w for w in family.written_by_hand if w.applies(series))
