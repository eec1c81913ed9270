"""The push of `benchmarks.engine_push` for the standalone draft families, on a device (CUDA; no vLLM there).

    python -m benchmarks.gpu_push [--device cuda|cpu] [--quick] [--repeats N] [--json PATH]

`benchmarks.gpu_check` runs it on CUDA next to the tracking and refresh benchmarks (`gpu_push.json`). For each
family in `models.FAMILIES` (its tiny sizes: the fixed cost) and a DFlash draft of real width (hidden 2048, 8
layers: `benchmarks.refresh.big_config`), graphs captured (pinned), a push of checkpoint B then A, alternating:
`begin_reload` -> `load_safetensors` (buckets: the whole file, one layer, one tensor) -> `finalize_loading` ->
`refresh_derived_buffers` (in place, pins verified), synchronized. The push writes each value straight into the
tensor the model serves (`write_tensor`: one copy, host to device) from one read buffer kept from push to push
(`lifecycle.checkpoint.ReadBuffer`), pinned host memory on CUDA: the plugin's push inside vLLM does the same
(`lifecycle.vllm.reload.direct`, `.staging`). The floor, interleaved with it round by round: the same safetensors
bytes read bucket by bucket into one reused pinned host buffer, copied once into tensors of the same shapes on the
device, and each derived buffer written once. Targets (issue 33), on the real-width draft: whole-file and one-layer
buckets <= 1.2x the floor, one-tensor buckets <= 1.5x; the per-round ratio and the CPU-time ratio side by side.
Without CUDA it prints SKIPPED and exits 0 (`--device cpu` runs it on the CPU).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python benchmarks/gpu_push.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import common
from benchmarks.common import Arm
from benchmarks.refresh import big_config
from benchmarks.stored import Summary, iqr, num, verdict
from lifecycle import DraftBackbone
from lifecycle.checkpoint import ReadBuffer, checkpoint_index
from lifecycle.events import configure_audit
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.read_buffers import MappedBuffer, padded
from models import FAMILIES, DraftFamily

NAME = "gpu_push"
REPEATS = 7
BUCKETS = {"whole": None, "layer": "layer", "tensor": 1}  # None: one bucket of every tensor
TARGETS = {"whole": 1.2, "layer": 1.2, "tensor": 1.5}
MEASURED = ("lifecycle", ":(exclude)lifecycle/vllm", ":(exclude)lifecycle/audit", "models", "benchmarks/gpu_push.py")
REAL_WIDTH = "dflash (real width)"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Floor:
    """What a push cannot beat (see the module docstring); its destinations and staging buffer made once."""

    def __init__(self, model: DraftBackbone, path: Path, device: str) -> None:
        self.index = checkpoint_index(path)
        self.device = device
        self.dest = {n: torch.empty(e.shape, dtype=e.dtype, device=device) for n, e in self.index.items()}
        pin = device.startswith("cuda")
        self.staging = MappedBuffer(torch.empty(sum(padded(e.nbytes) for e in self.index.values()),
                                                dtype=torch.uint8, pin_memory=pin))
        derived = [t for n in model.derived_buffer_names() if (t := model._buffers.get(n)) is not None]
        self.fused = [(torch.empty_like(t), t) for t in derived]

    def run(self, buckets: Sequence[Sequence[str]]) -> None:
        fds: dict[Path, int] = {}
        try:
            for names in buckets:
                views = common.read_floor_bucket(self.index, names, self.staging, fds)
                for name, value in views:
                    self.dest[name].copy_(value)
                _sync(self.device)  # the staging buffer is reused by the next bucket
            for dst, src in self.fused:
                dst.copy_(src)
            _sync(self.device)
        finally:
            for fd in fds.values():
                os.close(fd)


def buckets_of(path: Path, model: DraftBackbone, bucket: str) -> list[list[str]]:
    names = list(checkpoint_index(path))
    if bucket == "whole":
        return [names]
    if bucket == "tensor":
        return [[n] for n in names]
    layers = model.lifecycle.readiness.tensors_of_layer
    return [[n for n in group if n in names] for group in layers.values()]


def measure(label: str, family: DraftFamily, cfg: Any, device: str, tmp: Path, repeats: int) -> list[dict[str, Any]]:
    paths = [write_checkpoint(family.random_weights(cfg, seed), tmp / f"{family.name}-{seed}.safetensors")
             for seed in (1, 2)]
    model = family.build(cfg, device="meta", name=f"push-{family.name}")
    load_safetensors(model, paths[0], device=device)
    model.finalize_loading()
    model.refresh_derived_buffers()
    model.capture_graphs()
    floor = Floor(model, paths[0], device)
    index = checkpoint_index(paths[0])
    turn = [1]
    staging = ReadBuffer(pinned=device.startswith("cuda"))  # kept from push to push, as the plugin's

    def push(bucket_by: Any, n: int) -> Callable[[], None]:
        def run() -> None:
            path = paths[turn[0]]
            turn[0] ^= 1
            model.begin_reload()
            load_safetensors(model, path, bucket_by=n if bucket_by is None else bucket_by, device=device,
                             read_buffer=staging)
            model.finalize_loading()
            model.refresh_derived_buffers()
            _sync(device)
        return run

    arms = []
    for bucket, bucket_by in BUCKETS.items():
        arms.append(Arm(f"push {bucket}", push(bucket_by, len(index))))
        groups = buckets_of(paths[0], model, bucket)
        arms.append(Arm(f"floor {bucket}", lambda g=groups: floor.run(g)))
    cpu: dict[str, list[float]] = {}
    samples = common.interleaved(arms, repeats, cpu=cpu)
    pins_ok = not model.lifecycle.pinned_changes()
    nbytes = sum(e.nbytes for e in index.values())
    rows = []
    for bucket in BUCKETS:
        p, f = samples[f"push {bucket}"], samples[f"floor {bucket}"]
        ratio = common.paired_ratio(p, f)
        ratio_cpu = common.paired_ratio(cpu[f"push {bucket}"], cpu[f"floor {bucket}"])
        target = TARGETS.get(bucket) if label == REAL_WIDTH else None
        rows.append({"family": label, "device": device, "bucket": bucket, "tensors": len(index),
                     "mb": round(nbytes / 1e6, 2), "calls": len(buckets_of(paths[0], model, bucket)),
                     "push": common.summarize(p), "floor": common.summarize(f), "x_floor": ratio,
                     "x_floor_cpu": ratio_cpu,
                     "pins_ok": pins_ok, "state": model.lifecycle.state.value, "target_x": target,
                     "met": None if target is None else ratio["median"] <= target})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(NAME, __doc__.splitlines()[0], repeats=REPEATS)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = p.parse_args(argv)
    repeats = common.setup_run(args, default_repeats=REPEATS)
    device = args.device
    info = common.machine_info()
    if device.startswith("cuda") and not torch.cuda.is_available():
        common.say("gpu_push: SKIPPED: no CUDA device; --device cpu runs it on the CPU")
        return 0
    configure_audit(console=False)
    common.say(f"push of a standalone draft on {device}: against the floor ({'quick' if args.quick else 'full'} "
               f"run, {repeats} interleaved rounds per arm)")
    common.say(common.machine_line(info))
    rows: list[dict[str, Any]] = []
    with common.scratch("bench-gpu-push-") as d, torch.no_grad():
        for name, family in FAMILIES.items():
            rows += measure(name, family, family.config(num_hidden_layers=2), device, Path(d), repeats)
        rows += measure(REAL_WIDTH, FAMILIES["dflash"], big_config(args.quick), device, Path(d), repeats)
    common.finish(info)
    common.say("\npush: begin_reload, load_safetensors, finalize_loading, in-place refresh; median ms (min-max); "
               "x floor: median of the per-round ratios (IQR); CPU: the same in CPU time of the process (on CUDA it "
               "counts the host's waits, not the device's work)")
    common.say(common.table(
        ["draft", "buckets", "calls", "MB", "floor ms", "push ms", "x floor (IQR)", "CPU x floor", "pins kept",
         "target"],
        [[r["family"], r["bucket"], r["calls"], r["mb"], f"{r['floor']['median_ms']:.2f}",
          f"{r['push']['median_ms']:.2f} ({r['push']['min_ms']:.3g}-{r['push']['max_ms']:.3g})",
          iqr(r["x_floor"]), f"{r['x_floor_cpu']['median']:.2f}", "yes" if r["pins_ok"] else "NO",
          "(fixed cost)" if r["target_x"] is None else f"{verdict(r['met'])} (<= {r['target_x']}x)"]
         for r in rows]))
    common.say("\n" + common.end_line(info))
    common.say(common.noise_note(info))
    common.store(args, NAME, {"repeats": repeats, "device": device, "rows": rows}, info, summary(rows), MEASURED)
    return 0


def summary(rows: list[dict[str, Any]]) -> Summary:
    out = Summary()
    out.table(["draft", "device", "buckets", "calls", "MB", "floor ms", "push ms (min-max)", "x floor (IQR)",
               "pins kept"],
              [(r["family"], r["device"], r["bucket"], r["calls"], r["mb"], r["floor"]["median_ms"],
                common.ms(r["push"]), iqr(r["x_floor"]), r["pins_ok"]) for r in rows])
    for r in rows:
        if r["target_x"] is not None:
            out.target(f"push on {r['device']}, {r['family']}, {r['bucket']} buckets, <= {r['target_x']}x the floor",
                       f"{num(r['x_floor']['median'])}x", r["met"])
    return out


if __name__ == "__main__":
    sys.exit(main())
