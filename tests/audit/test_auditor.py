"""`reload-lifecycle audit`: real logs audit clean; every violation kind, made by editing a real log, is found
and named with its file:line; corrupt or truncated input never crashes the audit (exit 2, the rest audited)."""

from __future__ import annotations

import io
import json
import shutil
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle.audit.logstream import LogEvent, read_stream
from lifecycle.audit.replay import (
    VIOLATION_KINDS,
    Auditor,
    AuditResult,
    StreamReplay,
    audit_logs,
    unknown_table_names,
)
from lifecycle.audit.rules import CONDITION_CHECKS, GUARD_CHECKS, Check
from lifecycle.cli import main
from lifecycle.states import (
    TRANSITIONS,
    TRIGGERS,
    Condition,
    Guard,
    LifecycleState,
    Transition,
    possible_destinations,
)
from lifecycle.testing import cold_load, reload, write_synthetic
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft
from support.scenarios import bucketed_reload, index_of, logging_to, read_lines, write_lines

S = LifecycleState


@pytest.fixture
def logs(real_logs: Path, tmp_path: Path) -> Path:
    """A private copy of the real logs, to edit."""
    return Path(shutil.copytree(real_logs, tmp_path / "logs"))


def kinds(result: AuditResult) -> set[str]:
    return set(result.violation_counts)


def found(result: AuditResult, kind: str) -> list[Any]:
    return [v for v in result.violations if v.kind == kind]


def line_of(path: Path, i: int) -> str:
    """file:line of the event at index i (the logs have no blank lines)."""
    return f"{path}:{i + 1}"


# ---- clean ------------------------------------------------------------------------------------------------


