"""What `reload_session(rollback=True)` costs in memory, measured.

    .venv/bin/python benchmarks/rollback_memory.py            # prints a markdown table
    .venv/bin/python benchmarks/rollback_memory.py --hidden 1024 --layers 8

For each reload (all tensors, half the layers, one layer) the same session runs twice from the same state, with
rollback off and on, under `count_allocations()` (every new torch storage, counted at the dispatcher). The
difference is what the snapshot cost; it is compared with the bytes of the distinct tensors the reload touched
and with the whole checkpoint. The snapshot is released at commit or abort.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from lifecycle.events import configure_audit
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.storage import count_allocations
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights


def measure(cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path, prefixes: tuple[str, ...]) -> tuple[int, int, int, int]:
    """(tensors touched, bytes touched, snapshot_bytes, measured extra bytes) for a reload of `prefixes`."""
    m = DFlashQwen3Draft(cfg)
    load_safetensors(m, ckpt_a)
    m.finalize_loading()
    m.refresh_derived_buffers()
    m.capture_graphs()
    subset = [n for n in m.lifecycle.specs if n.startswith(prefixes)]
    touched = sum(m.get_parameter(n).numel() * m.get_parameter(n).element_size() for n in subset)
    allocated = {}
    for rollback in (True, False):
        with count_allocations() as log, m.reload_session(rollback=rollback) as s:
            s.load(ckpt_b, subset=subset, bucket_by="layer")
            s.abort("measure")
        allocated[rollback] = (log.bytes_allocated, s.snapshot_bytes)
        if rollback:
            m.recover()  # the exact rollback makes the second run start from the same state
    return len(subset), touched, allocated[True][1], allocated[True][0] - allocated[False][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    configure_audit(console=False)
    cfg = DFlashConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=max(2, args.hidden // 128), num_key_value_heads=1,
                       head_dim=min(128, args.hidden // 2))
    with tempfile.TemporaryDirectory() as d:
        a = write_checkpoint(random_weights(cfg, 0), Path(d) / "a.safetensors")
        b = write_checkpoint(random_weights(cfg, 1), Path(d) / "b.safetensors")
        total = a.stat().st_size
        half = tuple(f"layers.{i}." for i in range(args.layers // 2))
        cases = {"full reload": ("",), f"{len(half)} of {args.layers} layers": half, "1 layer": ("layers.0.",)}
        print(f"DFlash draft, hidden {args.hidden}, {args.layers} layers, float32: checkpoint {total / 2**20:.1f} MiB")
        print()
        print("| reload | tensors | touched bytes | snapshot_bytes | measured extra storage | of checkpoint |")
        print("|---|---|---|---|---|---|")
        for label, prefixes in cases.items():
            n, touched, snap, extra = measure(cfg, a, b, prefixes)
            print(f"| {label} | {n} | {touched / 2**20:.2f} MiB | {snap / 2**20:.2f} MiB | {extra / 2**20:.2f} MiB "
                  f"| {extra / total:.0%} |")


if __name__ == "__main__":
    main()
