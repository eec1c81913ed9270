"""Bounded resources whatever the log: streams, layers, names, details and the report's size are capped (and what
was left out is counted and said), and inputs are merged with a bounded number of open files and of pending lines
(the same order as merging them all at once). `benchmarks/hostile_logs.py` measures the same at full size."""

from __future__ import annotations

import heapq
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from lifecycle.audit import logstream
from lifecycle.audit.inputs import iter_events
from lifecycle.audit.logstream import LogEvent, read_input
from lifecycle.audit.replay import Auditor, audit_logs
from lifecycle.audit.report import FIGURES_CAP, write_report
from lifecycle.audit.results import DETAIL_CAP, MAX_LAYERS
from lifecycle.audit.traces import MAX_LAYERS as DRAWN_LAYERS
from lifecycle.audit.traces import MAX_TRACED

ROOT = Path(__file__).resolve().parents[2]


def _ts(i: int) -> str:
    return f"2026-01-01T00:{i // 60_000_000 % 60:02d}:{i // 1_000_000 % 60:02d}.{i % 1_000_000:06d}Z"


def _event(**fields: Any) -> str:
    return json.dumps({"rank": 0, "epoch": 0, "schema": 5, **fields}, separators=(",", ":")) + "\n"


def backbones_log(path: Path, n: int) -> Path:
    path.write_text("".join(_event(event="layer_ready", backbone=f"b{i:06d}", seq=1, layers=["layers.0"],
                                   layers_ready=1, layers_total=2, ts=_ts(i)) for i in range(n)))
    return path


def _peak(fn: Any) -> tuple[int, Any]:
    tracemalloc.start()
    try:
        out = fn()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


def test_streams_beyond_the_limit_are_counted_not_replayed_and_memory_stays_flat(tmp_path: Path) -> None:
    small, large = backbones_log(tmp_path / "small.jsonl", 2_000), backbones_log(tmp_path / "large.jsonl", 20_000)
    peak_small, _ = _peak(lambda: audit_logs([small], max_streams=100))
    peak_large, r_large = _peak(lambda: audit_logs([large], max_streams=100))
    assert len(r_large.streams) == 100 and r_large.events == 100 and r_large.status == 2
    (problem,) = r_large.input_problems
    assert problem.where == f"{large}:101"
    assert "19900 event(s) of (rank, backbone) streams beyond the first 100 were not audited" in problem.message
    assert peak_large < 1.3 * peak_small + 256 * 1024, (peak_small, peak_large)

    html_small, html_large = tmp_path / "small.html", tmp_path / "large.html"
    write_report([small], html_small, max_streams=100)
    write_report([large], html_large, max_streams=100)
    size_small, size_large = html_small.stat().st_size, html_large.stat().st_size
    assert size_large < 1.05 * size_small
    text = html_large.read_text()
    assert text.count('class="backbone-panel"') == MAX_TRACED
    assert f"stream(s) of {100 - MAX_TRACED} backbone(s) audited but not drawn" in text


def test_a_logs_own_layers_total_does_not_lift_the_layer_caps(tmp_path: Path) -> None:
    log = tmp_path / "layers.jsonl"
    n = 3 * MAX_LAYERS
    log.write_text("".join(_event(event="layer_ready", backbone="d", seq=i + 1, layers=[f"layers.{i}"],
                                  layers_ready=i + 1, layers_total=10**12, ts=_ts(i)) for i in range(n)))
    auditor = Auditor()
    for item in iter_events([log]):
        auditor.feed(item)
    (stream,) = auditor.streams.values()
    assert len(stream.ready) == MAX_LAYERS and stream.layers_total == 10**12
    out = tmp_path / "layers.html"
    assert write_report([log], out).status == 0
    text = out.read_text()
    assert text.count('class="layer-row"') == DRAWN_LAYERS
    assert f"{n - DRAWN_LAYERS} layer(s) ready (not drawn)" in text
    assert out.stat().st_size < 400_000


def test_violation_details_are_bounded(tmp_path: Path) -> None:
    """Log strings quoted in details (an unknown state, a storage problem, a missing tensor) are cut."""
    long = "s" * 4000
    lines = [
        _event(event="transition", backbone="d", seq=1, trigger="weights_loaded", src=long, dst=long, ts=_ts(1)),
        _event(event="storage_check", backbone="d", seq=2, ok=False, action=long, problems=[long] * 16, ts=_ts(2)),
        _event(event="refresh", backbone="d", seq=3, missing=[long] * 16, ts=_ts(3)),
    ]
    (tmp_path / "d.jsonl").write_text("".join(lines))
    result = audit_logs([tmp_path / "d.jsonl"])
    assert {v.kind for v in result.violations} >= {"illegal_transition", "storage_drift", "not_ready"}
    assert all(len(v.detail) <= DETAIL_CAP + 20 for v in result.violations)
    assert max(len(v.detail) for v in result.violations) < 1000


