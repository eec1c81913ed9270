"""Tracking overhead: the safetensors loader WITH the lifecycle vs the same streaming and copying WITHOUT it.

    python -m benchmarks.tracking_overhead [--quick] [--repeats N] [--json PATH] [--threads T]

Two realistic-size drafts (>= 100 MB of fp32 weights, >= 2,000 tensors, 8+ layers), each written once to a temp
dir:
  many-tensor  16 layers x 127 small tensors (an MoE-style draft: attention + 60 experts per layer)
  dflash-deep  the DFlash draft with 256 thin layers (8 tensors each): the per-layer-completion worst case
Arms, interleaved round by round in one process after a warm-up round (page cache, allocator):
  baseline             checkpoint_index + plan_buckets + iter_buckets + write_tensor: no lifecycle call at all
  lifecycle, audit on  begin_reload + load_safetensors + finalize_loading, audit events to a JSON-lines file
  lifecycle, audit off the same with audit events dropped (console off, no file)
and, for a cold load (parameters on META, materialised by the loader), baseline vs lifecycle with audit on.
"Bookkeeping only" is the lifecycle's own work measured with disk reads and tensor copies stubbed out in both
arms, in CPU time of this thread, min over rounds, divided by the fastest baseline round (a low-noise estimate
of the same difference). Checkpoints go to /dev/shm when there is one (every round reads from memory).
Per-event costs: a `transitions` trigger, a structlog event (JSON file / dropped / filtered), a readiness update,
a layer completion, the META scan.
Target (ARCHITECTURE.md): tracking adds at most 2% to the loader's time.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a file: python benchmarks/tracking_overhead.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transitions import Machine
from transitions.extensions import LockedMachine

from benchmarks import common
from benchmarks.common import Arm, ManyTensorConfig, ManyTensorDraft
from lifecycle import DraftBackbone, Phase
from lifecycle import events as audit_events
from lifecycle.events import configure_audit
from lifecycle.loading import (
    IndexEntry,
    apply_bucket,
    checkpoint_index,
    iter_buckets,
    load_safetensors,
    plan_buckets,
    write_checkpoint,
    write_tensor,
)
from lifecycle.readiness import LayerReadiness, layer_of
from lifecycle.testing import random_checkpoint
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

NAME = "tracking_overhead"
TARGET_OVERHEAD = 0.02


@dataclass
class Shape:
    name: str
    build: Callable[[], DraftBackbone]
    note: str


def shapes(quick: bool) -> list[Shape]:
    if quick:
        mt = ManyTensorConfig(hidden_size=32, num_hidden_layers=2, num_experts=4, expert_intermediate_size=8,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        df = DFlashConfig(num_hidden_layers=4)
    else:
        mt = ManyTensorConfig()
        df = DFlashConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=256, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64)
    return [
        Shape("many-tensor", lambda: ManyTensorDraft(mt, name="many-tensor"),
              f"{mt.num_hidden_layers} layers x {7 + 2 * mt.num_experts} tensors (MoE-style)"),
        Shape("dflash-deep", lambda: DFlashQwen3Draft(df, name="dflash-deep"),
              f"DFlash, {df.num_hidden_layers} layers x 8 tensors, hidden {df.hidden_size}"),
    ]


# ---- the two loaders -------------------------------------------------------------------------------------------


def baseline_load(model: DraftBackbone, path: Path, layer_map: dict[str, str], phase: Phase) -> int:
    """The same streaming and copying as `load_safetensors(bucket_by="layer")`, and the same post-load hooks the
    lifecycle runs in `finalize_loading` (called directly), with no lifecycle call. `layer_map` (name -> layer,
    built once, as the lifecycle's readiness map is) groups the buckets."""
    index = checkpoint_index(path)
    buckets = plan_buckets(list(index), layer_map.__getitem__, bucket_by="layer")
    n = 0
    for bucket in iter_buckets(index, buckets):
        for name, value in bucket:
            write_tensor(model, name, value, "cpu")
        n += len(bucket)
    for hook in model.post_load_hooks(phase):
        hook.fn(model)
    return n


def lifecycle_reload(model: DraftBackbone, path: Path) -> None:
    model.begin_reload()
    load_safetensors(model, path, bucket_by="layer")
    model.finalize_loading()


def lifecycle_cold(model: DraftBackbone, path: Path) -> None:
    load_safetensors(model, path, bucket_by="layer")
    model.finalize_loading()


@contextmanager
def stubbed_io(tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Disk reads come from memory and writes do nothing, in the loader and the baseline alike: what is left of
    the loader's time is the lifecycle's bookkeeping (validation, readiness, triggers, events)."""

    def from_memory(index: dict[str, IndexEntry], buckets: Sequence[Sequence[str]]
                    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in buckets:
            yield [(n, tensors[n]) for n in bucket]

    def no_write(module: torch.nn.Module, name: str, value: torch.Tensor, device: object) -> None:
        return None

    with mock.patch("lifecycle.loading.iter_buckets", from_memory), \
            mock.patch("lifecycle.loading.write_tensor", no_write), \
            mock.patch(f"{__name__}.iter_buckets", from_memory), \
            mock.patch(f"{__name__}.write_tensor", no_write):
        yield


# ---- per-event costs -------------------------------------------------------------------------------------------


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
            "anchor: ~12 us (Machine), ~80 us (LockedMachine)")

    fields = {"backbone": "draft", "rank": 0, "epoch": 1, "trigger": "weights_loaded", "src": "PARTIALLY_LOADED",
              "dst": "PARTIALLY_LOADED", "layers_ready": 3, "layers_total": 9, "duration_ms": 0.02}
    configure_audit(json_path=tmp / "events.jsonl", console=False)
    add("structlog event -> JSON-lines file",
        common.per_call_us(lambda: audit_events.emit("transition", **fields), number=n), "anchor: ~18 us")
    configure_audit(console=False)
    add("structlog event, audit off (dropped)",
        common.per_call_us(lambda: audit_events.emit("transition", **fields), number=n))
    add("structlog debug event (filtered at info)",
        common.per_call_us(lambda: audit_events.emit("loader_bucket", level="debug", **fields), number=n))

    names = [f"layers.{i}.w{j}" for i in range(16) for j in range(128)]
    readiness = LayerReadiness(names)

    def mark_all() -> None:
        readiness.new_epoch()
        for name in names:
            readiness.mark_loaded((name,))

    per_epoch = common.per_call_us(mark_all, number=max(2, n // 500))
    add("readiness update (per tensor)", {k: round(v / len(names), 3) for k, v in per_epoch.items()},
        "anchor: ~0.1 us for a dict update; this is mark_loaded((name,)) per tensor")

    layers = 8 if quick else 64
    model = DFlashQwen3Draft(DFlashConfig(num_hidden_layers=layers), name="events")
    weights = random_checkpoint(model, 0)
    lc = model.lifecycle
    per_layer = [list(names) for names in lc.readiness.tensors_of_layer.values()]
    for bucket in per_layer:
        apply_bucket(model, [(n, weights[n]) for n in bucket])
    model.finalize_loading()

    def reload_counts_only() -> None:
        lc.begin_reload()
        for bucket in per_layer:
            lc.weights_loaded(bucket)
        lc.finish_loading()

    cost = common.per_call_us(reload_counts_only, number=max(2, n // 200))
    add("layer completion: weights_loaded(layer) incl. trigger + 2 events, audit off",
        {k: round(v / len(per_layer), 3) for k, v in cost.items()}, f"{len(per_layer)} layers; includes begin/finish")
    scan = common.per_call_us(lc.missing, number=max(2, n // 200))
    add("META scan (readiness.missing incl. is_meta), per tensor",
        {k: round(v / len(weights), 3) for k, v in scan.items()}, f"runs in finish_loading and refresh guards; "
        f"{len(weights)} tensors")
    return rows


# ---- main ------------------------------------------------------------------------------------------------------


def measure_shape(shape: Shape, tmp: Path, repeats: int) -> list[dict[str, Any]]:
    model = shape.build()
    weights = random_checkpoint(model, 0)
    path = write_checkpoint(weights, tmp / f"{shape.name}.safetensors")
    tensors, nbytes = len(weights), common.checkpoint_bytes(weights)
    layers = model.lifecycle.readiness.layers_total
    layer_map = {n: layer_of(n) for n in weights}
    log = tmp / f"{shape.name}.audit.jsonl"

    def audit_on() -> None:
        configure_audit(console=False)
        log.unlink(missing_ok=True)
        configure_audit(json_path=log, console=False)

    def audit_off() -> None:
        configure_audit(console=False)

    audit_off()
    lifecycle_cold(model, path)
    model.refresh_derived_buffers()
    reload_arms = [
        Arm("baseline", lambda: baseline_load(model, path, layer_map, Phase.RELOAD), audit_off),
        Arm("lifecycle, audit on", lambda: lifecycle_reload(model, path), audit_on),
        Arm("lifecycle, audit off", lambda: lifecycle_reload(model, path), audit_off),
    ]
    samples = common.interleaved(reload_arms, repeats)
    audit_on()
    lifecycle_reload(model, path)
    audit_off()
    events_per_load = len(audit_events.read_events(log))
    # bookkeeping only: the same arms with reads from memory and no-op writes, in CPU time of this thread; the
    # minimum over repeats estimates the cost without interference from other tenants
    with stubbed_io(weights):
        stub = common.interleaved(reload_arms, repeats, clock=time.thread_time)
    audit_off()

    rows = []
    base = common.summarize(samples["baseline"])
    for arm in ("lifecycle, audit on", "lifecycle, audit off"):
        book_ms = (min(stub[arm]) - min(stub["baseline"])) * 1e3
        rows.append(_row(shape, "reload", arm, tensors, nbytes, layers, base, samples[arm], samples["baseline"],
                         book_ms, events_per_load))

    # cold load: a fresh model on META for every repeat (built untimed)
    holder: dict[str, DraftBackbone] = {}

    def fresh(audit_setup: Callable[[], None]) -> Callable[[], None]:
        def setup() -> None:
            holder.pop("m", None)
            holder["m"] = shape.build()
            audit_setup()
        return setup

    cold_arms = [
        Arm("baseline", lambda: baseline_load(holder["m"], path, layer_map, Phase.COLD_LOAD), fresh(audit_off)),
        Arm("lifecycle, audit on", lambda: lifecycle_cold(holder["m"], path), fresh(audit_on)),
    ]
    cold = common.interleaved(cold_arms, max(3, repeats // 2))
    audit_off()
    holder.clear()
    rows.append(_row(shape, "cold", "lifecycle, audit on", tensors, nbytes, layers,
                     common.summarize(cold["baseline"]), cold["lifecycle, audit on"], cold["baseline"], None, None))
    return rows


def _row(shape: Shape, mode: str, arm: str, tensors: int, nbytes: int, layers: int, base: dict[str, float],
         samples: list[float], baseline_samples: list[float], bookkeeping_ms: float | None, events: int | None
         ) -> dict[str, Any]:
    s = common.summarize(samples)
    paired = common.paired_ratio(samples, baseline_samples)
    # against the fastest baseline round: the loader's time with the least interference from other tenants
    book = None if bookkeeping_ms is None else bookkeeping_ms / base["min_ms"]
    return {
        "shape": shape.name, "shape_note": shape.note, "mode": mode, "arm": arm, "tensors": tensors,
        "mb": round(nbytes / 1e6, 1), "layers": layers, "baseline": base, "lifecycle": s,
        "overhead_of_medians": round(s["median_ms"] / base["median_ms"] - 1, 4),
        "overhead_paired": {k: round(v - 1, 4) for k, v in paired.items()},
        "bookkeeping_ms": None if bookkeeping_ms is None else round(bookkeeping_ms, 3),
        "bookkeeping_overhead": None if book is None else round(book, 4),
        "audit_events_per_load": events,
        "target_overhead": TARGET_OVERHEAD,
        "met_end_to_end": paired["median"] - 1 <= TARGET_OVERHEAD,
        "met_bookkeeping": None if book is None else book <= TARGET_OVERHEAD,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser(NAME, __doc__.splitlines()[0], repeats=15).parse_args(argv)
    repeats = common.setup_run(args, default_repeats=15)
    info = common.machine_info()
    common.say(f"tracking overhead: loader with the lifecycle vs without ({'quick' if args.quick else 'full'} run, "
               f"{repeats} interleaved repeats per arm)")
    common.say(common.machine_line(info))
    with tempfile.TemporaryDirectory(prefix="bench-tracking-", dir=common.scratch_dir()) as d:
        tmp = Path(d)
        rows: list[dict[str, Any]] = []
        for shape in shapes(args.quick):
            common.say(f"  measuring {shape.name}: {shape.note} ...")
            rows.extend(measure_shape(shape, tmp, repeats))
        costs = event_costs(tmp, args.quick)
    configure_audit(console=False)
    common.finish(info)

    pct = lambda x: f"{100 * x:+.1f}%"  # noqa: E731
    verdict = lambda ok: "-" if ok is None else ("met" if ok else "MISSED")  # noqa: E731
    common.say("\nloader time, median ms (min-max). overhead = lifecycle / baseline - 1, the median of the per-round "
               "ratios (IQR);\nbookkeeping = the lifecycle's own CPU work (I/O and copies stubbed out, min over "
               "rounds) / baseline min. Target: <= +2.0%.")
    common.say(common.table(
        ["draft", "load", "arm", "tensors", "MB", "layers", "baseline ms", "lifecycle ms", "overhead (IQR)",
         "e2e target", "bookkeeping", "bk target", "events/load"],
        [[r["shape"], r["mode"], r["arm"], r["tensors"], r["mb"], r["layers"],
          f"{r['baseline']['median_ms']:.1f} ({common.spread(r['baseline'])})",
          f"{r['lifecycle']['median_ms']:.1f} ({common.spread(r['lifecycle'])})",
          f"{pct(r['overhead_paired']['median'])} ({pct(r['overhead_paired']['p25'])}.."
          f"{pct(r['overhead_paired']['p75'])})",
          verdict(r["met_end_to_end"]),
          "-" if r["bookkeeping_ms"] is None else f"{r['bookkeeping_ms']:.2f} ms = {pct(r['bookkeeping_overhead'])}",
          verdict(r["met_bookkeeping"]),
          r["audit_events_per_load"] if r["audit_events_per_load"] is not None else "-"] for r in rows]))
    common.say("\nper-event costs, us (median of 5 batches; min)")
    common.say(common.table(["what", "median us", "min us", "note"],
                            [[c["what"], c["median_us"], c["min_us"], c["note"]] for c in costs]))
    common.say("\n" + common.end_line(info))
    out = common.write_json(common.json_path(args, NAME), {
        "benchmark": NAME, "quick": args.quick, "repeats": repeats, "machine": info,
        "target_overhead": TARGET_OVERHEAD, "rows": rows, "event_costs": costs})
    common.say(f"JSON: {out}")
    common.write_transcript(out.with_suffix(".txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
