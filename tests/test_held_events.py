"""Per-bucket events held back and written in batches (issue #15): with a JSON file alone (or no output) a
lifecycle holds its `layer_ready` events and writes them in one `write(2)` per batch, before its next other event.
Nothing is lost or reordered: the file equals what an unheld run writes (same events, same `seq` order, each with
the time it was made), and held events come out when `recent_events` is read, after `HOLD_MAX` of them, before
`configure_audit` switches the route, and at exit."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

from lifecycle import events
from lifecycle.events import configure_audit, read_events
from lifecycle.loading import apply_bucket, load_safetensors, write_checkpoint
from lifecycle.testing import random_checkpoint
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

ROOT = Path(__file__).resolve().parent.parent
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
        monkeypatch.setattr(events, "hold_events", (lambda: True) if held else (lambda: False))
        m = _draft()
        writes.clear()
        monkeypatch.setattr(os, "write", counting_write)
        load_safetensors(m, ckpt)
        m.finalize_loading()
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
    import torch

    from lifecycle.machine import BackboneLifecycle
    from lifecycle.types import TensorSpec

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
