"""Every in-process draft family's reload payload checked from the headers alone (lifecycle/vllm/expected.py), for
tests/vllm_plugin/reload/test_payload_headers_first.py: vLLM's own draft classes, cold-loaded by vLLM's loader, no
engine (support/vllm_inprocess.py). One process:

    PYTHONPATH=.:tests python -m support.vllm_payload_scenarios families WORKDIR   -> prints one JSON line

Per family and structure (plain, and with every optional submodule): the family's own checkpoint must pass (no
false refusal; for DFlash also under the `midlayer.` names its `hf_to_vllm_mapper` renames), a deeper model's
checkpoint (the tiny target with two more layers) and the family's checkpoint with its largest tensor claiming
1 TiB (a sparse file) must be refused naming the tensor, without a single read of tensor data (`os.preadv`, the
reader's only read, counted); so must the own checkpoint with its largest tensor one row short or one row long
(and, for DFlash, a row short under the `midlayer.` names), naming the tensor and both shapes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from support.needs import needs
from support.vllm_basic_scenarios import _try, main

__all__ = ["run_payload_families"]


@needs("vllm", "slow")
def run_payload_families(work: Path) -> dict[str, Any]:
    """The `families` scenario in its own process (vLLM's classes, no engine)."""
    from support.vllm_runs import run_script

    return run_script("vllm_payload_scenarios", "families", work)


def _deeper_target(folder: Path, target: Path) -> Path:
    from safetensors.torch import load_file

    from lifecycle.checkpoint import write_checkpoint

    tensors = load_file(str(target / "model.safetensors"))
    for extra in (2, 3):
        tensors |= {n.replace("layers.1.", f"layers.{extra}."): t.clone() for n, t in tensors.items()
                    if n.startswith("model.layers.1.")}
    return write_checkpoint(tensors, folder / "model.safetensors").parent


def _sparse_largest(folder: Path, own: Path) -> tuple[Path, str]:
    from safetensors.torch import load_file

    from support.sparse_checkpoints import write_with_sparse_tensor

    tensors = load_file(str(own / "model.safetensors"))
    largest = max(tensors, key=lambda n: tensors[n].numel())
    rest = {n: t for n, t in tensors.items() if n != largest}
    write_with_sparse_tensor(folder / "model.safetensors", rest, largest, (2**38,))
    return folder, largest


def _renamed(folder: Path, own: Path, old: str, new: str) -> Path:
    from safetensors.torch import load_file

    from lifecycle.checkpoint import write_checkpoint

    tensors = load_file(str(own / "model.safetensors"))
    return write_checkpoint({n.replace(old, new, 1) if n.startswith(old) else n: t for n, t in tensors.items()},
                            folder / "model.safetensors").parent


def _reshaped(folder: Path, own: Path, rows: int, prefix: tuple[str, str] | None = None) -> tuple[Path, str, str]:
    """The family's own checkpoint with its largest tensor `rows` rows longer (or shorter): (folder, its name, the
    expected message part); `prefix`: names renamed (old, new) too."""
    import torch
    from safetensors.torch import load_file

    from lifecycle.checkpoint import write_checkpoint

    tensors = load_file(str(own / "model.safetensors"))
    name = max((n for n in tensors if tensors[n].dim()), key=lambda n: tensors[n].numel())
    t = tensors[name]
    tensors[name] = t[:rows] if rows < 0 else torch.cat([t, t[:rows]])
    if prefix is not None:
        tensors = {n.replace(*prefix, 1) if n.startswith(prefix[0]) else n: v for n, v in tensors.items()}
        name = name.replace(*prefix, 1) if name.startswith(prefix[0]) else name
    shown = f"{list(tensors[name].shape)}, but the draft's first load took {list(t.shape)}"
    return write_checkpoint(tensors, folder / "model.safetensors").parent, name, shown


def _checked(folder: Path, model: Any) -> dict[str, Any]:
    """check_payload over every tensor of `folder`, counting the data reads it made."""
    from lifecycle.checkpoint import checkpoint_index
    from lifecycle.vllm.reload.expected import check_payload

    index = checkpoint_index(folder)
    reads = [0]
    real = os.preadv

    def counted(*args: Any) -> int:
        reads[0] += 1
        return real(*args)

    os.preadv = counted
    try:
        out = _try(lambda: check_payload(index, list(index), model))
    finally:
        os.preadv = real
    return {**out, "reads": reads[0]}


def _names(folder: Path) -> list[str]:
    from lifecycle.checkpoint import checkpoint_index

    return list(checkpoint_index(folder))


def scenario_families(work: Path) -> dict[str, Any]:
    from lifecycle.vllm.drafts.owners import backbones_in
    from support import vllm_inprocess as vi

    vi.setup()
    vi._config(None, None, None)  # makes the tiny target
    assert vi._TARGET is not None
    deeper = _deeper_target(work / "deeper-target", vi._TARGET)
    out: dict[str, Any] = {"in_process_families": sorted(vi.CASES)}
    for fam, case in vi.CASES.items():
        for tag, c in (("plain", case), ("structure", case.with_structure())):
            own = vi.make_draft(c, work / f"{fam}-{tag}", 1)
            model = vi.build(c, own)
            sparse, largest = _sparse_largest(work / f"{fam}-{tag}-sparse", own)
            b = backbones_in(model)[0]
            out[f"{fam}/{tag}"] = {"own": _checked(own, model), "deeper_target": _checked(deeper, model),
                                   "sparse": _checked(sparse, model), "largest": largest,
                                   # the names the exact shape check knows: every one of the own checkpoint
                                   "unrecorded": sorted(set(_names(own)) - set(getattr(
                                       b.lifecycle_runtime.structure, "cold_shapes", ())))}
            for rows in (-1, 1):  # one row short, one row long (issue 32, item 5)
                folder, name, shown = _reshaped(work / f"{fam}-{tag}-rows{rows}", own, rows)
                out[f"{fam}/{tag}"][f"rows{rows:+d}"] = {**_checked(folder, model), "tensor": name, "shown": shown}
            out[f"{fam}/{tag}"]["state"] = b.lifecycle.state.value
            if fam == "dflash":  # vLLM's DFlash mapper renames `midlayer.` to `layers.0.` (EAGLE-style names)
                out[f"{fam}/{tag}"]["midlayer"] = _checked(
                    _renamed(work / f"{fam}-{tag}-midlayer", own, "layers.0.", "midlayer."), model)
                folder, name, shown = _reshaped(work / f"{fam}-{tag}-midlayer-short", own, -1,
                                                ("layers.0.", "midlayer."))
                out[f"{fam}/{tag}"]["midlayer_short"] = {**_checked(folder, model), "tensor": name, "shown": shown}
    return out


if __name__ == "__main__":
    main(globals())
