"""Peak memory and output size of `reload-lifecycle audit` and `report` on hostile logs, as the hostility grows.

Each size of each hostile input is written to disk, then audited and reported in a fresh process (so peak RSS is
that command's, measured with `ru_maxrss`) that imports the audit tools without torch, as the commands do. The
inputs are those of issue 13:

  distinct backbones   one valid `layer_ready` line per backbone, every backbone new (41 MB at 200,000)
  long layer names     `layer_ready` lines whose layer name is 0.9 MB (each refused by the schema)
  4096-char names      distinct layers of one backbone, each name at the schema's limit (accepted)
  rank files           one small valid log (a cold load) per rank, merged under a 1,024 open-file limit (with
                       --max-streams 8192: every rank is its own stream, all of them audited)

Bounded means flat: peak RSS and the report's size must not grow with the input once its limits are reached
(the stream, layer and figure caps; the pending-line and open-file caps of the merge). Prints a table and writes
benchmarks/results/hostile_logs.json and .txt.

    .venv/bin/python -m benchmarks.hostile_logs            # the sizes of the issue (a few minutes, ~1 GB of disk)
    .venv/bin/python -m benchmarks.hostile_logs --quick    # a smoke run of seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAME = "hostile_logs"
MEASURED = ("lifecycle/audit", "lifecycle/cli.py", "lifecycle/event_bounds.py", "benchmarks/hostile_logs.py")
RESULTS = ROOT / "benchmarks" / "results"
TS = "2026-01-01T00:{:02d}:{:02d}.{:06d}Z"
OPEN_FILES = 1024


def _ts(i: int) -> str:
    return TS.format(i // 60_000_000 % 60, i // 1_000_000 % 60, i % 1_000_000)


def _line(**fields: Any) -> str:
    return json.dumps({"schema": 5, "level": "info", **fields}, separators=(",", ":")) + "\n"


def distinct_backbones(out: Path, n: int) -> None:
    with (out / "backbones.jsonl").open("w") as fh:
        for i in range(n):
            fh.write(_line(event="layer_ready", backbone=f"backbone-{i:07d}-of-a-hostile-log", rank=i % 8, epoch=0,
                           seq=1, layers=["layers.0"], layers_ready=1, layers_total=4, ts=_ts(i)))


def _layer_ready_lines(path: Path, n: int, layer_name: Callable[[int], str]) -> None:
    """`n` layer_ready events of one backbone, layer `i` named `layer_name(i)`, with a layer count of 10**9."""
    with path.open("w") as fh:
        for i in range(n):
            fh.write(_line(event="layer_ready", backbone="draft", rank=0, epoch=0, seq=i + 1, layers=[layer_name(i)],
                           layers_ready=i + 1, layers_total=10**9, ts=_ts(i)))


def long_layer_names(out: Path, n: int) -> None:
    name = "L" * 900_000
    _layer_ready_lines(out / "names.jsonl", n, lambda i: f"{i}{name}")


def names_at_the_limit(out: Path, n: int) -> None:
    pad = "n" * 4000
    _layer_ready_lines(out / "limit.jsonl", n, lambda i: f"{pad}{i:096d}")


def _cold_load(rank: int, layers: int = 4) -> Iterator[str]:
    """A valid cold load: layer_ready per layer, weights_loaded where the state changes (the first and the last
    layer), finish, refresh, capture (lockstep times)."""
    seq, state = 0, "META"
    for k in range(layers):
        seq += 1
        yield _line(event="layer_ready", backbone="draft", rank=rank, epoch=0, seq=seq, layers=[f"layers.{k}"],
                    tensors=8, layers_ready=k + 1, layers_total=layers, ts=_ts(seq))
        dst = "FULLY_LOADED" if k + 1 == layers else "PARTIALLY_LOADED"
        if dst == state:  # a bucket that leaves PARTIALLY_LOADED as it is: no transition event
            continue
        seq += 1
        yield _line(event="transition", backbone="draft", rank=rank, epoch=0, seq=seq, trigger="weights_loaded",
                    src=state, dst=dst, layers_ready=k + 1, layers_total=layers, ts=_ts(seq))
        state = dst
    for trigger, src, dst in (("finalize_loading", "FULLY_LOADED", "FINALIZED"),
                              ("refresh_derived", "FINALIZED", "DERIVED_REFRESHED"),
                              ("capture_graphs", "DERIVED_REFRESHED", "GRAPH_CAPTURED")):
        seq += 1
        yield _line(event="transition", backbone="draft", rank=rank, epoch=0, seq=seq, trigger=trigger, src=src,
                    dst=dst, layers_ready=layers, layers_total=layers, ts=_ts(seq))


def rank_files(out: Path, n: int) -> None:
    for r in range(n):
        (out / f"rank{r:05d}.jsonl").write_text("".join(_cold_load(r)))


CASES: dict[str, tuple[Callable[[Path, int], None], list[int], list[int], list[str]]] = {
    # name: (writer, sizes, quick sizes, options of both commands)
    "distinct backbones": (distinct_backbones, [2_000, 20_000, 200_000], [200, 2_000], []),
    "0.9 MB layer names": (long_layer_names, [30, 100, 300], [3, 10], []),
    "4096-char layer names": (names_at_the_limit, [1_000, 5_000, 20_000], [100, 1_000], []),
    "rank files": (rank_files, [500, 2_000, 5_000], [50, 300], ["--max-streams", "8192"]),
}

CHILD = r"""
import json, resource, sys, time, types, contextlib, io
root, command, logs, out = sys.argv[1:5]
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[5]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
options = sys.argv[6:]
package = types.ModuleType("lifecycle")  # the audit tools without `import lifecycle` (and torch)
package.__path__ = [root + "/lifecycle"]
sys.modules["lifecycle"] = package
from lifecycle.cli import main
args = [command, logs, *options] + (["-o", out] if command == "report" else ["--json"])
t0 = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()) as text:
    status = main(args)
