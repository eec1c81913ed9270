"""How fast the offline commands start: `reload-lifecycle audit|report|diagram` on a small log, in fresh processes.

    python -m benchmarks.cli_start [--quick] [--repeats N] [--json PATH]

Each command runs as `python -m lifecycle.cli ...` from the repository root, `repeats` times, interleaved with two
references measured in the same run: the bare interpreter (`python -c pass`, the floor) and `python -c "import
torch"` (what the commands paid when `import lifecycle` loaded the core; not with `--quick`). Per process: wall
time from spawn to exit, and peak resident memory (`ru_maxrss` of that child, from `os.wait4` in a small launcher
process that does not import torch: a child's peak counts the process it was forked from until its exec). The log
is one tiny cold load (about a dozen lines, written by a separate process before the measurement: an empty log is
refused, an auditor that saw nothing must not say clean), so the figures are the start-up cost. A separate run of each
command's `main` reports whether torch was imported. Targets (issue 15): under 0.3 s and under 60 MB, without
torch.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python benchmarks/cli_start.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from benchmarks.stored import Summary, num, verdict

NAME = "cli_start"
ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 0.3
TARGET_MIB = 60.0
MEASURED = ("lifecycle/cli.py", "lifecycle/audit", "lifecycle/__init__.py", "lifecycle/event_bounds.py",
            "lifecycle/states.py", "benchmarks/cli_start.py")

PROBE = ("import json, sys; from lifecycle.cli import main; status = main(json.loads(sys.argv[1])); "
         "print(json.dumps({'status': status, 'torch': 'torch' in sys.modules}))")


#: Runs in a small interpreter of its own (no torch): a child's peak RSS counts the process it was forked from
#: until its exec, so the commands are spawned from here, not from this (torch-importing) benchmark process.
LAUNCHER = r"""
import json, os, subprocess, sys, time
arms, repeats, cwd = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
names = list(arms)
samples = {name: [] for name in names}
for r in range(repeats + 1):  # round 0 warms the page cache, untimed
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *arms[name]], cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here
        if r:
            samples[name].append([wall, usage.ru_maxrss / 1024, proc.returncode])
print(json.dumps(samples))
"""


def spawn_all(arms: dict[str, list[str]], repeats: int) -> dict[str, list[tuple[float, float, int]]]:
    """name -> [(wall seconds, peak RSS in MiB, exit status)] of `repeats` fresh processes each, interleaved."""
    run = subprocess.run([sys.executable, "-c", LAUNCHER, json.dumps(arms), str(repeats), str(ROOT)],
                         capture_output=True, text=True, timeout=1800, check=True)
    return {name: [tuple(x) for x in got] for name, got in json.loads(run.stdout).items()}  # type: ignore[misc]


#: Run once in its own process (it imports torch): a tiny DFlash draft's cold load, audited into argv[1].
WRITE_LOG = """
import sys, tempfile
from pathlib import Path
from lifecycle import configure_audit, load_safetensors, write_checkpoint
from models import get_family
fam = get_family("dflash")
with tempfile.TemporaryDirectory() as d:
    ckpt = write_checkpoint(fam.random_weights(fam.config(), 0), Path(d) / "a.safetensors")
    configure_audit(sys.argv[1], console=False)
    model = fam.build(fam.config(), device="meta", name="bench")
    load_safetensors(model, ckpt)
    model.finalize_loading()
    model.refresh_derived_buffers()
    configure_audit(None, console=False)
