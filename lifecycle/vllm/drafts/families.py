"""What each vLLM draft family derives, as data: the classes it serves, the vLLM builder methods it replaces, what
those builders set (derived buffers and non-tensor precompute metadata), and every attribute they read.

`drafts.py` turns each declaration into a class; `capabilities.py` checks every name a declaration uses against
vLLM's own sources (at plugin activation, and against the 0.33 wheel in `make compat`), so a declaration cannot
silently drift from the vLLM it runs on. A family exists from the vLLM series named in `since`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...derived import DerivedSpec, alias, concat, custom, stack

__all__ = ["FAMILIES", "SHADOW", "OptionalModule", "Read", "Shadow", "VLLMDraftFamily", "WholeCheckpointCheck",
           "family"]

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

    @property
    def sets(self) -> frozenset[str]:
        """Every attribute the replaced builders set in vLLM: the derived buffers and the metadata."""
        return frozenset(s.name for s in self.derived()) | frozenset(self.metadata)

    @property
    def reads(self) -> frozenset[str]:
        """Every attribute name the declaration reads from vLLM's modules."""
        names: set[str] = set()
        for r in self.metadata.values():
            names.update(r.attrs)
        if self.shadow is not None:
            names.update(("layers", "self_attn", self.shadow.linear, "weight", *self.shadow.attrs))
        for spec in self.derived():
            for src in spec.sources:
                names.update(p for p in src.split(".") if not p.isdigit() and p != SHADOW)
        return frozenset(names)

    def set_metadata(self, model: VLLMModule) -> None:
        for name, read in self.metadata.items():
            setattr(model, name, read.get(model))


# ---- per-family declarations -------------------------------------------------------------------------------


def _shadow_source(name: str, kind: Callable[..., DerivedSpec] = concat) -> DerivedSpec:
    # backed: each layer's shadow becomes a view of its slice at the cold build, so the fused buffer is the only
    # copy of the rows in checkpoint layout, and the capture before processing writes it
    return kind(name, sources=(f"self_attn.{SHADOW}",), per_layer=lambda layer: getattr(layer.self_attn, SHADOW),
                backed=True)


def _k_norms(name: str = "_k_norm_weights") -> DerivedSpec:
    return stack(name, sources=("self_attn.k_norm.weight",), per_layer=lambda layer: layer.self_attn.k_norm.weight)


_ROPE_ALIAS = alias("_rope_cos_sin_cache", source="layers.0.self_attn.rotary_emb.cos_sin_cache")
_HIDDEN_NORM_ALIAS = alias("_hidden_norm_weight", source="hidden_norm.weight")


def _dflash_derived() -> tuple[DerivedSpec, ...]:
    return (_shadow_source("_fused_kv_weight"), _k_norms(), _ROPE_ALIAS, _HIDDEN_NORM_ALIAS)


#: What DFlash's `_build_fused_kv_buffers` sets besides its tensors (and every family built on it).
_GEOMETRY: dict[str, Read] = {
    "_rope_head_size": attn0("rotary_emb.head_size"),
    "_rope_is_neox": attn0("rotary_emb.is_neox_style"),
    "_num_attn_layers": NUM_LAYERS,
    "_kv_size": attn0("kv_size"),
    "_head_dim": attn0("head_dim"),
    "_num_kv_heads": attn0("num_kv_heads"),
    "_rms_norm_eps": attn0("q_norm.variance_epsilon"),
    "_attn_layers": each_attn("attn"),
}
# the per-projection fallback's inputs; Qwen3 DFlash attention has no bias (a biased variant would declare it)
_DFLASH_METADATA = {**_GEOMETRY, "_context_qkv_projs": each_attn("qkv_proj"), "_context_q_sizes": each_attn("q_size"),
                    "_fused_kv_bias": NONE}


def _gemma_derived() -> tuple[DerivedSpec, ...]:
    return (
        _shadow_source("_fused_k_weight"),
        _k_norms(),
        # v_norm has no learnable scale: a constant, built once, never rewritten
        custom("_v_norm_weights", build=lambda m: torch.ones(
            len(m.layers), m.layers[0].self_attn.head_dim, dtype=m.layers[0].self_attn.k_norm.weight.dtype,
            device=m.layers[0].self_attn.k_norm.weight.device)),
        _ROPE_ALIAS,
        _HIDDEN_NORM_ALIAS,
    )


def _laguna_derived() -> tuple[DerivedSpec, ...]:
    return (
        _shadow_source("_kv_weights", stack),
        stack("_input_layernorm_weights", sources=("input_layernorm.weight",),
              per_layer=lambda layer: layer.input_layernorm.weight),
        _k_norms(),
        _ROPE_ALIAS,
    )


