"""Per-bucket events held back and written in batches (issue #15): with a JSON file alone (or no output) a
lifecycle holds its `layer_ready` events and writes them in one `write(2)` per batch, before its next other event.
Nothing is lost or reordered: the file equals what an unheld run writes (same events, same `seq` order, each with
the time it was made), and held events come out when `recent_events` is read, after `HOLD_MAX` of them, before
`configure_audit` switches the route, and at exit."""

from __future__ import annotations

import contextlib
import datetime
import errno
import gc
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle import event_sink, events
from lifecycle.events import configure_audit, read_events
from lifecycle.loading import apply_bucket, write_checkpoint
from lifecycle.machine import BackboneLifecycle
from lifecycle.testing import cold_load, random_checkpoint
from lifecycle.types import TensorSpec
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 70  # more decoder layers than HOLD_MAX: a load fills at least one batch


@pytest.fixture(autouse=True)
def _no_output() -> Any:
    yield
    configure_audit(console=False)


def _draft(name: str = "held") -> DFlashQwen3Draft:
    return DFlashQwen3Draft(DFlashConfig(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=32,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16), name=name)


def _checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(random_checkpoint(_draft(), 0), tmp_path / "a.safetensors")


def _shape(evs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["event"], e["seq"], e.get("layers"), e.get("dst")) for e in evs]


