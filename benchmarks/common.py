"""What every benchmark shares: interleaved timing with medians and spread, tables, JSON output, the machine
description, and the synthetic many-tensor draft backbone.

>>> s = summarize([0.003, 0.001, 0.002])
>>> s["median_ms"], s["min_ms"], s["max_ms"], s["n"]
(2.0, 1.0, 3.0, 3)
>>> print(table(["a", "bb"], [[1, 2.5]]))
a | bb
--+----
1 | 2.5
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.stored import Summary, measured_on, num, warning
from lifecycle import DraftBackbone, concat, stack
from lifecycle.audit.views import table as text_table
from lifecycle.loading import apply_bucket
from lifecycle.read_buffers import MappedBuffer, padded
from models.layers import RMSNorm

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---- command line and output -----------------------------------------------------------------------------------


def parser(name: str, description: str, *, repeats: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke run of seconds")
    p.add_argument("--repeats", type=int, default=None, help=f"timed repeats per arm (default {repeats}; quick: 3)")
    p.add_argument("--json", type=Path, default=None,
                   help=f"where to write the JSON (default {RESULTS_DIR}/{name}.json)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    return p


def setup_run(args: argparse.Namespace, default_repeats: int) -> int:
    """Apply --threads; return the number of repeats."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return args.repeats or (3 if args.quick else default_repeats)


def json_path(args: argparse.Namespace, name: str) -> Path:
    """`--json`, else `benchmarks/results/NAME.json`; a `--quick` run's figures mean nothing, so they go to
    `benchmarks/results/quick/` (git-ignored) and never replace a full run's."""
    if args.json:
        return Path(args.json)
    return (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR) / f"{name}.json"


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def store(args: argparse.Namespace, name: str, data: Mapping[str, Any], info: dict[str, Any], summary: Summary,
          measured: Sequence[str], *, path: Path | None = None) -> Path:
    """Write the run's result (`--json`, else benchmarks/results/NAME.json; `path` overrides both) and its
    printout beside it: the benchmark's figures, the machine and its load (`busy`), the commit it measured and
    its measured path (`stored.measured_on`), and its own summary rows (`stored.Summary`), which
    docs/generate.py renders as they are."""
    provenance = measured_on(measured)
    if (why := warning(provenance)) is not None:
        say(f"NOTE: {why}")
    info["busy"] = busy(info)
    out = write_json(path or json_path(args, name), {
        "benchmark": name, "quick": bool(getattr(args, "quick", False)), **data, "machine": info,
        "measured_on": provenance, "summary": summary.as_dict()})
    say(f"JSON: {out}")
    write_transcript(out.with_suffix(".txt"))
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The project's text table (`lifecycle.audit.views.table`), numbers to three significant digits."""
    return text_table(headers, rows, cell=_cell)


