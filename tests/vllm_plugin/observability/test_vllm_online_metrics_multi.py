"""The reload_lifecycle_* metrics with several API servers (`vllm serve --api-server-count 2`; issue 32, item 8): a
real server whose `/metrics` is vLLM's multiprocess registry (prometheus_client's multiprocess mode), parsed with
prometheus_client's own parser (support/prom.py: every scrape holds no NaN, no `pid` label, no undocumented label
value), driven by a trainer that opens a new connection per call, so the calls of one push land on either server.

Before: every gauge came twice with a `pid` label, `weight_version_info` kept one series per version ever pushed,
the calls of one push that landed on different servers counted as `kind="unknown"` pushes of 2 ms, and no series
existed before the first push. The one-server tests are test_vllm_online_metrics.py; the same controlled pair (target
Z emits token 0; draft Z proposes it, always accepted).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.entry_points import dist_info
from support.prom import missing_at_start, scrape, settled, value
from support.rl_client import RLClient
from support.vllm_canary_scenarios import controlled_pair
from support.vllm_server import ROOT, VllmServer

DRAFT = {"backbone": "dflash-draft"}
ENGINE = {"engine": "0"}
PUSHES = 6  # x 3 calls (start, chunk, finish), each on a new connection: all on one server has p = 2**-17


@pytest.fixture(scope="module")
def served(vllm_workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    target_z, draft_z = controlled_pair(vllm_workdir)
    entry_points = dist_info(tmp_path_factory.mktemp("entry_points"))
    path = os.pathsep.join([str(entry_points), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))])
    server = VllmServer(target_z, draft_z, tmp_path_factory.mktemp("serve_metrics_multi"),
                        env={"PYTHONPATH": path, "RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS": "30"},
                        extra_args=["--api-server-count", "2"], startup_timeout_s=600)  # three processes to start
    server.start()
    client = RLClient(server.url, server.model, keepalive=False)
    try:
        yield {"server": server, "client": client, "draftZ": draft_z}
    finally:
        client.close()
        stopped = server.stop()
    assert stopped.left == [], stopped


def test_two_api_servers_run_and_every_series_is_there_once_before_the_first_push(served: dict[str, Any]) -> None:
    server: VllmServer = served["server"]
    names = [name for name, _ in server.rss().values()]
    assert sum(n.startswith("VLLM::APIServer") for n in names) == 2, names
    got = settled(served["client"], "reload_lifecycle_draft_usable", 1, timeout_s=30, **DRAFT)
    assert missing_at_start(got, one_server=False) == []  # and no pid label: scrape() checks every sample
    assert value(got, "reload_lifecycle_draft_epoch", **DRAFT) == 0
    assert value(got, "reload_lifecycle_pushes_total", kind="draft", outcome="ok") == 0
    assert not any(n.endswith("_created") for n in got["families"] if n.startswith("reload_lifecycle_"))


def test_pushes_whose_calls_land_on_either_server_count_once_each_with_their_kind(served: dict[str, Any]) -> None:
    c: RLClient = served["client"]
    first = c.push({"path": str(served["draftZ"])}, weight_version="m1")
    assert [e.status for e in first] == [200] * 5
    settled(c, "reload_lifecycle_draft_epoch", 1, timeout_s=30, **DRAFT)
    deadline = time.monotonic() + 30
    while not (per_push := value(scrape(c), "reload_lifecycle_written_bytes_total", **DRAFT)):
        assert time.monotonic() < deadline, "no bytes counted after a push"
        time.sleep(0.5)
    time.sleep(11)  # both servers' periodic pulls (every 10 s) came: the push is still counted once
    assert value(scrape(c), "reload_lifecycle_written_bytes_total", **DRAFT) == per_push
    for i in range(2, PUSHES + 1):
        assert [e.status for e in c.push({"path": str(served["draftZ"])}, weight_version=f"m{i}")] == [200] * 5
    got = settled(c, "reload_lifecycle_draft_epoch", PUSHES, timeout_s=30, **DRAFT)
    assert value(got, "reload_lifecycle_pushes_total", kind="draft", outcome="ok") == PUSHES
    assert value(got, "reload_lifecycle_push_duration_seconds_count", kind="draft", outcome="ok") == PUSHES
    for outcome in ("refused", "abandoned"):
        assert value(got, "reload_lifecycle_pushes_total", kind="draft", outcome=outcome) == 0
    assert value(got, "reload_lifecycle_stray_calls_total", call="finish_weight_update") == 0
    # the workers' totals are counted by API server 0 alone: not once per server
    got = settled(c, "reload_lifecycle_written_bytes_total", PUSHES * per_push, timeout_s=30, **DRAFT)
    assert value(got, "reload_lifecycle_written_bytes_total", **DRAFT) == PUSHES * per_push
    assert value(got, "reload_lifecycle_draft_usable", **DRAFT) == 1


def test_a_stray_finish_is_no_push_and_a_refused_push_names_its_class(served: dict[str, Any]) -> None:
    c: RLClient = served["client"]
    assert c.finish("stray").status >= 400
    steps = c.push({"path": str(served["draftZ"]), "exclude_prefixes": ["layers.1."]}, weight_version="bad")
    assert [e.status for e in steps][-2:] == [422, 200]
    got = settled(c, "reload_lifecycle_draft_quarantined", 1, timeout_s=30, **DRAFT)
    assert value(got, "reload_lifecycle_stray_calls_total", call="finish_weight_update") == 1
    assert value(got, "reload_lifecycle_pushes_total", kind="draft", outcome="refused") == 1
    assert value(got, "reload_lifecycle_refusals_total", kind="draft", error="LayersNotReadyError") == 1
    assert [e.status for e in c.push({"path": str(served["draftZ"])}, weight_version="good")] == [200] * 5
    got = settled(c, "reload_lifecycle_draft_usable", 1, timeout_s=30, **DRAFT)
    assert value(got, "reload_lifecycle_draft_quarantined", **DRAFT) == 0
