"""Where the tracking benchmark's end-to-end difference goes: the loader's steps timed one by one, in a real reload.

    python -m benchmarks.tracking_breakdown [--quick] [--repeats N] [--json PATH] [--threads T] [--shape NAME]

The shapes and the two loaders of `benchmarks.tracking_overhead` (`benchmarks.tracking_shapes`; baseline: no
lifecycle call; lifecycle: `begin_reload` + `load_safetensors` + `finalize_loading`, audit to a JSON-lines file),
with every step wrapped in a wall-clock timer: the header index, the bucket plan, the reads, the file checks, the
writes (shared by both loaders) and the lifecycle's own steps (`begin_reload`, `validate_index`, `weights_loaded`:
the reports of the buckets, which the loader makes after writing them, `finalize_loading`). Median ms per load over
the rounds, arms alternated. The timers cost about a microsecond a call, in both arms alike.

It shows what the stubbed "bookkeeping" figure of `tracking_overhead` leaves out: the same Python steps run
slower when they alternate with the loader's copies (each bucket's reads and writes stream the checkpoint through
the caches, and the lifecycle's tables are cold again at the next bucket) than in a loop of their own.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a file: python benchmarks/tracking_breakdown.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from benchmarks import tracking_shapes as tracking
from benchmarks.stored import Summary, num
from lifecycle import Phase, checkpoint, loading
from lifecycle.backbone import DraftBackbone
from lifecycle.events import configure_audit
from lifecycle.readiness import layer_of
from lifecycle.testing import random_checkpoint

NAME = "tracking_breakdown"
MEASURED = ("lifecycle", ":(exclude)lifecycle/vllm", ":(exclude)lifecycle/audit", "models",
            "benchmarks/tracking_breakdown.py", "benchmarks/tracking_shapes.py")
SHARED = ("index", "plan", "reads", "file checks", "writes")
OWN = ("begin_reload", "validate_index", "weights_loaded", "finalize_loading")


@contextmanager
def timed_steps(spent: dict[str, float]) -> Iterator[None]:
    """Every step wrapped where both loaders look it up; `spent[step]` sums its wall time."""

    def timer(step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[step] = spent.get(step, 0.0) + time.perf_counter() - t0
        return run

    index = timer("index", checkpoint.checkpoint_index)
    plan = timer("plan", loading.plan_buckets)
    write = timer("writes", loading.write_tensor)
    patches = [
        ("lifecycle.loading.load.checkpoint_index", index), ("benchmarks.tracking_shapes.checkpoint_index", index),
        ("lifecycle.loading.load.plan_buckets", plan), ("benchmarks.tracking_shapes.plan_buckets", plan),
        ("lifecycle.loading.write.write_tensor", write), ("benchmarks.tracking_shapes.write_tensor", write),
        ("lifecycle.checkpoint._read_tensor", timer("reads", checkpoint._read_tensor)),
        ("lifecycle.loading.load.validate_index", timer("validate_index", loading.validate_index)),
        # the loader tells the lifecycle about its buckets here, after writing them (one or two calls a load)
        ("lifecycle.loading.load._report_written", timer("weights_loaded", loading.load._report_written)),
    ]
    methods = [
        (checkpoint._OpenFile, "check", "file checks"),
        (DraftBackbone, "begin_reload", "begin_reload"),
        (DraftBackbone, "finalize_loading", "finalize_loading"),
    ]
    with ExitStack() as stack:
        for target, fn in patches:
            stack.enter_context(mock.patch(target, fn))
        for owner, attr, step in methods:
            stack.enter_context(mock.patch.object(owner, attr, timer(step, getattr(owner, attr))))
        yield


def measure(shape: tracking.Shape, tmp: Path, repeats: int) -> dict[str, Any]:
    model = shape.build()
    weights = random_checkpoint(model, 0)
    path = loading.write_checkpoint(weights, tmp / f"{shape.name}.safetensors")
    layer_map = {n: layer_of(n) for n in weights}
    tensors = len(weights)
    del weights
    configure_audit(console=False)
    tracking.lifecycle_cold(model, path)
    model.refresh_derived_buffers()
    log = tmp / f"{shape.name}.audit.jsonl"
    loaders = {"baseline": lambda: tracking.baseline_load(model, path, layer_map, Phase.RELOAD),
               "lifecycle": lambda: tracking.lifecycle_reload(model, path)}
    samples: dict[str, dict[str, list[float]]] = {arm: {} for arm in loaders}
    for round_ in range(repeats + 1):  # round 0 warms up (page cache, allocator)
        for arm, load in loaders.items():
            if arm == "lifecycle":
                log.unlink(missing_ok=True)
                configure_audit(json_path=log, console=False)
            spent: dict[str, float] = {}
            with timed_steps(spent):
                t0 = time.perf_counter()
                load()
                spent["total"] = time.perf_counter() - t0
            configure_audit(console=False)
            if round_:
                for step, s in spent.items():
                    samples[arm].setdefault(step, []).append(s)
    med = {arm: {step: statistics.median(v) * 1e3 for step, v in steps.items()} for arm, steps in samples.items()}
    for steps in med.values():
        steps["rest"] = steps["total"] - sum(v for k, v in steps.items() if k != "total")
    return {"shape": shape.name, "note": shape.note, "tensors": tensors, "ms": med}


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(NAME, __doc__.splitlines()[0], repeats=11)
    p.add_argument("--shape", action="append", default=None, choices=[s.name for s in tracking.shapes(False)],
                   help="measure only this shape (repeatable; default: many-tensor and dflash-deep)")
    args = p.parse_args(argv)
    repeats = common.setup_run(args, default_repeats=11)
    info = common.machine_info()
    wanted = args.shape or ["many-tensor", "dflash-deep"]
    common.say(f"tracking breakdown: each step of a reload timed, baseline vs lifecycle (audit on) "
               f"({'quick' if args.quick else 'full'} run, {repeats} rounds)")
    common.say(common.machine_line(info))
    results = []
    with common.scratch("bench-breakdown-") as d:
        for shape in tracking.shapes(args.quick):
            if shape.name in wanted:
                common.say(f"  measuring {shape.name}: {shape.note} ...")
                results.append(measure(shape, Path(d), repeats))
    info = common.finish(info)
    for r in results:
        base, life = r["ms"]["baseline"], r["ms"]["lifecycle"]
        own = sum(life.get(s, 0.0) for s in OWN)
        common.say(f"\n{r['shape']} ({r['tensors']} tensors): median ms per load; 'rest' is the loop around the steps")
        rows = [[step, f"{base.get(step, 0.0):.2f}" if step not in OWN else "-", f"{life.get(step, 0.0):.2f}",
                 f"{life.get(step, 0.0) - base.get(step, 0.0):+.2f}" if step not in OWN else f"{life[step]:+.2f}"]
                for step in (*SHARED, *OWN, "rest", "total")]
        common.say(common.table(["step", "baseline", "lifecycle", "difference"], rows))
        common.say(f"lifecycle's own steps: {own:.2f} ms = {100 * own / base['total']:.1f}% of the baseline load; "
                   f"end to end {100 * (life['total'] / base['total'] - 1):+.1f}%")
        r["own_ms"] = round(own, 3)
    common.say("\n" + common.end_line(info))
    common.say(common.noise_note(info))
    common.store(args, NAME, {"repeats": repeats, "shapes": results}, info, summary(results), MEASURED)
    return 0


def summary(results: list[dict[str, Any]]) -> Summary:
    out = Summary()
    steps: list[str] = []
    for shape in results:
        for arm in ("baseline", "lifecycle"):
            steps += [s for s in shape["ms"][arm] if s not in steps]
    steps = [s for s in steps if s not in ("rest", "total")] + ["rest", "total"]
    out.table(["step"] + [f"{s['shape']}: {arm}" for s in results for arm in ("baseline", "lifecycle")],
              [[step] + [num(s["ms"][arm].get(step)) for s in results for arm in ("baseline", "lifecycle")]
               for step in steps])
    own = ", ".join(f"{s['shape']} {num(s['own_ms'])} ms" for s in results)
    out.note(f"The lifecycle's own steps per reload: {own}.")
    return out


if __name__ == "__main__":
    sys.exit(main())