def _k3_derived() -> tuple[DerivedSpec, ...]:
    # vLLM builds it once, in the model's own process_weights_after_loading: a layerwise reload leaves it stale
    return (stack("_context_kv_norm_weights", sources=("self_attn.kv_a_layernorm.weight",),
                  per_layer=lambda layer: layer.self_attn.kv_a_layernorm.weight),)


def _k3_kv_scales(model: VLLMModule) -> torch.Tensor | None:
    """As vLLM: the per-layer K scales of a quantized KV cache (None for an unquantized one)."""
    attns = [layer.self_attn for layer in model.layers]
    if not str(attns[0].kv_cache_dtype).startswith("fp8"):
        return None
    return torch.stack([a._k_scale.reshape(()) for a in attns])


_K3_METADATA: dict[str, Read] = {
    "_num_context_layers": NUM_LAYERS,
    "_context_kv_width": Read(lambda m: m.layers[0].self_attn.kv_lora_rank + m.layers[0].self_attn.qk_rope_head_dim,
                              ("layers", "self_attn", "kv_lora_rank", "qk_rope_head_dim")),
    "_context_kv_lora_rank": attn0("kv_lora_rank"),
    "_context_rope_dim": attn0("qk_rope_head_dim"),
    "_context_rms_norm_eps": attn0("kv_a_layernorm.variance_epsilon"),
    "_context_kv_scales": Read(_k3_kv_scales, ("layers", "self_attn", "kv_cache_dtype", "_k_scale")),
}


def _beam_derived() -> tuple[DerivedSpec, ...]:
    return (_shadow_source("_context_kv_weight"), _k_norms("_context_k_norm_weight"))


def _muse_derived() -> tuple[DerivedSpec, ...]:
    return (_shadow_source("_stacked_kv_weight", stack),)


_MUSE_METADATA: dict[str, Read] = {
    "_context_pre_norms": Read(lambda m: tuple(layer.self_attn.pre_qkv_proj_norm for layer in m.layers),
                               ("layers", "self_attn", "pre_qkv_proj_norm")),
    "_num_attn_layers": NUM_LAYERS,
    "_kv_size": attn0("kv_size"),
    "_head_dim": attn0("head_dim"),
    "_num_kv_heads": attn0("num_kv_heads"),
    "_rms_norm_eps": attn0("qk_norm.variance_epsilon"),
    "_rotary_emb": attn0("rotary_emb"),
    "_attn_layers": each_attn("attn"),
}

_DFLASH_BUILDER = ("_build_fused_kv_buffers",)
_EAGLE_HEADS = (EMBED_TOKENS, LM_HEAD)  # process_eagle_weight: has_own_* set by the names of each call


def _reduced_vocab(m: VLLMModule) -> bool:
    reduced: bool = m.config.draft_vocab_size < m.target_vocab_size
    return reduced


class _VocabView:
    """The draft's config as vLLM's Qwen3 DSpark `load_weights` sees it during one call: input and output
    vocabularies equal to the target's, so its per-call vocabulary checks pass (they run at finalize)."""

    def __init__(self, config: Any, vocab: int) -> None:
        self.__dict__.update(_config=config, vocab_size=vocab, draft_vocab_size=vocab)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_config"], name)


_DSPARK_CHECKS = (
    WholeCheckpointCheck("Qwen3 DSpark checkpoints whose input vocab_size is larger than the target vocabulary "
                         "must include embed_tokens weights.", "embed_tokens",
                         lambda m: m.config.vocab_size > m.target_vocab_size),
    WholeCheckpointCheck("Reduced-vocabulary Qwen3 DSpark checkpoints must include lm_head weights; the full "
                         "target lm_head cannot be shared.", "lm_head", _reduced_vocab),
    WholeCheckpointCheck("Reduced-vocabulary Qwen3 DSpark checkpoints must include a d2t mapping so sampled draft "
                         "ids can be converted to target ids.", "d2t", _reduced_vocab),
)
_MUSE_CHECKS = (  # vLLM tests the call's names, not an attribute: not suspended (see README)
    WholeCheckpointCheck("Muse Spark DSpark requires its own lm_head", "lm_head", lambda m: True),
    WholeCheckpointCheck("Muse Spark DSpark requires a d2t vocabulary mapping", "d2t", lambda m: True),
)

