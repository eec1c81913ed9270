"""The audit trail's identity: streams are keyed by (node, rank, backbone), a clash that cannot be told apart is an
input problem, two live backbones of one name in one process get distinct names (said in the event), and the fast
timestamp parser refuses what the slow one does (lifecycle/audit/replay.py, lifecycle/audit/logstream.py,
lifecycle/names.py; issue 25, items 9, 10, 11).

Before: streams were keyed by (rank, backbone). Two nodes' clean rank-0 logs audited together gave storage_drift
and out_of_order violations and no input problem naming the clash, and a real lost line on one node was then
reported as something else. Two live backbones of one name in one process wrote one interleaved stream. A
timestamp with seconds 99.x or -9.x was accepted by the fixed-width fast path.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.audit.logstream import parse_line, parse_ts
from lifecycle.audit.replay import audit_logs
from lifecycle.checkpoint import write_checkpoint
from lifecycle.cli import main
from lifecycle.events import read_events
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.scenarios import bucketed_reload, logging_to

HERE = Path(__file__).resolve().parents[1]  # tests/
NODE = """
import sys
import time
from pathlib import Path
sys.path.insert(0, {tests!r})
from lifecycle.events import configure_audit
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft
from lifecycle.testing import cold_load
from support.scenarios import bucketed_reload
configure_audit(json_path={log!r}, console=False, node={node!r})
m = DFlashQwen3Draft(DFlashConfig(num_hidden_layers=3), name="draft", rank=0)
Path({log!r} + ".ready").touch()  # both nodes start together, as two engines serving at once
while len(list(Path({log!r}).parent.glob("*.ready"))) < 2:
    time.sleep(0.01)
cold_load(m, Path({a!r}))
Path({log!r} + ".loaded").touch()  # each reloads only once both loaded: the two streams interleave on any load
while len(list(Path({log!r}).parent.glob("*.loaded"))) < 2:
    time.sleep(0.01)
for k in range(4):
    bucketed_reload(m, Path({b!r} if k % 2 == 0 else {a!r}), seed=k)