def test_real_logs_audit_clean(real_logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = audit_logs([real_logs])
    assert result.status == 0, [v.as_dict() for v in result.violations]
    assert result.input_problem_count == 0 and len(result.inputs) == 5
    streams = {(r.rank, r.backbone): r for r in result.streams}
    assert set(streams) == {(0, "draft"), (1, "draft"), (2, "draft"), (0, "refusals"), (1, "aborted"),
                            (0, "quarantined"), (0, "rebuilt"), (1, "recovered"), (2, "selective"), (0, "debugged")}
    assert streams[(1, "recovered")].state is S.GRAPH_CAPTURED
    for rank in range(3):
        r = streams[(rank, "draft")]
        assert (r.state, r.epoch, r.pinned, r.epochs_begun) == (S.GRAPH_CAPTURED, 2, True, 2)
    assert streams[(0, "quarantined")].state is S.QUARANTINED
    assert streams[(1, "aborted")].epoch == 2
    # the scenarios drive every trigger of the table, and every event kind the machine emits
    taken = {t for r in result.streams for (t, _, _) in r.edges}
    assert taken == set(TRIGGERS)
    events = [e for f in sorted(real_logs.glob("*.jsonl")) for e in read_lines(f)]
    assert len(events) == result.events
    assert {e["event"] for e in events} >= {"transition", "refused", "layer_ready", "layers_unchanged", "refresh",
                                             "storage_check", "hook_run", "loader_bucket"}
    # the release-and-rebuild backbone really moved its buffers, unpinned: not drift
    rebuilt = [e for e in events if e["backbone"] == "rebuilt" and e["event"] == "refresh"]
    ptrs = [{b["name"]: b["data_ptr"] for b in e["buffers"]} for e in rebuilt]
    assert ptrs[0]["_fused_kv_weight"] != ptrs[1]["_fused_kv_weight"]

    assert main(["audit", str(real_logs)]) == 0
    out = capsys.readouterr().out
    assert "RESULT: CLEAN" in out and "| draft" in out
    assert main(["audit", "--json", *map(str, sorted(real_logs.glob("*.jsonl")))]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == 0 and doc["events"] == len(events) and len(doc["streams"]) == len(streams)
    assert doc["violations"] == [] and doc["input_problems"] == [] and set(doc["kinds"]) == set(VIOLATION_KINDS)


def test_stdin(real_logs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((real_logs / "mixed.jsonl").read_bytes())))
    assert main(["audit", "-"]) == 0
    assert "<stdin>" not in capsys.readouterr().out  # nothing to point at: clean


def test_a_restarted_lifecycle_under_the_same_rank_and_name_is_a_new_replay(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, tmp_path: Path) -> None:
    log = tmp_path / "restart.jsonl"
    for _ in range(2):  # the worker restarts and appends to the same log
        with logging_to(log):
            # the restarted worker's lifecycle, the old one gone (while it lives, one of its name writing to the
            # same file is named apart: lifecycle/names.py)
            m = DFlashQwen3Draft(tiny_cfg, name="draft", rank=0)
            cold_load(m, ckpt_a, capture_graphs=True)
            bucketed_reload(m, ckpt_b)
    result = audit_logs([log])
    assert result.status == 0, result.violations
    (r,) = result.streams
    assert r.incarnations == 2 and r.epoch == 1


# ---- the table is the only authority ------------------------------------------------------------------------


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_every_row_is_legal_and_nothing_else(trigger: str) -> None:
    """For every (trigger, src, dst): the auditor calls it illegal exactly when the table has no such row."""
    for src in LifecycleState:
        for dst in LifecycleState:
            a = Auditor()
            a.streams[(None, 0, "d")] = StreamReplay(0, "d", state_name=src.value, layers_total=1, ready={"layers.0"},
                                               pinned=True, recoverable=True)
            fields = {"event": "transition", "backbone": "d", "rank": 0, "epoch": 1 if trigger == "begin_reload"
                      else 0, "trigger": trigger, "src": src.value, "dst": dst.value, "layers_ready": 1,
                      "layers_total": 1}
            a.feed(LogEvent("t", 1, fields, 1.0))
            legal = dst in possible_destinations(trigger, src)
            assert ("illegal_transition" in a.counts) == (not legal), (trigger, src, dst, a.violations)


def test_the_auditor_understands_every_guard_and_condition_of_the_table() -> None:
    assert unknown_table_names() == []
    extra = Transition("weights_loaded", (S.META,), S.FULLY_LOADED, condition="moon_is_full",
                       guards=("require_tide",))
    assert unknown_table_names((*TRANSITIONS, extra)) == ["condition moon_is_full", "guard require_tide"]


def test_every_guard_and_condition_member_maps_to_what_the_replay_checks() -> None:
    assert set(GUARD_CHECKS) == set(Guard) and set(CONDITION_CHECKS) == set(Condition)
    assert GUARD_CHECKS[Guard.ALL_LAYERS_READY] is CONDITION_CHECKS[Condition.ALL_LAYERS_READY] is Check.READY
    assert GUARD_CHECKS[Guard.PINNED] is CONDITION_CHECKS[Condition.HAS_PINNED_GRAPHS] is Check.PINNED
    # a member the table declares but no row uses yet is unknown too
    assert unknown_table_names(guards=[*Guard, "require_tide"], conditions=[*Condition, "moon_is_full"]) == [
        "condition moon_is_full", "guard require_tide"]


def test_a_guard_the_replay_does_not_know_fails_the_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table growing a Guard member the auditor has no check for stops `lifecycle.audit` loading, loudly."""
    import enum
    import importlib.util

    import lifecycle.audit.rules as rules
    import lifecycle.states

    grown = enum.Enum("Guard", [(g.name, g.value) for g in Guard] + [("TIDE", "require_tide")], type=str)
    monkeypatch.setattr(lifecycle.states, "Guard", grown)
    spec = importlib.util.spec_from_file_location("lifecycle.audit.rules_with_a_grown_table", rules.__file__)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError, match=r"does not know \['guard require_tide'\] of the transition table"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# ---- each violation, made by editing a real log ---------------------------------------------------------------


def test_changed_dst_is_an_illegal_transition(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = logs / "rank0.jsonl"
    ev = read_lines(path)
    i = index_of(ev, trigger="capture_graphs")
    ev[i]["dst"] = "FULLY_LOADED"
    write_lines(path, ev)
    result = audit_logs([logs])
    (v,) = found(result, "illegal_transition")
    assert (v.where, v.rank, v.backbone) == (line_of(path, i), 0, "draft")
    assert "capture_graphs from DERIVED_REFRESHED leads to GRAPH_CAPTURED, not FULLY_LOADED" in v.detail
    assert main(["audit", str(logs)]) == 1
    out = capsys.readouterr().out
    assert "illegal_transition" in out and line_of(path, i) in out and "RESULT: " in out


def test_changed_src_is_a_state_mismatch(logs: Path) -> None:
    path = logs / "rank1.jsonl"
    ev = read_lines(path)
    i = index_of(ev, trigger="finalize_loading", epoch=1)
    ev[i]["src"] = "PARTIALLY_LOADED"  # a legal row, but not where the backbone was
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"state_mismatch"}
    (v,) = found(result, "state_mismatch")
    assert v.where == line_of(path, i) and "replay says FULLY_LOADED" in v.detail


def test_a_refresh_under_captured_graphs_outside_the_lifecycle(logs: Path) -> None:
    path = logs / "rank2.jsonl"
    ev = read_lines(path)
    last_refresh = [e for e in ev if e["event"] == "refresh"][-1]
    ev.append({**last_refresh, "seq": ev[-1]["seq"] + 1, "ts": ev[-1]["ts"]})
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"event_out_of_state"}
    assert "refresh in state GRAPH_CAPTURED" in found(result, "event_out_of_state")[0].detail


def test_a_deleted_layer_ready_line_is_a_gap_and_a_refresh_while_layers_were_missing(logs: Path) -> None:
    path = logs / "rank0.jsonl"
    ev = read_lines(path)
    i = index_of(ev, event="layer_ready", epoch=2)
    del ev[i]
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"missing_events", "not_ready"}
    (gap,) = found(result, "missing_events")
    assert gap.where == line_of(path, i) and "1 event(s) missing" in gap.detail
    refresh = index_of(ev, event="transition", trigger="refresh_derived", epoch=2)
    blamed = {v.where: v.detail for v in found(result, "not_ready")}
    assert line_of(path, refresh) in blamed
    assert "5/6 ready by the replayed layer_ready events" in blamed[line_of(path, refresh)]


def test_a_refresh_claiming_fewer_ready_layers_or_carrying_missing_tensors_is_not_ready(logs: Path) -> None:
    path = logs / "rank1.jsonl"
    ev = read_lines(path)
    i = index_of(ev, event="transition", trigger="refresh_derived", epoch=1)
    ev[i]["layers_ready"] = ev[i]["layers_total"] - 1
    j = index_of(ev, event="refresh", epoch=2)
    ev[j]["missing"] = ["layers.1.self_attn.qkv_proj.weight"]
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"not_ready"}
    assert [v.where for v in found(result, "not_ready")] == [line_of(path, i), line_of(path, j)]


@pytest.mark.parametrize("edit", ["data_ptr", "storage_check"])
def test_a_pinned_address_that_changed_is_storage_drift(logs: Path, edit: str) -> None:
    path = logs / "rank1.jsonl"
    ev = read_lines(path)
    if edit == "data_ptr":
        i = index_of(ev, event="refresh", epoch=2)
        buf = ev[i]["buffers"][0]
        old, buf["data_ptr"] = buf["data_ptr"], hex(int(buf["data_ptr"], 16) + 4096)
        expect = f"{buf['name']} moved under captured graphs: data_ptr {old} -> {buf['data_ptr']}"
    else:
        i = index_of(ev, event="storage_check", action="graphs_verified", epoch=1)
        ev[i].update(ok=False, problems=["_fused_kv_weight: data_ptr 0x1000 -> 0x2000"], problems_more=2)
        expect = "storage_check (graphs_verified) failed: _fused_kv_weight: data_ptr 0x1000 -> 0x2000 (+2 more)"
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"storage_drift"}
    (v,) = found(result, "storage_drift")
    assert (v.where, v.rank, v.epoch) == (line_of(path, i), 1, ev[i]["epoch"]) and expect in v.detail


def test_deleting_a_reloads_refresh_leaves_an_abandoned_epoch_a_warning(logs: Path) -> None:
    """begin_reload from FULLY_LOADED is a row of the table (a trainer may restart a push): the epoch it leaves
    behind is a warning, not a violation, and the exit status does not count it."""
    path = logs / "rank0.jsonl"
    ev = read_lines(path)
    start = index_of(ev, event="storage_check", epoch=1)
    end = index_of(ev, trigger="graphs_verified", epoch=1)
    del ev[start:end + 1]
    write_lines(path, ev)
    result = audit_logs([logs])
    assert "abandoned_epoch" not in kinds(result) and "abandoned_epoch" not in VIOLATION_KINDS
    (w,) = [w for w in result.warnings if w.kind == "abandoned_epoch"]
    assert w.epoch == 1 and "epoch 1" in w.detail and w.where == line_of(path, index_of(ev, trigger="begin_reload",
                                                                                        epoch=2))
    assert result.warning_counts == {"abandoned_epoch": 1}
    assert {(r.rank, r.backbone): sum(r.warnings.values()) for r in result.streams}[(0, "draft")] == 1


def test_a_real_reload_abandoned_for_the_next_one_is_a_warning_in_every_view(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The table lets begin_reload fire from FULLY_LOADED, so a real lifecycle can skip a reload's refresh: the
    audit is clean (exit 0) and says so with one warning, in text, JSON and the report."""
    log = tmp_path / "abandoned.jsonl"
    with logging_to(log):
        m = cold_load(DFlashQwen3Draft(tiny_cfg, name="draft"), ckpt_a, capture_graphs=True)
        reload(m, ckpt_b, refresh=False)
        bucketed_reload(m, ckpt_a)  # begin_reload again, from FULLY_LOADED
    result = audit_logs([log])
    assert result.status == 0 and kinds(result) == set()
    assert result.warning_counts == {"abandoned_epoch": 1} and result.total_warnings == 1
    (w,) = result.warnings
    assert (w.rank, w.backbone, w.epoch) == (0, "draft", 1) and "restarted push" in w.detail

    assert main(["audit", str(log)]) == 0
    out = capsys.readouterr().out
    assert "warnings (the exit status does not count them) (1):" in out and "| abandoned_epoch |" in out
    assert out.rstrip().endswith("RESULT: CLEAN (" + f"{result.events} events audited; 1 warning(s); exit status 0)")
    assert main(["audit", "--json", str(log)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == 0 and doc["violation_counts"] == {} and doc["warning_counts"] == {"abandoned_epoch": 1}
    assert doc["warnings"][0]["kind"] == "abandoned_epoch" and doc["streams"][0]["warnings"] == {"abandoned_epoch": 1}
    assert set(doc["warning_kinds"]) == {"abandoned_epoch", "acceptance_collapse"}  # issue 26 added the second
    report = tmp_path / "report.html"
    assert main(["report", str(log), "-o", str(report)]) == 0
    page = report.read_text()
    assert 'id="warning-table"' in page and 'data-kind="abandoned_epoch"' in page and "CLEAN · 1 WARNING(S)" in page


def test_a_log_cut_mid_reload_ends_mid_reload(logs: Path) -> None:
    path = logs / "rank0.jsonl"
    ev = read_lines(path)
    cut = index_of(ev, trigger="begin_reload", epoch=2) + 4
    write_lines(path, ev[:cut])
    result = audit_logs([logs])
    assert kinds(result) == {"ends_mid_reload"}
    (v,) = found(result, "ends_mid_reload")
    assert v.where == line_of(path, cut - 1) and "PARTIALLY_LOADED, epoch 2" in v.detail


def test_a_rank_that_missed_a_reload_disagrees_on_the_epoch(logs: Path) -> None:
    path = logs / "rank2.jsonl"
    ev = read_lines(path)
    write_lines(path, ev[:index_of(ev, trigger="begin_reload", epoch=2)])
    result = audit_logs([logs])
    assert kinds(result) == {"epoch_disagreement"}
    (v,) = found(result, "epoch_disagreement")
    assert (v.rank, v.backbone) == (2, "draft")
    assert "rank 2 ends at epoch 1, rank(s) 0, 1 at epoch 2" in v.detail


def test_swapped_lines_are_out_of_order(logs: Path) -> None:
    path = logs / "rank0.jsonl"
    ev = read_lines(path)
    i = index_of(ev, event="layer_ready", epoch=1)
    assert ev[i]["ts"] < ev[i + 1]["ts"]
    ev[i], ev[i + 1] = ev[i + 1], ev[i]
    write_lines(path, ev)
    result = audit_logs([logs])
    assert "out_of_order" in kinds(result)
    (v,) = found(result, "out_of_order")
    assert v.where == line_of(path, i + 1)
    assert "goes back" in v.detail and "ms before the previous event" in v.detail


def test_an_epoch_going_back_or_a_timestamp_going_back_is_out_of_order(logs: Path) -> None:
    path = logs / "rank1.jsonl"
    ev = read_lines(path)
    i = index_of(ev, event="layer_ready", epoch=2)
    ev[i]["epoch"] = 1
    j = index_of(ev, event="hook_run")
    ev[j]["ts"] = ev[0]["ts"]
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"out_of_order"}
    details = {v.where: v.detail for v in found(result, "out_of_order")}
    assert details[line_of(path, i)] == "epoch went back from 2 to 1"
    assert "before the previous event's" in details[line_of(path, j)]


def test_an_epoch_that_skips_is_an_epoch_jump(logs: Path) -> None:
    path = logs / "rank0.jsonl"
    ev = read_lines(path)
    for e in ev[index_of(ev, trigger="begin_reload", epoch=2):]:
        e["epoch"] += 1
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"epoch_jump", "epoch_disagreement"}
    assert "begin_reload to epoch 3 from epoch 1 (expected 2)" in found(result, "epoch_jump")[0].detail


def test_a_deleted_line_is_a_gap(logs: Path) -> None:
    path = logs / "mixed.jsonl"
    ev = read_lines(path)
    i = index_of(ev, event="hook_run", backbone="aborted")
    del ev[i]
    write_lines(path, ev)
    result = audit_logs([logs])
    assert kinds(result) == {"missing_events"}
    (v,) = found(result, "missing_events")
    assert (v.where, v.backbone, v.rank) == (line_of(path, i), "aborted", 1)


# ---- unreadable input ---------------------------------------------------------------------------------------


def test_corrupt_lines_are_reported_with_line_numbers_and_the_rest_is_audited(
        logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = logs / "rank1.jsonl"
    ev = read_lines(path)
    j = index_of(ev, event="refresh", epoch=2)
    ev[j]["buffers"][1]["data_ptr"] = "0x10"  # a violation AFTER the corrupt lines: still found
    text = [json.dumps(e) for e in ev]
    text.insert(5, '{"event": "transition", "backbone": "draft", "rank"')  # a torn line
    text.insert(9, "\x00\x01 not json at all")
    text.insert(12, '{"event": "layer_ready", "backbone": "draft", "rank": "one", "epoch": 0}')
    path.write_text("\n".join(text) + "\n" + json.dumps(ev[0])[:37])  # and a truncated last line
    result = audit_logs([logs])
    assert result.status == 2
    assert [p.where for p in result.input_problems] == [f"{path}:6", f"{path}:10", f"{path}:13",
                                                        f"{path}:{len(text) + 1}"]
    assert "field 'rank': expected a count (an integer from 0 to 2**63-1), got 'one'" in \
        result.input_problems[2].message
    assert "storage_drift" in kinds(result)
    assert main(["audit", str(logs)]) == 2
    out = capsys.readouterr().out
    assert f"{path}:10: not JSON" in out and "UNREADABLE INPUT (4 problem(s)" in out


def test_missing_and_empty_inputs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    garbage = tmp_path / "garbage.log"
    garbage.write_bytes(bytes(range(256)) * 64)
    result = audit_logs([tmp_path / "nope.jsonl", tmp_path / "empty", garbage])
    assert result.status == 2 and result.events == 0
    messages = [p.message for p in result.input_problems]
    assert messages[0].startswith("directory holds no log files") and messages[1].startswith("cannot open")
    assert all(p.source == str(garbage) for p in result.input_problems[2:-1])
    assert messages[-1].startswith("no audit events in the input")
    assert main(["audit", str(tmp_path / "nope.jsonl")]) == 2


def test_an_overlong_line_is_skipped_without_reading_it_whole() -> None:
    good = b'{"event":"hook_run","backbone":"d","rank":0,"epoch":0,"ts":"2026-01-01T00:00:00.000001Z"}\n'
    data = good + b'{"pad":"' + b"x" * 5000 + b'"}\n' + good
    items = list(read_stream(io.BytesIO(data), "big.jsonl", max_line=1024))
    assert [type(i).__name__ for i in items] == ["LogEvent", "InputProblem", "LogEvent"]
    assert items[1].where == "big.jsonl:2" and "longer than 1024 bytes" in items[1].message  # type: ignore[union-attr]
    assert items[2].where == "big.jsonl:3"  # type: ignore[union-attr]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_edit_of_a_real_log_crashes_the_audit(real_logs: Path, tmp_path_factory: pytest.TempPathFactory,
                                                  data: st.DataObject) -> None:
    raw = bytearray((real_logs / "rank0.jsonl").read_bytes())
    cut = data.draw(st.integers(0, len(raw)), label="truncate at")
    raw = raw[:cut]
    for _ in range(data.draw(st.integers(0, 6), label="edits")):
        if not raw:
            break
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "rank0.jsonl"
    path.write_bytes(bytes(raw))
    result = audit_logs([path])
    assert result.status in (0, 1, 2)
    assert (result.status == 2) == (result.input_problem_count > 0)
    assert all(p.line is not None or p.message.startswith("no audit events") for p in result.input_problems)
    assert result.events > 0 or result.status == 2  # nothing seen is never clean


# ---- bounded memory -----------------------------------------------------------------------------------------


def _peak_bytes(path: Path) -> tuple[int, AuditResult]:
    tracemalloc.start()
    try:
        result = audit_logs([path])
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_number_of_reloads(real_logs: Path, tmp_path: Path) -> None:
    recorded = [e for e in read_lines(real_logs / "rank0.jsonl") if e["epoch"] <= 1]
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    n_short = write_synthetic(short, recorded, 20)
    n_long = write_synthetic(long, recorded, 400)
    peak_short, r_short = _peak_bytes(short)
    peak_long, r_long = _peak_bytes(long)
    assert r_short.status == 0 and r_long.status == 0, r_long.violations[:3]
    assert (r_short.events, r_long.events) == (n_short, n_long) and n_long > 15 * n_short
    (stream,) = r_long.streams
    assert stream.epoch == 400 and len(stream.ready) <= 6 and len(stream.last_ptrs) == 4
    assert peak_long < 1.5 * peak_short + 64 * 1024, (peak_short, peak_long)


def test_recover_after_an_abort_that_was_not_rolled_back_is_a_violation(real_logs: Path, tmp_path: Path) -> None:
    """`recover` is guarded by `require_recoverable`; the abort_reload event records whether it held."""
    log = tmp_path / "mixed.jsonl"
    lines = read_lines(real_logs / "mixed.jsonl")
    (abort,) = [e for e in lines if e["backbone"] == "recovered" and e.get("trigger") == "abort_reload"]
    assert abort["recoverable"] is True
    assert audit_logs([real_logs / "mixed.jsonl"]).status == 0
    abort["recoverable"] = False
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    result = audit_logs([log])
    assert result.violation_counts["illegal_transition"] == 1
    assert "not recoverable" in result.violations[0].detail


def test_the_auditor_reads_the_writers_schema_and_refuses_another_by_name(tmp_path: Path) -> None:
    """Schema 3 added FINALIZED, 4 made layer_ready per bucket, 5 renamed finish_loading: a schema-2 log's refresh
    from FULLY_LOADED, a schema-3 layer_ready with its one `layer`, or a schema-4 `finish_loading`, must not read
    as a violation, nor pass as clean; each is an input problem that names the version (exit 2)."""
    from lifecycle.audit.replay import audit_logs
    from lifecycle.audit.schema import SCHEMA_READ
    from lifecycle.events import SCHEMA_VERSION

    assert SCHEMA_READ == SCHEMA_VERSION
    line = {"event": "transition", "backbone": "d", "rank": 0, "epoch": 0, "seq": 1, "trigger": "weights_loaded",
            "src": "META", "dst": "PARTIALLY_LOADED", "ts": "2026-01-01T00:00:00.000001Z"}
    for version in (2, 3, 4):
        old = tmp_path / f"old{version}.jsonl"
        old.write_text(json.dumps({**line, "schema": version}) + "\n")
        result = audit_logs([old])
        assert result.status == 2 and not result.violations
        assert any(f"schema {version}" in p.message for p in result.input_problems)
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps({**line, "schema": SCHEMA_VERSION}) + "\n")
    assert not audit_logs([new]).input_problems
