"""The reload_lifecycle_* metrics and the acceptance canary ONLINE: a real `vllm serve` (support/vllm_server.py) with
the plugin's stat logger (the `vllm.stat_logger_plugins` entry point, loaded by vLLM in the API-server process), its
`/metrics` parsed with prometheus_client's own parser, driven over HTTP by a plain client (support/rl_client.py).
Issue 26 items 3 and 4; the offline engine's are tests/vllm_plugin/observability/test_vllm_canary.py.

One server for the module, on the controlled pair of the offline test (support/vllm_canary_scenarios.py): target Z
(emits token 0 for every input) with draft Z (proposes token 0: always accepted); draft B's proposals are rejected.
Requests one after the other, 12 tokens each: a good period verifies 36 draft tokens, a bad one 132. The canary's
`min_tokens` is 30 here (the default, 500, is for real traffic). The tests run in order and share the server, started
with `RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S=5` (issue 31: that setting stopped `vllm serve` at start); the last
test checks it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lifecycle.vllm.settings import TAKEOVER_IDLE_ENV
from support.entry_points import dist_info
from support.prom import DOCUMENTED, missing_at_start, scrape, settled, total, value
from support.rl_client import RLClient
from support.vllm_canary_scenarios import controlled_pair
from support.vllm_server import ROOT, VllmServer

GOOD, BAD = 36, 132  # draft tokens verified by one round of 4 requests x 12 tokens
TAKEOVER_IDLE_S = 5
ENGINE = {"engine": "0"}
DRAFT = {"backbone": "dflash-draft"}


@pytest.fixture(scope="module")
def served(vllm_workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    target_z, draft_z = controlled_pair(vllm_workdir)
    entry_points = dist_info(tmp_path_factory.mktemp("entry_points"))  # this checkout's stat-logger entry point
    path = os.pathsep.join([str(entry_points), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))])
    server = VllmServer(target_z, draft_z, tmp_path_factory.mktemp("serve_metrics"), env={
        "PYTHONPATH": path, "RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS": "30",
        "RELOAD_LIFECYCLE_ACCEPTANCE_EVERY_STEPS": "0",
        # set before `vllm serve` (it stopped the server at start); no test here starts while a session is open
        # but the last one, which checks it
        TAKEOVER_IDLE_ENV: str(TAKEOVER_IDLE_S)})
    server.start()
    client = RLClient(server.url, server.model)
    try:
        yield {"server": server, "client": client, "work": vllm_workdir, "draftZ": draft_z}
    finally:
        client.close()
        stopped = server.stop()
    assert stopped.left == [], stopped


def canary_events(c: RLClient) -> list[dict[str, Any]]:
    (events,) = c.rpc("lifecycle_events", last=1000)
    return [e for e in events if e["event"].startswith("acceptance")]


def push(served: dict[str, Any], draft: str, version: str, **extra: Any) -> list[int]:
    folder = served["draftZ"] if draft == "draftZ" else served["work"] / draft
    return [s.status for s in served["client"].push({"path": str(folder), **extra}, weight_version=version)]


def test_every_documented_series_is_there_before_the_first_push(served: dict[str, Any]) -> None:
    """Issue 32, item 9: an alert on `draft_usable == 0` or `absent(...)` sees the series from the start. Before: no
    `reload_lifecycle_*` series existed until the first push. Each scrape also holds no NaN, no undocumented label
    value (support/prom.py)."""
    c: RLClient = served["client"]
    got = settled(c, "reload_lifecycle_draft_usable", 1, timeout_s=30, **DRAFT)  # the pull at the engine's start
    assert missing_at_start(got, one_server=True) == []
    for kind in ("draft", "policy"):
        for outcome in ("ok", "refused", "abandoned"):
            assert value(got, "reload_lifecycle_pushes_total", kind=kind, outcome=outcome) == 0
    assert value(got, "reload_lifecycle_acceptance_ratio", **ENGINE) == 0  # no period has verified a token: 0, not NaN
    assert value(got, "reload_lifecycle_draft_epoch", **DRAFT) == 0
    assert value(got, "reload_lifecycle_spec_accepted_tokens_per_pos_total", position="2", **ENGINE) == 0
    created = sorted(n for n in got["families"] if n.startswith("reload_lifecycle_") and n.endswith("_created"))
    documented = (Path(__file__).resolve().parents[3] / "docs" / "operating.md").read_text(encoding="utf-8")
    assert created and all(f"`{n}`" in documented for n in created), created  # the _created samples too


def test_metrics_is_vllms_registry_with_every_reload_lifecycle_family_in_vllms_conventions(
        served: dict[str, Any]) -> None:
    c: RLClient = served["client"]
    assert all(t == 0 for row in c.complete() for t in row)  # target Z
    got = settled(c, "reload_lifecycle_spec_draft_tokens_total", GOOD, **ENGINE)
    kinds = {name: f.type for name, f in got["families"].items() if name.startswith("reload_lifecycle_")}
    assert {k: v for k, v in kinds.items() if not k.endswith("_created")} == DOCUMENTED
    assert "vllm:spec_decode_num_draft_tokens" in got["families"]  # vLLM's own, on the same /metrics
    assert value(got, "reload_lifecycle_spec_accepted_tokens_total", **ENGINE) == GOOD
    assert value(got, "reload_lifecycle_acceptance_ratio", **ENGINE) == 1.0
    got = settled(c, "reload_lifecycle_draft_usable", 1, **DRAFT)
    assert value(got, "reload_lifecycle_draft_usable", **DRAFT) == 1
    assert value(got, "reload_lifecycle_draft_epoch", **DRAFT) == 0


def test_online_a_good_push_does_not_fire_a_bad_one_does_and_the_good_draft_again_clears_it(
        served: dict[str, Any]) -> None:
    c: RLClient = served["client"]
    server: VllmServer = served["server"]
    collapsed = "reload_lifecycle_acceptance_collapsed"
    seen: dict[str, tuple[float | None, float | None]] = {}
    for name, draft, version, flag in (("good", "draftZ", "v1", 0), ("bad", "draftB", "v2", 1),
                                       ("good again", "draftZ", "v3", 0)):
        assert push(served, draft, version) == [200] * 5
        c.complete()
        got = settled(c, collapsed, flag, **ENGINE)
        seen[name] = (value(got, collapsed, **ENGINE), value(got, "reload_lifecycle_acceptance_ratio", **ENGINE))
    assert seen == {"good": (0, 1.0), "bad": (1, 0.0), "good again": (0, 1.0)}
    assert value(got, "reload_lifecycle_acceptance_collapses_total", **ENGINE) == 1
    assert value(got, "reload_lifecycle_pushes_total", kind="draft", outcome="ok") == 3
    assert value(got, "reload_lifecycle_push_duration_seconds_count", kind="draft", outcome="ok") == 3
    # one series: the trainer's version and the push the draft serves, by the plugin's own name (issue 32 item 10)
    assert value(got, "reload_lifecycle_weight_version_info", weight_version="v3", push="epoch 3") == 1
    assert [k for k in got["values"] if k[0] == "reload_lifecycle_weight_version_info"] == [
        ("reload_lifecycle_weight_version_info", (("push", "epoch 3"), ("weight_version", "v3")))]
    events = canary_events(c)
    (collapse,) = [e for e in events if e["event"] == "acceptance_collapse"]
    assert (collapse["weight_version"], collapse["previous_weight_version"]) == ("v2", "v1")
    assert (collapse["push"], collapse["previous_push"], collapse["origin"]) == ("epoch 2", "epoch 1", "rpc")
    assert collapse["accepted_share"] == 0.0 and collapse["previous_share"] == 1.0
    (recovered,) = [e for e in events if e["event"] == "acceptance_recovered"]
    assert recovered["weight_version"] == "v3"
    finals = [(e["period"], e.get("push"), e.get("weight_version"), e["accepted_tokens"], e["draft_tokens"])
              for e in events if e["event"] == "acceptance" and e["final"]]
    assert finals == [(0, "epoch 0", None, GOOD, GOOD), (1, "epoch 1", "v1", GOOD, GOOD),
                      (2, "epoch 2", "v2", 0, BAD)]
    assert "reload-lifecycle: acceptance collapse on engine 0" in server.log_text()  # the server's log: a warning


def test_online_a_refused_push_is_counted_by_class_and_the_steps_without_the_draft_apart(
        served: dict[str, Any]) -> None:
    c: RLClient = served["client"]
    before = scrape(c)
    statuses = push(served, "draftZ", "v4", exclude_prefixes=["layers.1."])
    assert statuses[-2] == 422 and statuses[-1] == 200  # the refused finish, then resume
    got = settled(c, "reload_lifecycle_draft_usable", 0, **DRAFT)
    assert value(got, "reload_lifecycle_refusals_total", kind="draft", error="LayersNotReadyError") == 1
    assert value(got, "reload_lifecycle_pushes_total", kind="draft", outcome="refused") == 1
    assert value(got, "reload_lifecycle_draft_quarantined", **DRAFT) == 1
    vllm_accepted = total(before, "vllm:spec_decode_num_accepted_tokens_total")
    c.complete()
    got = settled(c, "reload_lifecycle_drafting_paused", 1, **DRAFT)
    # vLLM counts the gate's zero drafts as drafts, all accepted by target Z; the plugin counts them apart
    assert total(got, "vllm:spec_decode_num_accepted_tokens_total") - vllm_accepted == GOOD
    assert value(got, "reload_lifecycle_spec_placeholder_draft_tokens_total", **ENGINE) == GOOD
    assert value(got, "reload_lifecycle_spec_draft_tokens_total", **ENGINE) == value(
        before, "reload_lifecycle_spec_draft_tokens_total", **ENGINE)
    steps = value(got, "reload_lifecycle_steps_without_draft_total", **DRAFT)
    assert steps and steps > (value(before, "reload_lifecycle_steps_without_draft_total", **DRAFT) or 0)
    assert push(served, "draftZ", "v5") == [200] * 5  # the corrected push
    got = settled(c, "reload_lifecycle_draft_usable", 1, **DRAFT)
    assert value(got, "reload_lifecycle_draft_quarantined", **DRAFT) == 0
    assert value(got, "reload_lifecycle_draft_epoch", **DRAFT) == 5
    assert (value(got, "reload_lifecycle_written_bytes_total", **DRAFT) or 0) > 0


def test_online_a_chunk_or_finish_without_a_session_is_no_push_and_a_refusal_names_its_class(
        served: dict[str, Any]) -> None:
    """Issue 32, item 9. Before: a chunk or finish vLLM refused because no session was open counted as a refused
    push of kind "unknown" (46 of them in a day's trial), and most refusals were `error="Exception"`. Now such a
    call is `stray_calls_total{call}`, and a refused chunk is one refused push of its kind, by the error's class."""
    c: RLClient = served["client"]
    before = scrape(c)
    assert c.update({"path": str(served["draftZ"])}).status >= 400  # no session open: vLLM refuses it
    assert c.finish("stray").status >= 400
    assert c.start_draft().status == 200
    assert c.update({"path": str(served["work"] / "no-such-checkpoint")}).status == 422
    c.finish("after-a-refused-chunk")  # the trainer's finish: the push already ended with the refused chunk
    got = scrape(c)

    def delta(name: str, **labels: str) -> float:
        return (value(got, name, **labels) or 0) - (value(before, name, **labels) or 0)

    assert delta("reload_lifecycle_stray_calls_total", call="update_weights") == 1
    assert delta("reload_lifecycle_stray_calls_total", call="finish_weight_update") >= 1
    assert delta("reload_lifecycle_pushes_total", kind="draft", outcome="refused") == 1
    assert delta("reload_lifecycle_refusals_total", kind="draft", error="CheckpointError") == 1
    errors = {dict(labels).get("error") for (n, labels) in got["values"] if n == "reload_lifecycle_refusals_total"}
    assert errors == {"LayersNotReadyError", "CheckpointError"}, errors  # never a transport's Exception
    assert push(served, "draftZ", "v5b") == [200] * 5


def test_online_the_takeover_idle_setting_given_before_serve_keeps_an_open_session_that_long(
        served: dict[str, Any]) -> None:
    """`RELOAD_LIFECYCLE_SESSION_TAKEOVER_IDLE_S=5` was in the server's environment from its start (before issue 31
    the plugin refused the name and `vllm serve` exited): a start while a draft session had a call less than 5 s
    ago answers 409 naming it and changes nothing; after 5 s without a call the next push takes the session over."""
    c: RLClient = served["client"]
    server: VllmServer = served["server"]
    assert c.start_draft().status == 200  # then the trainer goes quiet
    opened = time.monotonic()
    refused = c.start_draft()
    assert refused.status == 409, refused
    assert (f"{TAKEOVER_IDLE_ENV}={TAKEOVER_IDLE_S} takes an open session over only after {TAKEOVER_IDLE_S} s "
            "without a call") in refused.message and "Nothing was changed" in refused.message, refused.message
    time.sleep(max(0.0, TAKEOVER_IDLE_S + 0.5 - (time.monotonic() - opened)))
    assert push(served, "draftZ", "v6") == [200] * 5  # the quiet session is taken over
    ended = [e for e in server.audit_events() if e["event"] == "weight_update_session_ended"]
    assert [e["outcome"] for e in ended][-2:] == ["abandoned", "finished"], ended[-2:]
    assert ended[-2]["reason"].startswith("abandoned: start_draft_weight_update began before finish_weight_update")
    assert ended[-2]["chunks"] == 0 and ended[-2]["idle_s"] >= TAKEOVER_IDLE_S
    assert value(settled(c, "reload_lifecycle_draft_usable", 1, **DRAFT), "reload_lifecycle_draft_usable", **DRAFT) == 1
