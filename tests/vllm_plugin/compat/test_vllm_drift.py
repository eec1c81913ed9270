"""The drift check (`lifecycle.vllm.plugin.drift`): every draft of vLLM's speculative-decoding registry is a declared
family or listed as deriving nothing, and what its sources derive is declared. Here on the installed vLLM (0.32,
read from its files; no engine), with edits and added files standing for a later release; `make compat` runs the
same check on the 0.33 wheel (`test_vllm_compat.py`)."""

from __future__ import annotations

import pytest

from lifecycle.vllm.compat.derived_scan import (
    BARE_WRITE,
    DERIVED,
    DUPLICATED,
    NON_PERSISTENT,
    scan,
    speculative_registry,
)
from lifecycle.vllm.compat.sources import SourceIndex, installed_reader
from lifecycle.vllm.drafts.families import FAMILIES, family
from lifecycle.vllm.plugin.drift import drift, listed_drafts
from support.vllm_sources import added, edited

INSTALLED = "0.32.0"
REGISTRY = "model_executor/models/registry.py"
FAKE_FILE = "vllm/model_executor/models/fake_draft.py"
FAKE = '''
import torch
from torch import nn


class FakeDraftModel(nn.Module):
    def _build_buffers(self):
        self._fused_kv = torch.cat([layer.kv_proj.weight for layer in self.layers])

    def forward(self, x):
        self._scratch = torch.cat([x, x])  # forward: per step, not derived state
        return x


class FakeDraftForCausalLM(nn.Module):
    def load_weights(self, weights):
        self.model._build_buffers()
'''


def with_fake_entry(arch: str = "FakeDraft") -> object:
    read = edited(installed_reader(), REGISTRY, '"MiMoMTPModel": ("mimo_mtp", "MiMoMTP"),',
                  f'"MiMoMTPModel": ("mimo_mtp", "MiMoMTP"),\n    "{arch}": ("fake_draft", "FakeDraftForCausalLM"),')
    return added(read, FAKE_FILE, FAKE)


def test_every_draft_of_the_installed_vllm_is_accounted_for() -> None:
    assert drift(installed_reader(), INSTALLED) == []


def test_the_registry_read_from_the_sources_is_vllms_live_registry() -> None:
    """0.32 is read live as well: the dict vLLM's registry module holds equals what the sources give (so the
    0.33 wheel, read only by its sources, is read the same way)."""
    from vllm.model_executor.models import registry

    live = {arch: (m if m.startswith("vllm.") else f"vllm.model_executor.models.{m}", c)
            for arch, (m, c) in registry._SPECULATIVE_DECODING_MODELS.items()}
    assert speculative_registry(SourceIndex(installed_reader())) == live
    assert len(live) > 50


def test_a_new_architecture_fails_naming_its_file_class_and_attribute() -> None:
    problems = drift(with_fake_entry(), INSTALLED)  # type: ignore[arg-type]
    (problem,) = problems
    assert problem.startswith(f"{FAKE_FILE}: class FakeDraftForCausalLM (vLLM's registry: FakeDraft) is neither a "
                              "family")
    assert f"{FAKE_FILE}: FakeDraftModel._fused_kv: derived in _build_buffers" in problem
    assert "_scratch" not in problem  # assigned in forward


def test_a_new_architecture_without_derived_state_must_still_be_listed() -> None:
    read = edited(installed_reader(), REGISTRY, '"MiMoMTPModel": ("mimo_mtp", "MiMoMTP"),',
                  '"MiMoMTPModel": ("mimo_mtp", "MiMoMTP"),\n    "MiMoMTPNext": ("mimo_mtp", "MiMoMTP"),')
    (problem,) = drift(read, INSTALLED)
    assert "class MiMoMTP (vLLM's registry: MiMoMTPNext) is neither a family" in problem
    assert problem.endswith("its sources show: nothing derived: list it, with why")


