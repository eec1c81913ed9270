"""The tracking benchmark's hot-path figures: the readiness update per tensor, a layer completion, and the cost of
each kind of audit event (`benchmarks.tracking_overhead` prints them)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from transitions import Machine
from transitions.extensions import LockedMachine

from benchmarks import common
from benchmarks.common import Arm
from lifecycle import DraftBackbone
from lifecycle import events as audit_events
from lifecycle.events import configure_audit
from lifecycle.loading import apply_bucket
from lifecycle.readiness import LayerReadiness
from lifecycle.testing import random_checkpoint
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

TARGET_PER_TENSOR_X = 2.0  # readiness update per tensor / dict update per tensor
TARGET_LAYER_US = 5.0  # one layer completion


def per_tensor_update(model: DraftBackbone, rounds: int) -> dict[str, Any]:
    """The readiness update of every bucket of a load (one per layer) vs a dict update per tensor of the same
    buckets, interleaved, CPU time of this thread; per tensor, min over rounds."""
    readiness = LayerReadiness(model.lifecycle.specs)  # the backbone's own, built afresh
    buckets = [list(names) for names in readiness.tensors_of_layer.values()]
    tensors = sum(map(len, buckets))
    loaded: dict[str, int] = {}

    def lifecycle_update() -> None:
        readiness.new_epoch()
        for bucket in buckets:
            readiness.mark_loaded(bucket)

    def mark(bucket: list[str], epoch: int = 1) -> None:  # a dict-based tracker told per bucket, as the lifecycle is
        for name in bucket:
            loaded[name] = epoch

    def dict_update() -> None:
        loaded.clear()
        for bucket in buckets:
            mark(bucket)

    arms = [Arm("readiness", lifecycle_update), Arm("dict", dict_update)]
    samples = common.interleaved(arms, rounds, clock=time.thread_time)
    ns = {k: min(v) / tensors * 1e9 for k, v in samples.items()}
    return {"tensors": tensors, "buckets": len(buckets), "readiness_ns": round(ns["readiness"], 1),
            "dict_ns": round(ns["dict"], 1), "ratio": round(ns["readiness"] / ns["dict"], 3),
            "met": ns["readiness"] <= TARGET_PER_TENSOR_X * ns["dict"]}


def layer_completion(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    """`weights_loaded` of buckets that each complete one layer, in the middle of a load (PARTIALLY_LOADED to
    PARTIALLY_LOADED: bookkeeping, one `layer_ready` event each), per bucket: audit off and audit on (JSON
    file). A 64-layer DFlash draft, 8 tensors per layer; CPU time, min over rounds."""
    model = DFlashQwen3Draft(DFlashConfig(num_hidden_layers=8 if quick else 64), name="layer-completion")
    weights = random_checkpoint(model, 0)
    lc = model.lifecycle
    per_layer = [list(names) for names in lc.readiness.tensors_of_layer.values()]
    for bucket in per_layer:
        apply_bucket(model, [(n, weights[n]) for n in bucket])
    model.finalize_loading()
    middle = per_layer[1:-1]
    log = tmp / "layer-completion.jsonl"
    rows = []
    for audit in ("off", "on (JSON file)"):
        configure_audit(console=False) if audit == "off" else configure_audit(json_path=log, console=False)

        def begin() -> None:
            if lc.can("weights_loaded"):  # the previous round's load: complete it
                lc.weights_loaded(per_layer[-1])
                lc.finalize_loading()
            lc.begin_reload()
            lc.weights_loaded(per_layer[0])

        def complete_layers(written: bool = audit != "off") -> None:
            for bucket in middle:
                lc.weights_loaded(bucket)
            if written:  # the held layer_ready events written, inside the timed part (amortized per layer)
                lc.flush_events()

        samples = common.interleaved([Arm("layers", complete_layers, begin)], 40 if not quick else 5,
                                     clock=time.thread_time)["layers"]
        us = min(samples) / len(middle) * 1e6
        rows.append({"audit": audit, "us": round(us, 2), "median_us": round(statistics.median(samples) / len(middle)
                                                                             * 1e6, 2),
                     "tensors_per_layer": len(middle[0]), "met": us <= TARGET_LAYER_US})
    configure_audit(console=False)
    return rows


class _Toggle:
    state: str


def event_costs(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    n = 200 if quick else 3000
    rows: list[dict[str, Any]] = []

    def add(what: str, cost: dict[str, float], note: str = "") -> None:
        rows.append({"what": what, **cost, "note": note})

    for cls in (Machine, LockedMachine):
        model = _Toggle()
        cls(model=model, states=["A", "B"], initial="A", auto_transitions=False,
            transitions=[{"trigger": "go", "source": "A", "dest": "B"}, {"trigger": "go", "source": "B", "dest": "A"}])
        add(f"transitions trigger ({cls.__name__})", common.per_call_us(model.go, number=n),  # type: ignore[attr-defined]
            "fired per load step (begin, first bucket, last layer, finish), never per bucket")

    lc = DFlashQwen3Draft(DFlashConfig(num_hidden_layers=2), name="events").lifecycle
    fields = {"trigger": "finalize_loading", "src": "FULLY_LOADED", "dst": "FINALIZED", "layers_ready": 3,
              "layers_total": 9, "duration_ms": 0.02}
    configure_audit(json_path=tmp / "events.jsonl", console=False)
    add("lifecycle event -> JSON-lines file", common.per_call_us(lambda: lc.audit_event("transition", **fields),
                                                                 number=n), "numbered, bounded, kept, written")
    add("layer_ready event -> JSON-lines file",
        common.per_call_us(lambda: lc._audit_layers("layer_ready", ["layers.1"], tensors=8), number=n),
        f"held, written {audit_events.HOLD_MAX} to a write(2) (amortized)")
    configure_audit(console=False)
    add("lifecycle event, audit off (kept in memory only)",
        common.per_call_us(lambda: lc.audit_event("transition", **fields), number=n), "numbered, bounded, kept")
    add("layer_ready event, audit off (kept in memory only)",
        common.per_call_us(lambda: lc._audit_layers("layer_ready", ["layers.1"], tensors=8), number=n),
        "held, built only when recent_events is read (never here)")
    layers = [f"layers.{i}" for i in range(64)]
    buckets = [([f"layers.{i}.w{j}" for j in range(8)], time.time_ns()) for i in range(64)]
    add("layer_ready event, audit off, a load's whole layers in one pass",
        {k: round(v / len(layers), 3) for k, v in common.per_call_us(
            lambda: lc._audit_whole_layers(layers, buckets, 0), number=max(n // 64, 10)).items()},
        "per event, 64 made in one call (as the loader reports whole layers)")
    add("debug event, filtered at info",
        common.per_call_us(lambda: lc.audit_event("loader_bucket", level="debug", **fields), number=n),
        "the level is checked before anything is built")
    return rows