def test_the_report_draws_at_most_its_figure_budget(tmp_path: Path) -> None:
    """Many streams with many epochs each: at most FIGURES_CAP timelines in all, the rest said."""
    lines, i = [], 0
    for rank in range(MAX_TRACED):
        for epoch in range(1, 21):
            i += 1
            lines.append(_event(event="layer_ready", backbone="d", rank=rank, epoch=epoch, layers=["layers.0"],
                                ts=_ts(i)))
    (tmp_path / "e.jsonl").write_text("".join(lines))
    out = tmp_path / "e.html"
    write_report([tmp_path / "e.jsonl"], out, max_epochs=50)
    text = out.read_text()
    assert text.count('<figure class="timeline-figure"') == FIGURES_CAP
    assert "(the figure limit of the report)" in text


# ---- the merge ----------------------------------------------------------------------------------------------------


def _rank_files(folder: Path, ranks: int, lines: int, *, long_every: int = 0) -> list[Path]:
    folder.mkdir()
    paths = []
    for r in range(ranks):
        body = []
        for k in range(lines):
            extra = {"pad": "x" * 6000} if long_every and k % long_every == 0 else {}
            body.append(_event(event="hook_run", backbone="d", rank=r, seq=k + 1, ts=_ts(k * 10 + r % 3), **extra))
        if r % 4 == 1:
            body.insert(lines // 2, "not json\n")  # an unreadable line keeps its place (the previous timestamp)
        paths.append(folder / f"rank{r:03d}.jsonl")
        paths[-1].write_text("".join(body))
    return paths


def _where(items: Any) -> list[tuple[str, int | None]]:
    return [(i.source, i.line) for i in items]


def test_the_bounded_merge_keeps_the_order_of_merging_everything_at_once(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _rank_files(tmp_path / "ranks", 9, 40, long_every=7)
    names = [str(p) for p in paths]

    def keyed(name: str) -> Any:
        last = float("-inf")
        for item in read_input(name):
            if isinstance(item, LogEvent):
                last = item.ts
            yield last, item

    reference = [item for _, item in heapq.merge(*(keyed(n) for n in names), key=lambda pair: pair[0])]
    monkeypatch.setattr(logstream, "OPEN_FILES", 2)  # far fewer than the inputs: files are closed and reopened
    monkeypatch.setattr(logstream, "HELD_LINE", 1024)  # the long lines are read again when their turn comes
    merged = list(iter_events(names))
    assert _where(merged) == _where(reference)
    assert [i.fields for i in merged if isinstance(i, LogEvent)] == [
        i.fields for i in reference if isinstance(i, LogEvent)]
    assert sum(1 for i in merged if not isinstance(i, LogEvent)) == 2  # ranks 1 and 5


PROBE = r"""
import json, resource, sys, types
root, folder = sys.argv[1:3]
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
package = types.ModuleType("lifecycle")
package.__path__ = [root + "/lifecycle"]
sys.modules["lifecycle"] = package
from lifecycle.audit.replay import audit_logs
r = audit_logs([folder])
print(json.dumps({"events": r.events, "streams": len(r.streams), "problems": [p.message for p in r.input_problems]}))
"""


def test_a_thousand_rank_files_under_an_open_file_limit_of_64(tmp_path: Path) -> None:
    _rank_files(tmp_path / "ranks", 1000, 5)
    done = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), str(tmp_path / "ranks")], capture_output=True,
                          text=True, check=True, timeout=300)
    result = json.loads(done.stdout)
    assert result["streams"] == 1000 and result["events"] == 5000
    assert len(result["problems"]) == 250 and set(result["problems"]) == {
        "not JSON (JSONDecodeError: Expecting value: line 1 column 1 (char 0))"}


def test_the_hostile_logs_benchmark_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its --quick smoke run: every row audited and reported without torch, the verdicts the bounds imply."""
    from benchmarks import hostile_logs

    out = tmp_path / "hostile_logs.json"
    assert hostile_logs.main(["--quick", "--json", str(out)]) == 0
    assert "report peak RSS MiB" in capsys.readouterr().out
    rows = {(r["input"], r["size"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("distinct backbones", 2_000)]["streams"] == 1024 and rows[("distinct backbones", 2_000)][
        "audit_status"] == 2
    # each of the 10 lines refused, and nothing left to audit: 11 input problems
    assert rows[("0.9 MB layer names", 10)]["problems"] == 11 and rows[("0.9 MB layer names", 10)]["events"] == 0
    assert all(r["audit_status"] == 0 and r["problems"] == 0 for (name, _), r in rows.items()
               if name in ("rank files", "4096-char layer names"))
    assert all(r["report_bytes"] < 2**20 for r in rows.values())


def test_the_auditors_limits_are_checked(tmp_path: Path) -> None:
    from lifecycle.audit.traces import ReportCollector

    for bad in ({"max_details": -1}, {"max_streams": 0}, {"max_streams": True}):
        with pytest.raises(ValueError, match="must be an int"):
            Auditor(**bad)
    for epochs in (0, -3, 51):
        with pytest.raises(ValueError, match="max_epochs must be an int from 1 to 50"):
            ReportCollector(epochs)