@pytest.mark.parametrize(("module_file", "old", "new", "named"), [
    # a family's draft: an attribute built outside its declared builder
    ("models/qwen3_dspark.py", '        orig_to_new_substr = {"mask_embedding": None}\n',
     "        self._stacked_heads = torch.stack([self.lm_head.weight, self.lm_head.weight])\n"
     '        orig_to_new_substr = {"mask_embedding": None}\n',
     "vllm/model_executor/models/qwen3_dspark.py: class Qwen3DSparkForCausalLM, attribute _stacked_heads: "
     f"{DERIVED} in load_weights"),
    # a family's builder: a new derived attribute beside the declared ones
    ("models/qwen3_dflash.py", "            self._fused_kv_weight: torch.Tensor | None = ",
     "            self._fused_q_weight = torch.cat([a.qkv_proj.weight for a in layers_attn])\n"
     "            self._fused_kv_weight: torch.Tensor | None = ",
     f"class DFlashQwen3Model, attribute _fused_q_weight: {DERIVED} in _build_context_kv_buffers"),
    # a listed draft (EAGLE3): a view of a parameter kept on self
    ("models/llama_eagle3.py", "        if not includes_mask_hidden and self.use_parallel_drafting:",
     "        self._fc_t = self.model.fc.weight.t()\n"
     "        if not includes_mask_hidden and self.use_parallel_drafting:",
     "vllm/model_executor/models/llama_eagle3.py: class Eagle3LlamaForCausalLM, attribute _fc_t: derived in "
     "load_weights"),
    # a listed draft (an MTP): a non-persistent buffer, and a bare write into a parameter
    ("models/deepseek_mtp.py", "        self.config = vllm_config.model_config.hf_config\n",
     "        self.config = vllm_config.model_config.hf_config\n"
     "        self.register_buffer('mtp_scale', torch.ones(1), persistent=False)\n",
     f"class DeepSeekMTP, attribute mtp_scale: {NON_PERSISTENT} in __init__"),
    ("models/deepseek_mtp.py", "\n            if not is_fusion_moe_shared_experts_layer:\n",
     "\n            if \"e_score_bias\" in name:\n"
     "                params_dict[name].copy_(loaded_weight)\n"
     "            if not is_fusion_moe_shared_experts_layer:\n",
     f"class DeepSeekMTP, attribute e_score_bias: {BARE_WRITE} in load_weights"),
])
def test_a_new_derived_attribute_fails_naming_its_file_class_and_attribute(module_file: str, old: str, new: str,
                                                                            named: str) -> None:
    problems = drift(edited(installed_reader(), module_file, old, new), INSTALLED)
    assert len(problems) == 1 and named in problems[0], problems
    assert "does not declare" in problems[0]


def test_a_declaration_vllm_no_longer_matches_is_named() -> None:
    # DeepSeek-V4 DSpark's loader stops filling the context projection from every layer
    read = edited(installed_reader(), "deepseek_v4/nvidia/dspark.py",
                  '        yield f"context_wkv_proj.{match.group(2)}", stacked_weight\n', "")
    assert drift(read, INSTALLED) == [
        "family deepseek_v4_dspark declares that _duplicate_context_wkv_weights fills context_wkv_proj from every "
        "layer; vLLM's sources no longer do"]
    # an architecture vLLM dropped, and one it moved to another class
    read = edited(installed_reader(), REGISTRY, '"Gemma4DSparkModel": ("gemma4_dspark", "Gemma4DSparkForCausalLM"),\n',
                  "")
    assert drift(read, INSTALLED) == ["family gemma4_dspark declares architecture Gemma4DSparkModel, which vLLM's "
                                      "speculative-decoding registry lacks"]
    read = edited(installed_reader(), REGISTRY, '"MiMoMTPModel": ("mimo_mtp", "MiMoMTP"),',
                  '"MiMoMTPModel": ("mimo_v2_mtp", "MiMoV2MTP"),')
    assert drift(read, INSTALLED) == ["the listed draft mimo_mtp declares MiMoMTPModel as "
                                      "vllm.model_executor.models.mimo_mtp.MiMoMTP; vLLM's registry maps it to "
                                      "vllm.model_executor.models.mimo_v2_mtp.MiMoV2MTP"]


def test_the_scan_sees_what_the_new_families_declare() -> None:
    """DeepSeek-V4 DSpark's projection filled from every layer's WKV and 0.32's attention sink written by hand;
    LiLiCorr's head state beside DFlash's buffers."""
    index = SourceIndex(installed_reader())
    dsv4 = {f.key for f in scan(index, "vllm.models.deepseek_v4", "DSparkDeepseekV4ForCausalLM") or []}
    assert dsv4 == {("_duplicate_context_wkv_weights", "context_wkv_proj", DUPLICATED),
                    ("DSparkDeepseekV4ForCausalLM", "attn_sink", BARE_WRITE)}
    lilicorr = {f.key for f in scan(index, "vllm.model_executor.models.lilicorr", "LiLiCorrForCausalLM") or []}
    head = {("LiLiCorrHead", a, DERIVED) for a in ("_attn_bias", "_factor_input_splits", "_fused_edge_bias",
                                                    "_fused_edge_weight")}
    assert head <= lilicorr
    assert set(family("lilicorr").submodule_buffers[0].binds) >= {a for _, a, _ in head}


def test_every_architecture_is_declared_once() -> None:
    archs = [a for d in (*FAMILIES, *listed_drafts(None)) for a in d.architectures]
    assert len(archs) == len(set(archs))
