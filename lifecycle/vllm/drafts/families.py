"""What each vLLM draft family derives, as data: the classes it serves, the vLLM builder methods it replaces, what
those builders set (derived buffers and non-tensor precompute metadata), and every attribute they read; the types
are `declarations.py`'s.

`reload.classes` turns each declaration into a class; `plugin.capabilities` checks every name a declaration uses
against vLLM's own sources (at plugin activation, and against the 0.33 wheel in `make compat`), and `plugin.drift`
checks that every draft of vLLM's speculative-decoding registry is a family here or listed in `underived.py`, each
with everything its sources derive declared, so a declaration cannot silently drift from the vLLM it runs on. A
family exists from the vLLM series named in `since`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ...derived import DerivedSpec, alias, concat, custom, stack
from ..compat.derived_scan import DERIVED, NON_PERSISTENT
from .declarations import (
    CONFIDENCE_HEAD,
    CONFIDENCE_HEAD_DROPPED,
    D2T,
    EMBED_TOKENS,
    KV_ROWS,
    LM_HEAD,
    NONE,
    NUM_LAYERS,
    SHADOW,
    Accounted,
    HandWrite,
    LoaderCopy,
    OptionalModule,
    Read,
    Shadow,
    SubmoduleBuffers,
    VLLMDraftFamily,
    VLLMModule,
    WholeCheckpointCheck,
    attn0,
    each_attn,
)

__all__ = ["FAMILIES", "SHADOW", "Accounted", "HandWrite", "LoaderCopy", "OptionalModule", "Read", "Shadow",
           "VLLMDraftFamily", "VLLMModule", "WholeCheckpointCheck", "family"]


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


# ---- LiLiCorr: DFlash's buffers, and its correlator head's (vLLM's `materialize_inference_buffers`) ----------------
_LILICORR = "lilicorr."


def _like_head(m: VLLMModule) -> dict[str, Any]:
    """Where vLLM puts the head's buffers: the device and dtype of its `slot_embedding`."""
    p = m.lilicorr.slot_embedding
    return {"device": p.device, "dtype": p.dtype}


def _edges(leaf: str) -> DerivedSpec:
    # vLLM: out_head and in_head stacked, so one linear computes both edge vectors
    def build(m: VLLMModule) -> torch.Tensor:
        head = m.lilicorr
        return torch.cat([getattr(head.out_head, leaf), getattr(head.in_head, leaf)]).to(**_like_head(m)).contiguous()

    return custom(f"_lilicorr_fused_edge_{leaf}", build=build,
                  depends_on=(f"{_LILICORR}out_head.{leaf}", f"{_LILICORR}in_head.{leaf}"))


def _factor_split(part: int) -> DerivedSpec:
    # vLLM: factor_input_proj's weight split into its self / anchor / cross input blocks
    def build(m: VLLMModule) -> torch.Tensor:
        h = m.lilicorr.hidden_size
        block: torch.Tensor = m.lilicorr.factor_input_proj.weight[:, part * h:(part + 1) * h if part < 2 else None]
        return block.contiguous()

    return custom(f"_lilicorr_factor_input_{('self', 'anchor', 'cross')[part]}", build=build,
                  depends_on=(f"{_LILICORR}factor_input_proj.weight",))