def _cell(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


_transcript: list[str] = []


def say(text: str = "") -> None:
    """Print, and keep the line for `write_transcript`."""
    _transcript.append(text)
    print(text, flush=True)


def write_transcript(path: Path) -> Path:
    """Write everything `say` printed in this run (the tables) to `path`, next to the JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(_transcript) + "\n", encoding="utf-8")
    _transcript.clear()
    return path


def scratch_dir() -> str | None:
    """Where benchmarks write their temporary checkpoints: /dev/shm (tmpfs) when there is one, so that reads
    come from memory every time (other tenants' I/O cannot evict the page cache mid-run); else the default."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[str]:
    """A run's scratch folder in `scratch_dir()`, named after this process (`<prefix><pid>-...`), removed when the
    block ends, also when a SIGTERM (`kill`, a job's timeout) ends it: inside the block SIGTERM raises
    SystemExit(143) in the main thread, as an interrupt would, where Python's default ends the process without its
    `finally` blocks (the folder, a GiB of /dev/shm, would hold that memory until the machine restarts; the run's
    engines would not be closed). The folders of this name whose process is gone (a run killed with SIGKILL) are
    removed first."""
    where = scratch_dir()
    remove_orphaned_scratch(Path(where or tempfile.gettempdir()), prefix)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if main and previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-", dir=where) as folder:
            yield folder
    finally:
        if main and previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def remove_orphaned_scratch(where: Path, prefix: str) -> list[Path]:
    """Remove the folders `<prefix><pid>-...` in `where` whose process no longer exists; returns them. A live pid
    (its own, or one the system gave to another process since) keeps its folder."""
    removed = []
    name = re.compile(re.escape(prefix) + r"(\d+)-")
    with contextlib.suppress(OSError):
        for folder in where.iterdir():
            m = name.match(folder.name)
            if m is None or not folder.is_dir() or _alive(int(m.group(1))):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, torch version and threads, and the load average (others share this machine)."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": mem_gib,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "probe_copy_64mib_ms_start": probe_copy_ms(),
    }


def finish(info: dict[str, Any]) -> dict[str, Any]:
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    info["probe_copy_64mib_ms_end"] = probe_copy_ms()
    return info


def probe_copy_ms(nbytes: int = 64 * 2**20, repeats: int = 7) -> float:
    """Median time of one `copy_` of 64 MiB: a yardstick for the state of a shared machine. When other tenants
    saturate it, this probe (and everything else) runs several times slower than on a quiet machine."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def machine_line(info: Mapping[str, Any]) -> str:
    return (f"machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']} ({info['torch_threads']} threads), "
            f"load average at start {info['loadavg_start'][0]}, 64 MiB copy_ probe {info['probe_copy_64mib_ms_start']} "
            "ms")


#: A quiet 2-core machine of this project copies 64 MiB in 2-7 ms (AMD EPYC 4-7, Intel Xeon about 2); above this
#: the machine was busy.
QUIET_PROBE_MS = 8.0
#: Or above this many times the quietest probe stored for the same CPU model: other tenants of the host, whose
#: memory traffic the load average does not show (an Intel Xeon host that copies 64 MiB in 2.1 ms took 5-8 ms for
#: hours, and its Python ran 2-3 times slower, while under `QUIET_PROBE_MS`).
BUSY_FACTOR = 2.0


def quietest_probe_ms(cpu: str, nproc: int | None, results: Path = RESULTS_DIR) -> float | None:
    """The least 64 MiB copy probe the stored results (`results/*.json`) record on a machine of `cpu` and `nproc`
    (a CPU's name alone is shared by hosts of other sizes: a GPU machine's 16-core Xeon copies 3x faster), or
    None."""
    probes = []
    for path in sorted(results.glob("*.json")):
        try:
            machine = json.loads(path.read_text(encoding="utf-8")).get("machine") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(machine, dict) and machine.get("cpu") == cpu and machine.get("nproc") == nproc:
            probes += [v for k in ("probe_copy_64mib_ms_start", "probe_copy_64mib_ms_end")
                       if isinstance(v := machine.get(k), (int, float)) and v > 0]
    return min(probes, default=None)


def busy(info: Mapping[str, Any], results: Path = RESULTS_DIR) -> bool:
    """Whether other tenants loaded the machine during the run: the copy probe above `QUIET_PROBE_MS` or above
    `BUSY_FACTOR` times this CPU's quietest stored probe, or the load average above the CPU count, at start or
    end."""
    probe = max(info["probe_copy_64mib_ms_start"], info.get("probe_copy_64mib_ms_end", 0.0))
    load = max(info["loadavg_start"][0], info.get("loadavg_end", [0.0])[0])
    quietest = quietest_probe_ms(str(info.get("cpu")), info.get("nproc"), results)
    return probe > QUIET_PROBE_MS or (quietest is not None and probe > BUSY_FACTOR * quietest) \
        or load > (info.get("nproc") or 2)


def noise_note(info: Mapping[str, Any]) -> str:
    """What the machine's state says about this run's wall-clock figures (the probe and the load average at start
    and end)."""
    probe = max(info["probe_copy_64mib_ms_start"], info.get("probe_copy_64mib_ms_end", 0.0))
    load = max(info["loadavg_start"][0], info.get("loadavg_end", [0.0])[0])
    if not busy(info):
        return f"machine quiet (64 MiB copy probe <= {probe} ms, load average <= {load}): wall-clock figures hold"
    quietest = quietest_probe_ms(str(info.get("cpu")), info.get("nproc"))
    quiet = f"quiet: under {QUIET_PROBE_MS:g}" + (f" and {BUSY_FACTOR:g}x this CPU's quietest stored, {quietest} ms"
                                                  if quietest is not None else "")
    return (f"MACHINE BUSY (64 MiB copy probe up to {probe} ms, {quiet}; load average up to {load}): wall-clock "
            "ratios are unreliable in this run; the CPU-time ratios beside them are less affected. Re-run on a quiet "
            "machine.")


def enough_rounds(repeats: int, info: Mapping[str, Any], explicit: bool) -> int:
    """`repeats`, doubled when the machine is busy at the start and the count was not given (`--repeats`): the
    median of many paired ratios, not of a few, on a shared machine."""
    if explicit or not busy(info):
        return repeats
    say(f"MACHINE BUSY at the start (load average {info['loadavg_start'][0]}, 64 MiB copy probe "
        f"{info['probe_copy_64mib_ms_start']} ms): {2 * repeats} rounds instead of {repeats}")
    return 2 * repeats


def end_line(info: Mapping[str, Any]) -> str:
    return (f"load average {info['loadavg_start']} at start, {info['loadavg_end']} at end; 64 MiB copy_ probe "
            f"{info['probe_copy_64mib_ms_start']} ms at start, {info['probe_copy_64mib_ms_end']} ms at end")


# ---- timing ----------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One thing to time. `setup` runs untimed before every timed `run` (e.g. begin_reload before a refresh)."""

    name: str
    run: Callable[[], object]
    setup: Callable[[], object] | None = None


class Eviction:
    """A 64 MiB copy (two 64 MiB tensors, made once): run in an arm's setup, untimed, before the arm's own setup,
    it gives every arm the same cache state to start from. Arms rotate each round, but who follows whom does not
    change: without it an arm that always follows a 256 MiB copy, or an allocation of one, runs colder than the
    arm it is compared with."""

    def __init__(self) -> None:
        self._src = torch.empty(16 * 2**20)
        self._dst = torch.empty_like(self._src)

    def before(self, setup: Callable[[], object] | None = None) -> Callable[[], None]:
        """A setup that evicts, then runs `setup` (if any)."""

        def run() -> None:
            self._dst.copy_(self._src)
            if setup is not None:
                setup()

        return run


def interleaved(arms: Sequence[Arm], repeats: int, *, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter,
                faults: dict[str, list[int]] | None = None,
                cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Time every arm `repeats` times (seconds), interleaved round by round with the order rotated each round, so
    drift and other tenants' load hit every arm alike. `warmup` untimed rounds first (page cache, allocator).
    `clock`: wall time by default; `time.thread_time` measures CPU work of this thread only (for pure-Python
    bookkeeping: it does not count time the scheduler gave to other tenants). `faults`, if given, gets each
    timed run's minor page faults (the process's): an arm whose buffers the allocator gives back to the system
    between rounds faults every page in again, which shows here and not in the arm's own code. `cpu`, if given,
    gets each timed run's CPU time of the process (every thread: what other tenants' load inflates least)."""
    samples: dict[str, list[float]] = {a.name: [] for a in arms}
    gc.collect()  # once: the collector is then off while an arm is timed, and runs (if due) in between
    for r in range(warmup + repeats):
        shift = r % len(arms)
        for arm in [*arms[shift:], *arms[:shift]]:
            if arm.setup is not None:
                arm.setup()
            gc.disable()
            try:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                c0 = time.process_time()
                t0 = clock()
                arm.run()
                dt = clock() - t0
                used = time.process_time() - c0
                faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            finally:
                gc.enable()
            if r >= warmup:
                samples[arm.name].append(dt)
                if faults is not None:
                    faults.setdefault(arm.name, []).append(faulted)
                if cpu is not None:
                    cpu.setdefault(arm.name, []).append(used)
    return samples


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="where the model's tensors live: cpu (default) or cuda (the GPU "
                                                   "check runs the benchmark so)")


def synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """`fn`, then on CUDA `torch.cuda.synchronize()`: a timed arm ends when its kernels have, not when they were
    queued."""
    if not str(device).startswith("cuda"):
        return fn

    def run() -> object:
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and quartiles in milliseconds."""
    ms = sorted(s * 1e3 for s in samples)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": round(statistics.median(ms), 4), "min_ms": round(ms[0], 4), "max_ms": round(ms[-1], 4),
            "p25_ms": round(q[0], 4), "p75_ms": round(q[2], 4), "n": len(ms)}


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Ratios a[i]/b[i] of samples taken in the same round: median and quartiles (robust to slow drift)."""
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    return {"median": round(statistics.median(r), 4), "p25": round(q[0], 4), "p75": round(q[2], 4)}


def per_call_us(fn: Callable[[], object], *, number: int, repeats: int = 5) -> dict[str, float]:
    """Microseconds per call of a cheap `fn`: `repeats` batches of `number` calls; median and min of the batches."""
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        per.append((time.perf_counter() - t0) / number * 1e6)
    return {"median_us": round(statistics.median(per), 3), "min_us": round(min(per), 3)}


def ms(t: Mapping[str, float]) -> str:
    """A summarized arm as shown: `12.3 (11.9-14)` (median, min-max, ms)."""
    return f"{num(t['median_ms'])} ({num(t['min_ms'])}-{num(t['max_ms'])})"


def spread(s: Mapping[str, float]) -> str:
    return f"{s['min_ms']:.3g}-{s['max_ms']:.3g}"


def mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 2)


def read_floor_bucket(index: Mapping[str, Any], names: Sequence[str], staging: MappedBuffer,
                      fds: dict[Path, int]) -> list[tuple[str, torch.Tensor]]:
    """The floor's read of one bucket: each tensor's bytes read once (`os.preadv`, one descriptor per file kept in
    `fds` for the caller to close) into the reused `staging` buffer at 64-byte aligned offsets; returns a tensor of
    each one's dtype and shape over its bytes, made as the plugin's reader makes it (`MappedBuffer.value`: one
    tensor per value)."""
    offset, views = 0, []
    for name in names:
        e = index[name]
        fd = fds.get(e.path)
        if fd is None:
            fd = fds[e.path] = os.open(e.path, os.O_RDONLY)
        os.preadv(fd, [staging.bytes[offset:offset + e.nbytes]], e.start)
        views.append((name, staging.value(e.dtype, e.shape, offset)))
        offset += padded(e.nbytes)
    return views


# ---- the synthetic many-tensor draft ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ManyTensorConfig:
    """A draft with many small tensors per layer (an MoE-style draft: attention plus `num_experts` experts with
    their own gate_up/down projections): 7 + 2 * num_experts tensors per layer."""

    hidden_size: int = 256
    num_hidden_layers: int = 16
    num_experts: int = 60
    expert_intermediate_size: int = 48
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6


class _Expert(nn.Module):
    def __init__(self, c: ManyTensorConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.expert_intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.expert_intermediate_size, c.hidden_size, bias=False)


class _Attention(nn.Module):
    def __init__(self, c: ManyTensorConfig) -> None:
        super().__init__()
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class _MoELayer(nn.Module):
    def __init__(self, c: ManyTensorConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(c) for _ in range(c.num_experts))


class ManyTensorDraft(DraftBackbone):
    """Synthetic draft backbone with thousands of small tensors; derives a fused KV weight and stacked k-norms
    exactly as the DFlash draft does. Only loading and refreshing are exercised (no forward)."""

    derived_buffers = (
        concat("_fused_kv_weight", sources=("self_attn.qkv_proj.weight",),
               per_layer=lambda layer: layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:]),
        stack("_k_norm_weights", sources=("self_attn.k_norm.weight",),
              per_layer=lambda layer: layer.self_attn.k_norm.weight),
    )

    def __init__(self, config: ManyTensorConfig | None = None, *, device: str | torch.device = "meta",
                 name: str = "many-tensor") -> None:
        super().__init__()
        c = self.config = config or ManyTensorConfig()
        with torch.device(device):
            self.layers = nn.ModuleList(_MoELayer(c) for _ in range(c.num_hidden_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.init_lifecycle(name)


def checkpoint_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---- building loaded drafts without a checkpoint on disk -------------------------------------------------------


def materialize(model: DraftBackbone, seed: int, device: str = "cpu") -> None:
    """Load random weights into a META model through the lifecycle, one bucket per layer (only one layer's
    tensors exist besides the model at any time), on `device`, then finalize: the model ends FINALIZED."""
    gen = torch.Generator().manual_seed(seed)
    lc = model.lifecycle
    for names in lc.readiness.tensors_of_layer.values():
        bucket = []
        for name in names:
            spec = lc.specs[name]
            low, high = (0.5, 1.5) if name.endswith("norm.weight") else (-0.05, 0.05)
            value = torch.empty(spec.shape, dtype=torch.float32).uniform_(low, high, generator=gen)
            bucket.append((name, value.to(spec.dtype)))
        apply_bucket(model, bucket, device)
    model.finalize_loading()


def mark_reloaded(model: DraftBackbone, layers: Sequence[int] | None = None) -> None:
    """Start a reload epoch and report tensors as written again, without writing them: all of them, or (with
    `layers`) only those of these decoder layers, the rest declared unchanged. Ends FULLY_LOADED."""
    lc = model.lifecycle
    model.begin_reload()
    if layers is None:
        lc.weights_loaded(list(lc.specs))
        model.finalize_loading()
    else:
        prefixes = tuple(f"layers.{i}." for i in layers)
        lc.weights_loaded([n for n in lc.specs if n.startswith(prefixes)])
        model.finalize_loading(keep_untouched=True)
