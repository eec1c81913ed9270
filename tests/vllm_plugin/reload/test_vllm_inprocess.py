"""Draft families the CPU build cannot start an engine with (Qwen3 DSpark and DFlash2 need Model Runner V2, which
needs Triton; a Kimi K3 target's MLA does not run on CPU), driven in-process: vLLM's own draft classes, loader and
reload functions under a CPU VllmConfig, no engine (tests/support/vllm_inprocess.py). For each family, on both weight
layouts, a cold load of draft A, pinned, then every trainer path alternating A <-> B: after each, every derived
buffer and every tracked tensor equals a cold load of that draft (sha256), no derived buffer moved, no pinned
identity changed, and the fused path is usable. The drafts have every optional submodule their family can have
(a confidence head, own embeddings and lm_head, a reduced vocabulary with d2t: `DraftCase.with_structure`), so
every path also shows the structure the cold load froze kept, bucket after bucket. One process runs them all
(the session fixture `vllm_work`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lifecycle.states import LifecycleState
from lifecycle.vllm.drafts.families import family
from support.vllm_inprocess_runs import INPROCESS_FAMILIES, MEMORY_ONLY
from support.vllm_trainer_paths import DRAFT_PATHS, PATHS

FAMILIES = INPROCESS_FAMILIES.split(",")
LAYOUTS = ("cpu", "gpu")


@pytest.fixture(scope="module")
def inprocess(vllm_work: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    return vllm_work[1]


def ok(result: dict[str, Any]) -> Any:
    assert result["ok"], f"{result.get('error')}: {result.get('message')}\n{result.get('trace', '')}"
    return result["value"]


def run_for(inprocess: dict[str, Any], fam: str, layout: str) -> dict[str, Any]:
    return ok(inprocess[fam][layout])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_cold_load_by_vllms_loader_builds_the_buffers(inprocess: dict[str, Any], fam: str, layout: str) -> None:
    res = run_for(inprocess, fam, layout)
    assert res["cold_state"] == LifecycleState.DERIVED_REFRESHED.value
    assert (res["layout"] == [0]) == (layout == "cpu")  # vLLM's CPU repack empties the weight; the GPU layout not
    assert res["refs_differ"]  # drafts A and B differ in every check below, so equality means something
    assert res["pinned"] > 0


def assert_no_byte_beyond_stock(mem: dict[str, Any], fam: str, layout: str, layers: int = 2) -> None:
    """The draft holds exactly stock vLLM's bytes, cold and after reloads: a K/V shadow only where processing
    empties the weight (the CPU repack), each one a view of its fused buffer; none in the GPU layout."""
    shadowed = family(fam).shadow is not None and layout == "cpu"
    for when in ("cold", "reloaded"):
        assert mem[when]["bytes"] == mem["stock"]["bytes"], f"{when}: the plugin holds bytes stock vLLM does not"
        assert mem[when]["shadows"] == (layers if shadowed else 0)
        assert mem[when]["shadow_views"] == mem[when]["shadows"] and mem[when]["shadow_bytes_apart"] == 0
    assert mem["stock"]["shadows"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_the_draft_holds_no_byte_beyond_stock_vllm(inprocess: dict[str, Any], fam: str, layout: str) -> None:
    assert_no_byte_beyond_stock(run_for(inprocess, fam, layout)["memory"], fam, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", MEMORY_ONLY.split(","))
def test_engine_families_hold_no_byte_beyond_stock_vllm(inprocess: dict[str, Any], fam: str, layout: str) -> None:
    res = run_for(inprocess, fam, layout)
    assert (res["layout"] == [0]) == (layout == "cpu")
    assert_no_byte_beyond_stock(res, fam, layout)
    ok(res["reload"])
    assert res["derived_differ"] == [], "after a reload to B the derived buffers differ from a cold load of B"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_trainer_path_in_process_equals_a_cold_load(inprocess: dict[str, Any], fam: str, layout: str,
                                                    path: str) -> None:
    res = run_for(inprocess, fam, layout)
    (run,) = [r for r in res["runs"] if r["path"] == path]
    ok(run["result"])
    assert run["derived_differ"] == [], "derived buffers differ from a cold load of the same draft"
    assert run["weights_differ"] == [], "tracked tensors differ from a cold load of the same draft"
    assert run["moved"] == [] and run["pin_problems"] == []
    assert run["state"] == LifecycleState.GRAPH_CAPTURED.value
    ok(run["fused_path"])
    assert run["structure"] == res["cold_structure"], "the optional submodules differ from the cold load's"
    assert [r["epoch"] for r in res["runs"]] == [1, 2, 3, 4, 5, 5]
    assert len(DRAFT_PATHS) == len(PATHS) - 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_a_dummy_start_serves_and_its_first_sync_must_write_every_layer(inprocess: dict[str, Any], fam: str,
                                                                        layout: str) -> None:
    """As veRL starts its rollout engine (`load_format="dummy"`): the buffers are built from vLLM's random values;
    a first sync without layer 1 is refused (K3: the context projection vLLM builds from every layer names it),
    a complete one equals a cold load of that draft."""
    d = ok(run_for(inprocess, fam, layout)["dummy"])
    assert d["start"] == LifecycleState.DERIVED_REFRESHED.value and d["start_differs"]
    assert d["partial"]["error"] == "LayersNotReadyError" and d["partial_state"] == LifecycleState.QUARANTINED.value
    assert ("context_kv_proj.weight" if fam == "kimi_k3_dspark" else "layers.1.") in d["partial"]["message"]
    ok(d["full"])
    assert d["state"] == LifecycleState.DERIVED_REFRESHED.value and d["epoch"] == 2
    assert d["derived_differ"] == [] and d["weights_differ"] == [] and d["moved"] == []
    ok(d["fused_path"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_a_dropped_draft_is_freed(inprocess: dict[str, Any], fam: str, layout: str) -> None:
    """The plugin's per-module table held each draft from a value its key's owner held: no draft was ever freed,
    not even by the cyclic collector. Two cold-loaded drafts, dropped: gone once it ran."""
    assert run_for(inprocess, fam, layout)["cold_dropped_alive"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_a_plain_write_left_unfinished_refuses_until_process_weights_after_loading(
        inprocess: dict[str, Any], fam: str, layout: str) -> None:
    u = run_for(inprocess, fam, layout)["unfinished"]
    ok(u["written"])
    assert u["open"]["fused_path"]["error"] == "LayersNotReadyError"
    ok(u["finish"])
    assert u["derived_differ"] == [] and u["weights_differ"] == [] and u["moved"] == []
    ok(u["fused_path"])


@pytest.mark.parametrize("fam", FAMILIES)
def test_declared_buffers_and_metadata_equal_what_vllms_own_builder_computes(inprocess: dict[str, Any],
                                                                             fam: str) -> None:
    """On the GPU layout vLLM's builder can read the weights: run it on a copy of the reloaded draft and compare
    every attribute it sets with what the lifecycle set (the family declaration is right, name by name)."""
    same = run_for(inprocess, fam, "gpu")["same_as_vllm_builder"]
    assert set(same) == set(family(fam).sets)
    assert all(same.values()), [n for n, v in same.items() if not v]


#: Per family, the optional submodules its structure drafts have (what the cold load must freeze).
STRUCTURE = {
    "qwen3_dspark": {"confidence_head": True, "embed_tokens": True, "lm_head": True, "d2t": True},
    "gemma4_dspark": {"confidence_head": True, "embed_tokens": True, "lm_head": True},
    "dflash2": {"embed_tokens": True, "lm_head": True, "d2t": True},
    "kimi_k3_dspark": {"confidence_head": True},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_the_cold_load_freezes_the_optional_submodules_it_carried(inprocess: dict[str, Any], fam: str,
                                                                    layout: str) -> None:
    cold = run_for(inprocess, fam, layout)["cold_structure"]
    assert cold["frozen"] == cold["holds"] == STRUCTURE[fam]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fam", FAMILIES)
def test_a_reload_that_leaves_the_optional_submodules_out_is_refused_and_keeps_them(
        inprocess: dict[str, Any], fam: str, layout: str) -> None:
    """Partial policy `keep` is not there yet: a bucketed reload that sends no optional tensor fails closed at
    finalize (Qwen3 DSpark: vLLM's own reduced-vocabulary message, once per epoch instead of per call), the draft
    is quarantined with the cold structure, the optional tensors keep the values they had, and nothing moved.
    The next reload, each optional module in a bucket of its own and first, equals a cold load again."""
    res = run_for(inprocess, fam, layout)
    opt = res["optional"]
    left = opt["left_out"]
    if fam == "qwen3_dspark":
        assert left["result"]["error"] == "IncompleteCheckpointError"
        assert left["result"]["message"].endswith("Reduced-vocabulary Qwen3 DSpark checkpoints must include lm_head "
                                                  "weights; the full target lm_head cannot be shared.")
    else:
        assert left["result"]["error"] == "LayersNotReadyError"
        assert all(n in left["result"]["message"] for n in opt["optional"])
    assert left["state"] == LifecycleState.QUARANTINED.value
    assert left["structure"] == res["cold_structure"]
    assert left["optional_kept"] and all(left["optional_kept"].values()), left["optional_kept"]
    assert left["moved"] == [] and left["pin_problems"] == []
    assert left["fused_path"]["error"] == "QuarantinedError"
    own = opt["own_buckets"]
    ok(own["result"])
    assert own["result"]["value"] == len(STRUCTURE[fam]) + 3  # one bucket per optional module, 2 layers, the rest
    assert own["state"] == LifecycleState.GRAPH_CAPTURED.value and own["structure"] == res["cold_structure"]
    assert own["weights_differ"] == own["derived_differ"] == own["moved"] == own["pin_problems"] == []


def test_tensors_for_optional_submodules_the_draft_lacks_are_refused_and_stock_vllm_writes_the_target(
        inprocess: dict[str, Any]) -> None:
    """A Qwen3 DSpark draft whose cold load carried a confidence head and no other optional submodule: a bucket
    with tensors for embeddings, lm_head and d2t is refused before anything is written, each named (no epoch
    begun, the draft and the target's shared embedding and lm_head unchanged, the refusal audited); stock vLLM
    writes the embedding into the target's module, and a plain bucketed reload deletes its confidence head. A
    draft whose own embeddings the proposer replaced with the target's after the load: a reload sending them is
    refused, one without them completes."""
    res = ok(inprocess["frozen_absent"])
    plain = res["plain"]
    assert plain["result"]["error"] == "FrozenStructureError"
    for module, name in (("embed_tokens", "embed_tokens.weight"), ("lm_head", "lm_head.weight"), ("d2t", "d2t")):
        assert f"{module} (absent since the first load): {name}" in plain["result"]["message"]
    assert "layers." not in plain["result"]["message"]  # the bucket's real tensors are not named: nothing wrong
    assert (plain["state"], plain["epoch"]) == (LifecycleState.GRAPH_CAPTURED.value, 0)
    assert plain["structure"] == {**dict.fromkeys(STRUCTURE["qwen3_dspark"], False), "confidence_head": True}
    assert plain["target_unchanged"] and plain["draft_unchanged"]
    (event,) = plain["refused_event"]
    assert (event["error"], event["trigger"]) == ("FrozenStructureError", "weights_loaded")
    ok(res["then_complete"])
    assert res["then_state"] == LifecycleState.GRAPH_CAPTURED.value
    ok(res["stock"])
    assert res["stock_target_embed_changed"], "stock vLLM no longer writes a draft's embeddings into the target's?"
    ok(res["stock_plain"])  # silently: the first bucket without confidence_head.* deleted it
    assert res["stock_confidence_head"] is False
    shared = res["shared_sent"]
    assert shared["error"] == "FrozenStructureError" and "embed_tokens (shared with the target" in shared["message"]
    ok(res["shared_left_out"])
    assert res["shared_state"] == LifecycleState.GRAPH_CAPTURED.value
    assert res["shared_structure"]["frozen"]["embed_tokens"] and not res["shared_structure"]["holds"]["embed_tokens"]


@pytest.mark.parametrize("fam", FAMILIES)
def test_stock_vllm_fails_the_same_bucketed_reload(inprocess: dict[str, Any], fam: str) -> None:
    """vLLM's own class on the same structure drafts and buckets (the optional modules last, with the rest)."""
    stock = ok(inprocess[fam]["stock"])
    plain = stock["plain_gpu"]  # the same buckets as plain load_weights calls, GPU layout: no META in the way
    if fam == "kimi_k3_dspark":  # no per-bucket rebuild: the norms are built once and silently stay draft A's
        ok(stock["reload"])
        assert stock["norms_equal_B"] is False
        assert stock["confidence_head"] is plain["confidence_head"] is True  # K3 keeps its head: no per-call drop
    elif fam == "qwen3_dspark":  # every bucket without lm_head (and d2t) of a reduced-vocabulary draft is refused
        for run in (stock["reload"], plain["reload"]):
            assert run["error"] == "ValueError" and run["message"] == (
                "Reduced-vocabulary Qwen3 DSpark checkpoints must include lm_head weights; the full target "
                "lm_head cannot be shared.")
    else:  # torch.cat over META placeholders in the builder load_weights runs after every bucket
        assert not stock["reload"]["ok"] and "meta" in stock["reload"]["message"]
    if fam == "gemma4_dspark":  # the first bucket without confidence_head.* deletes the head for good, silently
        assert stock["confidence_head"] is False
        ok(plain["reload"])
        assert plain["confidence_head"] is False
        assert "_v_norm_weights" in plain["moved"]  # torch.ones again at every call: new storage per bucket
    if fam in ("gemma4_dspark", "dflash2"):  # the builder's torch.cat at every call: new storage per bucket
        assert {"_fused_k_weight" if fam == "gemma4_dspark" else "_fused_kv_weight", "_k_norm_weights"} <= set(
            plain["moved"])


def test_worker_rpcs_find_the_draft_on_both_model_runners(inprocess: dict[str, Any]) -> None:
    """Model Runner V2 keeps the draft in `runner.speculator`, V1 in `runner.drafter`: the RPCs ask each real
    runner class's `get_draft_model()` (runners built without a device, holding an in-process draft)."""
    lookup = ok(inprocess["runner_lookup"])
    for runner in ("v1", "v2"):
        assert lookup[runner]["roles"] == ["target", "draft"], runner
        assert lookup[runner]["states"][0]["role"] == "draft" and lookup[runner]["states"][0]["epoch"] == 0
    assert lookup["v2"]["runner_class"] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
    assert lookup["v1"]["runner_class"] == "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
