"""Tracking overhead: the safetensors loader WITH the lifecycle vs the same streaming and copying WITHOUT it.

    python -m benchmarks.tracking_overhead [--quick] [--repeats N] [--json PATH] [--threads T] [--shape NAME]
                                           [--device cpu|cuda]

Three drafts, each written once to a temp dir (/dev/shm when there is one: every round reads from memory):
  many-tensor  16 layers x 127 small tensors, fp32, 155 MB (an MoE-style draft: attention + 60 experts per layer)
  dflash-deep  the DFlash draft with 256 thin layers (8 tensors each), fp32, 152 MB: the per-layer worst case
  dflash-8x4k  a real-size DFlash draft: 8 layers, hidden 4096 (32 heads x 128, 8 KV heads), MLP 4096, bf16
Arms, interleaved round by round in one process after a warm-up round (page cache, allocator):
  baseline             checkpoint_index + plan_buckets + iter_buckets + write_tensor (+ the post-load hooks,
                       called directly): no lifecycle call at all
  lifecycle, audit on  begin_reload + load_safetensors + finalize_loading, audit events to a JSON-lines file
  lifecycle, audit off the same with audit events kept in memory only (console off, no file)
and, for a cold load (parameters on META, materialised by the loader), baseline vs lifecycle with audit on.
The drafts and both loaders are in `benchmarks.tracking_shapes`, the hot-path figures in
`benchmarks.tracking_hot_path`.
"Bookkeeping" is the lifecycle's own work measured with disk reads and tensor copies stubbed out in both arms,
in CPU time of this thread, min over rounds, divided by the fastest baseline round (a low-noise estimate of the
same difference).

Targets (issue 15), each printed against a figure measured in this run:
  end to end     lifecycle / baseline - 1 <= 2%, audit on, every shape, reload and cold load (the median of the
                 per-round ratios; of the CPU-time ratios when the machine was busy, both shown)
  per tensor     the readiness update of a bucket (`LayerReadiness.mark_loaded`), per tensor, within 2x of a dict
                 update per tensor (a function told each bucket, `loaded[name] = epoch` for each name in it), both
                 timed here on the same buckets
  per layer      a layer completion (`weights_loaded` of one layer's bucket: readiness, the bucket's `layer_ready`
                 event, no machine trigger) <= 5 us, audit off and audit on (JSON file)
  audit off      the events a load keeps in memory, at their measured cost, are not measurable: <= 0.2% of the load
                 (below the run-to-run spread of the loader itself)
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a file: python benchmarks/tracking_overhead.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from benchmarks.common import Arm
from benchmarks.stored import Summary, iqr, num, pct, verdict
from benchmarks.tracking_hot_path import (
    TARGET_LAYER_US,
    TARGET_PER_TENSOR_X,
    event_costs,
    layer_completion,
    per_tensor_update,
)
from benchmarks.tracking_shapes import (
    Shape,
    baseline_load,
    lifecycle_cold,
    lifecycle_reload,
    shapes,
    stubbed_io,
)
from lifecycle import DraftBackbone, Phase
from lifecycle import events as audit_events
from lifecycle.events import configure_audit
from lifecycle.loading import write_checkpoint
from lifecycle.readiness import layer_of
from lifecycle.testing import random_checkpoint

NAME = "tracking_overhead"
TARGET_OVERHEAD = 0.02  # end to end, audit on
TARGET_AUDIT_OFF = 0.002  # events kept with audit off, share of the load
REPEATS = 41
MEASURED = ("lifecycle", ":(exclude)lifecycle/vllm", ":(exclude)lifecycle/audit", "models",
            "benchmarks/tracking_overhead.py", "benchmarks/tracking_shapes.py", "benchmarks/tracking_hot_path.py")


# ---- main ------------------------------------------------------------------------------------------------------


def measure_shape(shape: Shape, tmp: Path, repeats: int, device: str = "cpu"
                  ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, int]]:
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
    lifecycle_cold(model, path, device)
    model.refresh_derived_buffers()
    live = {"m": model}  # dropped before the cold loads (the real-size draft holds 1.5 GB)
    del model
    reload_arms = [
        Arm("baseline", common.synced(lambda: baseline_load(live["m"], path, layer_map, Phase.RELOAD, device),
                                      device), audit_off),
        Arm("lifecycle, audit on", common.synced(lambda: lifecycle_reload(live["m"], path, device), device), audit_on),
        Arm("lifecycle, audit off", common.synced(lambda: lifecycle_reload(live["m"], path, device), device),
            audit_off),
    ]
    faults: dict[str, list[int]] = {}
    cpu: dict[str, list[float]] = {}
    samples = common.interleaved(reload_arms, repeats, faults=faults, cpu=cpu)
    audit_on()
    whole = live["m"].lifecycle._audit_whole_layers
    with mock.patch.object(live["m"].lifecycle, "_audit_whole_layers", wraps=whole) as in_one_pass:
        lifecycle_reload(live["m"], path, device)
    audit_off()
    # the layer_ready events this load made in one pass (its whole layers, reported after the writes); then the
    # mock and the bound method let go of the lifecycle: one kept alive until the cold loads claimed its name in
    # their audit file, and each of them collected garbage in full to find it alive (issue 33)
    in_one_pass_per_load = sum(len(c.args[0]) for c in in_one_pass.call_args_list)
    del whole, in_one_pass
    logged = audit_events.read_events(log)
    events_per_load = len(logged)
    kinds = dict(Counter(e["event"] for e in logged))
    # bookkeeping only: the same arms with reads from memory and no-op writes, in CPU time of this thread; the
    # minimum over repeats estimates the cost without interference from other tenants
    with stubbed_io(weights):
        stub = common.interleaved(reload_arms, max(repeats, 7), clock=time.thread_time)
    audit_off()
    update = per_tensor_update(live["m"], max(repeats, 7))
    del weights

    rows = []
    base = common.summarize(samples["baseline"])
    for arm in ("lifecycle, audit on", "lifecycle, audit off"):
        book_ms = (min(stub[arm]) - min(stub["baseline"])) * 1e3
        rows.append(_row(shape, "reload", arm, tensors, nbytes, layers, base, samples[arm], samples["baseline"],
                         book_ms, events_per_load, (faults["baseline"], faults[arm]), (cpu[arm], cpu["baseline"])))
        rows[-1]["layer_ready_in_one_pass"] = in_one_pass_per_load

    # cold load: a fresh model on META for every repeat (built untimed)
    holder: dict[str, DraftBackbone] = {}

    def fresh(audit_setup: Callable[[], None]) -> Callable[[], None]:
        def setup() -> None:
            holder.pop("m", None)
            gc.collect()  # the previous round's model freed before the next is built (never two 1.5 GB drafts)
            holder["m"] = shape.build()
            audit_setup()
        return setup

    named: set[str] = set()

    def cold_load(model: DraftBackbone) -> None:
        lifecycle_cold(model, path, device)
        named.add(model.lifecycle.name)  # a user's cold load: its own name, no other live backbone holds it

    live.clear()
    cold_arms = [
        Arm("baseline", common.synced(lambda: baseline_load(holder["m"], path, layer_map, Phase.COLD_LOAD, device),
                                      device), fresh(audit_off)),
        Arm("lifecycle, audit on", common.synced(lambda: cold_load(holder["m"]), device), fresh(audit_on)),
    ]
    cold_faults: dict[str, list[int]] = {}
    cold_cpu: dict[str, list[float]] = {}
    cold = common.interleaved(cold_arms, max(5, repeats), faults=cold_faults, cpu=cold_cpu)
    if named != {shape.name}:  # a live backbone of that name in the audit file: each load then paid a name clash
        raise RuntimeError(f"the cold arm measured a name clash, not a user's cold load: its lifecycles were named "
                           f"{sorted(named)} in the audit file, not {shape.name!r}")
    audit_off()
    holder.clear()
    path.unlink()
    rows.append(_row(shape, "cold", "lifecycle, audit on", tensors, nbytes, layers,
                     common.summarize(cold["baseline"]), cold["lifecycle, audit on"], cold["baseline"], None, None,
                     (cold_faults["baseline"], cold_faults["lifecycle, audit on"]),
                     (cold_cpu["lifecycle, audit on"], cold_cpu["baseline"])))
    return rows, {"shape": shape.name, **update}, kinds


def _row(shape: Shape, mode: str, arm: str, tensors: int, nbytes: int, layers: int, base: dict[str, float],
         samples: list[float], baseline_samples: list[float], bookkeeping_ms: float | None, events: int | None,
         faults: tuple[list[int], list[int]], cpu: tuple[list[float], list[float]]) -> dict[str, Any]:
    s = common.summarize(samples)
    paired = common.paired_ratio(samples, baseline_samples)
    paired_cpu = common.paired_ratio(*cpu)
    # against the fastest baseline round: the loader's time with the least interference from other tenants
    book = None if bookkeeping_ms is None else bookkeeping_ms / base["min_ms"]
    audit_on = arm.endswith("audit on")
    return {
        "shape": shape.name, "shape_note": shape.note, "mode": mode, "arm": arm, "tensors": tensors,
        "mb": round(nbytes / 1e6, 1), "layers": layers, "baseline": base, "lifecycle": s,
        "overhead_of_medians": round(s["median_ms"] / base["median_ms"] - 1, 4),
        "overhead_paired": {k: round(v - 1, 4) for k, v in paired.items()},
        "overhead_cpu": {k: round(v - 1, 4) for k, v in paired_cpu.items()},
        "bookkeeping_ms": None if bookkeeping_ms is None else round(bookkeeping_ms, 3),
        "bookkeeping_overhead": None if book is None else round(book, 4),
        "audit_events_per_load": events,
        # minor page faults per load, median (baseline, lifecycle): a difference is the allocator's, not the code's
        "page_faults_per_load": [int(statistics.median(f)) for f in faults],
        "target_overhead": TARGET_OVERHEAD,
        "met_end_to_end": paired["median"] - 1 <= TARGET_OVERHEAD,
        "end_to_end_is_target": audit_on,  # the target is set with audit on; audit off is shown beside it
        "met_bookkeeping": None if book is None else book <= TARGET_OVERHEAD,
    }


def audit_off_share(rows: list[dict[str, Any]], kinds: dict[str, dict[str, int]], costs: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """Per shape: what the events of one load cost with audit off (kept in memory only), each kind at its measured
    cost (a layer_ready event, or any other lifecycle event), as a share of the loader's fastest round."""
    ready_us = next(c["min_us"] for c in costs if c["what"] == "layer_ready event, audit off (kept in memory only)")
    batched_us = next(c["min_us"] for c in costs if c["what"].endswith("whole layers in one pass"))
    other_us = next(c["min_us"] for c in costs if c["what"].startswith("lifecycle event, audit off"))
    out = []
    for r in rows:
        if r["mode"] == "reload" and r["arm"] == "lifecycle, audit on":
            k = kinds[r["shape"]]
            batched = r["layer_ready_in_one_pass"]
            ready = k.get("layer_ready", 0)
            ms = (batched * batched_us + (ready - batched) * ready_us + (sum(k.values()) - ready) * other_us) / 1e3
            share = ms / r["baseline"]["min_ms"]
            out.append({"shape": r["shape"], "events": sum(k.values()), "layer_ready": ready,
                        "layer_ready_in_one_pass": batched, "ms": round(ms, 3),
                        "share": round(share, 5), "met": share <= TARGET_AUDIT_OFF})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    # 41 rounds: a 2% target against rounds that move by several percent on a shared machine needs the median of
    # many paired ratios (the real-size draft runs half as many: it reads 1.5 GB a round)
    p = common.parser(NAME, __doc__.splitlines()[0], repeats=REPEATS)
    common.add_device_argument(p)
    p.add_argument("--shape", action="append", default=None, choices=[s.name for s in shapes(False)],
                   help="only this draft (repeatable; default: all three)")
    args = p.parse_args(argv)
    repeats = common.setup_run(args, default_repeats=REPEATS)
    info = common.machine_info()
    common.say(f"tracking overhead: loader with the lifecycle vs without ({'quick' if args.quick else 'full'} run, "
               f"{repeats} interleaved repeats per arm, tensors on {args.device})")
    common.say(common.machine_line(info))
    with common.scratch("bench-tracking-") as d:
        tmp = Path(d)
        rows: list[dict[str, Any]] = []
        updates: list[dict[str, Any]] = []
        kinds: dict[str, dict[str, int]] = {}
        for shape in [s for s in shapes(args.quick) if args.shape is None or s.name in args.shape]:
            common.say(f"  measuring {shape.name}: {shape.note} ...")
            shape_rows, update, kinds[shape.name] = measure_shape(shape, tmp, max(3, round(repeats * shape.repeats)),
                                                                  args.device)
            rows.extend(shape_rows)
            updates.append(update)
        completion = layer_completion(tmp, args.quick)
        costs = event_costs(tmp, args.quick)
    configure_audit(console=False)
    common.finish(info)
    judged_on = "CPU time (MACHINE BUSY)" if common.busy(info) else "wall time"
    for r in rows:  # other tenants inflate wall time far more than the loaders' CPU time
        r["met_end_to_end"] = r["overhead_cpu" if common.busy(info) else "overhead_paired"]["median"] <= TARGET_OVERHEAD
        r["judged_on"] = judged_on
    off = audit_off_share(rows, kinds, costs)

    common.say("\n1. end to end: loader time, median ms (min-max); overhead = lifecycle / baseline - 1, the median of "
               f"the per-round ratios (IQR), in wall and in CPU time. Target: <= +2.0% with audit on, judged on the "
               f"{judged_on} ratio.\n   bookkeeping = the lifecycle's own "
               "CPU work (I/O and copies stubbed out, min over rounds) / baseline min.\n   page faults/load = minor "
               "page faults of a load, median, baseline / lifecycle: where they differ, the allocator gave a buffer "
               "back between rounds in one arm (its pages are faulted in again), not the lifecycle's own work.")
    common.say(common.table(
        ["draft", "load", "arm", "tensors", "MB", "layers", "baseline ms", "lifecycle ms", "overhead (IQR)",
         "CPU time: overhead (IQR)", "target", "bookkeeping", "events/load", "page faults/load"],
        [[r["shape"], r["mode"], r["arm"], r["tensors"], r["mb"], r["layers"],
          f"{r['baseline']['median_ms']:.1f} ({common.spread(r['baseline'])})",
          f"{r['lifecycle']['median_ms']:.1f} ({common.spread(r['lifecycle'])})",
          iqr(r["overhead_paired"], pct), iqr(r["overhead_cpu"], pct),
          verdict(r["met_end_to_end"]) if r["end_to_end_is_target"] else "(shown)",
          "-" if r["bookkeeping_ms"] is None else f"{r['bookkeeping_ms']:.2f} ms = {pct(r['bookkeeping_overhead'])}",
          r["audit_events_per_load"] if r["audit_events_per_load"] is not None else "-",
          "{} / {}".format(*r["page_faults_per_load"])] for r in rows]))
    common.say(f"\n2. per tensor: the readiness update of a load's buckets (one per layer) vs a dict update per tensor "
               f"of the same buckets; ns per tensor, CPU time, min over rounds. Target: <= {TARGET_PER_TENSOR_X:g}x.")
    common.say(common.table(
        ["draft", "tensors", "buckets", "readiness ns", "dict update ns", "x dict", "target"],
        [[u["shape"], u["tensors"], u["buckets"], u["readiness_ns"], u["dict_ns"], f"{u['ratio']:.2f}",
          verdict(u["met"])] for u in updates]))
    common.say(f"\n3. per layer completion: weights_loaded of one layer's bucket ({completion[0]['tensors_per_layer']} "
               f"tensors) in the middle of a load, us, CPU time, min (median) over rounds. Target: <= "
               f"{TARGET_LAYER_US:g} us.")
    common.say(common.table(["audit", "us per layer", "median", "target"],
                            [[c["audit"], c["us"], c["median_us"], verdict(c["met"])] for c in completion]))
    common.say("\n4. audit off: a load's events, kept in memory only, each kind at its cost below (layer_ready, or any "
               f"other), as a share of the load. Target: <= {100 * TARGET_AUDIT_OFF:.1f}% (not measurable end to end).")
    common.say(common.table(["draft", "events/load", "of them layer_ready", "made in one pass", "ms",
                             "share of the load", "target"],
                            [[o["shape"], o["events"], o["layer_ready"], o["layer_ready_in_one_pass"], o["ms"],
                              f"{100 * o['share']:.3f}%",
                              verdict(o["met"])] for o in off]))
    common.say("\nper-event costs, us (median of 5 batches; min)")
    common.say(common.table(["what", "median us", "min us", "note"],
                            [[c["what"], c["median_us"], c["min_us"], c["note"]] for c in costs]))
    targets = ([r["met_end_to_end"] for r in rows if r["end_to_end_is_target"]] + [u["met"] for u in updates]
               + [c["met"] for c in completion] + [o["met"] for o in off])
    common.say(f"\nTARGETS: {sum(targets)} of {len(targets)} met" + ("" if all(targets) else " (see MISSED above)"))
    common.say("\n" + common.end_line(info))
    common.say(common.noise_note(info))
    common.store(args, NAME, {
        "repeats": repeats, "device": args.device, "target_overhead": TARGET_OVERHEAD, "rows": rows,
        "per_tensor": updates, "layer_completion": completion, "audit_off": off, "event_kinds_per_load": kinds,
        "event_costs": costs, "targets_met": sum(targets), "targets": len(targets)},
        info, summary(rows, updates, completion, off, costs), MEASURED)
    return 0


