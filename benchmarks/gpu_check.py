"""Prepared GPU check: a captured CUDA graph replayed after an in-place reload reads the NEW weights; after a
vLLM-style rebuild it reads STALE ones. Then the tracking and refresh benchmarks with the tensors on the GPU.

    python -m benchmarks.gpu_check                 # on a CUDA machine (3-4 minutes); skips (exit 0) without CUDA
    python -m benchmarks.gpu_check --device cpu    # the same checks with a CPU stand-in for the graph
    python -m benchmarks.gpu_check --device cpu --benchmarks --quick   # and the benchmarks' GPU path, on the CPU

For every draft family in `models.FAMILIES`, on the device:
  1. write checkpoints A and B; cold-load a reference model from B and run its fused path eagerly (`expected`)
  2. lifecycle: load A, refresh, capture the fused path in a `torch.cuda.CUDAGraph` (warm-up on a side stream,
     static inputs), pin (`capture_graphs`); reload B through the lifecycle (shuffled buckets of 3, finalize,
     in-place refresh); replay the graph WITHOUT re-capture: the output must equal `expected`
  3. vLLM-style: load A, refresh, capture; write B's weights straight into the parameters (no lifecycle), rebuild
     the derived buffers with `torch.cat`/`torch.stack` into NEW tensors and rebind the attributes (what vLLM's
     `_build_fused_kv_buffers` does); eager output then equals `expected`, but the replay still reads the
     buffers captured before: it must DIFFER from `expected` (stale). The old buffers are kept referenced, so
     the replay reads stale values rather than freed memory (vLLM frees them: garbage or an illegal access).
  4. level-2 sleep: load A, refresh, capture; what vLLM's level-2 sleep and wake do (buffers saved, the weights'
     memory released and mapped back at the same addresses holding other bytes, NaN here, the buffers copied
     back) and what the plugin does (quarantined, every layer owed a full write); the refill with B through the
     lifecycle; the replay WITHOUT re-capture must equal `expected` (vLLM #52479: acceptance fell to 0 there).
The CPU stand-in (`--device cpu`) replays with the tensor objects that existed at capture swapped back into the
module, which is what a graph does with addresses; everything else (loading, comparisons, verdicts) is shared.
Prints the checks' table (the replay before the reload equal to eager A, after it equal to a cold B or stale);
exit 1 if a check fails; writes JSON (`benchmarks/results/gpu_check.json` or `--json`).
With `--benchmarks` (the default on CUDA): `benchmarks.tracking_overhead` and `benchmarks.refresh` run next with
`--device` set, fewer repeats (`--bench-repeats`, 7), their tables printed and written beside the JSON
(`gpu_tracking_overhead.json`, `gpu_refresh.json`): the loader's tracking cost and the in-place refresh against a
`copy_` and vLLM's rebuild, on the GPU; then `benchmarks.gpu_push` (`gpu_push.json`): a push of each standalone
family (begin_reload, load_safetensors, finalize_loading, in-place refresh) against the floor of the bytes it moves,
the figures `benchmarks.engine_push` gives inside vLLM on the CPU (no vLLM on a lent GPU machine); on CUDA only.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

if __package__ in (None, ""):  # run as a file: python benchmarks/gpu_check.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import common
from benchmarks.stored import Summary, num
from lifecycle import DraftBackbone
from lifecycle.events import configure_audit
from lifecycle.loading import checkpoint_index, iter_buckets, load_safetensors, write_checkpoint, write_tensor
from lifecycle.storage import StorageIdentity
from models import FAMILIES, DraftFamily

NAME = "gpu_check"
MEASURED = ("lifecycle", ":(exclude)lifecycle/vllm", ":(exclude)lifecycle/audit", "models", "benchmarks/gpu_check.py",
            "benchmarks/gpu_push.py")
SLEEP = "level-2 sleep, refill"
ATOL = 1e-5  # replay vs eager of the same weights: same kernels, expected bit-exact; this allows reassociation
STALE_MIN_DIFF = 1e-3  # A and B are independent random weights: stale outputs differ by far more than this

Outputs = tuple[torch.Tensor, ...]


# ---- replaying what was captured ---------------------------------------------------------------------------------


class Replayer(Protocol):
    def capture(self) -> None: ...

    def replay(self) -> Outputs: ...


class CudaGraphReplayer:
    """A real CUDA graph of `fn` (which reads only the model's tensors and static inputs)."""

    def __init__(self, fn: Callable[[], Outputs]) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_out: Outputs = ()

    def capture(self) -> None:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy init, kernel selection)
            for _ in range(3):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = self.fn()
        torch.cuda.synchronize()

    def replay(self) -> Outputs:
        assert self.graph is not None, "capture() first"
        self.graph.replay()
        torch.cuda.synchronize()
        return tuple(t.clone() for t in self.static_out)


