"""The drafts vLLM ships that the plugin leaves to vLLM, each with the reason it derives nothing a reload must own.

vLLM's speculative-decoding registry names about fifty draft classes; the families (`families.py`) are those that
build state from their weights (fused K/V buffers, stacked norms, a projection filled from every layer). Every other
one is listed here: `plugin.drift` reads each one's sources (`compat.derived_scan`) and fails `make compat` on any
finding a listing does not account for, so "derives nothing" is checked, not assumed. An `Accounted` finding is
something the scan sees that is no derived state (a constant, a scratch tensor, a checkpoint tensor written by
hand), or derived state that stays vLLM's (`derived=True`, named in docs/vllm.md).

These drafts are served by vLLM's own classes: a reload is vLLM's layerwise reload, which copies every tensor back
into its storage, and nothing else of theirs is built from the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compat.derived_scan import BARE_WRITE, DERIVED, NON_PERSISTENT
from .declarations import Accounted

__all__ = ["UNDERIVED", "UnderivedDraft"]


@dataclass(frozen=True)
class UnderivedDraft:
    """A vLLM draft class the plugin does not wrap, and why: every finding of its sources accounted for."""

    name: str
    architectures: tuple[str, ...]  # vLLM registry names served by this class
    module: str  # as vLLM's registry names it
    cls: str
    why: str
    accounted: tuple[Accounted, ...] = ()
    since: str = "0.32"  # the first release series whose registry has it
    until: str = ""  # the last one ("": still there)


_EAGLE = ("an EAGLE head (a decoder layer, fc, norms): every tensor loads through a weight loader, none is built "
          "from others")
_EAGLE3 = _EAGLE + "; the aux hidden states are combined per step, in `combine_hidden_states`"
_MTP = ("multi-token-prediction layers (the target's embedding and lm_head shared): every tensor loads through a "
        "weight loader, none is built from others")
_MASK_HIDDEN = ("parallel drafting's mask (PEagle), a checkpoint tensor `load_weights` writes into this "
                "non-persistent buffer with a bare copy_: no value derived from weights. A layerwise reload cannot see "
                "that write (the vLLM #57800 class): vLLM's own")
_SINK_032 = ("vLLM 0.32 writes the attention sink with a bare copy_ (vLLM #57800): no value derived from weights, "
             "but a layerwise reload leaves it stale; 0.33 loads it through its weight loader. vLLM's own")


def _eagle3(name: str, archs: tuple[str, ...], module: str, cls: str) -> UnderivedDraft:
    return UnderivedDraft(name, archs, f"vllm.model_executor.models.{module}", cls, _EAGLE3, (
        Accounted(cls, "mask_hidden", NON_PERSISTENT, _MASK_HIDDEN),
        Accounted(cls, "mask_hidden", BARE_WRITE, _MASK_HIDDEN)))


def _mtp(name: str, arch: str, module: str, cls: str, *accounted: Accounted, since: str = "0.32") -> UnderivedDraft:
    full = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    return UnderivedDraft(name, (arch,), full, cls, _MTP, accounted, since)


def _eagle(name: str, arch: str, module: str, cls: str) -> UnderivedDraft:
    return UnderivedDraft(name, (arch,), f"vllm.model_executor.models.{module}", cls, _EAGLE)


UNDERIVED: tuple[UnderivedDraft, ...] = (
    _eagle("eagle_llama", "EagleLlamaForCausalLM", "llama_eagle", "EagleLlamaForCausalLM"),
    _eagle("eagle_llama4", "EagleLlama4ForCausalLM", "llama4_eagle", "EagleLlama4ForCausalLM"),
    _eagle("eagle_minicpm", "EagleMiniCPMForCausalLM", "minicpm_eagle", "EagleMiniCPMForCausalLM"),
    _eagle("eagle_cohere", "EagleCohereForCausalLM", "cohere_eagle", "EagleCohereForCausalLM"),
    _eagle("eagle_mistral", "EagleMistralForCausalLM", "mistral_eagle", "EagleMistralForCausalLM"),
    _eagle("eagle_mistral_large3", "EagleMistralLarge3ForCausalLM", "mistral_large_3_eagle",
           "EagleMistralLarge3ForCausalLM"),
    _eagle("eagle_deepseek_mtp", "EagleDeepSeekMTPModel", "deepseek_eagle", "EagleDeepseekV3ForCausalLM"),
    _eagle3("eagle3_llama", ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3MiniMaxM2ForCausalLM",
                             "Eagle3Qwen2_5vlForCausalLM", "Eagle3Qwen3vlForCausalLM", "PEagleDraftModel",
                             "PeagleLlamaForCausalLM"), "llama_eagle3", "Eagle3LlamaForCausalLM"),
    _eagle3("eagle3_qwen3", ("Eagle3Qwen3ForCausalLM", "PeagleQwen3ForCausalLM"), "qwen3_eagle3",
            "Eagle3Qwen3ForCausalLM"),
    UnderivedDraft("eagle3_deepseek", ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"),
                   "vllm.model_executor.models.deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM", _EAGLE3),
    UnderivedDraft("extract_hidden_states", ("ExtractHiddenStatesModel",),
                   "vllm.model_executor.models.extract_hidden_states", "ExtractHiddenStatesModel",
                   "no weights: it hands the target's hidden states on"),
    UnderivedDraft("medusa", ("MedusaModel",), "vllm.model_executor.models.medusa", "Medusa",
                   "Medusa heads: every tensor loads through a weight loader, none is built from others",
                   until="0.32"),
    _mtp("deepseek_mtp", "DeepSeekMTPModel", "deepseek_mtp", "DeepSeekMTP"),
    _mtp("deepseek_v32_mtp", "DeepseekV32MTPModel", "vllm.models.deepseek_v32", "DeepseekV32MTP"),
    _mtp("deepseek_v4_mtp", "DeepSeekV4MTPModel", "vllm.models.deepseek_v4", "DeepSeekV4MTP",
         Accounted("DeepSeekV4MTP", "attn_sink", BARE_WRITE, _SINK_032)),
    _mtp("dots3_note_mtp", "Dots3NoteMTPModel", "vllm.models.dots3_note", "Dots3NoteMTP",
         Accounted("Dots3NoteMultiTokenPredictor", "max_token_id", NON_PERSISTENT,
                   "a constant from the config (the last token id), no weight")),
    _mtp("bailing_moe_v3_mtp", "BailingMoeV3MTPModel", "bailing_moe_v3_mtp", "BailingMoeV3MTPModel"),
    _mtp("bailing_moe_v25_mtp", "BailingMoeV25MTPModel", "bailing_moe_mtp", "BailingMoeV25MTPModel"),
    _mtp("minimax_m3_mtp", "MiniMaxM3MTP", "vllm.models.minimax_m3", "MiniMaxM3MTP"),
    _mtp("inkling_mtp", "InklingMTPModel", "vllm.models.inkling", "InklingMTP",
         Accounted("InklingMTP", "_logits_zero", DERIVED,
                   "a zero scalar in the lm_head's dtype and device (addmm's beta=0 input), no value from weights")),
    _mtp("gemma4_mtp", "Gemma4MTPModel", "gemma4_mtp", "Gemma4MTP",
         Accounted("Gemma4MultiTokenPredictor", "normalizer", NON_PERSISTENT,
                   "a constant from the config (sqrt of the backbone's hidden size), no weight"),
         Accounted("Gemma4MTP", "_stable_full_lm_head_weight", DERIVED,
                   "at tensor parallelism > 1 only: an all-gathered copy of the lm_head (the target's, shared), made "
                   "at the first compute_logits and never rebuilt, so a target update leaves it stale", derived=True)),
    _mtp("ernie_mtp", "ErnieMTPModel", "ernie_mtp", "ErnieMTP"),
    _mtp("exaone_moe_mtp", "ExaoneMoeMTP", "exaone_moe_mtp", "ExaoneMoeMTP"),
    _mtp("exaone4_5_mtp", "Exaone4_5_MTP", "exaone4_5_mtp", "Exaone4_5_MTP"),
    _mtp("nemotron_h_mtp", "NemotronHMTPModel", "nemotron_h_mtp", "NemotronHMTP"),
    _mtp("longcat_flash_mtp", "LongCatFlashMTPModel", "longcat_flash_mtp", "LongCatFlashMTP"),
    _mtp("glm4_moe_mtp", "Glm4MoeMTPModel", "glm4_moe_mtp", "Glm4MoeMTP"),
    _mtp("glm4_moe_lite_mtp", "Glm4MoeLiteMTPModel", "glm4_moe_lite_mtp", "Glm4MoeLiteMTP"),
    _mtp("glm_ocr_mtp", "GlmOcrMTPModel", "glm_ocr_mtp", "GlmOcrMTP"),
    _mtp("glm5next_mtp", "Glm5NextMTPModel", "vllm.models.glm5next", "Glm5NextMTP"),
    _mtp("openpangu_mtp", "OpenPanguMTPModel", "openpangu_mtp", "OpenPanguMTP"),
    _mtp("nemotron_parse_mtp", "ParseAuxMTPModel", "nemotron_parse3_5_mtp", "ParseAuxMTPModel", since="0.33"),
    _mtp("qwen3_next_mtp", "Qwen3NextMTP", "qwen3_next_mtp", "Qwen3NextMTP"),
    _mtp("step5_mtp", "Step5MTP", "vllm.models.step5", "Step5MTP", since="0.33"),
    _mtp("qwen4_exp_mtp", "Qwen4ExpMTP", "vllm.models.qwen4_exp", "Qwen4ExpMTP"),
    _mtp("step3p5_mtp", "Step3p5MTP", "step3p5_mtp", "Step3p5MTP"),
    _mtp("qwen3_5_mtp", "Qwen3_5MTP", "qwen3_5_mtp", "Qwen3_5MTP"),
    _mtp("qwen3_5_moe_mtp", "Qwen3_5MoeMTP", "qwen3_5_mtp", "Qwen3_5MoeMTP"),
    _mtp("interns2_mobius_mtp", "InternS2MobiusMTP", "interns2_mobius", "InternS2MobiusMTP"),
    _mtp("hy_v3_mtp", "HYV3MTPModel", "hy_v3_mtp", "HYV3MTP"),
    _mtp("hy_v4_mtp", "HYV4MTPModel", "vllm.models.hy_v4", "HYV4MTP",
         Accounted("HYV4MTP", "learnable_sink_param", BARE_WRITE,
                   _SINK_032.replace("attention sink", "learnable sink"))),
    _mtp("kimi_k3_mtp", "KimiK3MTPModel", "vllm.models.kimi_k3", "KimiK3MTP"),
    _mtp("mimo_mtp", "MiMoMTPModel", "mimo_mtp", "MiMoMTP"),
    _mtp("mimo_v2_mtp", "MiMoV2MTPModel", "mimo_v2_mtp", "MiMoV2MTP"),
    _mtp("mimo_v2_omni_mtp", "MiMoV2OmniMTPModel", "mimo_v2_mtp", "MiMoV2OmniMTP"),
)
