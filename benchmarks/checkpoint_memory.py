"""Peak extra memory of reading a checkpoint folder: bucket by bucket (`lifecycle.checkpoint`) vs the whole folder.

    .venv/bin/python benchmarks/checkpoint_memory.py              # prints a markdown table
    .venv/bin/python benchmarks/checkpoint_memory.py --files 8 --file-mib 32

A folder of safetensors files (float32 tensors of 4 MiB) is read once per arm, each arm in a fresh process: the
peak resident set (`VmHWM`, reset just before the read) minus the resident set then, while each bucket is consumed (one
pass over its values, as `load_weights` copies them) and dropped. Arms: `iter_buckets` with buckets of 1, 4 and
16 tensors, and what `reload_draft_weights` did before issue 12 (`safetensors.torch.load_file` of every file of
the folder, then the buckets). The reader allocates exactly each tensor's bytes and reads with `preadv`: the
page cache it fills is not resident in the process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TENSOR_MIB = 4


def _measure(folder: str, bucket: int) -> dict[str, float]:
    """Run in the child process: read `folder` in buckets of `bucket` tensors (0: the old whole-folder read)."""
    import torch

    from lifecycle.checkpoint import checkpoint_index, iter_buckets

    def status(field: str) -> int:  # kB in /proc/self/status
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    index = checkpoint_index(folder)
    names = sorted(index)
    torch.empty(TENSOR_MIB * 2**18).sum()  # warm the allocator and the kernels up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident set: imports peaked higher
    before = status("VmRSS")
    if bucket:
        buckets = [names[i:i + bucket] for i in range(0, len(names), bucket)]
        for b in iter_buckets(index, buckets):
            for _, t in b:
                t.sum()
            del b, t  # as load_weights: nothing of the bucket is kept
    else:
        from safetensors.torch import load_file

        items = [kv for f in sorted(Path(folder).glob("*.safetensors")) for kv in load_file(str(f)).items()]
        for i in range(0, len(items), 4):
            for _, t in items[i:i + 4]:
                t.sum()
        del items
    return {"peak_extra_mib": max(0, status("VmHWM") - before) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=32)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child[0], int(args.child[1]))))
        return
    import torch

    from lifecycle.loading import write_checkpoint

    per_file = args.file_mib // TENSOR_MIB
    with tempfile.TemporaryDirectory() as d:
        for f in range(args.files):
            write_checkpoint({f"layers.{f}.t{i}": torch.randn(TENSOR_MIB * 2**18) for i in range(per_file)},
                             Path(d) / f"model-{f:05d}.safetensors")
        total = args.files * per_file * TENSOR_MIB
        print(f"folder: {args.files} files x {args.file_mib} MiB = {total} MiB, tensors of {TENSOR_MIB} MiB")
        print()
        print("| read | bucket | peak extra resident memory |")
        print("|---|---|---|")
        for bucket, label in ((1, "iter_buckets"), (4, "iter_buckets"), (16, "iter_buckets"),
                              (0, "load_file per file (before)")):
            out = subprocess.run([sys.executable, __file__, "--child", d, str(bucket)], capture_output=True,
                                 text=True, check=True)
            mib = json.loads(out.stdout.splitlines()[-1])["peak_extra_mib"]
            size = f"{bucket} x {TENSOR_MIB} MiB = {bucket * TENSOR_MIB} MiB" if bucket else f"all {total} MiB"
            print(f"| {label} | {size} | {mib:.1f} MiB |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