class PinnedReplayer:
    """CPU stand-in for a graph: remembers every tensor object the model holds at capture (parameters, buffers,
    derived buffers) and replays `fn` with exactly those objects swapped back in, as a graph replays with the
    addresses it captured. A refresh that wrote in place changed what those objects hold; a rebuild did not."""

    def __init__(self, model: DraftBackbone, fn: Callable[[], Outputs]) -> None:
        self.model = model
        self.fn = fn
        self.captured: dict[str, torch.Tensor | None] = {}

    def _slots(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, the dict that holds it) once per distinct slot (a shared module's tensor has several names)."""
        seen: set[tuple[int, str]] = set()
        out = []
        for name, (mod, leaf) in self.model._tensor_slots.items():
            if (id(mod), leaf) not in seen:
                seen.add((id(mod), leaf))
                out.append((name, mod._parameters if leaf in mod._parameters else mod._buffers))
        return out

    def capture(self) -> None:
        self.captured = self.model.graph_visible_tensors()
        self.fn()

    def replay(self) -> Outputs:
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for name, table in self._slots():
                leaf = self.model._tensor_slots[name][1]
                swapped.append((table, leaf, table.get(leaf)))
                table[leaf] = self.captured.get(name)
            return tuple(t.clone() for t in self.fn())
        finally:
            for table, leaf, live in reversed(swapped):
                table[leaf] = live


def make_replayer(model: DraftBackbone, fn: Callable[[], Outputs], device: str) -> Replayer:
    return CudaGraphReplayer(fn) if device.startswith("cuda") else PinnedReplayer(model, fn)


# ---- the vLLM-style rebuild (no lifecycle) ---------------------------------------------------------------------


def vllm_write_weights(model: DraftBackbone, path: Path, device: str) -> None:
    """Write every tensor of `path` into the existing parameters (copy_ in place), no lifecycle call: what
    vLLM's weight loaders do on reload."""
    index = checkpoint_index(path)
    for bucket in iter_buckets(index, [list(index)]):
        for name, value in bucket:
            write_tensor(model, name, value, device)


@torch.no_grad()
def vllm_rebuild(model: DraftBackbone) -> dict[str, torch.Tensor]:
    """Rebuild every derived buffer into NEW storage and rebind the attribute (vLLM's `torch.cat` after
    `load_weights`). Returns the buffers it replaced, so the caller can keep them alive."""
    old: dict[str, torch.Tensor] = {}
    for spec in model.derived_buffers:
        if spec.kind == "alias":
            continue  # its source was written in place (copy_): re-pointing the alias would change nothing
        if spec.kind in ("concat", "stack"):
            layers = functools.reduce(getattr, spec.layers_attr.split("."), model)
            assert spec.per_layer is not None
            slices = [spec.per_layer(layer) for layer in layers]  # type: ignore[attr-defined]
            new = torch.stack(slices) if spec.kind == "stack" else torch.cat(slices, spec.dim)
        else:
            assert spec.build is not None
            new = spec.build(model).clone()
        current = model._buffers.get(spec.name)
        if current is not None:
            old[spec.name] = current
        setattr(model, spec.name, new)  # a registered buffer: rebinding the attribute replaces it in _buffers
        assert model._buffers[spec.name] is new
    return old


# ---- the check -----------------------------------------------------------------------------------------------


@dataclass
class Row:
    family: str
    device: str
    path: str
    recaptured: bool
    buffers_kept_address: bool
    lifecycle_pins_ok: bool
    captured_before_reload_ok: bool  # the replay before the reload equals eager A (the capture itself works)
    eager_after_equals_expected: bool
    replay_equals_expected: bool
    replay_bit_exact: bool
    max_abs_diff: float
    expect_replay_equal: bool
    ok: bool


def max_diff(a: Outputs, b: Outputs) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def outputs_equal(a: Outputs, b: Outputs) -> bool:
    return all(x.shape == y.shape and torch.allclose(x, y, rtol=0.0, atol=ATOL) for x, y in zip(a, b, strict=True))


def derived_identities(model: DraftBackbone) -> dict[str, StorageIdentity]:
    return {n: StorageIdentity.of(t) for n in model.derived_buffer_names() if (t := model._buffers.get(n)) is not None}


def loaded(family: DraftFamily, cfg: Any, path: Path, device: str, name: str) -> DraftBackbone:
    model = family.build(cfg, device="meta", name=name)
    load_safetensors(model, path, device=device)
    model.finalize_loading()
    model.refresh_derived_buffers()
    return model


@torch.no_grad()
def check_family(family: DraftFamily, device: str, tmp: Path, *, layers: int = 3, seed: int = 0) -> list[Row]:
    """Both paths for one family on one device; see the module docstring."""
    cfg = family.config(num_hidden_layers=layers)
    path_a = write_checkpoint(family.random_weights(cfg, seed), tmp / f"{family.name}-A.safetensors")
    path_b = write_checkpoint(family.random_weights(cfg, seed + 1), tmp / f"{family.name}-B.safetensors")
    inputs = family.example_inputs(cfg, seed + 7, device)  # static inputs: the same tensors at capture and replay
    expected = tuple(t.clone() for t in family.fused(loaded(family, cfg, path_b, device, "cold-B"), inputs))
    rows = []
    for path in ("lifecycle in place", "vLLM rebuild", SLEEP):
        model = loaded(family, cfg, path_a, device, f"{family.name}-{path}")
        eager_a = tuple(t.clone() for t in family.fused(model, inputs))
        replayer = make_replayer(model, lambda m=model: family.fused(m, inputs), device)
        replayer.capture()
        model.capture_graphs()
        before_ok = outputs_equal(replayer.replay(), eager_a)
        ids = derived_identities(model)
        kept_alive: dict[str, torch.Tensor] = {}
        discarded_ok = True
        if path == SLEEP:
            discarded_ok = level_2_sleep(model)
        if path in ("lifecycle in place", SLEEP):
            model.begin_reload()
            load_safetensors(model, path_b, bucket_by=3, shuffle=True, seed=seed, device=device)
            model.finalize_loading()
            model.refresh_derived_buffers()
        else:
            vllm_write_weights(model, path_b, device)
            kept_alive = vllm_rebuild(model)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        eager_after = tuple(t.clone() for t in family.fused(model, inputs))
        out = replayer.replay()  # no re-capture
        kept = derived_identities(model) == ids
        pins_ok = not model.lifecycle.pinned_changes()
        equal = outputs_equal(out, expected)
        diff = max_diff(out, expected)
        expect_equal = path != "vLLM rebuild"
        ok = (discarded_ok and before_ok and outputs_equal(eager_after, expected)
              and (equal if expect_equal else (not equal and diff > STALE_MIN_DIFF)))
        rows.append(Row(family.name, device, path, False, kept, pins_ok, before_ok,
                        outputs_equal(eager_after, expected), equal,
                        all(torch.equal(x, y) for x, y in zip(out, expected, strict=True)), diff, expect_equal, ok))
        del kept_alive
    return rows


@torch.no_grad()
def level_2_sleep(model: DraftBackbone) -> bool:
    """What vLLM's level-2 sleep and wake do to a draft (vLLM #52479), and what the plugin does about it
    (`lifecycle.vllm.reload.epoch.discard`): its buffers saved, its weights' memory released and mapped back at the
    same addresses holding other bytes (NaN here), the buffers copied back; the draft quarantined, owed a full write
    of every layer. True when it then refuses to serve and its derived buffers kept their storage."""
    lc = model.lifecycle
    saved = {n: t.clone() for n, t in model.named_buffers()}
    ids = derived_identities(model)
    for p in model.parameters():
        if p.dtype.is_floating_point:
            p.fill_(float("nan"))
    for n, t in model.named_buffers():
        t.copy_(saved[n])
    lc.audit_event("weights_discarded", cause="a level-2 sleep (gpu_check)")
    model.begin_reload()
    lc.readiness.require_full_write(list(lc.readiness.tensors_of_layer), "a level-2 sleep (gpu_check)")
    lc.abort_reload("weights discarded by a level-2 sleep")
    return lc.quarantined and lc.recovery_blocker is not None and derived_identities(model) == ids


def run(device: str, families: Sequence[str] | None = None, layers: int = 3) -> list[Row]:
    configure_audit(console=False)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as d:
        for name in families or list(FAMILIES):
            rows.extend(check_family(FAMILIES[name], device, Path(d), layers=layers))
    return rows


def print_table(rows: Sequence[Row]) -> None:
    common.say(common.table(
        ["family", "device", "reload path", "replay before == eager A", "re-captured", "buffer addresses kept",
         "pins verified", "replay after == cold-B eager", "max |diff|", "expected", "check"],
        [[r.family, r.device, r.path, "yes" if r.captured_before_reload_ok else "NO",
          "no" if not r.recaptured else "yes", "yes" if r.buffers_kept_address else "NO",
          "yes" if r.lifecycle_pins_ok else "NO (drift)",
          ("yes (bit-exact)" if r.replay_bit_exact else "yes") if r.replay_equals_expected else "NO (stale)",
          f"{r.max_abs_diff:.2e}", "equal" if r.expect_replay_equal else "stale",
          "PASS" if r.ok else "FAIL"] for r in rows]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (default) or cpu (the CPU stand-in for a graph)")
    p.add_argument("--quick", action="store_true", help="tiny benchmark sizes (the checks' sizes are already tiny)")
    p.add_argument("--layers", type=int, default=3, help="decoder layers per draft (default 3)")
    p.add_argument("--family", action="append", default=None, choices=sorted(FAMILIES),
                   help="only this family (repeatable; default: every family)")
    p.add_argument("--json", type=Path, default=None, help=f"where to write the JSON (default "
                                                            f"{common.RESULTS_DIR}/{NAME}.json)")
    p.add_argument("--benchmarks", action=argparse.BooleanOptionalAction, default=None,
                   help="then run the tracking and refresh benchmarks on the device (default: on CUDA only)")
    p.add_argument("--bench-repeats", type=int, default=7, help="repeats of those benchmarks (default 7)")
    args = p.parse_args(argv)
    out_path = args.json or common.RESULTS_DIR / f"{NAME}.json"
    device = args.device or "cuda"
    info = common.machine_info()
    if device.startswith("cuda") and not torch.cuda.is_available():
        msg = ("gpu_check: SKIPPED: no CUDA device (torch.cuda.is_available() is False). Run it on a CUDA "
               "machine, or with --device cpu for the CPU stand-in.")
        common.say(msg)
        common.finish(info)
        skipped = Summary()
        skipped.note(f"Skipped: {msg}")
        skipped.target("GPU check: CUDA-graph replay after an in-place reload, and the push on CUDA", "not run "
                       "(no GPU)", None)
        if args.json is None:  # `make bench` without CUDA: the stored result (a CUDA machine's) stays as it is
            common.say(f"not stored: {out_path} keeps the last CUDA machine's result")
            return 0
        common.store(args, NAME, {"skipped": True, "reason": msg, "rows": []}, info, skipped, MEASURED, path=out_path)
        return 0
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    rows = run(device, args.family, args.layers)
    elapsed = time.perf_counter() - t0
    ok = all(r.ok for r in rows)
    common.finish(info)
    common.say(f"gpu_check on {device}{' (' + info['gpu'] + ')' if 'gpu' in info else ' (CPU stand-in for a graph)'}"
               f": {len(FAMILIES if not args.family else args.family)} families, {elapsed:.1f} s\n")
    print_table(rows)
    common.say("\nRESULT: " + ("all checks passed" if ok else "SOME CHECKS FAILED"))
    common.store(args, NAME, {"skipped": False, "device": device, "elapsed_s": round(elapsed, 2), "ok": ok,
                              "rows": [asdict(r) for r in rows]}, info, summary(rows, device, ok), MEASURED,
                 path=out_path)
    if args.benchmarks if args.benchmarks is not None else device.startswith("cuda"):
        run_benchmarks(device, out_path.parent, args.bench_repeats, args.quick)
    return 0 if ok else 1


def summary(rows: Sequence[Row], device: str, ok: bool) -> Summary:
    out = Summary()
    out.table(["family", "path", "buffers kept their address", "replay reads the new weights", "max abs diff",
               "check"],
              [(r.family, r.path, num(r.buffers_kept_address), num(r.replay_equals_expected), r.max_abs_diff,
                "ok" if r.ok else "FAIL") for r in rows])
    what = "CUDA graphs" if device.startswith("cuda") else f"the {device} stand-in for a graph"
    out.target(f"GPU check logic on {what}", f"{sum(r.ok for r in rows)} of {len(rows)} checks pass", ok)
    return out


def run_benchmarks(device: str, folder: Path, repeats: int, quick: bool) -> None:
    """The tracking, refresh and push benchmarks with the tensors on `device`, each writing `gpu_NAME.json/.txt` in
    `folder` (their own tables are printed as they run)."""
    from benchmarks import gpu_push, refresh, tracking_overhead

    # the push on the CPU is `benchmarks.engine_push`'s, inside vLLM: `gpu_push --device cpu` runs it standalone
    for module in (tracking_overhead, refresh, *([gpu_push] if device.startswith("cuda") else [])):
        print(f"\n==== {module.NAME} on {device} ====", flush=True)
        json_name = "gpu_push.json" if module is gpu_push else f"gpu_{module.NAME}.json"
        module.main(["--device", device, "--repeats", str(repeats), "--json", str(folder / json_name),
                     *(["--quick"] if quick else [])])


if __name__ == "__main__":
    sys.exit(main())