configure_audit(console=False)
"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two nodes' rank-0 logs of one backbone, each written by its own process at the same time (as two
    engines on two machines), gathered into one folder."""
    root = tmp_path_factory.mktemp("two-nodes")
    cfg = DFlashConfig(num_hidden_layers=3)
    a = write_checkpoint(random_weights(cfg, 0), root / "a.safetensors")
    b = write_checkpoint(random_weights(cfg, 1), root / "b.safetensors")
    logs = root / "logs"
    logs.mkdir()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", NODE.format(tests=str(HERE), log=str(logs / f"{n}.jsonl"),
                                                                 node=n, a=str(a), b=str(b))], env=env)
             for n in ("gpu-node-1", "gpu-node-2")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    for marker in [*logs.glob("*.ready"), *logs.glob("*.loaded")]:
        marker.unlink()
    return logs


def _copy(logs: Path, dest: Path, edit: object = None) -> Path:
    dest.mkdir()
    for f in logs.iterdir():
        events = read_events(f)
        if callable(edit):
            events = edit(f.name, events)
        (dest / f.name).write_text("".join(json.dumps(e) + "\n" for e in events))
    return dest


def test_two_nodes_clean_rank0_logs_audit_clean_as_two_streams(two_nodes: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    spans = [(evs[0]["ts"], evs[-1]["ts"]) for evs in map(read_events, two_nodes.iterdir())]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # the two nodes' events really interleave
    result = audit_logs([two_nodes])
    assert result.status == 0, (result.violation_counts, [p.message for p in result.input_problems])
    assert sorted((r.node, r.rank, r.backbone) for r in result.streams) == [
        ("gpu-node-1", 0, "draft"), ("gpu-node-2", 0, "draft")]
    assert main(["audit", str(two_nodes)]) == 0
    assert "RESULT: CLEAN" in capsys.readouterr().out
    page = two_nodes.parent / "report.html"
    assert main(["report", str(two_nodes), "-o", str(page)]) == 0
    ids = re.findall(r' id="([^"]+)"', page.read_text())
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)[:4]  # each node's figures apart
    assert any("-n-gpu-node-1-" in i for i in ids) and any("-n-gpu-node-2-" in i for i in ids)


def test_a_lost_line_on_one_node_is_named_as_a_gap_of_that_node(two_nodes: Path, tmp_path: Path) -> None:
    def drop_first_refresh(name: str, events: list[dict]) -> list[dict]:
        if name != "gpu-node-2.jsonl":
            return events
        i = next(i for i, e in enumerate(events) if e["event"] == "refresh")
        return events[:i] + events[i + 1:]

    logs = _copy(two_nodes, tmp_path / "logs", drop_first_refresh)
    result = audit_logs([logs])
    assert dict(result.violation_counts) == {"missing_events": 1}, result.violation_counts
    (v,) = result.violations
    assert v.node == "gpu-node-2" and "gpu-node-2.jsonl" in v.where and "1 event(s) missing" in v.detail
    assert result.input_problem_count == 0


def test_two_writers_that_cannot_be_told_apart_are_an_input_problem(two_nodes: Path, tmp_path: Path) -> None:
    """The same logs with `node` taken out (an older writer, a hand-made merge): one (rank, backbone) fed by two
    interleaved writers. That is an input problem naming both files, not a list of made-up violations."""
    logs = _copy(two_nodes, tmp_path / "logs", lambda name, evs: [{k: v for k, v in e.items() if k != "node"}
                                                                  for e in evs])
    result = audit_logs([logs])
    assert result.status == 2
    assert not result.violation_counts, result.violation_counts  # before: storage_drift, out_of_order, ...
    (problem,) = result.input_problems
    assert "cannot be told apart" in problem.message
    assert "gpu-node-1.jsonl" in problem.message and "gpu-node-2.jsonl" in problem.message



def test_two_live_backbones_of_one_name_get_distinct_names_and_say_so(ckpt_a: Path, ckpt_b: Path,
                                                                      tiny_cfg: DFlashConfig,
                                                                      tmp_path: Path) -> None:
    log = tmp_path / "one-process.jsonl"
    with logging_to(log):
        first = DFlashQwen3Draft(tiny_cfg, name="draft")
        second = DFlashQwen3Draft(tiny_cfg, name="draft")  # same name, same rank, same process, both alive
        cold_load(first, ckpt_a)
        cold_load(second, ckpt_a)
        bucketed_reload(first, ckpt_b)
        bucketed_reload(second, ckpt_b, seed=3)
    assert first.lifecycle.name == "draft" and second.lifecycle.name == "draft#2"
    assert second.lifecycle.requested_name == "draft"
    renamed = [e for e in read_events(log) if e["event"] == "name_taken"]
    assert [(e["backbone"], e["requested"]) for e in renamed] == [("draft#2", "draft")]
    result = audit_logs([log])
    assert result.status == 0, (result.violation_counts, result.input_problems)
    assert sorted(r.backbone for r in result.streams) == ["draft", "draft#2"]
    del first, second
    gc.collect()
    with logging_to(log):
        again = DFlashQwen3Draft(tiny_cfg, name="draft")
        cold_load(again, ckpt_a)
        assert again.lifecycle.name == "draft"  # a freed name is free again
        other_rank = cold_load(DFlashQwen3Draft(tiny_cfg, name="draft", rank=1), ckpt_a)
        assert other_rank.lifecycle.name == "draft"  # another rank is another stream already


@pytest.mark.parametrize("ts", ["2026-01-01T00:00:99.000000Z", "2026-01-01T00:00:-9.000000Z",
                                "2026-01-01T00:00:60.000000Z", "2026-01-01T00:00: 9.000000Z",
                                "2026-01-01T00:00:+9.000000Z", "2026-01-01T00:00:1_0.00000Z",
                                "2026-01-01T00:00:\u0661\u0662.000000Z", "2026-01-01T00:00x09.000000Z"])
def test_the_fast_timestamp_path_refuses_what_iso_8601_does(ts: str) -> None:
    assert len(ts) == 27
    assert parse_ts(ts) is None
    item = parse_line(json.dumps({"event": "hook_run", "backbone": "d", "rank": 0, "epoch": 0, "ts": ts}), "log", 1)
    assert type(item).__name__ == "InputProblem" and "ISO-8601" in item.message


def test_the_fast_timestamp_path_still_reads_the_writers_format() -> None:
    assert parse_ts("1970-01-01T00:01:02.500000Z") == 62.5
    assert parse_ts("2026-01-01T00:00:59.999999Z") == pytest.approx(1767225659.999999)


def test_a_name_held_only_by_garbage_is_free_whichever_collection_frees_it() -> None:
    """The holder of a name that nothing reaches any more (a dropped backbone in a reference cycle) is freed by the
    collector, and the name goes to the next owner unchanged: also when the young generation's collection is the
    one that frees it (it raised UnboundLocalError then, and a restarted worker's cold load failed)."""
    from lifecycle import names

    class Holder:
        def __init__(self) -> None:
            self.cycle = self

    scope = f"test-scope-{id(object())}"
    first = Holder()
    assert names.claim("draft", 0, first, scope) == "draft"
    del first  # only the cycle holds it now: gc.collect(1) frees it (it is in the young generation)
    second = Holder()
    assert names.claim("draft", 0, second, scope) == "draft"
    third = Holder()  # while the second lives, the name is taken
    assert names.claim("draft", 0, third, scope) == "draft#2"
    gc.collect()