doc = json.loads(text.getvalue()) if command == "audit" else {}
print(json.dumps({"status": status, "seconds": time.perf_counter() - t0, "torch": "torch" in sys.modules,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "events": doc.get("events"),
                  "streams": len(doc.get("streams", ())), "problems": doc.get("input_problem_count")}))
"""


def measure(command: str, logs: Path, out: Path, options: list[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), command, str(logs), str(out), str(OPEN_FILES),
                           *options],
                          capture_output=True, text=True, check=False, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{command} {logs} failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if result["torch"]:
        raise RuntimeError("the audit tools imported torch")
    return result


def run_case(name: str, size: int, work: Path) -> dict[str, Any]:
    writer, _, _, options = CASES[name]
    logs = work / "logs"
    logs.mkdir()
    writer(logs, size)
    log_bytes = sum(f.stat().st_size for f in logs.iterdir())
    audit = measure("audit", logs, work / "unused.html", options)
    report = measure("report", logs, work / "report.html", options)
    html_bytes = (work / "report.html").stat().st_size
    for f in [*logs.iterdir(), work / "report.html"]:
        f.unlink()
    logs.rmdir()
    return {"input": name, "size": size, "log_bytes": log_bytes, "audit_peak_kib": audit["peak_kib"],
            "audit_seconds": audit["seconds"], "audit_status": audit["status"], "events": audit["events"],
            "streams": audit["streams"], "problems": audit["problems"], "report_peak_kib": report["peak_kib"],
            "report_seconds": report["seconds"], "report_status": report["status"], "report_bytes": html_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of seconds")
    parser.add_argument("--json", type=Path, default=RESULTS / f"{NAME}.json")
    args = parser.parse_args(argv)
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hostile-logs-") as tmp:
        work = Path(tmp)
        (work / "empty").mkdir()
        (work / "empty" / "empty.jsonl").write_text("")
        base = measure("audit", work / "empty", work / "unused.html", [])
        for name, (_, sizes, quick, _) in CASES.items():
            for size in quick if args.quick else sizes:
                rows.append(run_case(name, size, work))
                print(f"  {name} x {size:,}: done", flush=True)
    headers = ["input", "size", "log MiB", "audit exit", "streams", "events", "input problems",
               "audit peak RSS MiB", "audit s", "report peak RSS MiB", "report MiB", "report s"]
    table = [[r["input"], f"{r['size']:,}", f"{r['log_bytes'] / 2**20:.1f}", r["audit_status"], r["streams"],
              f"{r['events']:,}", f"{r['problems']:,}", f"{r['audit_peak_kib'] / 1024:.0f}",
              f"{r['audit_seconds']:.1f}", f"{r['report_peak_kib'] / 1024:.0f}", f"{r['report_bytes'] / 2**20:.2f}",
              f"{r['report_seconds']:.1f}"] for r in rows]
    widths = [max(len(h), *(len(str(row[i])) for row in table)) for i, h in enumerate(headers)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    lines.append(f"baseline: the audit of an empty log peaks at {base['peak_kib'] / 1024:.0f} MiB RSS (the interpreter "
                 f"and the audit tools, no torch); open-file limit {OPEN_FILES} in every run.")
    text = "\n".join(lines)
    print(text)
    from benchmarks.stored import Summary, measured_on, num, warning

    summary = Summary()
    summary.table(["input", "size", "log", "audit exit", "streams audited", "input problems", "audit peak RSS",
                   "report peak RSS", "report size"],
                  [(r["input"], r["size"], f"{num(r['log_bytes'] / 2**20)} MiB", str(r["audit_status"]), r["streams"],
                    r["problems"], f"{num(r['audit_peak_kib'] / 1024)} MiB", f"{num(r['report_peak_kib'] / 1024)} MiB",
                    f"{num(r['report_bytes'] / 2**20)} MiB") for r in rows])
    summary.note(f"Each size in a fresh process without torch, under an open-file limit of {num(OPEN_FILES)}; an "
                 f"empty log peaks at {num(base['peak_kib'] / 1024)} MiB.")
    provenance = measured_on(MEASURED)
    if (why := warning(provenance)) is not None:
        print(f"NOTE: {why}")
    nproc = os.cpu_count() or 1
    load_end = [round(x, 2) for x in os.getloadavg()]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": NAME, "quick": args.quick, "rows": rows,
                                     "baseline_peak_kib": base["peak_kib"], "open_files": OPEN_FILES,
                                     "machine": {"nproc": nproc, "python": platform.python_version(),
                                                 "loadavg_start": load_start, "loadavg_end": load_end,
                                                 "busy": max(load_start[0], load_end[0]) > nproc,
                                                 "when": time.ctime()},
                                     "measured_on": provenance, "summary": summary.as_dict()}, indent=2) + "\n")
    args.json.with_suffix(".txt").write_text(text + "\n")
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
