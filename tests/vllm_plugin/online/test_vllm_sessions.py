"""vLLM's weight-update session kept in step with the draft's reload epoch, offline: an `LLM` driven through vLLM's
own RL calls (`start_draft_weight_update`, `update_weights`, `finish_weight_update(weight_version=...)`), as a
colocated trainer drives it (issue 24 items 9-10; tests/vllm_plugin/online/test_vllm_online.py drives the same over
HTTP). Also the draft in vLLM's weight checker on both weight layouts (issue 26 item 2) and the trainer's
`weight_version` in the audit (item 5). One scenario process (support/vllm_session_scenarios.py): an engine on the CPU
layout, then one on the GPU layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle.env import EnvSettingError
from lifecycle.vllm.demo.tiny import dflash_draft_tensors
from lifecycle.vllm.observability.weight_checker import DIFFERS, EQUAL, digest, expected_checksums
from lifecycle.vllm.online.sessions import REFUSED, TAKEOVER_IDLE_ENV, takeover_idle_s
from support.digests import weight_derived
from support.vllm_basic_scenarios import run_scenario

OK3 = [{"ok": True}] * 3


@pytest.fixture(scope="module")
def offline(vllm_workdir: Path) -> dict[str, Any]:
    return run_scenario("offline", vllm_workdir, script="vllm_session_scenarios")


def _digests_differ(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[str]:
    """Each derived buffer whose digest differs, per rank and backbone, and the ranks' nodes: the assertion's message
    (pytest cuts the two lists short at the first differing dict)."""
    def flat(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], str]:
        return {(r.get("rank"), b, k): v for r in rows for b, bufs in r.get("backbones", {}).items()
                for k, v in bufs.items()}

    g, w = flat(got), flat(want)
    nodes = [(r.get("rank"), r.get("node")) for r in got], [(r.get("rank"), r.get("node")) for r in want]
    return [f"{k}: {g.get(k, 'absent')[:16]} != {w.get(k, 'absent')[:16]}" for k in sorted(g.keys() | w.keys(), key=str)
            if g.get(k) != w.get(k)] + [f"nodes {nodes[0]} vs {nodes[1]}"]


def _derived(entries: dict[str, str]) -> dict[str, str]:
    return {k.rpartition(".")[2]: v for k, v in entries.items() if ".derived." in k}


def test_a_refused_finish_closes_the_session_names_what_was_refused_and_a_corrected_push_and_a_policy_sync_follow(
        offline: dict[str, Any], cold_b: dict[str, Any]) -> None:
    cpu = offline["cpu"]
    start, update, finish = cpu["refused"]
    assert start["ok"] and update["ok"] and finish["error"] == "WeightUpdateRefused"
    # the trainer's error names the refusal, the layer and what it left
    assert finish["message"].startswith(f"{REFUSED} the draft weight update: LayersNotReadyError:")
    assert "layers.1: layers.1.self_attn.qkv_proj.weight" in finish["message"]
    assert "without speculation" in finish["message"] and "start_weight_update proceeds" in finish["message"]
    assert cpu["refused_state"]["state"] == "QUARANTINED" and cpu["refused_generate"] == cpu["generate_cold"]
    assert set(_derived(cpu["refused_checksums"]).values()) == {"not-serving:QUARANTINED"}
    # before the fix every later start answered "start_weight_update called while a weight update is already active"
    assert cpu["corrected"] == OK3 and cpu["corrected_state"]["state"] == "DERIVED_REFRESHED"
    got, want = weight_derived(cpu["corrected_digests"]), weight_derived(cold_b["digests"])
    assert got == want, _digests_differ(got, want)
    assert cpu["policy"] == OK3


def test_an_abandoned_push_refuses_a_start_until_taken_over_by_name_audited_and_the_next_push_proceeds(
        offline: dict[str, Any], cold_b: dict[str, Any]) -> None:
    cpu = offline["cpu"]
    epoch = cpu["abandoned_state"]["epoch"]
    assert cpu["abandoned"] == [{"ok": True}] * 2 and cpu["abandoned_state"]["state"] == "PARTIALLY_LOADED"
    assert set(_derived(cpu["abandoned_checksums"]).values()) == {"not-serving:PARTIALLY_LOADED"}
    refused = cpu["abandoned_refused_start"]  # before: the start took the active push over at once
    assert refused["error"] == "WeightUpdateRefused" and f"epoch {epoch}, opened" in refused["message"]
    assert "lifecycle_take_over_push" in refused["message"]
    assert cpu["abandoned_taken_over"][0]["taken_over"] == f"epoch {epoch}"
    assert cpu["next"] == OK3 and cpu["next_state"]["state"] == "DERIVED_REFRESHED"
    got, want = weight_derived(cpu["next_digests"]), weight_derived(cold_b["digests"])
    assert got == want, _digests_differ(got, want)
    (ended,) = [e for e in cpu["events"][0] if e["event"] == "weight_update_session_ended" and e["epoch"] == epoch]
    assert ended["outcome"] == "taken_over" and ended["chunks"] == 1 and ended["push"] == f"epoch {epoch}"
    assert ended["reason"].startswith("taken over: lifecycle_take_over_push ended the open draft session")
    assert ended["open_s"] >= ended["idle_s"] >= 0


def test_an_abandoned_draft_push_then_a_policy_sync_ends_the_draft_push_and_the_next_draft_push_recovers(
        offline: dict[str, Any]) -> None:
    cpu = offline["cpu"]
    assert cpu["abandoned_policy"] == [{"ok": True}] * 5
    state = cpu["abandoned_policy_state"]
    assert state["state"] == "QUARANTINED" and state["quarantine_reason"].startswith("taken over:")
    assert cpu["after_policy"] == OK3 and cpu["after_policy_state"]["state"] == "DERIVED_REFRESHED"


def test_under_the_takeover_setting_a_live_session_is_refused_naming_it_and_its_own_finish_completes(
        offline: dict[str, Any]) -> None:
    cpu = offline["cpu"]
    start, update, second_draft, policy = cpu["live"]
    assert start["ok"] and update["ok"]
    for refused, what in ((second_draft, "start_draft_weight_update"), (policy, "start_weight_update")):
        assert refused["error"] == "WeightUpdateRefused" and refused["message"].startswith(f"{REFUSED} {what}:")
        assert f"{TAKEOVER_IDLE_ENV}=600" in refused["message"] and "Nothing was changed" in refused["message"]
        assert "1 update_weights chunk(s)" in refused["message"]
    assert cpu["live_state"]["state"] == "PARTIALLY_LOADED"  # the open session is untouched
    assert cpu["live_finish"] == {"ok": True} and cpu["live_finish_state"]["state"] == "DERIVED_REFRESHED"
    assert cpu["live_finish_state"]["epoch"] == cpu["live_state"]["epoch"]


def test_a_refused_chunk_ends_the_session_says_that_nothing_was_written_and_the_next_push_proceeds(
        offline: dict[str, Any]) -> None:
    cpu = offline["cpu"]
    start, chunk = cpu["bad_chunk"]
    assert start["ok"] and chunk["error"] == "CheckpointError"  # the class a caller caught before
    assert chunk["message"].startswith(f"{REFUSED} the draft's update_weights chunk: CheckpointError:")
    assert "Nothing was written: the draft serves its last weights" in chunk["message"]
    assert cpu["bad_chunk_state"]["state"] == "DERIVED_REFRESHED"  # rolled back exactly and serving
    assert cpu["after_bad_chunk"] == OK3 and cpu["generate_end"] == cpu["generate_cold"]


def test_the_weight_checker_covers_the_draft_and_equals_the_trainer_side_digests_on_both_layouts(
        offline: dict[str, Any]) -> None:
    expected_a, expected_b = offline["expected_A"], offline["expected_B"]
    # what the trainer sent is what the engine serves: every draft entry, keys and values
    assert offline["cpu_cold_checksums"] == expected_a and offline["gpu_cold_checksums"] == expected_a
    assert offline["cpu"]["corrected_checksums"] == expected_b
    assert offline["gpu_push"] == OK3 and offline["gpu_checksums"] == expected_b
    keys = {k.split(":", 4)[-1] for k in expected_b}
    assert "draft.model.layers.0.self_attn.qkv_proj.weight" in keys and "draft.model.fc.weight" in keys
    assert {"draft.derived._fused_kv_weight", "draft.derived._rope_cos_sin_cache"} <= keys
    assert not any("mask_embedding" in k or "embed_tokens" in k for k in keys)  # not a checkpoint tensor / the target's
    # the CPU layout empties every linear weight: the recorded digest is not vLLM's digest of no bytes
    empty = digest(torch.empty(0))
    assert empty not in offline["cpu"]["corrected_checksums"].values()
    assert expected_a != expected_b


def test_a_stale_derived_buffer_reads_differs_from_cold_build_on_both_layouts(offline: dict[str, Any]) -> None:
    for name, seen in [*offline["cpu"]["stale"].items(), *offline["gpu_stale"].items()]:
        assert seen["tampered"][name] == DIFFERS, (name, seen)
        assert {n: v for n, v in seen["tampered"].items() if n != name} == dict.fromkeys(
            set(seen["tampered"]) - {name}, EQUAL)
        assert set(seen["restored"].values()) == {EQUAL}
    # on the CPU layout the fused K/V buffer is the only copy of its rows: the check reads the rows' digest taken
    # before the weight was repacked
    assert "_fused_kv_weight" in offline["cpu"]["stale"]


def test_a_finish_is_one_worker_round_trip_carrying_the_version(offline: dict[str, Any]) -> None:
    # before: the version went first (`lifecycle_note_weight_version`), then the finish, then a pull of the state
    calls = offline["cpu"]["corrected_calls"]
    assert calls[calls.index("update_weights") + 1:] == ["finish_weight_update"], calls
    assert "lifecycle_note_weight_version" not in calls and calls.count("finish_weight_update") == 1


def test_every_push_audits_the_trainers_weight_version_in_its_epoch(offline: dict[str, Any]) -> None:
    events = offline["cpu"]["events"][0]
    versions = {e["epoch"]: e["weight_version"] for e in events if e["event"] == "weight_version"}
    ended = {e["epoch"]: (e["outcome"], e["weight_version"]) for e in events
             if e["event"] == "weight_update_session_ended"}
    assert versions[offline["cpu"]["corrected_state"]["epoch"]] == "B-1"
    assert versions[offline["cpu"]["next_state"]["epoch"]] == "B-2"
    assert ended[offline["cpu"]["corrected_state"]["epoch"]] == ("finished", "B-1")
    refused_epoch = offline["cpu"]["refused_state"]["epoch"]
    assert versions[refused_epoch] == "B-missing-layer" and ended[refused_epoch] == ("refused", "B-missing-layer")
    assert "policy-1" not in versions.values()  # a policy sync is the target's: not audited in the draft's epochs


# ---- no engine -------------------------------------------------------------------------------------------------


def test_the_takeover_setting_reads_seconds_and_refuses_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TAKEOVER_IDLE_ENV, raising=False)
    assert takeover_idle_s() == 60.0  # issue 32: a live push is not taken over by default
    monkeypatch.setenv(TAKEOVER_IDLE_ENV, " 2.5 ")
    assert takeover_idle_s() == 2.5
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv(TAKEOVER_IDLE_ENV, bad)
        with pytest.raises(EnvSettingError, match=f"{TAKEOVER_IDLE_ENV}='{bad}' is not a number of seconds"):
            takeover_idle_s()


def test_expected_checksums_fuses_as_the_engine_loads_and_refuses_what_it_cannot_compute() -> None:
    sent = dflash_draft_tensors(3)
    expected = expected_checksums(sent, prefix="")
    qkv = torch.cat([sent[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([sent["layers.0.mlp.gate_proj.weight"], sent["layers.0.mlp.up_proj.weight"]])
    assert expected["draft.model.layers.0.self_attn.qkv_proj.weight"] == digest(qkv)
    assert expected["draft.model.layers.0.mlp.gate_up_proj.weight"] == digest(gate_up)
    assert expected["draft.model.norm.weight"] == digest(sent["norm.weight"])
    widened = expected_checksums({n: t.double() for n, t in sent.items()}, prefix="")  # cast to the engine's dtype
    assert widened == expected
    assert expected_checksums(sent, dtype=torch.bfloat16, prefix="") != expected
    missing = {n: t for n, t in sent.items() if n != "layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"layers.1.self_attn.qkv_proj.weight needs q_proj, k_proj, v_proj; .* k_proj"):
        expected_checksums(missing)
    with pytest.raises(ValueError, match="family 'gemma4_dspark' is not supported"):
        expected_checksums(sent, family="gemma4_dspark")
    with pytest.raises(TypeError, match=r"state_dict\['norm.weight'\] is list, not a tensor"):
        expected_checksums({**sent, "norm.weight": [1.0]})  # type: ignore[dict-item]
