"""A long run: a thousand draft pushes on a live `vllm serve`, and what grows (issue 32, item 12).

    python -m benchmarks.soak [--pushes N] [--traced M] [--quick] [--json PATH]

Two parts, each in processes of its own:

1. online: a real `vllm serve` with the plugin (tests/support/vllm_server.py: the `safetensors_file` transfer engine,
   the lifecycle worker extension, audit files in a folder, rotated at RELOAD_LIFECYCLE_AUDIT_MAX_BYTES) driven over
   HTTP by a trainer (tests/support/rl_client.py): N pushes (pause, start, chunk, finish, resume), alternating two
   drafts, a request every 10 pushes. After a warm-up of 20 pushes, at 11 checkpoints: each process's RSS and open
   files, the server's /dev/shm entries, the audit folder's bytes and files. Printed per process: RSS growth per
   push (the least-squares slope over the checkpoints; the allocator grows in steps, so the slope over many pushes
   is what says whether memory grows), open files at start and end; /dev/shm at start and end; audit bytes per push.
2. traced: the same pushes in one process (an offline `LLM`, engine core and worker in-process: the plugin's worker
   side and its front view) with tracemalloc on from the start. Of the memory alive after M pushes less what was
   alive after a warm-up of 80 (what is bounded is full by then), the part allocated by the plugin's own code (the
   allocating frame in `lifecycle/`), per push, and the lines that hold it. Target: 0 bytes per push. Also that
   process's RSS slope.

The full run (1,000 pushes online, 300 traced) takes about 15 minutes on 2 shared cores (the server's start is 3 of
them); `--quick`: 60 and 40 pushes (about 6 minutes). `make bench` runs the full one; `make test` never does.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python benchmarks/soak.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from benchmarks.stored import Summary, num

ROOT = Path(__file__).resolve().parent.parent
NAME = "soak"
WARMUP = 20
TRACED_WARMUP = 80  # > the 256 events each lifecycle keeps, at about 12 events a push
CHECKPOINTS = 10  # intervals: 11 measurements
REQUEST_EVERY = 10
KIB = 1024
#: The plugin's own allocations alive per push below this many bytes count as no growth (tracemalloc's own noise).
ZERO_BYTES = 16
#: What a change of which can change the figures: the plugin, the core under it, this script and its test helpers.
MEASURED = ("lifecycle", "benchmarks/soak.py", "tests/support/vllm_server.py", "tests/support/cpu_shm.py",
            "tests/support/rl_client.py")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _audit(folder: Path) -> tuple[int, int]:
    files = [f for f in folder.iterdir() if f.is_file()] if folder.is_dir() else []
    return sum(f.stat().st_size for f in files), len(files)


def make_checkpoints(work: Path) -> tuple[Path, Path, Path]:
    from lifecycle.vllm.demo.tiny import make_dflash_draft, make_target

    return make_target(work / "target"), make_dflash_draft(work / "draftA", 1), make_dflash_draft(work / "draftB", 2)


# ---- 1. online ------------------------------------------------------------------------------------------------


def online(work: Path, pushes: int) -> dict[str, Any]:
    sys.path[:0] = [str(ROOT / "tests")]
    from support.rl_client import RLClient
    from support.vllm_server import VllmServer

    target, a, b = make_checkpoints(work)
    server = VllmServer(target, a, work / "serve", env={"RELOAD_LIFECYCLE_AUDIT_MAX_BYTES": "1M"})
    common.say(f"online: starting vllm serve ({pushes} pushes after a warm-up of {WARMUP}) ...")
    server.start()
    common.say(f"online: the server answered after {server.start_seconds:.0f} s")
    client = RLClient(server.url, server.model)
    every = max(1, pushes // CHECKPOINTS)
    points: list[dict[str, Any]] = []
    failed: list[str] = []
    began = time.monotonic()
    try:
        for i in range(WARMUP + pushes + 1):
            if i >= WARMUP and (i - WARMUP) % every == 0:
                procs = {pid: (name, rss) for pid, (name, rss) in server.rss().items()}
                audit_bytes, audit_files = _audit(server.audit_dir)
                points.append({"push": i - WARMUP, "rss_kib": {str(p): r for p, (_, r) in procs.items()},
                               "names": {str(p): n for p, (n, _) in procs.items()},
                               "fds": {str(p): _fds(p) for p in procs}, "shm": len(server.shm_entries()),
                               "audit_bytes": audit_bytes, "audit_files": audit_files,
                               "seconds": round(time.monotonic() - began, 1)})
            if i == WARMUP + pushes:
                break
            steps = client.push({"path": str(a if i % 2 else b)}, weight_version=f"soak-{i}")
            if [s.status for s in steps] != [200] * 5:
                failed.append(f"push {i}: {[str(s) for s in steps if not s.ok][:1]}")
            if i % REQUEST_EVERY == 0:
                client.completion([1, 2, 3, 4], 8)
    finally:
        client.close()
        stopped = server.stop()
    return {"points": points, "failed": failed, "start_seconds": server.start_seconds,
            "stopped_left": stopped.left, "pushes": pushes}


def report_online(res: dict[str, Any]) -> dict[str, Any]:
    pts = res["points"]
    xs = [float(p["push"]) for p in pts]
    rows, per_process = [], {}
    for k, (pid, name) in enumerate(pts[0]["names"].items()):
        if not all(pid in p["rss_kib"] for p in pts):
            continue
        if k == 0:  # the server's own process: `vllm serve`'s API server (with one)
            name = f"API server ({name})"
        elif name in per_process:
            name = f"{name} {pid}"
        ys = [float(p["rss_kib"][pid]) for p in pts]
        growth = slope(xs, ys)
        per_process[name] = {"rss_start_mib": ys[0] / KIB, "rss_end_mib": ys[-1] / KIB,
                             "kib_per_push_slope": growth, "kib_per_push_end_minus_start": (ys[-1] - ys[0]) / xs[-1],
                             "fds_start": pts[0]["fds"][pid], "fds_end": pts[-1]["fds"][pid]}
        if ys[0] > 50 * KIB or name.startswith("VLLM"):  # the server's processes, not the launcher's shell
            rows.append([name, round(ys[0] / KIB, 1), round(ys[-1] / KIB, 1), round(growth, 2),
                         round((ys[-1] - ys[0]) / xs[-1], 2), f"{pts[0]['fds'][pid]} -> {pts[-1]['fds'][pid]}"])
    common.say(common.table(["process", "RSS start MiB", "RSS end MiB", "KiB/push (slope)", "KiB/push (end-start)",
                             "open files"], rows))
    audit = slope(xs, [float(p["audit_bytes"]) for p in pts])
    shm = f"{pts[0]['shm']} -> {pts[-1]['shm']}"
    common.say(f"/dev/shm entries of the server: {shm}; audit: {audit:.0f} bytes per push, "
               f"{pts[-1]['audit_files']} files at the end (rotated at 1 MiB); {len(res['failed'])} push(es) failed; "
               f"{res['pushes']} pushes in {pts[-1]['seconds']} s")
    for line in res["failed"][:5]:
        common.say(f"  {line}")
    return {"processes": per_process, "audit_bytes_per_push": audit, "shm": [pts[0]["shm"], pts[-1]["shm"]],
            "audit_files_end": pts[-1]["audit_files"], "failed": len(res["failed"]), "seconds": pts[-1]["seconds"]}


# ---- 2. traced ------------------------------------------------------------------------------------------------

TRACED = r"""
import gc, json, os, resource, sys, time, tracemalloc
sys.path[:0] = [{root!r}]
from lifecycle.vllm.demo.tiny import ENGINE_ENV, engine_kwargs
os.environ.update(ENGINE_ENV)
from vllm import LLM, SamplingParams
llm = LLM(**engine_kwargs({target!r}, {a!r}))
params = SamplingParams(max_tokens=8, temperature=0.0)
drafts = [{a!r}, {b!r}]

