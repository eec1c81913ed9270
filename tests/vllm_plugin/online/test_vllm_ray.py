"""The plugin under vLLM's Ray executors (V1 `RayDistributedExecutor`, V2 `RayExecutorV2`), TP=2 on this machine.

Needs Ray (requirements/ray.lock.txt): `make test-ray` installs it and runs this module, which `make test`
leaves out (marker `ray`: four Ray engine starts and a single-rank cold engine, a few minutes on two cores).

vLLM's CPU platform refuses Ray; the scenarios (tests/support/ray_scenarios.py) allow it in the test process and its Ray
workers only, never through the plugin. Each scenario runs in its own process (one engine per process).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from lifecycle.audit.replay import audit_logs
from lifecycle.states import LifecycleState
from lifecycle.vllm.settings import AUDIT_DIR_ENV
from support.digests import weight_derived
from support.needs import needs
from support.vllm_runs import run_script

pytestmark = pytest.mark.ray

HOST = socket.gethostname()


@needs("engine")
def run(script: str, name: str, work: Path, arg: str = "") -> dict[str, Any]:
    # each scenario sets the audit folder itself, after Ray started
    return run_script(script, name, work, *([arg] if arg else []), unset=(AUDIT_DIR_ENV,))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoints the scenarios load: a target, draft A (cold) and draft B (the reload)."""
    from lifecycle.vllm.demo.tiny import make_dflash_draft, make_target

    work = tmp_path_factory.mktemp("vllm-ray")
    make_target(work / "target")
    for name, seed in (("draftA", 1), ("draftB", 2)):
        make_dflash_draft(work / name, seed=seed)
    return work


@pytest.fixture(scope="module")
def cold_b(workdir: Path) -> dict[str, Any]:
    """A cold single-rank engine on draft B (its KV heads are replicated under TP=2: every rank derives the
    same buffers)."""
    return run("vllm_basic_scenarios", "cold", workdir)


@pytest.fixture(scope="module", params=["v1", "v2"])
def tp2(request: pytest.FixtureRequest, workdir: Path) -> tuple[str, dict[str, Any]]:
    return request.param, run("ray_scenarios", "tp2", workdir, request.param)


def test_each_rank_runs_the_plugin_and_reloads_in_place(tp2: tuple[str, dict[str, Any]]) -> None:
    executor, out = tp2
    assert out["executor"] == {"v1": "RayDistributedExecutor", "v2": "RayExecutorV2"}[executor]
    assert sorted((p["rank"], p["active"], p["node"]) for p in out["probes"]) == [(0, True, HOST), (1, True, HOST)]
    assert out["reload"]["ok"], out["reload"]
    assert [(a["rank"], a["node"], a["buckets"]) for a in out["reload"]["value"]] == [(0, HOST, 5), (1, HOST, 5)]
    drafts = [s for rank_states in out["states"] for s in rank_states if s["role"] == "draft"]
    assert sorted((d["rank"], d["node"]) for d in drafts) == [(0, HOST), (1, HOST)]
    assert all(d["state"] == LifecycleState.GRAPH_CAPTURED.value and d["epoch"] == 1 for d in drafts)
    assert all(v["ok"] and v["checked"] > 0 for answer in out["verify"] for v in answer["backbones"].values())
    assert out["generate_after"]["ok"] and out["generate_after"]["value"] == out["generate_before"]["value"]


def test_both_ranks_derive_what_a_cold_engine_derives(tp2: tuple[str, dict[str, Any]],
                                                      cold_b: dict[str, Any]) -> None:
    _, out = tp2
    (cold,) = (answer["backbones"] for answer in weight_derived(cold_b["digests"]))
    got = weight_derived(out["digests"])
    assert cold and all(answer["backbones"] == cold for answer in got), (got, cold)
    assert [a["rank"] for a in out["digests"]] == [0, 1]


def test_every_worker_writes_an_audit_file_and_the_audit_is_clean(tp2: tuple[str, dict[str, Any]],
                                                                  workdir: Path) -> None:
    """The V1 executor copies only variables it knows of: without the plugin adding its prefix, no worker
    would write a log, and the auditor would see nothing (exit status 2, not clean)."""
    executor, _ = tp2
    folder = workdir / f"audit-ray-{executor}"
    written = {}
    for log in sorted(folder.glob("audit-*.jsonl")):
        events = [json.loads(line) for line in log.read_text().splitlines()]
        if events:
            written[log.name] = sorted({(e["rank"], e["node"]) for e in events})
    assert sorted(written.values()) == [[(0, HOST)], [(1, HOST)]], written  # one file per worker, one rank each
    assert all(name.startswith(f"audit-{HOST}-") for name in written)
    result = audit_logs([folder], expect_ranks=range(2))
    assert result.status == 0, ([v.as_dict() for v in result.violations], result.input_problems)
    assert result.ranks == [0, 1] and result.nodes == [HOST] and result.missing_ranks == ()
    assert {r.epoch for r in result.streams} == {1}


@pytest.mark.parametrize("variant", ["stock", "extension"])
def test_a_node_without_the_package_stops_the_engine_start_naming_the_node(workdir: Path, variant: str) -> None:
    """stock: the workers start with vLLM's own draft class, and the check after start refuses them; extension:
    a worker cannot import the lifecycle's worker extension, and the refusal explains vLLM's failure."""
    start = run("ray_scenarios", "bad_node", workdir, variant)["start"]
    assert not start["ok"] and start["error"] == "NodeSetupError", start
    message = start["message"]
    assert "the vLLM plugin is not active on every node of this Ray engine" in message
    assert f"node {HOST}" in message and "cannot be imported there" in message
    if variant == "stock":
        assert "rank(s) 0, 1" in message  # the running workers said which ranks they are
    else:
        assert "lifecycle" in start["cause"]  # vLLM's own failure, chained