def summary(rows: list[dict[str, Any]], updates: list[dict[str, Any]], completion: list[dict[str, Any]],
            off: list[dict[str, Any]], costs: list[dict[str, Any]]) -> Summary:
    out = Summary()
    out.table(["draft", "load", "arm", "tensors", "MB", "layers", "baseline ms (min-max)", "lifecycle ms (min-max)",
               "overhead (IQR)", "CPU time: overhead (IQR)", "target", "bookkeeping", "page faults / load"],
              [(r["shape"], r["mode"], r["arm"], r["tensors"], r["mb"], r["layers"], common.ms(r["baseline"]),
                common.ms(r["lifecycle"]), iqr(r["overhead_paired"], pct), iqr(r["overhead_cpu"], pct),
                verdict(r["met_end_to_end"]) if r["end_to_end_is_target"] else "(shown)",
                "-" if r["bookkeeping_ms"] is None else f"{num(r['bookkeeping_ms'])} ms",
                " / ".join(num(v) for v in r["page_faults_per_load"])) for r in rows])
    out.table(["what", "median µs", "min µs", "note"], [(c["what"], c["median_us"], c["min_us"], c["note"])
                                                       for c in costs], title="Per event:")
    if rows:
        out.note(f"End to end judged on the {rows[0]['judged_on']} ratios (the median of the per-round ratios).")
    for r in rows:
        if r["end_to_end_is_target"]:
            out.target(f"tracking <= {pct(TARGET_OVERHEAD)} end to end, {r['shape']} {r['mode']} ({r['arm']})",
                       f"{pct(r['overhead_paired']['median'])} (CPU time {pct(r['overhead_cpu']['median'])})",
                       r["met_end_to_end"])
    for u in updates:
        out.target(f"bookkeeping per tensor within {TARGET_PER_TENSOR_X:g}x a dict update, {u['shape']}",
                   f"{num(u['ratio'])}x", u["met"])
    for c in completion:
        out.target(f"per layer completion <= {TARGET_LAYER_US:g} µs, audit {c['audit']}", f"{num(c['us'])} µs",
                   c["met"])
    for o in off:
        out.target(f"audit off: <= {100 * TARGET_AUDIT_OFF:.1f}% of a load, {o['shape']}", f"{o['share'] * 100:.3f}%",
                   o["met"])
    return out


if __name__ == "__main__":
    sys.exit(main())
