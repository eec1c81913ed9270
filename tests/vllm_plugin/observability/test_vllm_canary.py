"""The acceptance canary and the reload_lifecycle_* metrics on a live offline engine (`LLM`), issue 26 items 3-4.

One engine for the module (tests/support/vllm_canary_scenarios.py): target Z, which emits token 0 for every input,
served with draft Z (proposes token 0: always accepted) and, after a bad push, draft B (its proposals are
rejected). Phases: cold, a good push, a bad push, the good draft again, a refused push (quarantined), a corrected
push, one more push. The metrics are the process's Prometheus registry (what `/metrics` serves online; online:
tests/vllm_plugin/observability/test_vllm_online_metrics.py), parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lifecycle.cli import main
from support.needs import needs
from support.vllm_runs import run_script

GOOD, BAD = (48, 48), (0, 180)  # (accepted, draft tokens) of one phase: 4 requests x 16 tokens, 3 per draft


@needs("engine")
def run_canary(work: Path) -> dict[str, Any]:
    return run_script("vllm_canary_scenarios", "canary", work)


@pytest.fixture(scope="module")
def canary(vllm_workdir: Path) -> dict[str, Any]:
    result = run_canary(vllm_workdir)
    result["by_name"] = {p["name"]: p for p in result["phases"]}
    return result


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of the reload_lifecycle_* families in Prometheus text."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("reload_lifecycle_"):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def _events(phase: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in phase["events"] if e["event"] == name]


def test_the_controlled_pair_holds_and_vllms_own_counters_cannot_tell_a_quarantined_draft(
        canary: dict[str, Any]) -> None:
    p = canary["by_name"]
    for phase in canary["phases"]:
        assert all(t == 0 for row in phase["tokens"] for t in row), phase["name"]  # target Z emits token 0, always
    vllm = {name: (p[name]["vllm"]["num_accepted_tokens"], p[name]["vllm"]["num_draft_tokens"]) for name in p}
    assert vllm["cold"] == vllm["good push"] == vllm["good again"] == GOOD and vllm["bad push"] == BAD
    assert p["refused push"]["refusal"] and "LayersNotReadyError" in p["refused push"]["refusal"]
    assert p["refused push"]["draft_state"] == "QUARANTINED"
    assert vllm["refused push"] == GOOD  # vLLM counts the gate's zero drafts: 48/48 "accepted", no draft ran


def test_a_good_push_does_not_fire_the_canary_a_bad_one_does_and_the_good_draft_again_clears_it(
        canary: dict[str, Any]) -> None:
    p = canary["by_name"]
    fired = {name: _events(p[name], "acceptance_collapse") for name in p}
    assert fired["cold"] == fired["good push"] == fired["good again"] == [] and sum(map(len, fired.values())) == 1
    (collapse,) = fired["bad push"]
    assert collapse["weight_version"] == "v2-bad"
    assert collapse["accepted_share"] == 0.0 and collapse["previous_share"] == 1.0
    assert collapse["previous_weight_version"] == "v1-good" and collapse["draft_tokens"] >= 40
    assert collapse["epoch"] == 2  # in the draft's own stream, in the epoch the bad push made
    (recovered,) = _events(p["good again"], "acceptance_recovered")
    assert recovered["weight_version"] == "v3-good" and recovered["collapsed_period"] == collapse["period"]
    # each period reported once at the next push (final), with its weight_version; the bad one also every 12 steps
    finals = [e for ph in canary["phases"] for e in _events(ph, "acceptance") if e["final"]]
    assert [(e["period"], e.get("weight_version"), e["accepted_tokens"], e["draft_tokens"]) for e in finals] == [
        (0, None, 48, 48), (1, "v1-good", 48, 48), (2, "v2-bad", 0, 180), (3, "v3-good", 48, 48),
        (4, None, 0, 0), (5, "v5-good", 48, 48)]
    assert [e["final"] for e in _events(p["bad push"], "acceptance")] == [True, False]


def test_steps_served_without_the_draft_are_counted_apart_and_judge_nothing(canary: dict[str, Any]) -> None:
    p = canary["by_name"]
    (quarantined,) = [e for e in _events(p["corrected push"], "acceptance") if e["period"] == 4]
    assert quarantined["placeholder_draft_tokens"] == 48 and quarantined["draft_tokens"] == 0
    assert quarantined["accepted_share"] is None and quarantined["push_outcome"] == "refused"
    assert not _events(p["refused push"], "acceptance_collapse")
    assert not _events(p["corrected push"], "acceptance_recovered")


def test_the_metrics_parse_with_prometheus_clients_parser_and_follow_every_phase(canary: dict[str, Any]) -> None:
    m = {name: ph["metrics"] for name, ph in canary["by_name"].items()}
    last = m["last push"]
    push = "reload_lifecycle_pushes_total"
    assert value(last, push, kind="draft", outcome="ok") == 5
    assert value(last, push, kind="draft", outcome="refused") == 1
    assert value(last, "reload_lifecycle_push_duration_seconds_count", kind="draft", outcome="ok") == 5
    assert value(last, "reload_lifecycle_refusals_total", kind="draft", error="LayersNotReadyError") == 1
    engine, draft = {"engine": "0"}, {"backbone": "dflash-draft"}
    collapsed = {name: value(text, "reload_lifecycle_acceptance_collapsed", **engine) for name, text in m.items()}
    assert collapsed == {"cold": 0, "good push": 0, "bad push": 1, "good again": 0, "refused push": 0,
                         "corrected push": 0, "last push": 0}
    assert value(m["bad push"], "reload_lifecycle_acceptance_ratio", **engine) == 0.0
    assert value(m["good again"], "reload_lifecycle_acceptance_ratio", **engine) == 1.0
    assert value(last, "reload_lifecycle_acceptance_collapses_total", **engine) == 1
    # only steps the draft served: 5 good phases + the bad one; the quarantined phase's 48 apart
    assert value(last, "reload_lifecycle_spec_draft_tokens_total", **engine) == 5 * 48 + 180
    assert value(last, "reload_lifecycle_spec_accepted_tokens_total", **engine) == 5 * 48
    assert value(last, "reload_lifecycle_spec_accepted_tokens_per_pos_total", position="2", **engine) == 5 * 16
    assert value(last, "reload_lifecycle_spec_placeholder_draft_tokens_total", **engine) == 48
    q = m["refused push"]
    assert value(q, "reload_lifecycle_draft_usable", **draft) == 0
    assert value(q, "reload_lifecycle_draft_quarantined", **draft) == 1
    assert value(q, "reload_lifecycle_drafting_paused", **draft) == 1
    assert value(last, "reload_lifecycle_draft_usable", **draft) == 1
    assert value(last, "reload_lifecycle_drafting_paused", **draft) == 0
    assert value(last, "reload_lifecycle_draft_epoch", **draft) == 6
    assert (value(last, "reload_lifecycle_steps_without_draft_total", **draft) or 0) >= 1
    per_push = value(m["good push"], "reload_lifecycle_written_bytes_total", **draft)
    total = value(last, "reload_lifecycle_written_bytes_total", **draft) or 0
    assert per_push and 5 * per_push < total < 6 * per_push  # 5 whole pushes and what the refused one wrote
    versions = [dict(k[1]) for k in samples(last) if k[0] == "reload_lifecycle_weight_version_info"]
    assert len(versions) == 1 and versions[0]["weight_version"] == "v6-good"  # the current one only: bounded
    assert versions[0]["push"].startswith("epoch ")  # the push the draft serves, by the plugin's own name


def test_the_auditor_lists_the_collapse_as_a_warning_and_the_report_marks_it(
        canary: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    audit = canary["audit_dir"]
    lines = [json.loads(x) for f in sorted(Path(audit).glob("*.jsonl")) for x in f.read_text().splitlines()]
    levels = {(e["event"], e["level"]) for e in lines if e["event"].startswith("acceptance")}
    assert levels == {("acceptance", "info"), ("acceptance_collapse", "warning"), ("acceptance_recovered", "info")}
    assert main(["audit", "--json", audit]) == 0  # a warning: the exit status does not count it
    doc = json.loads(capsys.readouterr().out)
    assert doc["violation_counts"] == {} and doc["warning_counts"] == {"acceptance_collapse": 1}
    (w,) = doc["warnings"]
    assert w["epoch"] == 2 and "accepted share 0.000" in w["detail"] and "weight_version v2-bad)" in w["detail"]
    report = tmp_path / "report.html"
    assert main(["report", audit, "-o", str(report)]) == 0
    page = report.read_text()
    assert "acceptance collapse: 0.000 of" in page and 'data-kind="acceptance_collapse"' in page