def push(i):
    llm.collective_rpc("start_draft_weight_update")
    llm.collective_rpc("update_weights", args=({{"path": drafts[i % 2]}},))
    llm.collective_rpc("finish_weight_update")
    if i % {every} == 0:
        llm.generate([{{"prompt_token_ids": [1, 2, 3, 4]}}], params, use_tqdm=False)

def rss_kib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

tracemalloc.start(1)
# traced from here: the warm-up fills what is bounded (each lifecycle's ring of its last 256 events, caches made
# once), so that an entry allocated before tracing and replaced after does not count as growth
for i in range({warmup}):
    push(i)
gc.collect()
before, rss0, t0 = tracemalloc.take_snapshot(), [rss_kib()], time.monotonic()
xs, ys = [0], [rss0[0]]
for i in range({pushes}):
    push(i)
    if (i + 1) % max(1, {pushes} // 10) == 0:
        xs.append(i + 1); ys.append(rss_kib())
gc.collect()
after = tracemalloc.take_snapshot()
ours = [tracemalloc.Filter(True, os.path.join({root!r}, "lifecycle", "*"))]
diff = after.filter_traces(ours).compare_to(before.filter_traces(ours), "lineno")
lines = [(str(s.traceback[0]).replace({root!r} + "/", ""), s.size_diff, s.count_diff) for s in diff if s.size_diff]
total = sum(s.size_diff for s in diff)
print(json.dumps({{"bytes": total, "lines": sorted(lines, key=lambda x: -abs(x[1]))[:15], "xs": xs, "ys": ys,
                  "seconds": time.monotonic() - t0, "pushes": {pushes}}}))
"""


def traced(work: Path, pushes: int) -> dict[str, Any]:
    target, a, b = work / "target", work / "draftA", work / "draftB"
    if not target.exists():
        target, a, b = make_checkpoints(work)
    script = TRACED.format(root=str(ROOT), target=str(target), a=str(a), b=str(b), warmup=TRACED_WARMUP,
                           pushes=pushes, every=REQUEST_EVERY)
    common.say(f"traced: an offline engine in one process, {pushes} pushes with tracemalloc ...")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"the traced run failed: {proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def report_traced(res: dict[str, Any]) -> dict[str, Any]:
    per_push = res["bytes"] / res["pushes"]
    rss = slope([float(x) for x in res["xs"]], [float(y) for y in res["ys"]])
    common.say(f"traced: the plugin's own allocations alive after {res['pushes']} pushes, less after the warm-up: "
               f"{res['bytes']} bytes, {per_push:.1f} bytes per push (target 0); the process's RSS "
               f"{rss:.2f} KiB per push (slope)")
    if res["lines"]:
        common.say(common.table(["where (lifecycle/)", "bytes", "blocks"], [list(x) for x in res["lines"]]))
    return {"plugin_bytes": res["bytes"], "plugin_bytes_per_push": per_push, "rss_kib_per_push_slope": rss,
            "lines": res["lines"], "seconds": res["seconds"]}


def summary(pushes: int, on: dict[str, Any], tr: dict[str, Any]) -> Summary:
    """The rows docs/performance.md shows of a run."""
    out = Summary()
    out.table(["process", "RSS at start (MiB)", "at end", "KiB per push (slope)", "KiB per push (end - start)",
               "open files"],
              [(name, p["rss_start_mib"], p["rss_end_mib"], p["kib_per_push_slope"],
                p["kib_per_push_end_minus_start"], f"{p['fds_start']} -> {p['fds_end']}")
               for name, p in on["processes"].items() if p["rss_start_mib"] > 50])
    out.note(f"Online, {num(pushes)} pushes in {num(on['seconds'])} s ({on['failed']} failed): `/dev/shm` entries "
             f"{on['shm'][0]} -> {on['shm'][1]}; the audit grew {num(on['audit_bytes_per_push'])} bytes per push, "
             f"{on['audit_files_end']} files at the end (rotated at 1 MiB). In one process with tracemalloc: the "
             f"plugin's own allocations still alive grew {num(tr['plugin_bytes_per_push'])} bytes per push, the "
             f"process's RSS {num(tr['rss_kib_per_push_slope'])} KiB per push.")
    if tr["lines"]:
        out.table(["where the plugin's residue was allocated", "bytes", "blocks"], [list(x) for x in tr["lines"]],
                  title="The plugin's own allocations alive after the traced run, less the warm-up's:")
    out.target(f"the plugin's own allocations alive per push, over a long run: 0 (under {ZERO_BYTES} bytes)",
               f"{num(tr['plugin_bytes_per_push'])} bytes", abs(tr["plugin_bytes_per_push"]) < ZERO_BYTES)
    return out


def main(argv: list[str] | None = None) -> int:
    p = common.parser(NAME, "a long run: pushes on a live server, and what grows", repeats=1)
    p.add_argument("--pushes", type=int, default=None, help="online pushes after the warm-up (default 1000)")
    p.add_argument("--traced", type=int, default=None, help="pushes traced in one process (default 300)")
    args = p.parse_args(argv)
    pushes = args.pushes or (60 if args.quick else 1000)
    traced_pushes = args.traced or (40 if args.quick else 300)
    info = common.machine_info()
    common.say(common.machine_line(info))
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(tmp)
        online_res = report_online(online(work, pushes))
        traced_res = report_traced(traced(work, traced_pushes))
    info = common.finish(info)
    common.say(common.end_line(info))
    common.say(common.noise_note(info))
    common.store(args, NAME, {"pushes": pushes, "online": online_res, "traced": traced_res}, info,
                 summary(pushes, online_res, traced_res), MEASURED)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
