"""Selective refresh: a reload that touched k of L layers rewrites only those k slices.

    python -m benchmarks.selective [--quick] [--repeats N] [--json PATH] [--threads T]

The refresh benchmark's draft (8 layers, 256 MiB fused KV weight, graphs captured). For k = 1, 2, 4, ..., L a
reload reports k evenly spaced layers as written and declares the rest unchanged
(`finalize_loading(keep_untouched=True)`); then `refresh_derived_buffers()` is timed. All k are interleaved round
by round, at torch's default intra-op thread count and at 1 thread, each from the same cache state (a 64 MiB
copy before its setup: in the rotation k=1 follows k=L's full copy). Elements written come from the refresh
report (deterministic: k x (2 x kv_size x hidden + head_dim)).
Target (ARCHITECTURE.md): a reload that touched k of L layers refreshes in about k/L of a full refresh (the
anchor: one layer's slice ~0.11x of a plain copy of the whole buffer), for k >= 2. For k = 1 the ratio is reported,
not judged (issue 33: a fixed cost per refresh dominates one slice); the refresh's fixed cost is judged instead,
measured here on a tiny draft with graphs captured (`benchmarks.refresh.fixed_overhead`, CPU time): <= 0.3 ms.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python benchmarks/selective.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import common
from benchmarks.common import Arm
from benchmarks.refresh import big_config, fixed_overhead, fused_bytes, loaded_draft
from benchmarks.stored import Summary, iqr, num, verdict
from lifecycle.events import configure_audit

NAME = "selective"
TOLERANCE = 1.2  # "about k/L": within 1.2x of k/L, as the in-place refresh is within 1.2x of its floor
TARGET_FIXED_US = 300.0  # the refresh's fixed cost with graphs captured (k = 1's ratio is not judged)
MEASURED = ("lifecycle", ":(exclude)lifecycle/vllm", ":(exclude)lifecycle/audit", "models", "benchmarks/selective.py",
            "benchmarks/refresh.py")


def spread(k: int, layers: int) -> list[int]:
    """k evenly spaced layer indices out of `layers`.

    >>> spread(1, 8), spread(2, 8), spread(8, 8)
    ([0], [0, 4], [0, 1, 2, 3, 4, 5, 6, 7])
    """
    return sorted({i * layers // k for i in range(k)})


def ks(layers: int) -> list[int]:
    """1, 2, 4, ... up to and including `layers`.

    >>> ks(8), ks(6)
    ([1, 2, 4, 8], [1, 2, 4, 6])
    """
    out = [1]
    while out[-1] * 2 < layers:
        out.append(out[-1] * 2)
    return [*out, layers] if out[-1] != layers else out


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser(NAME, __doc__.splitlines()[0], repeats=15).parse_args(argv)
    repeats = common.setup_run(args, default_repeats=15)
    info = common.machine_info()
    repeats = common.enough_rounds(repeats, info, explicit=args.repeats is not None)
    configure_audit(console=False)
    cfg = big_config(args.quick)
    L = cfg.num_hidden_layers
    common.say(f"selective refresh: k of {L} layers reloaded ({'quick' if args.quick else 'full'} run, {repeats} "
               f"interleaved repeats per k)")
    common.say(common.machine_line(info))
    common.say(f"  building a DFlash draft: {L} layers, fused KV weight {common.mib(fused_bytes(cfg))} MiB ...")
    model = loaded_draft(cfg, "selective-bench")
    kv_slice = 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.hidden_size
    knorm_slice = cfg.head_dim

    def reload_k(k: int) -> None:
        common.mark_reloaded(model, spread(k, L))

    after_eviction = common.Eviction().before  # k=1 follows k=L's full copy in the rotation: level them
    arms = [Arm(f"k={k}", model.refresh_derived_buffers, after_eviction(lambda k=k: reload_k(k))) for k in ks(L)]
    default_threads = torch.get_num_threads()
    samples: dict[int, dict[str, list[float]]] = {}
    with torch.no_grad():
        for threads in dict.fromkeys([default_threads, 1]):
            torch.set_num_threads(threads)
            samples[threads] = common.interleaved(arms, repeats)
        torch.set_num_threads(default_threads)
        reports = {}
        for k in ks(L):
            reload_k(k)
            reports[k] = model.refresh_derived_buffers()
    fixed = fixed_overhead(repeats)
    common.finish(info)

    rows: list[dict[str, Any]] = []
    for threads, smp in samples.items():
        full = smp[f"k={L}"]
        for k in ks(L):
            name = f"k={k}"
            s = common.summarize(smp[name])
            paired = common.paired_ratio(smp[name], full)
            rep = reports[k]
            kv, kn = rep["_fused_kv_weight"], rep["_k_norm_weights"]
            rows.append({
                "k": k, "layers": L, "threads": threads, **s, "ratio_to_full": paired, "target_ratio": round(k / L, 4),
                "elements_written": rep.elements_written, "expected_elements": k * (kv_slice + knorm_slice),
                "slices_written": kv.slices_written, "slices_total": kv.slices_total,
                "knorm_slices_written": kn.slices_written, "bytes_allocated": rep.bytes_allocated,
                "met": None if k == 1 else paired["median"] <= TOLERANCE * k / L,
            })
    fixed_us = fixed["graphs_captured"]["median_us"]

    common.say(f"\nrefresh after a reload of k of {L} layers; median ms (min-max); x full = median of per-round "
               f"ratios to k={L} (IQR); target about k/L (met: <= {TOLERANCE} k/L)")
    common.say(common.table(
        ["k", "threads", "median ms", "min-max", "x full (IQR)", "k/L", "slices", "elements written", "expected",
         "target"],
        [[r["k"], r["threads"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.3g}-{r['max_ms']:.3g}",
          f"{r['ratio_to_full']['median']:.3f} ({r['ratio_to_full']['p25']:.3f}-{r['ratio_to_full']['p75']:.3f})",
          f"{r['target_ratio']:.3f}", f"{r['slices_written']}/{r['slices_total']}", r["elements_written"],
          r["expected_elements"], verdict(r["met"]) if r["met"] is not None else "(retired)"]
         for r in rows]))
    common.say(f"\nthe refresh's fixed cost (a tiny draft, CPU time, median): {fixed_us:.0f} us with graphs captured "
               f"({'met' if fixed_us <= TARGET_FIXED_US else 'MISSED'}: <= {TARGET_FIXED_US:.0f} us), "
               f"{fixed['no_graphs']['median_us']:.0f} us without; k=1 is reported, not judged (retired)")
    common.say("\n" + common.end_line(info))
    common.say(common.noise_note(info))
    common.store(args, NAME, {
        "repeats": repeats,
        "config": {"layers": L, "hidden_size": cfg.hidden_size, "num_key_value_heads": cfg.num_key_value_heads,
                   "head_dim": cfg.head_dim, "fused_kv_bytes": fused_bytes(cfg)},
        "tolerance": TOLERANCE, "rows": rows, "fixed_overhead": fixed, "target_fixed_us": TARGET_FIXED_US},
        info, summary(rows, fixed), MEASURED)
    return 0


def summary(rows: list[dict[str, Any]], fixed: dict[str, Any]) -> Summary:
    out = Summary()
    out.table(["k of L", "threads", "median ms (min-max)", "x full (IQR)", "k/L", "elements written", "target"],
              [(f"{r['k']} of {r['layers']}", r["threads"], common.ms(r), iqr(r["ratio_to_full"], num),
                f"{num(r['target_ratio'])} (<= {num(TOLERANCE)}x)", r["elements_written"],
                "(retired: reported)" if r["met"] is None else verdict(r["met"])) for r in rows])
    for r in rows:
        if r["met"] is not None and r["k"] < r["layers"]:
            out.target(f"selective refresh of {r['k']} of {r['layers']} layers in about k/L of a full one "
                       f"(<= {num(TOLERANCE)} k/L), {r['threads']} thread(s)", num(r["ratio_to_full"]["median"]),
                       r["met"])
    us = fixed["graphs_captured"]["median_us"]
    out.target(f"the refresh's fixed cost <= {TARGET_FIXED_US / 1e3:g} ms with graphs captured (tiny draft, CPU time)",
               f"{num(us / 1e3)} ms", us <= TARGET_FIXED_US)
    out.note(f"k = 1 is reported, not judged: a fixed cost per refresh dominates one slice. That cost (a tiny draft, "
             f"CPU time, median): {num(us)} µs with graphs captured ({fixed['pin_verification_passes_per_refresh']} "
             f"pin verifications of {num(fixed['pin_verification_pass_us'])} µs over {fixed['pinned_tensors']} "
             f"pinned tensors), {num(fixed['no_graphs']['median_us'])} µs without.")
    return out


if __name__ == "__main__":
    sys.exit(main())
