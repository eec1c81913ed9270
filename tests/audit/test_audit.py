"""Audit events: the transition path of a cold load and a reload, refusals, and the JSON-lines sink."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle.errors import IllegalTransitionError, LayersNotReadyError, StorageDriftError
from lifecycle.events import LIST_CAP, SCHEMA_VERSION, STR_CAP, configure_audit, emit, read_events
from lifecycle.loading import load_safetensors
from lifecycle.states import LifecycleState, possible_destinations
from lifecycle.testing import cold_load, reload
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

S = LifecycleState


def _cold_and_reload(cfg: DFlashConfig, a: Path, b: Path) -> DFlashQwen3Draft:
    m = cold_load(DFlashQwen3Draft(cfg, name="draft-r3", rank=3), a, capture_graphs=True)
    reload(m, b, bucket_by=3, shuffle=True, seed=7)
    return m


def test_cold_load_and_reload_transition_path(tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path) -> None:
    with capture_logs() as logs:
        m = _cold_and_reload(tiny_cfg, ckpt_a, ckpt_b)
    assert m.lifecycle.state is S.GRAPH_CAPTURED
    transitions = [e for e in logs if e["event"] == "transition"]

    # a chain: each event starts where the previous one ended, and each is a row of the table
    cur = S.META
    for ev in transitions:
        assert ev["src"] == cur.value
        assert S(ev["dst"]) in possible_destinations(ev["trigger"], S(ev["src"]))
        cur = S(ev["dst"])
    assert cur is S.GRAPH_CAPTURED

    states = [k for k, _ in groupby([transitions[0]["src"]] + [e["dst"] for e in transitions])]
    assert states == ["META", "PARTIALLY_LOADED", "FULLY_LOADED", "FINALIZED", "DERIVED_REFRESHED", "GRAPH_CAPTURED",
                      "PARTIALLY_LOADED", "FULLY_LOADED", "FINALIZED", "DERIVED_REFRESHED", "GRAPH_CAPTURED"]
    triggers = [k for k, _ in groupby(e["trigger"] for e in transitions)]
    assert triggers == ["weights_loaded", "finalize_loading", "refresh_derived", "capture_graphs", "begin_reload",
                        "weights_loaded", "finalize_loading", "refresh_derived", "graphs_verified"]
    # weights_loaded fires where the state changes (the first bucket, the last layer), never per tensor; each
    # bucket that completed layers says so in one layer_ready event
    n_layers = m.lifecycle.readiness.layers_total
    cold_loads = [(e["src"], e["dst"]) for e in transitions if e["trigger"] == "weights_loaded" and e["epoch"] == 0]
    assert cold_loads == [("META", "PARTIALLY_LOADED"), ("PARTIALLY_LOADED", "FULLY_LOADED")]
    ready = [e for e in logs if e["event"] == "layer_ready"]
    cold_ready = [e for e in ready if e["epoch"] == 0]
    assert len(cold_ready) == n_layers and all(len(e["layers"]) == 1 for e in cold_ready)  # bucket_by="layer"
    assert sorted(layer for e in ready for layer in e["layers"]) == sorted(2 * list(
        m.lifecycle.readiness.tensors_of_layer))
    assert all(e["layers_more"] == 0 and e["tensors"] >= 1 for e in ready)

    for ev in [*logs, *m.lifecycle.recent_events]:
        assert ev["backbone"] == "draft-r3" and ev["rank"] == 3, ev
        assert isinstance(ev["epoch"], int)
    reload_at = next(i for i, e in enumerate(logs) if e.get("trigger") == "begin_reload")
    assert {e["epoch"] for e in logs[:reload_at]} == {0}
    assert {e["epoch"] for e in logs[reload_at:]} == {1}
    assert logs[reload_at]["pinned"] is True
    for ev in transitions:
        assert ev["layers_total"] == n_layers and 0 <= ev["layers_ready"] <= n_layers
        assert ev["duration_ms"] >= 0

    refreshes = [e for e in logs if e["event"] == "refresh"]
    assert len(refreshes) == 2
    for buf in refreshes[1]["buffers"]:
        live = m._buffers[buf["name"]]
        assert buf["data_ptr"] == hex(live.data_ptr())
        assert buf["nbytes"] == live.numel() * live.element_size()
    assert {b["mode"] for b in refreshes[0]["buffers"]} == {"cold", "alias"}
    assert {b["mode"] for b in refreshes[1]["buffers"]} == {"in_place", "alias"}


def test_refusals_are_events_with_error_and_reason(tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    m = DFlashQwen3Draft(tiny_cfg)
    lc = m.lifecycle
    with capture_logs() as logs:
        with pytest.raises(LayersNotReadyError) as not_ready:
            m.refresh_derived_buffers()
        load_safetensors(m, ckpt_a)
        with pytest.raises(IllegalTransitionError) as illegal:
            m.capture_graphs()
    refused = [e for e in logs if e["event"] == "refused"]
    assert len(refused) == 2
    first, second = refused
    assert (first["trigger"], first["src"], first["error"]) == ("refresh_derived", "META", "LayersNotReadyError")
    assert first["reason"] == not_ready.value.reason
    n_names = len(lc.specs)
    assert n_names > LIST_CAP
    assert len(first["missing"]) == LIST_CAP and first["missing_more"] == n_names - LIST_CAP
    assert set(first["missing"]) <= set(lc.specs)
    assert (second["trigger"], second["src"], second["error"]) == ("capture_graphs", "FULLY_LOADED",
                                                                   "IllegalTransitionError")
    assert second["reason"] == illegal.value.reason and "DERIVED_REFRESHED" in second["reason"]
    for ev in refused:
        assert (ev["backbone"], ev["rank"], ev["epoch"]) == ("dflash", 0, 0)
        assert "dst" not in ev
    # the most recent events are also kept on the lifecycle, for an error report
    assert [e["event"] for e in lc.recent_events if e["event"] == "refused"] == ["refused", "refused"]


def _floats_in_lists(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_floats_in_lists(v) for v in value.values())
    if isinstance(value, list):
        return any(isinstance(v, float) or _floats_in_lists(v) for v in value)
    return False


def _parse_utc(ts: str) -> datetime:
    assert ts.endswith(("Z", "+00:00")), ts
    parsed = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    assert parsed.utcoffset() == timedelta(0)
    return parsed


@pytest.mark.parametrize("level", ["info", "debug"])
def test_json_lines_sink(tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, tmp_path: Path, level: str) -> None:
    path = tmp_path / "logs" / "audit.jsonl"
    sink = configure_audit(json_path=path, console=False, level=level)
    assert sink is not None
    m = _cold_and_reload(tiny_cfg, ckpt_a, ckpt_b)
    m.release_graphs()
    with pytest.raises(IllegalTransitionError):
        m.release_graphs()
    configure_audit(console=False)  # closes the sink
    events = read_events(path)

    kinds = {e["event"] for e in events}
    assert {"transition", "refused", "refresh", "layer_ready", "hook_run"} <= kinds
    assert ("loader_bucket" in kinds) == (level == "debug")  # per-bucket detail only at debug level
    times = []
    for ev in events:
        times.append(_parse_utc(ev["ts"]))
        assert ev["schema"] == SCHEMA_VERSION
        assert ev["level"] in ("info", "debug")
        assert ev["backbone"] == "draft-r3" and ev["rank"] == 3 and isinstance(ev["epoch"], int)
        assert not _floats_in_lists(ev), f"tensor values in {ev['event']}"
        assert "tensor(" not in str(ev)
    assert times == sorted(times)
    assert abs(datetime.now(times[-1].tzinfo) - times[-1]) < timedelta(minutes=5)
    (refused,) = [e for e in events if e["event"] == "refused"]
    assert refused["trigger"] == "release_graphs" and refused["error"] == "IllegalTransitionError"
    refresh = [e for e in events if e["event"] == "refresh"][-1]
    assert all(isinstance(b["data_ptr"], str) and b["data_ptr"].startswith("0x") for b in refresh["buffers"])
    # the JSON transitions are the same path the structlog events describe
    path_states = [k for k, _ in groupby(e["dst"] for e in events if e["event"] == "transition")]
    assert path_states == ["PARTIALLY_LOADED", "FULLY_LOADED", "FINALIZED", "DERIVED_REFRESHED", "GRAPH_CAPTURED",
                           "PARTIALLY_LOADED", "FULLY_LOADED", "FINALIZED", "DERIVED_REFRESHED", "GRAPH_CAPTURED",
                           "DERIVED_REFRESHED"]


def test_console_output_is_optional(tmp_path: Path) -> None:
    out = io.StringIO()
    configure_audit(console=True, stream=out)
    emit("transition", backbone="draft", rank=0, epoch=1, trigger="begin_reload")
    assert "transition" in out.getvalue() and "begin_reload" in out.getvalue()
    quiet = io.StringIO()
    configure_audit(console=False, stream=quiet)
    emit("transition", backbone="draft", rank=0, epoch=1, trigger="begin_reload")
    assert quiet.getvalue() == ""


def test_log_hygiene_fixed_width_utc_timestamps_contiguous_seq_bounded_fields(
        tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, tmp_path: Path) -> None:
    """Schema 2: every info event carries `seq` (1, 2, ... per lifecycle, no gaps), a fixed-width UTC timestamp,
    and fields of bounded size; debug events are not numbered."""
    import re

    path = tmp_path / "audit.jsonl"
    configure_audit(json_path=path, console=False, level="debug")
    m = _cold_and_reload(tiny_cfg, ckpt_a, ckpt_b)
    m.lifecycle.audit_event("hook_failed", hook="h", error="x" * 10_000, names=[f"n{i}" for i in range(40)],
                            value=torch.ones(2, 2))
    configure_audit(console=False)
    lines = path.read_text().splitlines()
    events = [json.loads(line) for line in lines]
    info = [e for e in events if e["level"] == "info"]
    assert [e["seq"] for e in info] == list(range(1, len(info) + 1))
    assert all("seq" not in e for e in events if e["level"] == "debug") and len(info) < len(events)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", e["ts"]) for e in events)
    last = events[-1]
    assert len(last["error"]) == STR_CAP and last["error_truncated"] == 10_000 - STR_CAP
    assert len(last["names"]) == LIST_CAP and last["names_more"] == 40 - LIST_CAP
    assert last["value"] == "<tensor shape=(2, 2) dtype=torch.float32 device=cpu>"
    assert max(map(len, lines)) < 2 * STR_CAP


def test_capped_lists_always_say_how_many_were_left_out(ckpt_a: Path) -> None:
    cfg = DFlashConfig(num_hidden_layers=LIST_CAP + 4)
    m = DFlashQwen3Draft(cfg)
    from lifecycle.loading import write_checkpoint
    from models.qwen3_dflash import random_weights

    ckpt = write_checkpoint(random_weights(cfg, 0), ckpt_a.parent / "big.safetensors")
    with capture_logs() as logs:
        cold_load(m, ckpt, capture_graphs=True)
        m.begin_reload()
        m.abort_reload("test")  # every tensor missing
        m.begin_reload()
        m.lifecycle.weights_unchanged(list(m.lifecycle.specs))  # every layer declared unchanged at once
        pinned = m.lifecycle.pinned
        assert pinned is not None
        m.lifecycle.bind(pinned_tensors=lambda: {n: torch.zeros(1) for n in pinned.identities})  # every one moved
        with pytest.raises(StorageDriftError):
            m.lifecycle.verify_pinned()
    n_layers = m.lifecycle.readiness.layers_total
    abort = next(e for e in logs if e.get("trigger") == "abort_reload")
    assert len(abort["missing"]) == LIST_CAP and abort["missing_more"] == len(m.lifecycle.specs) - LIST_CAP
    unchanged = next(e for e in logs if e["event"] == "layers_unchanged")
    assert len(unchanged["layers"]) == LIST_CAP and unchanged["layers_more"] == n_layers - LIST_CAP
    check = next(e for e in logs if e["event"] == "storage_check" and not e["ok"])
    assert len(check["problems"]) == LIST_CAP and check["problems_more"] > 0
