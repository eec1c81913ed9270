"""A draft reload that fails at any point leaves a REAL vLLM engine (the CPU build) serving, and a correct retry of
the same call works on the same engine, without a restart.

Before (vLLM 0.32 CPU, tiny DFlash draft, found by issue 12): `reload_draft_weights` of an empty folder, with
`bucket_size="2"`, with `exclude_prefixes="layers.1."` (split into characters), or with a `load_weights` that
raised left the draft in PARTIALLY_LOADED on META with no quarantine reason; `generate` then failed with "Tensor on
device cpu is not on the expected device meta!", a correct retry was refused (`IllegalTransitionError:
'begin_reload' is not allowed from state PARTIALLY_LOADED`), and only a restart recovered. A quarantined draft made
`generate` raise QuarantinedError, after which the next `generate` on that engine hung. A checkpoint truncated
under the reader killed the process (SIGBUS); one rewritten in place during a load was mixed into the draft.

Two engines (tests/support/vllm_failure_scenarios.py): `failures` in the CPU layout (unquantized weights repacked, their
`weight` emptied), every case on one engine in sequence; `gpu_layout` with the weights kept after loading (as
on CUDA), where a tensor sent in part can be completed with its last values.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle.states import LifecycleState
from support.digests import weight_derived
from support.vllm_basic_scenarios import run_scenario

S = LifecycleState
USABLE = S.GRAPH_CAPTURED.value  # the draft's storage was pinned at the start of each scenario


@pytest.fixture(scope="module")
def failures(vllm_workdir: Path) -> dict[str, Any]:
    return run_scenario("failures", vllm_workdir, script="vllm_failure_scenarios",
                        RELOAD_LIFECYCLE_PATH_ROOT=str(vllm_workdir),
                        RELOAD_LIFECYCLE_AUDIT_DIR=str(vllm_workdir / "audit-failures"))


@pytest.fixture(scope="module")
def gpu_layout(tmp_path_factory: pytest.TempPathFactory, vllm_workdir: Path) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-gpu-layout")
    for name in ("target", "draftA", "draftB"):
        (work / name).symlink_to(vllm_workdir / name)
    return run_scenario("gpu_layout", work, script="vllm_failure_scenarios", RELOAD_LIFECYCLE_PARTIAL="keep")


def triggers(case: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(e["trigger"], e["dst"]) for e in case["events"] if e["event"] == "transition"
            and e["trigger"] in ("abort_reload", "recover")]


def assert_serves_and_retries(case: dict[str, Any]) -> None:
    """The engine generates after the failure, and the corrected call succeeds on the same engine."""
    assert case["generate"]["ok"], case["generate"]
    assert case["retry"]["ok"], case["retry"]
    assert case["state_after_retry"]["state"] == USABLE
    assert case["state_after_retry"]["quarantine_reason"] is None
    assert case["generate_after_retry"]["ok"], case["generate_after_retry"]
    assert case["generate_after_retry"]["value"] == case["generate"]["value"]  # greedy: the target decides


def assert_quarantined(case: dict[str, Any], error: str, reason: str) -> None:
    """Written in part: quarantined with the reason, the drafter paused while it is, resumed after the retry."""
    assert not case["call"]["ok"] and case["call"]["error"] == error, case["call"]
    assert case["state"]["state"] == S.QUARANTINED.value
    assert reason in case["state"]["quarantine_reason"], case["state"]["quarantine_reason"]
    assert ("abort_reload", S.QUARANTINED.value) in triggers(case)
    events = [e["event"] for e in case["events"]]
    assert "drafting_paused" in events and "drafting_resumed" in events
    resumed = next(e for e in case["events"] if e["event"] == "drafting_resumed")
    assert resumed["steps_without_draft"] >= 1
    assert_serves_and_retries(case)


def assert_rolled_back(case: dict[str, Any], error: str, message: str) -> None:
    """Touched but nothing written: vLLM's kept tensors were put back, an exact rollback, and the draft was
    recovered at once: serving with its last good weights, drafting never paused."""
    assert not case["call"]["ok"] and case["call"]["error"] == error, case["call"]
    assert message in case["call"]["message"]
    assert case["state"]["state"] == USABLE
    assert triggers(case)[:2] == [("abort_reload", S.QUARANTINED.value), ("recover", USABLE)]
    abort = next(e for e in case["events"] if e.get("trigger") == "abort_reload")
    assert abort["rolled_back"] is True and abort["recoverable"] is True
    assert "drafting_paused" not in [e["event"] for e in case["events"]]
    assert_serves_and_retries(case)


# ---- refused before the draft is touched ------------------------------------------------------------------------

UNTOUCHED = {
    "empty_folder": ("CheckpointError", "the folder holds no *.safetensors file"),
    "missing_path": ("CheckpointError", "nope: No such file or directory"),
    "fifo": ("CheckpointError", "not a regular file (a FIFO)"),  # used to hang the RPC
    "outside_root": ("PermissionError", "outside the allowed root"),
    "bucket_size_str": ("TypeError", "bucket_size must be a positive int or None (a bucket per layer), got '2'"),
    "bucket_size_zero": ("ValueError", "bucket_size must be a positive int or None (a bucket per layer), got 0"),
    "prefixes_str": ("TypeError", "not one string: 'layers.1.' would be read as its characters"),
    "everything_excluded": ("CheckpointError", "nothing to load"),
    "partial_unknown": ("ValueError", "partial='maybe': expected one of 'refuse', 'keep'"),
    # from the headers alone (issue 25, item 7): before, a RuntimeError after trying to allocate 1 TiB, and
    # another model's folder or a name the draft lacks reached vLLM's loader with the draft on META
    "sparse_tib": ("CheckpointError", "tensor layers.1.mlp.down_proj.weight claims 1,099,511,627,776 bytes"),
    "target_folder": ("FrozenStructureError", "embed_tokens (absent since the first load)"),
    "bogus_name": ("CheckpointError", "a_bogus.weight ("),
    # exactly from the header, naming the tensor and both shapes (issue 32, item 5): before, a tensor a row short
    # (or one of fewer columns) reached vLLM, whose check raised mid-load and quarantined the draft naming nothing
    "bad_shape": ("CheckpointError", "layers.1.mlp.down_proj.weight ("),
    "short_row": ("CheckpointError", "layers.1.self_attn.k_proj.weight ("),
    "long_row": ("CheckpointError", "layers.1.self_attn.k_proj.weight ("),
}
SHAPES = {"bad_shape": "[64, 96], but the draft's first load took [64, 128]",
          "short_row": "[31, 64], but the draft's first load took [32, 64]",
          "long_row": "[33, 64], but the draft's first load took [32, 64]"}


@pytest.mark.parametrize("case", sorted(UNTOUCHED))
def test_bad_arguments_and_paths_are_refused_before_the_draft_is_touched(failures: dict[str, Any], case: str
                                                                         ) -> None:
    got = failures["untouched"][case]
    error, message = UNTOUCHED[case]
    assert not got["call"]["ok"] and got["call"]["error"] == error, got["call"]
    assert message in got["call"]["message"]
    assert SHAPES.get(case, "") in got["call"]["message"]
    assert got["after"] == got["before"]  # same state, epoch, readiness and buffer identities: nothing began


def test_after_refused_arguments_the_engine_serves_and_the_corrected_call_works(failures: dict[str, Any]) -> None:
    assert failures["untouched_generate"]["ok"]
    assert failures["untouched_retry"]["ok"], failures["untouched_retry"]
    assert failures["untouched_retry"]["value"][0]["buckets"] == 13  # bucket_size=2 over 25 tensors
    # no bucket_size: a layer per bucket (2 layers), fc, hidden_norm and norm alone; never the whole payload
    assert failures["default_plan"]["ok"] and failures["default_plan"]["value"][0]["buckets"] == 5


# ---- before the first bucket: touched (META), nothing written -------------------------------------------------


def test_a_transfer_session_chunk_that_cannot_be_read_rolls_back_exactly(failures: dict[str, Any]) -> None:
    """start_draft_weight_update moved the draft to META; the chunk's file does not exist. vLLM ends the session
    without calling finish, so the plugin ends the epoch itself."""
    assert_rolled_back(failures["session_missing_file"], "CheckpointError", "vanished: No such file")


def test_a_session_chunk_a_row_short_is_refused_from_its_header_and_rolls_back_exactly(failures: dict[str, Any]
                                                                                        ) -> None:
    """The issue's online case: the chunk's k_proj one row short. Before: vLLM's weight loader raised mid-load
    (422 "AssertionError: ..." naming no tensor, the draft QUARANTINED); now the header refuses it naming the
    tensor and both shapes, before a byte is read, and the draft serves its last weights."""
    case = failures["session_short_row"]
    assert_rolled_back(case, "CheckpointError", SHAPES["short_row"])
    assert "layers.1.self_attn.k_proj.weight (" in case["call"]["message"]


def test_a_malformed_update_info_rolls_back_exactly(failures: dict[str, Any]) -> None:
    assert_rolled_back(failures["session_bad_update_info"], "ValueError", "unexpected keyword argument 'pathh'")


def test_a_load_weights_that_raises_on_the_first_bucket_rolls_back_exactly(failures: dict[str, Any]) -> None:
    assert_rolled_back(failures["first_bucket_raises"], "ValueError", "injected: load_weights failed on the first")


def test_an_abandoned_reload_is_ended_by_the_next_one(failures: dict[str, Any]) -> None:
    """A trainer that dies between initialize_layerwise_reload and finalize: the engine serves meanwhile without
    the draft (the modules the draft shares with the target, its embedding, LM head and rotary embedding, stay
    live: they were on META until finalize, and the target's forward failed), and the next reload ends the
    abandoned epoch (quarantine: its buckets were written) instead of being refused from PARTIALLY_LOADED."""
    case = failures["abandoned_reload"]
    assert case["call"]["ok"] and case["state"]["state"] == S.PARTIALLY_LOADED.value
    assert case["generate"]["ok"], case["generate"]
    paused = next(e for e in case["events"] if e["event"] == "drafting_paused")
    assert paused["state"] == S.PARTIALLY_LOADED.value
    abort = next(e for e in case["events"] if e.get("trigger") == "abort_reload")
    assert "abandoned" in abort["reason"]
    assert case["retry"]["ok"], case["retry"]
    assert case["state_after_retry"]["state"] == USABLE and case["generate_after_retry"]["ok"]


# ---- written in part: quarantined, the engine serves without the draft ----------------------------------------


def test_a_bucket_failing_midway_quarantines(failures: dict[str, Any]) -> None:
    """The first bucket was written (and processed) before the second raised inside load_weights (a tensor of
    the wrong shape did this before the header check refused it first)."""
    case = failures["mid_bucket"]
    assert_quarantined(case, "RuntimeError", "injected: load_weights failed on the second bucket")


@pytest.mark.parametrize("how", ["rewrite", "truncate"])
def test_a_checkpoint_changed_while_read_quarantines_and_the_engine_survives(failures: dict[str, Any], how: str
                                                                             ) -> None:
    """After the first bucket the file is rewritten in place (mixed into the draft before) or truncated (SIGBUS
    before): the reader refuses the next bucket, naming the file."""
    case = failures[f"changed_while_read_{how}"]
    assert_quarantined(case, "CheckpointError", "changing/model.safetensors changed since its header was read")
    assert ("size" if how == "truncate" else "mtime_ns") in case["call"]["message"]


def test_finalize_with_a_wrong_config_ends_the_epoch(failures: dict[str, Any]) -> None:
    assert_quarantined(failures["finalize_without_config"], "TypeError",
                       "model_config must be the draft's ModelConfig, got NoneType")


def test_a_reload_hook_failing_in_finalize_quarantines(failures: dict[str, Any]) -> None:
    assert_quarantined(failures["reload_hook_raises"], "RuntimeError", "injected: reload hook failed")


def test_vllms_own_finalize_failing_quarantines_and_puts_every_module_back(failures: dict[str, Any]) -> None:
    assert_quarantined(failures["vllm_finalize_raises"], "RuntimeError",
                       "finalize_layerwise_reload failed: RuntimeError: injected: attention processing failed")


def test_a_failing_refresh_quarantines(failures: dict[str, Any]) -> None:
    assert_quarantined(failures["refresh_raises"], "DerivedBuildError", "_k_norm_weights failed in per_layer")


def test_the_engine_ends_every_case_usable_with_every_pinned_address_kept(failures: dict[str, Any]) -> None:
    assert failures["final_state"]["state"] == USABLE and failures["final_state"]["epoch"] >= 20
    (verify,) = failures["verify"]
    assert all(v["ok"] and v["checked"] > 0 for v in verify["backbones"].values())


def test_the_failures_audit_log_replays_clean(failures: dict[str, Any], vllm_workdir: Path) -> None:
    from lifecycle.audit.replay import audit_logs

    result = audit_logs([vllm_workdir / "audit-failures"])
    assert result.status == 0, [str(v) for v in result.violations]


# ---- partial payloads ------------------------------------------------------------------------------------------


def _layer(fp: dict[str, str], prefix: str) -> dict[str, str]:
    return {n: d for n, d in fp.items() if n.startswith(prefix)}


def test_partial_refuse_quarantines_and_keeps_unsent_layers_unchanged(failures: dict[str, Any]) -> None:
    """The default: an incomplete payload (layer 1 left out) quarantines; layer 1 keeps its values (vLLM put its
    tensors back), it is not processed from uninitialised memory."""
    case = failures["partial_refuse"]
    assert_quarantined(case, "LayersNotReadyError", "layers.1: layers.1.self_attn.qkv_proj.weight")
    (b,), (now,) = failures["keep_fingerprint"], case["fingerprint"]  # draft B before: the last retry loaded it
    assert _layer(now, "model.layers.1.") == _layer(b, "model.layers.1.")
    assert _layer(now, "model.layers.0.") != _layer(b, "model.layers.0.")  # layer 0 came from draft A


def test_the_fused_path_of_a_quarantined_draft_refuses_real_work_and_skips_dummy_runs(failures: dict[str, Any]
                                                                                      ) -> None:
    """Nothing reaches it while the drafter is paused; if something does, a step that stores context K/V is
    refused (QuarantinedError), and a dummy run (no slots: what vLLM runs on data-parallel ranks whose drafter it
    skipped) is skipped instead of failing the engine step."""
    case = failures["fused_path_while_quarantined"]
    assert case["state"]["state"] == S.QUARANTINED.value
    assert case["probe"] == [{"dummy": "None", "real": "QuarantinedError"}]
    assert_serves_and_retries(case)


def test_partial_keep_of_one_layer_equals_a_cold_engine_on_the_merged_weights(failures: dict[str, Any],
                                                                            cold_b: dict[str, Any]) -> None:
    """The engine starts on M = draft B with layer 1 of draft A; a payload of B's layer 1 alone, partial='keep',
    makes B: every draft tensor as the model computes with it (linear layers read through an identity input)
    and every derived buffer equal the cold engine on B, bit for bit."""
    assert failures["keep_one_layer"]["ok"], failures["keep_one_layer"]
    assert failures["keep_one_layer"]["value"][0]["partial"] == "keep"
    assert failures["keep_state"]["state"] == USABLE and failures["keep_generate"]["ok"]
    (keep_fp,), (cold_fp,) = failures["keep_fingerprint"], cold_b["fingerprint"]
    assert keep_fp == cold_fp, [n for n in cold_fp if keep_fp.get(n) != cold_fp[n]]
    (keep_digests,), (cold_digests,) = weight_derived(failures["keep_digests"]), weight_derived(cold_b["digests"])
    assert keep_digests == cold_digests
    # the kept tensors are audited; the fused buffer is backed by the K/V shadows (CPU repack), so the capture of
    # the one processed layer wrote its slice and the refresh only verified
    (partial,) = [e for e in failures["keep_events"] if e["event"] == "partial_reload"]
    assert partial["policy"] == "keep" and "layers.0.self_attn.qkv_proj.weight" in partial["kept"]
    assert not any(n.startswith("layers.1.") for n in partial["kept"])
    refresh = [e for e in failures["keep_events"] if e["event"] == "refresh"][-1]
    fused = next(b for b in refresh["buffers"] if b["name"] == "_fused_kv_weight")
    assert (fused["mode"], fused["slices_written"], fused["slices_total"]) == ("backed", 0, 2)


def test_partial_keep_refuses_a_tensor_sent_in_part_when_its_layout_was_repacked(failures: dict[str, Any]
                                                                                 ) -> None:
    """Only layer 0's k_proj (a third of the fused qkv_proj): on CPU the processed qkv_proj is a oneDNN handle
    (its weight emptied), so the rest cannot be kept. Refused, named with why; the tensor kept, not garbage."""
    case = failures["keep_part_of_a_tensor"]
    assert_quarantined(case, "LayersNotReadyError",
                       "layers.0.self_attn.qkv_proj.weight (2048 of 8192 elements were sent; kept unchanged")
    assert "repacked after loading" in case["call"]["message"]
    assert case["fingerprint"] == failures["keep_fingerprint"]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_partial_keep_completes_a_tensor_sent_in_part_with_its_last_values(gpu_layout: dict[str, Any]) -> None:
    """GPU layout, RELOAD_LIFECYCLE_PARTIAL=keep: draft A's layer-0 k_proj alone into M. vLLM would process the
    fused qkv_proj with its q and v rows uninitialised; the plugin fills them with their last values first."""
    from lifecycle.vllm.demo.tiny import dflash_draft_tensors

    assert gpu_layout["keep_k0"]["ok"], gpu_layout["keep_k0"]
    assert gpu_layout["keep_k0"]["value"][0]["partial"] == "keep"  # the engine-wide setting
    assert gpu_layout["keep_k0_state"]["state"] == USABLE and gpu_layout["keep_k0_generate"]["ok"]
    a, b = dflash_draft_tensors(1), dflash_draft_tensors(2)  # M's layer 0 is B's
    p = "layers.0.self_attn."
    qkv = torch.cat([b[p + "q_proj.weight"], a[p + "k_proj.weight"], b[p + "v_proj.weight"]])
    (before,), (after,) = gpu_layout["fingerprint_m"], gpu_layout["keep_k0_fingerprint"]
    assert after["model.layers.0.self_attn.qkv_proj(x)"] == _sha(qkv.T)  # F.linear(I, W) = W^T, exactly
    assert {n for n in before if before[n] != after[n]} == {"model.layers.0.self_attn.qkv_proj(x)"}
    kv = torch.cat([a[p + "k_proj.weight"], b[p + "v_proj.weight"], a["layers.1.self_attn.k_proj.weight"],
                    a["layers.1.self_attn.v_proj.weight"]])
    (digests,) = gpu_layout["keep_k0_digests"]
    assert digests["backbones"]["dflash-draft"]["_fused_kv_weight"] == _sha(kv)


def test_partial_refuse_per_call_overrides_the_engine_setting_and_writes_no_garbage(gpu_layout: dict[str, Any]
                                                                                    ) -> None:
    """partial='refuse' on an engine set to keep: B's k_proj alone is refused; the fused qkv_proj keeps its
    values (vLLM would have processed it with the rest uninitialised)."""
    case = gpu_layout["refuse_k0"]
    assert_quarantined(case, "LayersNotReadyError", "(partial='refuse')")
    assert case["fingerprint"] == gpu_layout["keep_k0_fingerprint"]
    assert case["retry"]["value"][0]["partial"] == "keep"
    (verify,) = gpu_layout["verify"]
    assert all(v["ok"] for v in verify["backbones"].values())


def test_a_bad_engine_wide_setting_stops_the_plugin_before_it_patches_anything(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """vLLM calls the plugin's entry point unguarded in every process: the engine does not start."""
    import lifecycle.vllm.plugin.activation as plugin

    monkeypatch.setattr(plugin, "_active", False)
    monkeypatch.setenv("RELOAD_LIFECYCLE_PARTIAL", "sometimes")
    with pytest.raises(ValueError, match="RELOAD_LIFECYCLE_PARTIAL='sometimes' is not one of: refuse, keep"):
        plugin.activate()
    assert plugin._active is False
    monkeypatch.setenv("RELOAD_LIFECYCLE_PARTIAL", "keep")
    monkeypatch.setenv("RELOAD_LIFECYCLE_PATH_ROOT", "relative/folder")
    with pytest.raises(ValueError, match="RELOAD_LIFECYCLE_PATH_ROOT='relative/folder' must be an absolute path"):
        plugin.activate()
    assert plugin._active is False


def test_a_payload_that_resends_a_shard_and_omits_another_is_refused_or_completed_on_an_engine(
        gpu_layout: dict[str, Any]) -> None:
    """A real engine, `reload_draft_weights` of B without layer 0's k_proj and with its q_proj also under vLLM's
    `midlayer.` alias: vLLM's element count for the fused qkv_proj adds up (q twice = q + k + v). Before (issue 24,
    item 13) the layer was processed with K rows never sent and the draft served them. Now partial='refuse' is
    refused naming the shard (the draft keeps B's values, a complete reload works), and the engine-wide keep
    completes the shard never sent with its last values: the draft is B again, bit for bit."""
    refused = gpu_layout["duplicate_shard_refuse"]
    assert_quarantined(refused, "LayersNotReadyError", "shard 'k' (layers.0.self_attn.k_proj.weight) never sent")
    assert "sent 'q' 2 times" in refused["call"]["message"]
    assert refused["fingerprint"] == gpu_layout["fingerprint_b"]  # nothing of the refused payload was served
    kept = gpu_layout["duplicate_shard_keep"]
    assert kept["ok"], kept
    assert kept["value"][0]["partial"] == "keep"
    assert gpu_layout["duplicate_shard_keep_state"]["state"] == USABLE
    assert gpu_layout["duplicate_shard_keep_generate"]["ok"]
    assert gpu_layout["duplicate_shard_keep_fingerprint"] == gpu_layout["fingerprint_b"]  # k kept: B's, not garbage