"""


def commands(log: Path, out: Path) -> dict[str, list[str]]:
    return {
        "audit": ["audit", str(log)],
        "audit --json": ["audit", str(log), "--json"],
        "report": ["report", str(log), "-o", str(out)],
        "diagram": ["diagram"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser(NAME, __doc__.splitlines()[0], repeats=15).parse_args(argv)
    repeats = common.setup_run(args, default_repeats=15)
    info = common.machine_info()
    common.say(f"CLI start-up: offline commands on a one-load log ({'quick' if args.quick else 'full'} run, {repeats} "
               "fresh processes per command, interleaved)")
    common.say(common.machine_line(info))
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as d:
        log, out = Path(d) / "cold.jsonl", Path(d) / "report.html"
        subprocess.run([sys.executable, "-c", WRITE_LOG, str(log)], cwd=ROOT, check=True, timeout=300)
        cmds = commands(log, out)
        arms: dict[str, list[str]] = {
            "python -c pass (floor)": ["-c", "pass"],
            **({} if args.quick else {"python -c 'import torch' (reference)": ["-c", "import torch"]}),
            **{f"reload-lifecycle {name}": ["-m", "lifecycle.cli", *cmd] for name, cmd in cmds.items()},
        }
        samples = spawn_all(arms, repeats)
        names = list(arms)
        torch_loaded = {}
        for name, cmd in cmds.items():
            probe = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cmd)], cwd=ROOT,
                                   capture_output=True, text=True, timeout=120, check=False)
            torch_loaded[name] = json.loads(probe.stdout.strip().splitlines()[-1])["torch"]
    common.finish(info)

    rows: list[dict[str, Any]] = []
    for name in names:
        walls = [w for w, _, _ in samples[name]]
        rss = [m for _, m, _ in samples[name]]
        command = name.removeprefix("reload-lifecycle ") if name.startswith("reload-lifecycle") else None
        row: dict[str, Any] = {
            "what": name, "median_s": round(statistics.median(walls), 4), "min_s": round(min(walls), 4),
            "max_s": round(max(walls), 4), "peak_rss_mib": round(max(rss), 1),
            "exit_statuses": sorted({s for _, _, s in samples[name]}),
        }
        if command is not None:
            row["torch_imported"] = torch_loaded[command]
            row["met"] = (row["median_s"] < TARGET_S and row["peak_rss_mib"] < TARGET_MIB
                          and not row["torch_imported"] and row["exit_statuses"] == [0])
        rows.append(row)

    common.say(f"\nper process: wall s median (min-max), peak RSS; target < {TARGET_S} s and < {TARGET_MIB:.0f} MiB "
               "without torch")
    common.say(common.table(
        ["what", "wall s", "min-max", "peak RSS MiB", "torch imported", "exit", "target"],
        [[r["what"], f"{r['median_s']:.3f}", f"{r['min_s']:.3f}-{r['max_s']:.3f}", r["peak_rss_mib"],
          {True: "YES", False: "no"}.get(r.get("torch_imported"), "-"), ",".join(map(str, r["exit_statuses"])),
          ("met" if r["met"] else "MISSED") if "met" in r else "-"] for r in rows]))
    common.say("\n" + common.end_line(info))
    common.say(common.noise_note(info))
    common.store(args, NAME, {"repeats": repeats, "target_s": TARGET_S, "target_mib": TARGET_MIB, "rows": rows}, info,
                 summary(rows), MEASURED)
    return 0


def summary(rows: list[dict[str, Any]]) -> Summary:
    out = Summary()
    out.table(["command", "wall s (min-max)", "peak RSS MiB", "torch imported", "target"],
              [(r["what"], f"{num(r['median_s'])} ({num(r['min_s'])}-{num(r['max_s'])})", r["peak_rss_mib"],
                num(r.get("torch_imported")), verdict(r.get("met"))) for r in rows])
    timed = [r for r in rows if "met" in r]
    out.target(f"`audit`, `report`, `diagram` start < {num(TARGET_S)} s and < {num(TARGET_MIB)} MiB, no torch",
               f"{num(min(t['median_s'] for t in timed))}-{num(max(t['median_s'] for t in timed))} s, "
               f"{num(min(t['peak_rss_mib'] for t in timed))}-{num(max(t['peak_rss_mib'] for t in timed))} MiB",
               all(t["met"] for t in timed))
    return out


if __name__ == "__main__":
    sys.exit(main())