def _rank_columns(m: VLLMModule) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's two constant feature columns: each candidate's rank as a fraction, and whether it is the top one."""
    topk, device = m.lilicorr.candidate_topk, _like_head(m)["device"]
    rank = (torch.arange(topk, device=device, dtype=torch.float32).view(1, 1, topk) / float(topk - 1) if topk > 1
            else torch.zeros(1, 1, topk, device=device, dtype=torch.float32))
    top1 = torch.zeros(1, 1, topk, device=device, dtype=torch.float32)
    top1[..., 0] = 1.0
    return rank.contiguous(), top1.contiguous()


def _lilicorr_derived() -> tuple[DerivedSpec, ...]:
    return (*_dflash_derived(), _edges("weight"), _edges("bias"), *(_factor_split(i) for i in range(3)),
            custom("_lilicorr_attn_bias", build=lambda m: m.lilicorr._build_attention_bias(**_like_head(m)),
                   depends_on=(f"{_LILICORR}relative_slot_bias", f"{_LILICORR}same_slot_bias")),
            custom("_lilicorr_rank_frac", build=lambda m: _rank_columns(m)[0]),
            custom("_lilicorr_is_top1", build=lambda m: _rank_columns(m)[1]))


_LILICORR_HEAD = SubmoduleBuffers(
    "lilicorr", "LiLiCorrHead", "materialize_inference_buffers",
    {"_fused_edge_weight": ("_lilicorr_fused_edge_weight",), "_fused_edge_bias": ("_lilicorr_fused_edge_bias",),
     "_factor_input_splits": ("_lilicorr_factor_input_self", "_lilicorr_factor_input_anchor",
                              "_lilicorr_factor_input_cross"),
     "_attn_bias": ("_lilicorr_attn_bias",), "_rank_frac_col": ("_lilicorr_rank_frac",),
     "_is_top1_col": ("_lilicorr_is_top1",)},
    keep_layout=("out_head", "in_head", "factor_input_proj"), uses=("_build_attention_bias",))
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
    VLLMDraftFamily("lilicorr", ("LiLiCorrDraftModel",), "vllm.model_executor.models.lilicorr", "LiLiCorrForCausalLM",
                    "LiLiCorr", _DFLASH_BUILDER, _lilicorr_derived, _DFLASH_METADATA, KV_ROWS, quantized_fallback=True,
                    submodule_buffers=(_LILICORR_HEAD,), whole_calls=True,
                    notes=("vLLM's load_weights raises unless every call carries every `lilicorr.*` tensor (and "
                           "`lm_head` when the draft has its own)",)),
    # DeepSeek-V4 / V4.1 DSpark: vLLM's registry names the per-platform package; the family is its CUDA class (the
    # CPU class is a stub that raises; ROCm and XPU keep vLLM's own). The draft layers ship in the target checkpoint
    # as `mtp.{i}.*`, renamed by its own `_remap_dspark_name`; embeddings and lm_head are always the target's.
    VLLMDraftFamily("deepseek_v4_dspark", ("DSparkDraftModel",), "vllm.models.deepseek_v4.nvidia.dspark",
                    "DSparkDeepseekV4ForCausalLM", "DSparkDeepseekV4Model", (), lambda: (), {},
                    dispatched_by="vllm.models.deepseek_v4", renamed_in_code=("mtp.", "context_wkv_proj.")),
    VLLMDraftFamily("deepseek_v41_dspark", ("DSparkV41DraftModel",), "vllm.models.deepseek_v41.nvidia.dspark",
                    "DSparkDeepseekV4ForCausalLM", "DSparkDeepseekV4Model", (), lambda: (), {},
                    dispatched_by="vllm.models.deepseek_v41", renamed_in_code=("mtp.",)),
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
    "lilicorr": {"optional": _EAGLE_HEADS},  # full vocabulary only: never a d2t
    "deepseek_v4_dspark": {"optional": (CONFIDENCE_HEAD_DROPPED,)},
    "deepseek_v41_dspark": {"optional": (CONFIDENCE_HEAD_DROPPED,)},
}

#: vLLM 0.32's DeepSeek-V4 drafts write each layer's attention sink by hand (`params_dict[name][:n].copy_(...)`,
#: vLLM #57800); 0.33 loads it through the parameter's weight loader
_ATTN_SINK = HandWrite("attn_sink", "layers.*.attn.attn_sink", until="0.32")
_ZERO_MASK = "a constant zero placeholder: no load writes it (`has_separate_mask_embedding` stays False)"
#: Per family, what else vLLM's sources show it keeps besides what its builders set (`plugin.drift` finds each):
#: findings that are no derived state the lifecycle owns, modules its loader fills from every layer, hand writes.
_FOUND: dict[str, dict[str, Any]] = {
    "gemma4_dspark": {"accounted": (Accounted("Gemma4DSparkModel", "normalizer", NON_PERSISTENT,
                                              "a constant from the config (sqrt of the hidden size), no weight"),)},
    "laguna_dflash": {"accounted": (Accounted("DFlashLagunaModel", "mask_embedding", NON_PERSISTENT, _ZERO_MASK),)},
    "muse_spark_dspark": {"accounted": (Accounted("MuseSparkDSparkModel", "mask_embedding", NON_PERSISTENT,
                                                  _ZERO_MASK + "; its loader drops `model.mask_embedding`"),)},
    "kimi_k3_dspark": {"duplicated": (LoaderCopy("context_kv_proj", "_duplicate_context_kv_weights",
                                                 "layers.{i}.self_attn.kv_a_proj_with_mqa",
                                                 "layers.{i}.self_attn.fused_qkv_a_proj"),)},
    "qwen3_xpress": {"accounted": (
        Accounted("XPressRefinerHead", "_fused_buf", DERIVED, "the refiner head's transposed copies, rebuilt by "
                  "`build_fused_buffers` at the end of every load_weights call (whole calls only), stay vLLM's",
                  derived=True),),
        # folded from the call's raw `xpress_head.mix.L` by `fold_from_raw_`, a bare copy_ into the parameter
        "written_by_hand": (HandWrite("mix.L", "xpress_head.mix_L"),)},
    "deepseek_v4_dspark": {"duplicated": (LoaderCopy("context_wkv_proj", "_duplicate_context_wkv_weights",
                                                     "mtp.{i}.attn.wkv", "layers.{i}.attn.fused_wqa_wkv"),),
                           "written_by_hand": (_ATTN_SINK,)},
    "deepseek_v41_dspark": {"written_by_hand": (_ATTN_SINK,)},
}
#: How the CPU build exercises each family (docs/vllm.md's table; tests/project/test_docs.py checks the in-process
#: ones against the suite's lists): "live engine" (tests/vllm_plugin/reload/test_vllm_engine.py), "in-process"
#: (vLLM's classes without an engine), or nothing: by sources only.
_IN_PROCESS = "in-process: every path x both layouts"
_TESTED_HERE = {
    "dflash": "live engine: every path x both layouts, (a)-(d); TP=2: every path",
    "laguna_dflash": "live engine: every path, CPU layout, (a)-(c); (d) not comparable: stock vLLM's Laguna draft "
                     "proposes differently between two generate calls with the same weights on CPU",
    "qwen3_dspark": _IN_PROCESS, "gemma4_dspark": _IN_PROCESS, "dflash2": _IN_PROCESS,
    "kimi_k3_dspark": f"{_IN_PROCESS}; `_context_kv_norm_weights` refreshed in place (stock vLLM leaves draft A's "
                      "norms after a reload)",
    "lilicorr": "in-process: every whole-checkpoint path x both layouts (its load_weights refuses a bucket)",
    "deepseek_v4_dspark": "by sources: vLLM's CPU class is a stub that raises, and its CUDA class does not construct "
                          "on CPU (`torch.cuda.Event()` in `DeepseekV4Attention.__init__`)",
    "deepseek_v41_dspark": "by sources: vLLM picks its CUDA class on CPU too, which does not construct here "
                           "(`torch.cuda.Event()` in its attention, as V4's)",
}
FAMILIES = tuple(replace(f, **_STRUCTURE.get(f.name, {}), **_FOUND.get(f.name, {}),
                         tested_here=_TESTED_HERE.get(f.name, "")) for f in FAMILIES)


def family(name: str) -> VLLMDraftFamily:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no vLLM draft family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")