def test_a_held_load_writes_the_same_events_in_order_in_fewer_writes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _checkpoint(tmp_path)
    writes: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: Any) -> int:
        writes.append(fd)
        return real_write(fd, data)

    runs = {}
    for held in (True, False):
        log = tmp_path / f"{held}.jsonl"
        sink = configure_audit(json_path=log, console=False)
        assert sink is not None
        hold = events.HOLD_WRITE if held else events.HOLD_NONE
        monkeypatch.setattr(events, "hold_events", lambda hold=hold: hold)
        m = _draft()
        writes.clear()
        monkeypatch.setattr(os, "write", counting_write)
        cold_load(m, ckpt, refresh=False)
        monkeypatch.setattr(os, "write", real_write)
        runs[held] = (read_events(log), sum(fd == sink._fd for fd in writes))
    (held_events, held_writes), (plain_events, plain_writes) = runs[True], runs[False]
    layer_ready = [e for e in held_events if e["event"] == "layer_ready"]
    assert len(layer_ready) == LAYERS + 3  # every decoder layer and the draft's other modules, one event each
    assert _shape(held_events) == _shape(plain_events)
    assert [e["seq"] for e in held_events] == list(range(1, len(held_events) + 1))
    assert [e["ts"] for e in held_events] == sorted(e["ts"] for e in held_events)  # each stamped when made
    assert plain_writes == len(plain_events)
    assert held_writes <= len(held_events) - len(layer_ready) + -(-len(layer_ready) // events.HOLD_MAX) + 1


def test_held_events_come_out_when_asked_for_and_never_more_than_hold_max(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "HOLD_NS", 10 ** 15)  # only the count bounds a batch here (reading is slow)
    log = tmp_path / "a.jsonl"
    configure_audit(json_path=log, console=False)
    m = _draft()
    weights = random_checkpoint(m, 0)
    per_layer = list(m.lifecycle.readiness.tensors_of_layer.values())
    on_file = []
    for names in per_layer[:LAYERS - 1]:
        apply_bucket(m, [(n, weights[n]) for n in names])
        on_file.append(sum(e["event"] == "layer_ready" for e in read_events(log)))
    assert max(i + 1 - n for i, n in enumerate(on_file)) == events.HOLD_MAX - 1  # at most a batch held
    assert events.HOLD_MAX in {b - a for a, b in itertools.pairwise(on_file)}  # a full batch, in one go
    kept = m.lifecycle.recent_events  # reading the lifecycle's events writes the held ones first
    assert sum(e["event"] == "layer_ready" for e in kept) == LAYERS - 1
    assert sum(e["event"] == "layer_ready" for e in read_events(log)) == LAYERS - 1


def test_switching_the_route_writes_held_events_to_the_old_sink(tmp_path: Path) -> None:
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    configure_audit(json_path=first, console=False)
    m = _draft()
    weights = random_checkpoint(m, 0)
    for names in list(m.lifecycle.readiness.tensors_of_layer.values())[:2]:
        apply_bucket(m, [(n, weights[n]) for n in names])
    # the first bucket's transition wrote its layer_ready; the second bucket's is held
    assert [e["event"] for e in read_events(first)] == ["layer_ready", "transition"]
    configure_audit(json_path=second, console=False)
    assert [e["event"] for e in read_events(first)] == ["layer_ready", "transition", "layer_ready"]
    assert not second.exists() or not read_events(second)


def test_capture_logs_sees_each_event_at_once() -> None:
    m = _draft()
    weights = random_checkpoint(m, 0)
    with structlog.testing.capture_logs() as logs:
        for names in list(m.lifecycle.readiness.tensors_of_layer.values())[:2]:
            apply_bucket(m, [(n, weights[n]) for n in names])
        # not held: the second bucket's event is seen before anything else happens
        assert [e["event"] for e in logs] == ["layer_ready", "transition", "layer_ready"]


def test_events_held_at_exit_are_written(tmp_path: Path) -> None:
    log = tmp_path / "exit.jsonl"
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from lifecycle.events import configure_audit
from lifecycle.loading import apply_bucket
from lifecycle.testing import random_checkpoint
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft
configure_audit(json_path={str(log)!r}, console=False)
m = DFlashQwen3Draft(DFlashConfig(num_hidden_layers=3), name="exiting")
w = random_checkpoint(m, 0)
for names in list(m.lifecycle.readiness.tensors_of_layer.values())[:2]:
    apply_bucket(m, [(n, w[n]) for n in names])
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    kinds = [e["event"] for e in read_events(log)]
    assert kinds.count("layer_ready") == 2 and kinds[-1] == "layer_ready"


def test_with_nothing_written_the_kept_events_are_those_of_an_unheld_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit off: the records are built only when `recent_events` is read, and only the last ones are held."""
    configure_audit(console=False)
    kept = {}
    for hold in (events.HOLD_KEEP, events.HOLD_NONE):
        monkeypatch.setattr(events, "hold_events", lambda hold=hold: hold)
        names = [f"layers.{i}.{t}" for i in range(200) for t in ("a", "b")]
        lc = BackboneLifecycle("kept", dict.fromkeys(names, TensorSpec((1,), torch.float32)), recent_events=16)
        for i in range(200):
            lc.weights_loaded([f"layers.{i}.a", f"layers.{i}.b"])
            assert len(lc._held) <= 2 * 16 + events.HOLD_MAX
        kept[hold] = [(e["event"], e["seq"], e.get("layers"), e.get("layers_ready")) for e in lc.recent_events]
    assert len(kept[events.HOLD_KEEP]) == 16
    assert kept[events.HOLD_KEEP] == kept[events.HOLD_NONE]


# ---- the lines formatted from the held tuples (JSON file alone) are the lines of the unheld path ----------------

NODE = 'n\u00f6de "1"\\'  # the node is encoded into every line too
AWKWARD = ['q"uote', "back\\slash", "caf\u00e9 \u4e2d \U0001f600", "ctl\n\t\x00\x1f\x7f", "line\u2028sep",
           "lone\ud800surrogate", '","ts":"2026-01-01T00:00:00.000000Z","schema":5}', ""]
TS = re.compile(r'"level":"info","ts":"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z","schema":')
DURATION = re.compile(r',"duration_ms":[-+.e0-9]+,')  # a transition's own: it differs between runs


def _timeless(line: str) -> str:
    return DURATION.sub(',"duration_ms":0,', TS.sub('"level":"info","ts":"T","schema":', line))


def _timeless_record(event: dict[str, Any]) -> list[Any]:
    return [(k, 0 if k == "duration_ms" else v) for k, v in event.items()]


def _layer_names(stem: str, count: int = 30) -> list[str]:
    return [f"{AWKWARD[i % len(AWKWARD)]}{stem}{i}" for i in range(count)]


def _reload_script(name: str, layers: list[str], rank: Any, log: Path | None, hold: int | None = None,
                   recent: int = 512) -> tuple[list[str], list[list[Any]], Any]:
    """A first load and a reload of a backbone with these (distinct) layer names, two tensors each, with audit to
    `log` (None: off); `hold` forces what `events.hold_events` answers (None: the route's own answer). Buckets of
    one layer, of more layers than `LIST_CAP`, of half a layer, and declared unchanged (`layers_unchanged`), with
    `recent_events` (keeping `recent`) read part way. Returns the file's lines and the kept events (as item
    lists: keys, values and their order), both with times and durations blanked (the runs differ only there), and
    the lifecycle."""
    with pytest.MonkeyPatch.context() as mp:
        if hold is not None:
            mp.setattr(events, "hold_events", lambda: hold)
        return _run_reload_script(name, layers, rank, log, recent)


def _run_reload_script(name: str, layers: list[str], rank: Any, log: Path | None, recent: int
                       ) -> tuple[list[str], list[list[Any]], Any]:
    configure_audit(json_path=log, console=False, node=NODE)
    tensors = {f"t{i}.{j}": layer for i, layer in enumerate(layers) for j in range(2)}
    lc = BackboneLifecycle(name, dict.fromkeys(tensors, TensorSpec((1,), torch.float32)), rank=rank,
                           layer_key=tensors.__getitem__, recent_events=recent)

    def of(chosen: list[str]) -> list[str]:
        return [t for t, layer in tensors.items() if layer in chosen]

    half = events.LIST_CAP + 4  # declared unchanged in one call: more than a list holds
    lc.weights_loaded(of(layers[:1]))
    lc.weights_loaded(of(layers[1:events.LIST_CAP + 5]))  # one bucket completes more layers than a list holds
    seen = lc.recent_events  # read part way: the held events built, the deque and its records stay the same objects
    first_kept = {e["seq"]: e for e in seen}
    for layer in layers[events.LIST_CAP + 5:]:
        lc.weights_loaded(of([layer]))
    lc.finalize_loading()
    lc.begin_reload()
    lc.weights_unchanged(of(layers[:half]))
    lc.weights_loaded([f"t{half}.0"])  # half a layer: no event
    lc.weights_loaded([f"t{half}.1"])
    for layer in layers[half + 1:]:
        lc.weights_loaded(of([layer]))
    lc.weights_unchanged([])
    lc.finalize_loading()
    lc.refresh_derived(lambda: None)
    kept = lc.recent_events
    assert kept is seen and all(first_kept[e["seq"]] is e for e in kept if e["seq"] in first_kept)
    assert all(type(e) is dict for e in kept)
    lines = [_timeless(line) for line in log.read_text(encoding="ascii").splitlines(keepends=True)] \
        if log is not None else []
    return lines, [_timeless_record(e) for e in kept], lc


@pytest.fixture
def no_failures_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's count of lost audit events at 0, as in a fresh process: earlier tests may have lost some,
    and a held event is kept unbuilt only while none was."""
    monkeypatch.setattr(event_sink, "_failures", 0)


@pytest.fixture
def templated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many batches were written from the held tuples (`write_held_lines`), one entry (lines) per batch."""
    batches: list[int] = []
    real = events.JsonLinesSink.write_held_lines

    def spy(self: events.JsonLinesSink, lines: Any, level: str, node: str) -> None:
        batches.append(0)
        real(self, lambda *frame: _count(batches, lines(*frame)), level, node)

    monkeypatch.setattr(events.JsonLinesSink, "write_held_lines", spy)
    return batches


def _count(batches: list[int], text: str) -> str:
    batches[-1] = text.count("\n")
    return text


CASES = {
    "awkward names": ('dr"a\\ft \u00e9\u4e2d\n\x01\ud83d', _layer_names("layers."), 3, True),
    "names at the cap": ("\u00e9" * events.STR_CAP, [f"{n}{i}".rjust(events.STR_CAP, "\\")
                                                     for i, n in enumerate(_layer_names("x"))], 0, True),
    "negative rank": ("draft", _layer_names("layers."), -(2 ** 63), True),
    "backbone name over the cap": ('"' * (events.STR_CAP + 1), _layer_names("layers."), 0, False),
    "layer name over the cap": ("draft", [*_layer_names("layers.", 29), "\u00e9" * (events.STR_CAP + 1)], 0, False),
    "rank not a plain int": ("draft", _layer_names("layers."), 2 ** 64, False),
    "rank a bool": ("draft", _layer_names("layers."), True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_held_lines_and_kept_events_are_those_of_the_unheld_path(case: str, tmp_path: Path, no_failures_yet: None,
                                                                  templated: list[int]) -> None:
    """Plain events (names and rank within the bounds) are written from their tuples (`write_held_lines`), the
    others as records; either way each line is, byte for byte, the line the unheld path writes (`write_held` of
    the record, one at a time), and `recent_events` holds the same records as unheld or audit-off runs."""
    name, layers, rank, plain = CASES[case]
    held_lines, held_kept, lc = _reload_script(name, layers, rank, tmp_path / "held.jsonl")
    assert (lc._line_prefixes is not None) == plain
    assert sum(templated) == (sum('"event":"layer' in line for line in held_lines) if plain else 0)
    templated.clear()
    plain_lines, plain_kept, _ = _reload_script(name, layers, rank, tmp_path / "plain.jsonl", events.HOLD_NONE)
    assert not templated
    _, off_kept, _ = _reload_script(name, layers, rank, None)  # audit off: held, nothing written
    assert held_lines == plain_lines  # byte for byte, but for the timestamps
    assert held_kept == plain_kept == off_kept
    layer_events = [dict(e) for e in held_kept if e[0][1] in ("layer_ready", "layers_unchanged")]
    assert [e["layers_more"] for e in layer_events if len(e["layers"]) == events.LIST_CAP] == [4, 4]
    assert {e["event"] for e in layer_events} == {"layer_ready", "layers_unchanged"}
    assert all("sink_failures" not in e for e in layer_events)


@pytest.mark.parametrize("recent", [1, 7])
def test_a_short_memory_keeps_the_last_records_of_the_unheld_path(recent: int, tmp_path: Path,
                                                                  no_failures_yet: None) -> None:
    """Fewer events kept than held ones between reads: the last ones, built, as an unheld or audit-off run keeps."""
    name, layers, rank, _ = CASES["awkward names"]
    runs = [_reload_script(name, layers, rank, tmp_path / "held.jsonl", recent=recent)[1],
            _reload_script(name, layers, rank, tmp_path / "plain.jsonl", events.HOLD_NONE, recent=recent)[1],
            _reload_script(name, layers, rank, None, recent=recent)[1]]
    assert len(runs[0]) == recent and runs[0] == runs[1] == runs[2]


def test_an_awkward_held_log_passes_the_auditor(tmp_path: Path, no_failures_yet: None, templated: list[int]
                                                 ) -> None:
    log = tmp_path / "held.jsonl"
    name, layers, rank, _ = CASES["awkward names"]
    _reload_script(name, layers, rank, log)
    assert templated
    done = subprocess.run([sys.executable, "-m", "lifecycle.cli", "audit", "--json", str(log)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["events"] == len(read_events(log))
    assert [s["backbone"] for s in result["streams"]] == [name]


def test_held_events_after_a_failed_write_carry_the_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           no_failures_yet: None, templated: list[int]) -> None:
    """A batch whose write fails is lost from the file (counted); it and every later event kept say how many
    events were lost so far, as unheld events do; events kept before the failure do not."""
    layers = _layer_names("layers.", 12)
    tensors = {f"t{i}": layer for i, layer in enumerate(layers)}

    def run(log: Path, hold: int | None) -> tuple[list[str], list[dict[str, Any]]]:
        configure_audit(json_path=log, console=False, node=NODE)
        sink = events._route.sink
        assert sink is not None
        if hold is not None:
            monkeypatch.setattr(events, "hold_events", lambda: hold)
        lc = BackboneLifecycle('d"raft', dict.fromkeys(tensors, TensorSpec((1,), torch.float32)),
                               layer_key=tensors.__getitem__)
        for t in list(tensors)[:4]:
            lc.weights_loaded([t])
        lc.recent_events  # noqa: B018  (written, and kept without a count)
        real_write = os.write
        failing = [0]

        def full_disk(fd: int, data: Any) -> int:
            if fd == sink._fd:
                failing[0] += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", full_disk)
        for t in list(tensors)[4:7]:
            lc.weights_loaded([t])
        lc.flush_events()
        monkeypatch.setattr(os, "write", real_write)
        assert failing[0] == (1 if hold is None else 3)
        for t in list(tensors)[7:]:
            lc.weights_loaded([t])
        kept = [dict(_timeless_record(e)) for e in lc.recent_events]
        monkeypatch.setattr(event_sink, "_failures", 0)
        monkeypatch.setattr(events, "hold_events", real_hold)
        return log.read_text(encoding="ascii").splitlines(), kept

    real_hold = events.hold_events
    with contextlib.redirect_stderr(io.StringIO()):
        held_lines, held_kept = run(tmp_path / "held.jsonl", None)
        plain_lines, plain_kept = run(tmp_path / "plain.jsonl", events.HOLD_NONE)
    assert templated
    assert [_timeless(line) for line in held_lines] == [_timeless(line) for line in plain_lines]
    # seq 2 and 14: the transitions of the first and the last bucket; 6 to 8 lost
    assert [json.loads(line)["seq"] for line in held_lines] == [1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14]
    assert [e.pop("sink_failures", None) for e in held_kept] == [None] * 5 + [3] * 9
    assert [e.pop("sink_failures", None) for e in plain_kept] == [None] * 5 + [1, 2] + [3] * 7
    assert held_kept == plain_kept


@given(name=st.text(max_size=12), layers=st.lists(st.text(max_size=12), min_size=1, max_size=20, unique=True),
       rank=st.integers(-(2 ** 63), 2 ** 63 - 1))
@settings(max_examples=40, deadline=None)
def test_any_names_held_lines_are_the_encoders(name: str, layers: list[str], rank: int) -> None:
    """For any names the templated line is the JSON encoder's line for the record (ensure_ascii, the same
    separators): each held event's line, parsed and encoded again, is itself, and holds the kept record."""
    # no audit write lost yet (earlier tests may have lost some): kept records carry no `sink_failures`
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(event_sink, "_failures", 0):
        log = Path(tmp) / "held.jsonl"
        configure_audit(json_path=log, console=False, node=NODE)
        tensors = {f"t{i}": layer for i, layer in enumerate(layers)}
        lc = BackboneLifecycle(name, dict.fromkeys(tensors, TensorSpec((1,), torch.float32)), rank=rank,
                               layer_key=tensors.__getitem__)
        names = list(tensors)
        lc.weights_loaded(names[:len(names) // 2 + 1])
        for t in names[len(names) // 2 + 1:]:
            lc.weights_loaded([t])
        kept = {e["seq"]: e for e in lc.recent_events}
        lines = log.read_text(encoding="ascii").splitlines(keepends=True)
        configure_audit(console=False)
    for line in lines:
        event = json.loads(line)
        assert line == json.dumps(event, separators=(",", ":")) + "\n"
        assert list(event) == ["node", *kept[event["seq"]], "level", "ts", "schema"]
        assert {k: event[k] for k in kept[event["seq"]]} == kept[event["seq"]]


@pytest.mark.parametrize("start", [0, 999_999_000, 1_700_000_000_999_990_500, -3_000_000_001])
def test_timestamps_of_a_batch_are_each_times_own(start: int) -> None:
    times = [start + i * 3_001 for i in range(20)]  # across a second's end
    expected = [datetime.datetime.fromtimestamp(t // 10 ** 9, tz=datetime.timezone.utc)
                .strftime("%Y-%m-%dT%H:%M:%S.") + f"{t % 10 ** 9 // 1000:06d}Z" for t in times]
    assert events.timestamps(times) == expected
    assert [events.timestamp(t) for t in reversed(times)] == expected[::-1]


def _names_lifecycle(locked: bool = False, layers: int = 6) -> BackboneLifecycle:
    names = [f"layers.{i}.w" for i in range(layers)]
    return BackboneLifecycle("review", dict.fromkeys(names, TensorSpec((1,), torch.float32)), locked=locked)


def test_a_locked_lifecycle_keeps_records_never_tuples(tmp_path: Path) -> None:
    """Found in review: on the JSON-file route a locked lifecycle (writer threads) kept its layer_ready events as
    tuples, built later by `recent_events` without the lock (a writer appending meanwhile was put out of order,
    or left a tuple that the worker RPC's `{**e}` failed on). It keeps records."""
    configure_audit(json_path=tmp_path / "locked.jsonl", console=False)
    lc = _names_lifecycle(locked=True)
    for name in lc.specs:
        lc.weights_loaded([name])
    kept = list(lc._recent)
    assert kept and all(type(e) is dict for e in kept)
    assert [e["seq"] for e in kept] == sorted(e["seq"] for e in kept)
    assert [e["seq"] for e in read_events(tmp_path / "locked.jsonl")] == [e["seq"] for e in kept]


@pytest.mark.parametrize("bad", [1.7e18, "now", None, -1, 2**63, True])
def test_a_bucket_time_that_is_not_time_ns_is_refused_before_anything_is_recorded(tmp_path: Path, bad: Any) -> None:
    """Found in review: a float or str `at_ns` raised out of the held-event bookkeeping after the bucket was
    counted, or lost the whole batch of lines when it was formatted."""
    log = tmp_path / "bad.jsonl"
    configure_audit(json_path=log, console=False)
    lc = _names_lifecycle()
    names = list(lc.specs)
    buckets = [([names[0]], time.time_ns()), ([names[1]], bad)]
    with pytest.raises(TypeError, match=r"backbone 'review'.*time\.time_ns\(\).*nothing recorded"):
        lc.weights_loaded_buckets(buckets)
    if bad is not None:
        with pytest.raises(TypeError, match=r"at_ns must be a time\.time_ns\(\) value"):
            lc.weights_loaded([names[1]], at_ns=bad)
    assert lc.readiness.layers_ready == 0 and lc.state.value == "META"
    lc.flush_events()
    assert read_events(log) == []


def test_held_events_of_a_dropped_lifecycle_are_written(tmp_path: Path) -> None:
    """Found in review: the registry of holders is weak, so a lifecycle collected with held layer_ready events
    (before its next event) lost them, even at exit. They are written when it is collected."""
    log = tmp_path / "dropped.jsonl"
    configure_audit(json_path=log, console=False)
    lc = _names_lifecycle()
    for name in list(lc.specs)[:4]:
        lc.weights_loaded([name])
    assert lc._held  # held, not written yet
    written_before = [e["seq"] for e in read_events(log)]
    del lc
    gc.collect()
    seqs = [e["seq"] for e in read_events(log)]
    assert len(seqs) > len(written_before) and seqs == sorted(seqs) and seqs[-1] == 5
