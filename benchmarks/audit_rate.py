"""How fast `reload-lifecycle audit` streams, and that its memory does not grow with the log.

A real lifecycle is recorded once (a DFlash draft: cold load, capture, one bucketed shuffled reload with a refused
early refresh, in-place refresh); its reload is then repeated with increasing epoch numbers, per rank, into one
file per rank (`lifecycle.testing`), until the logs hold the requested number of events. Each size is audited in
a fresh process (so peak RSS is that audit's), which must find the log clean. Prints a table.

    .venv/bin/python benchmarks/audit_rate.py                       # 100,000 and 1,000,000 events, 4 ranks
    .venv/bin/python benchmarks/audit_rate.py --events 10000 --ranks 2 --layers 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def record(layers: int, work: Path) -> list[dict[str, Any]]:
    """One real lifecycle's events: epoch 0 (cold load, capture) and epoch 1 (a bucketed reload)."""
    sys.path.insert(0, str(ROOT))
    from lifecycle.errors import LayersNotReadyError
    from lifecycle.events import configure_audit, read_events
    from lifecycle.loading import (
        apply_bucket,
        checkpoint_index,
        iter_buckets,
        load_safetensors,
        plan_buckets,
        write_checkpoint,
    )
    from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

    cfg = DFlashConfig(num_hidden_layers=layers)
    a = write_checkpoint(random_weights(cfg, 0), work / "a.safetensors")
    b = write_checkpoint(random_weights(cfg, 1), work / "b.safetensors")
    log = work / "recorded.jsonl"
    configure_audit(json_path=log, console=False)
    m = DFlashQwen3Draft(cfg, name="draft")
    load_safetensors(m, a)
    m.finalize_loading()
    m.refresh_derived_buffers()
    m.capture_graphs()
    m.begin_reload()
    lc = m.lifecycle
    index = checkpoint_index(b)
    buckets = plan_buckets(list(index), lambda n: lc.readiness.layer_of_name[n], bucket_by=3, shuffle=True, seed=0)
    for i, bucket in enumerate(iter_buckets(index, buckets)):
        apply_bucket(m, bucket, "cpu")
        if i == 0:
            with contextlib.suppress(LayersNotReadyError):  # the guard's refusal is part of the recorded reload
                m.refresh_derived_buffers()
    m.finalize_loading()
    m.refresh_derived_buffers()
    configure_audit(console=False)
    return read_events(log)


def write_logs(recorded: list[dict[str, Any]], events: int, ranks: int, out: Path) -> int:
    from lifecycle.testing import write_synthetic

    cold = sum(1 for e in recorded if e["epoch"] == 0)
    reload = sum(1 for e in recorded if e["epoch"] == 1)
    reloads = max(1, math.ceil((events / ranks - cold) / reload))
    out.mkdir(parents=True, exist_ok=True)
    return sum(write_synthetic(out / f"rank{r}.jsonl", recorded, reloads, rank=r) for r in range(ranks))


def child(logs: str) -> None:
    """Audit `logs` in this process and print what it cost, as JSON."""
    sys.path.insert(0, str(ROOT))
    from lifecycle.audit.replay import audit_logs

    before = rss_kib()
    t0, c0 = time.perf_counter(), time.process_time()
    result = audit_logs([logs])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = rss_kib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"events": result.events, "seconds": seconds, "cpu_seconds": cpu, "status": result.status,
                      "violations": dict(result.violation_counts), "before_kib": before, "after_kib": after,
                      "peak_kib": peak, "streams": len(result.streams),
                      "final_epoch": max(r.epoch for r in result.streams)}))


def rss_kib() -> int:
    """Resident set size now (Linux /proc), or the peak so far where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="audit-rate-") as tmp:
        work = Path(tmp)
        recorded = record(args.layers, work)
        print(f"recorded one real lifecycle: {len(recorded)} events "
              f"({sum(e['epoch'] == 1 for e in recorded)} per reload), {args.layers} layers")
        for n in args.events:
            logs = work / f"logs-{n}"
            written = write_logs(recorded, n, args.ranks, logs)
            size = sum(f.stat().st_size for f in logs.iterdir())
            out = subprocess.run([sys.executable, __file__, "--child", str(logs)], capture_output=True, text=True,
                                 check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if r["status"] != 0 or r["events"] != written:
                print(f"audit of {written} synthetic events was not clean: {r}", file=sys.stderr)
                return 1
            rows.append([f"{r['events']:,}", args.ranks, f"{size / 2**20:.0f}", r["final_epoch"],
                         f"{r['seconds']:.2f}", f"{r['events'] / r['seconds']:,.0f}",
                         f"{r['events'] / r['cpu_seconds']:,.0f}",
                         f"{r['before_kib'] / 1024:.0f}", f"{r['after_kib'] / 1024:.0f}",
                         f"{r['peak_kib'] / 1024:.0f}"])
            for f in logs.iterdir():
                f.unlink()

    headers = ["events", "ranks", "log MiB", "epochs/rank", "seconds", "events/s",
               "events/CPU-s", "RSS before MiB",
               "RSS after MiB", "peak RSS MiB"]
    widths = [max(len(h), *(len(str(row[i])) for row in rows)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))
    print("events/s is wall clock (shared machines vary); events/CPU-s counts only the auditing process's CPU time.")
    print("RSS is the auditing process's (ru_maxrss for the peak): the interpreter and `import lifecycle` (which "
          "imports torch) are most of it; before -> after is what the audit itself holds.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
