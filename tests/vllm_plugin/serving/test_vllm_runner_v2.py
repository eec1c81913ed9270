"""Model Runner V2 (vLLM's GPU default, the only runner for DSpark), issue 26 item 7, as far as the CPU build runs
V2's classes (tests/support/vllm_v2_runs.py, part of the in-process scenario: no engine):

- the drafting gate on vLLM's real `DFlashSpeculator.propose` (DSpark and DFlash2 speculators inherit it), on a
  real `DSparkSpeculator` holding a real Qwen3 DSpark lifecycle draft: usable, vLLM's own propose runs; not usable,
  the step's draft tokens are the speculator's own buffer zeroed, without entering it; `dummy_run` always runs it;
- Gemma4 DSpark's own embedding and lm_head through V2's own loader functions.

GPU-only (not run here): vLLM's propose itself (Triton kernels, CUDA streams in the speculator's `__init__`), the
CUDA-graph replay of the draft step, V2's `GPUModelRunner` (its `__init__` needs CUDA; `VllmConfig` refuses V2
without Triton), and data parallelism > 1 (a gated rank skips the draft forward while another may run it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lifecycle.states import LifecycleState
from lifecycle.vllm.plugin.capabilities import requirements

DERIVED_REFRESHED = LifecycleState.DERIVED_REFRESHED.value


@pytest.fixture(scope="module")
def v2(vllm_work: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    return vllm_work[1]["runner_v2"]


def ok(result: dict[str, Any]) -> Any:
    assert result["ok"], f"{result.get('error')}: {result.get('message')}\n{result.get('trace', '')}"
    return result["value"]


def test_the_gate_is_installed_on_the_propose_every_lifecycle_speculator_inherits(v2: dict[str, Any]) -> None:
    gate = ok(v2["gate"])
    assert gate["installed"] and gate["inherited_by"] == ["DSparkSpeculator", "DFlash2Speculator"]


def test_a_usable_draft_drafts_through_vllms_own_propose(v2: dict[str, Any]) -> None:
    gate = ok(v2["gate"])
    assert gate["usable"]["state"] == DERIVED_REFRESHED
    # vLLM's propose was entered (and stopped on CPU: an instance without __init__, no Triton): GPU-only from here
    assert gate["usable"]["entered_vllms_propose"], gate["usable"]
    assert gate["usable_recorded"]["calls"] == [False]


def test_a_draft_mid_reload_is_not_run_and_the_step_drafts_zeros_in_the_speculators_own_buffer(
        v2: dict[str, Any]) -> None:
    mid = ok(v2["gate"])["mid_reload"]
    assert mid["state"] == LifecycleState.PARTIALLY_LOADED.value  # after vLLM's initialize_layerwise_reload
    assert mid["tokens"] == [[0, 0, 0], [0, 0, 0]] and mid["same_storage"]  # what the runner stores and verifies
    assert mid["buffer"] == [[0] * 3] * 2 + [[9] * 3] * 2  # only the batch's rows (the rest: as they were)
    assert mid["paused_steps"] == 1 and mid["steps_without_draft"] == 1


def test_v2s_draft_model_speculator_is_gated_as_the_dflash_one(v2: dict[str, Any]) -> None:
    """`StandaloneARSpeculator` (V2's `method="draft_model"`, vLLM #43091) holding a draft mid-reload: zeros in its
    own buffer, the draft not run; once the reload completed, vLLM's own propose (which needs CUDA from there)."""
    draft_model = ok(v2["gate"])["draft_model"]
    assert draft_model["installed"]
    assert draft_model["mid_reload"] == {"tokens": [[0, 0, 0], [0, 0, 0]], "same_storage": True}
    assert draft_model["reloaded"]["entered_vllms_propose"], draft_model["reloaded"]


def test_dummy_runs_always_run_vllms_propose(v2: dict[str, Any]) -> None:
    # profiling, warm-up, graph capture, an idle data-parallel rank's lock-step: by keyword and by position
    assert ok(v2["gate"])["mid_reload_dummy_runs"] == [True, True]


def test_probabilistic_sampling_sees_the_zeros_distribution_for_the_batchs_requests_only(v2: dict[str, Any]) -> None:
    prob = ok(v2["gate"])["probabilistic"]
    assert prob["one_hot_rows"] == [True, True] and prob["other_rows_untouched"]
    assert prob["confidence"][:2] == [[0.0] * 3] * 2 and prob["confidence"][2:] == [[1.0] * 3] * 2


def test_after_the_reload_completes_the_draft_drafts_again_audited_once_each_way(v2: dict[str, Any]) -> None:
    gate = ok(v2["gate"])
    assert gate["reloaded"]["state"] == DERIVED_REFRESHED and gate["reloaded"]["calls"] == [False]
    assert gate["reloaded"]["entered_vllms_propose"]
    assert gate["events"] == ["drafting_paused", "drafting_resumed"]


def test_gemma4_dspark_keeps_its_own_embedding_and_lm_head_on_v2_where_vllms_own_class_loses_them(
        v2: dict[str, Any]) -> None:
    heads = ok(v2["own_heads"])
    gemma = heads["gemma4_dspark"]
    assert gemma["had_own"] == [True, True]
    assert gemma["flags"] == {"has_own_embed_tokens": True, "has_own_lm_head": True}
    assert gemma["embed_kept"] and gemma["lm_head_kept"]
    assert gemma["equal_lm_head_shared"]  # equal to the target's: shared, vLLM's rule for every own-heads draft
    stock = heads["gemma4_dspark_stock"]  # dspark_shares_target_embeddings = False, read nowhere: replaced
    assert stock["had_own"] == [True, True] and not stock["embed_kept"] and not stock["lm_head_kept"]


def test_the_capability_check_declares_the_v2_gate_and_what_it_reads() -> None:
    names = {(r.module, r.name) for r in requirements()}
    spec = "vllm.v1.worker.gpu.spec_decode"
    assert (f"{spec}.dflash.speculator", "DFlashSpeculator.propose") in names
    assert (f"{spec}.standalone_ar.speculator", "StandaloneARSpeculator.propose") in names
    assert {(f"{spec}.speculator", "DraftModelSpeculator.draft_tokens"),
            (f"{spec}.eagle.utils", "maybe_share_target_embed"),
            ("vllm.model_executor.models.gemma4_dspark", "Gemma4DSparkForCausalLM.dspark_shares_target_embeddings")
            } <= names
