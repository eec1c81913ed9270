"""The auditor never calls clean what it did not see: no events, a missing rank, a backbone a rank lacks; and every
view says which ranks and nodes the logs cover (several machines' logs merged into one folder)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from lifecycle.audit.replay import Auditor, audit_logs
from lifecycle.audit.report import write_report
from lifecycle.cli import main
from support.scenarios import read_lines, write_lines


@pytest.fixture
def ranks(real_logs: Path, tmp_path: Path) -> Path:
    """The three rank files of one backbone (no other backbone), to edit."""
    out = tmp_path / "ranks"
    out.mkdir()
    for r in range(3):
        shutil.copy(real_logs / f"rank{r}.jsonl", out)
    return out


def test_an_input_without_events_is_an_input_problem_not_clean(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """What vLLM's V1 Ray executor left before the plugin forwarded its switches: the driver's own empty log."""
    folder = tmp_path / "audit"
    folder.mkdir()
    (folder / "audit-driver-1234.jsonl").write_text("")
    result = audit_logs([folder])
    assert result.status == 2 and result.events == 0
    (problem,) = result.input_problems
    assert problem.message.startswith("no audit events in the input")
    assert "RELOAD_LIFECYCLE_AUDIT_DIR" in problem.message
    assert main(["audit", str(folder)]) == 2
    out, err = capsys.readouterr()  # nothing audited: an error, one line on stderr naming the input (issue 35)
    assert out == "" and err.startswith(f"reload-lifecycle audit: error: nothing to audit: {folder}: no audit events")
    assert main(["audit", "--json", str(folder)]) == 2
    assert json.loads(capsys.readouterr().out)["status"] == 2
    report = tmp_path / "report.html"
    write_report([folder], report)
    page = report.read_text()
    assert "status-unreadable" in page and "no audit events in the input" in page


def test_a_missing_rank_is_named_only_when_expected(ranks: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (ranks / "rank2.jsonl").unlink()
    assert audit_logs([ranks]).status == 0  # two ranks that agree: nothing says a third existed
    result = audit_logs([ranks], expect_ranks=range(3))
    assert result.status == 2 and result.missing_ranks == (2,) and result.ranks == [0, 1]
    (problem,) = result.input_problems
    assert "no events of rank(s) 2 (expected ranks 0-2)" in problem.message
    assert main(["audit", "--expect-ranks", "3", str(ranks)]) == 2
    out = capsys.readouterr().out
    assert "ranks: 0-1 (expected 0-2; missing: 2)" in out.splitlines()[1]
    assert main(["audit", "--json", "--expect-ranks", "3", str(ranks)]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ranks"], doc["expected_ranks"], doc["missing_ranks"]) == ([0, 1], [0, 1, 2], [2])
    report = tmp_path / "report.html"
    assert main(["report", "--expect-ranks", "3", str(ranks), "-o", str(report)]) == 2  # a missing rank
    page = report.read_text()
    assert "ranks: 0-1 (expected 0-2; missing: 2)" in page and "status-unreadable" in page


def test_all_expected_ranks_present_is_clean_and_a_rank_outside_them_is_named(ranks: Path) -> None:
    result = audit_logs([ranks], expect_ranks=range(3))
    assert result.status == 0 and result.missing_ranks == () and result.input_problem_count == 0
    result = audit_logs([ranks], expect_ranks=range(2))
    assert result.status == 2
    (problem,) = result.input_problems
    assert "events of rank(s) 2, outside the expected ranks 0-1" in problem.message


def test_a_rank_behind_the_others_disagrees_and_an_absent_one_is_named(ranks: Path) -> None:
    """Rank 2 missed the last reload: the epoch check says so; with rank 1's log gone too, `expect_ranks` names it."""
    path = ranks / "rank2.jsonl"
    ev = read_lines(path)
    write_lines(path, ev[:next(i for i, e in enumerate(ev) if e.get("trigger") == "begin_reload" and e["epoch"] == 2)])
    (ranks / "rank1.jsonl").unlink()
    result = audit_logs([ranks], expect_ranks=range(3))
    assert result.status == 2 and set(result.violation_counts) == {"epoch_disagreement"}
    assert result.missing_ranks == (1,)
    assert "rank 2 ends at epoch 1, rank(s) 0 at epoch 2" in result.violations[0].detail


def test_a_backbone_some_expected_ranks_lack_is_named(real_logs: Path) -> None:
    result = audit_logs([real_logs / "rank0.jsonl", real_logs / "rank1.jsonl", real_logs / "mixed.jsonl"],
                        expect_ranks=range(2))
    messages = [p.message for p in result.input_problems]
    assert result.status == 2
    assert any(m.startswith("backbone refusals: no events of rank(s) 1 (expected ranks 0-1)") for m in messages)
    assert any("outside the expected ranks 0-1" in m for m in messages)  # mixed.jsonl has rank 2 (selective)


@pytest.mark.parametrize("spec", ["0", "-1", "x", "3-1", "65537", "0-65536", "1,,x", ","])
def test_a_bad_expect_ranks_is_a_usage_error(spec: str, ranks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["audit", f"--expect-ranks={spec}", str(ranks)])
    assert stop.value.code == 2 and "--expect-ranks: must be N" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expect_ranks"):
        Auditor(expect_ranks=[])


def test_events_carry_their_node_and_logs_of_several_nodes_merge(ranks: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Every written event names the machine that wrote it; a folder of logs from two nodes shows both."""
    host = socket.gethostname()
    assert all(e["node"] == host for e in read_lines(ranks / "rank0.jsonl"))
    path = ranks / "rank1.jsonl"
    write_lines(path, [{**e, "node": "gpu-node-2"} for e in read_lines(path)])
    result = audit_logs([ranks])
    assert result.status == 0 and result.nodes == [host, "gpu-node-2"]
    assert {r.rank: list(r.nodes) for r in result.streams} == {0: [host], 1: ["gpu-node-2"], 2: [host]}
    assert main(["audit", str(ranks)]) == 0
    out = capsys.readouterr().out
    assert f"nodes: {host}, gpu-node-2" in out and "| gpu-node-2 |" in out
    assert main(["audit", "--json", str(ranks)]) == 0
    assert json.loads(capsys.readouterr().out)["streams"][1]["nodes"] == ["gpu-node-2"]
    write_lines(path, [{**e, "node": ["not", "a", "name"]} for e in read_lines(path)[:1]])
    assert audit_logs([path]).input_problems[0].message.startswith(
        "not a valid event: field 'node': expected a name")