FAMILIES: tuple[VLLMDraftFamily, ...] = (
    VLLMDraftFamily("dflash", ("DFlashDraftModel", "DFlashMuseGlimmerAssistantModel", "MuseGlimmerAssistantModel"),
                    "vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM", "DFlashQwen3Model",
                    _DFLASH_BUILDER, _dflash_derived, _DFLASH_METADATA, KV_ROWS, quantized_fallback=True),
    VLLMDraftFamily("dflash2", ("DFlash2DraftModel",), "vllm.model_executor.models.qwen3_dflash2",
                    "DFlash2Qwen3ForCausalLM", "DFlash2Qwen3Model", _DFLASH_BUILDER, _dflash_derived,
                    _DFLASH_METADATA, KV_ROWS, quantized_fallback=True),
    VLLMDraftFamily("qwen3_dspark", ("Qwen3DSparkModel", "Qwen3OmniDSparkModel"),
                    "vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM", "Qwen3DSparkModel",
                    _DFLASH_BUILDER, _dflash_derived, _DFLASH_METADATA, KV_ROWS, quantized_fallback=True),
    VLLMDraftFamily("gemma4_dspark", ("Gemma4DSparkModel",), "vllm.model_executor.models.gemma4_dspark",
                    "Gemma4DSparkForCausalLM", "Gemma4DSparkModel", _DFLASH_BUILDER, _gemma_derived,
                    {**_GEOMETRY, "_fused_k_bias": NONE}, Shadow("k_proj")),
    VLLMDraftFamily("laguna_dflash", ("DFlashLagunaForCausalLM",), "vllm.model_executor.models.laguna_dflash",
                    "DFlashLagunaForCausalLM", "DFlashLagunaModel", _DFLASH_BUILDER, _laguna_derived,
                    {**_GEOMETRY, "_kv_biases": NONE}, KV_ROWS),
    VLLMDraftFamily("kimi_k3_dspark", ("K3DSparkModel",), "vllm.models.kimi_k3.nvidia.dspark_mla",
                    "K3DSparkForCausalLM", "K3DSparkModel", ("_build_fused_context_kv_metadata",), _k3_derived,
                    _K3_METADATA),
    VLLMDraftFamily("qwen3_xpress", ("Qwen3XPressModel", "DFlashQwen3XPressModel"),
                    "vllm.model_executor.models.qwen3_xpress", "Qwen3XPressForCausalLM", "Qwen3XPressModel",
                    _DFLASH_BUILDER, _dflash_derived, _DFLASH_METADATA, KV_ROWS, since="0.33", quantized_fallback=True,
                    notes=("the refiner head's transposed copies (`xpress_head._fused_buf`, rebuilt by "
                           "`build_fused_buffers` at every load_weights) stay vLLM's",
                           "vLLM's load_weights raises unless every call carries `xpress_head.mix.L`"),
                    whole_calls=True, renamed_in_code=("xpress_head.",)),
    VLLMDraftFamily("dflash2_beam", ("DFlash2BeamDraftModel",), "vllm.models.beam.nvidia.dflash2",
                    "DFlash2BeamForCausalLM", "DFlash2BeamModel", ("build_context_kv_weights",), _beam_derived, {},
                    KV_ROWS, since="0.33"),
    VLLMDraftFamily("muse_spark_dspark", ("MuseSparkDSparkModel",), "vllm.models.muse_spark.common.dspark",
                    "MuseSparkDSparkForCausalLM", "MuseSparkDSparkModel", _DFLASH_BUILDER, _muse_derived,
                    _MUSE_METADATA, Shadow("qkv_proj", lambda a: slice(a.q_size, a.q_size + 2 * a.kv_size),
                                           ("q_size", "kv_size")), since="0.33",
                    notes=("vLLM's load_weights raises unless every call carries `lm_head` and `d2t`",),
                    whole_calls=True),
)

#: Per family, what its `load_weights` decides from the current call's tensors (read in both releases' sources):
#: the optional submodules it builds or drops, and the checks only a whole checkpoint passes.
_STRUCTURE: dict[str, dict[str, Any]] = {
    "dflash": {"optional": (*_EAGLE_HEADS, D2T)},
    "dflash2": {"optional": (*_EAGLE_HEADS, D2T)},
    "qwen3_dspark": {"optional": (CONFIDENCE_HEAD_DROPPED, *_EAGLE_HEADS, D2T), "checks": _DSPARK_CHECKS,
                     "check_view": lambda m: {"config": _VocabView(m.config, m.target_vocab_size)},
                     "check_reads": ("vocab_size", "draft_vocab_size", "target_vocab_size")},
    "gemma4_dspark": {"optional": (CONFIDENCE_HEAD_DROPPED, *_EAGLE_HEADS)},
    "laguna_dflash": {"optional": _EAGLE_HEADS},
    "kimi_k3_dspark": {"optional": (CONFIDENCE_HEAD,)},  # embeddings and lm_head: dropped by its mapper by design
    "qwen3_xpress": {"optional": _EAGLE_HEADS},
    "dflash2_beam": {"optional": _EAGLE_HEADS},  # never in its checkpoint: frozen absent, refused if sent
    "muse_spark_dspark": {"optional": (CONFIDENCE_HEAD, LM_HEAD, D2T), "checks": _MUSE_CHECKS},
}
FAMILIES = tuple(replace(f, **_STRUCTURE.get(f.name, {})) for f in FAMILIES)


def family(name: str) -> VLLMDraftFamily:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no vLLM draft family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")
