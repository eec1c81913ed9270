"""The console script: `demo` proves its claims (and says FAIL when one is false), `diagram` draws the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lifecycle.derived
from lifecycle.cli import main
from lifecycle.states import TRANSITIONS, LifecycleState


def test_demo_runs_and_every_check_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--out", str(tmp_path), "--layers", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "RESULT: all checks passed" in out
    assert "FAIL" not in out
    assert "REFUSED: LayersNotReadyError" in out
    cold = "META -> PARTIALLY_LOADED -> FULLY_LOADED -> FINALIZED -> DERIVED_REFRESHED -> GRAPH_CAPTURED"
    reload = "PARTIALLY_LOADED -> FULLY_LOADED -> FINALIZED -> DERIVED_REFRESHED -> GRAPH_CAPTURED"
    assert f"state sequence: {cold} -> {reload}" in out
    for check in ("every derived buffer's storage identity unchanged",
                  "every derived buffer bit-equal to a cold build from B",
                  "fused path equals the per-layer reference path",
                  "refused refresh wrote nothing",
                  "the audit log replays clean through the transition table"):
        assert f"PASS  {check}" in out
    events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert events and all(e["backbone"] and "epoch" in e and "ts" in e for e in events)
    assert any(e["event"] == "refused" and e["error"] == "LayersNotReadyError" for e in events)
    assert "stateDiagram-v2" in (tmp_path / "lifecycle.mmd").read_text()


def test_demo_reports_fail_and_exits_1_when_a_refresh_skips_a_slice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's checks are real: sabotage the in-place refresh (drop the first slice of every concat/stack
    write) and the demo must say which check failed, and exit 1."""
    real_apply = lifecycle.derived.apply_refresh

    def lossy_apply(backbone, plan):  # type: ignore[no-untyped-def]
        for bp in plan.buffers:
            if bp.mode == "in_place" and bp.spec.kind in ("concat", "stack"):
                bp.copies = bp.copies[1:]
        return real_apply(backbone, plan)

    monkeypatch.setattr("lifecycle.backbone.apply_refresh", lossy_apply)
    assert main(["demo", "--out", str(tmp_path), "--layers", "2", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  every derived buffer bit-equal to a cold build from B" in out
    assert "RESULT: SOME CHECKS FAILED" in out


def test_diagram_is_drawn_from_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--state", "GRAPH_CAPTURED"]) == 0
    out = capsys.readouterr().out
    assert "Class GRAPH_CAPTURED s_active" in out
    for state in LifecycleState:
        assert f'state "{state.value}"' in out
    for t in TRANSITIONS:
        for src in t.sources:
            edge = [line for line in out.splitlines() if line.strip().startswith(f"{src.value} --> {t.dest.value}:")]
            assert edge and t.trigger in edge[0], f"{src.value} -> {t.dest.value} by {t.trigger} not drawn"


def test_demo_help_documents_the_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["demo", "--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "shuffled buckets" in out and "--bucket-size" in out and "Exit status 1" in out


def test_models_lists_every_family_with_what_it_derives(capsys: pytest.CaptureFixture[str]) -> None:
    from models import FAMILIES

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for fam in FAMILIES.values():
        assert fam.name in out and fam.derives in out


def test_diagram_as_dot_is_drawn_from_the_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import re

    assert main(["diagram", "--format", "dot", "--state", "QUARANTINED"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("digraph reload_lifecycle {") and out.rstrip().endswith("}")
    edges = re.findall(r"^\s+(\w+) -> (\w+) \[label=\"([^\"]+)\"\];$", out, re.M)
    expected = [(s.value, t.dest.value, t.trigger + (f" [{t.condition}]" if t.condition else ""))
                for t in TRANSITIONS for s in t.sources]
    assert edges == expected
    nodes = dict(re.findall(r"^\s+(\w+) \[(label=.*)\];$", out, re.M))
    assert set(nodes) == {s.value for s in LifecycleState}
    assert "fillcolor" in nodes["QUARANTINED"] and "fillcolor" not in nodes["META"]
    assert out.count("{") == out.count("}")  # balanced: a well-formed graph body
    target = tmp_path / "lifecycle.dot"
    assert main(["diagram", "--format", "dot", "-o", str(target)]) == 0
    assert target.read_text().startswith("digraph")
    with pytest.raises(SystemExit):
        main(["diagram", "--format", "png"])
