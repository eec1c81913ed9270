"""K/V shadows: the bytes a vLLM draft with the plugin holds beyond stock vLLM's draft of the same checkpoint.

    python -m benchmarks.shadow_memory [--quick] [--json PATH]

In-process (vLLM's own classes and loader under a CPU VllmConfig, `tests/support/vllm_inprocess.py`), per family with a
K/V shadow and per weight layout (`cpu`: vLLM's CPU repack empties the attention weight; `gpu`: it keeps it, as
on CUDA, simulated), a tiny draft is cold-loaded twice: by stock vLLM's class and by the plugin's. Counted, not
timed: the bytes of the distinct storages behind every parameter, buffer and tensor the family's builders set
(stock vLLM keeps its fused buffers as plain attributes), the K/V shadows and how many of them are views of the
fused buffer. "main" is what the plugin allocated before issue #15's item 2: one shadow per layer on every layout,
the K/V rows in checkpoint layout, i.e. the fused K/V buffer's size again (computed from that buffer; main's code
measured the same way once gave exactly these figures for DFlash and Gemma4 DSpark on both layouts).
Target (issue #15): bytes over stock = 0 for every family and layout. `--quick`: two families.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a file: python benchmarks/shadow_memory.py
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the in-process vLLM harness

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.stored import Summary, verdict  # noqa: E402

NAME = "shadow_memory"
MEASURED = ("lifecycle/vllm/drafts", "lifecycle/vllm/reload", "benchmarks/shadow_memory.py",
            "tests/support/vllm_inprocess.py")
FAMILIES = ("dflash", "dflash2", "qwen3_dspark", "gemma4_dspark", "laguna_dflash")
QUICK = ("dflash", "gemma4_dspark")
LAYOUTS = ("cpu", "gpu")


def fused_kv_bytes(model: Any, fam: str) -> int:
    """Bytes of the family's fused K/V buffer (the one its shadows back): what main's shadows cost."""
    from lifecycle.vllm.drafts.families import SHADOW, family

    inner = model.model
    specs = [s for s in family(fam).derived() if any(src.endswith(SHADOW) for src in s.sources)]
    return sum(t.numel() * t.element_size() for s in specs if isinstance(t := getattr(inner, s.name), torch.Tensor))


def measure(fam: str, layout: str, work: Path) -> dict[str, Any]:
    from support.vllm_inprocess import CASES, build, gpu_weight_layout, make_draft, memory

    case = CASES[fam].with_structure()
    folder = work / fam
    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        if not folder.exists():
            make_draft(case, folder, 1, work / "target")
        stock = memory(build(case, folder, work / "target", stock=True), fam)
        model = build(case, folder, work / "target")
        plugin = memory(model, fam)
        main_shadows = fused_kv_bytes(model, fam)
    return {"family": fam, "layout": layout, "stock_bytes": stock["bytes"], "plugin_bytes": plugin["bytes"],
            "over_stock_bytes": plugin["bytes"] - stock["bytes"], "main_over_stock_bytes": main_shadows,
            "shadows": plugin["shadows"], "shadow_views": plugin["shadow_views"],
            "shadow_bytes_apart": plugin["shadow_bytes_apart"],
            "met": plugin["bytes"] == stock["bytes"] and plugin["shadow_bytes_apart"] == 0}


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser(NAME, __doc__.splitlines()[0], repeats=1).parse_args(argv)
    common.setup_run(args, default_repeats=1)
    from lifecycle.vllm.demo.tiny import make_target
    from support.vllm_inprocess import setup

    info = common.machine_info()
    run = "quick" if args.quick else "full"
    common.say(f"K/V shadow memory: a vLLM draft with the plugin beside stock vLLM's ({run} run; deterministic byte "
               "counts, in-process, tiny drafts)")
    common.say(common.machine_line(info))
    setup()
    families = QUICK if args.quick else FAMILIES
    with common.scratch("bench-shadow-") as d:
        work = Path(d)
        make_target(work / "target")
        rows = [measure(fam, layout, work) for fam in families for layout in LAYOUTS]
    common.finish(info)
    common.say("\nbytes of distinct storages (parameters, buffers, the builders' tensors); target: over stock = 0")
    common.say(common.table(
        ["family", "layout", "stock", "plugin", "over stock", "main over stock", "shadows (views)", "target"],
        [[r["family"], r["layout"], r["stock_bytes"], r["plugin_bytes"], r["over_stock_bytes"],
          r["main_over_stock_bytes"], f"{r['shadows']} ({r['shadow_views']})", "met" if r["met"] else "MISSED"]
         for r in rows]))
    met = sum(r["met"] for r in rows)
    common.say(f"\nTARGETS: {met}/{len(rows)} met (over stock = 0 bytes)")
    common.say("\n" + common.end_line(info))
    summary = Summary()
    summary.table(["family", "layout", "stock bytes", "plugin bytes", "over stock", "shadows", "shadows that are views",
                   "target"],
                  [(r["family"], r["layout"], r["stock_bytes"], r["plugin_bytes"], r["over_stock_bytes"], r["shadows"],
                    r["shadow_views"], verdict(r["met"])) for r in rows])
    summary.target("K/V shadows: 0 bytes over stock vLLM, every shadowed family and layout",
                   f"{met} of {len(rows)} cases at 0", met == len(rows))
    common.store(args, NAME, {"rows": rows, "targets": len(rows), "targets_met": met}, info, summary, MEASURED)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
