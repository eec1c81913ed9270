"""Writes that reach a draft without vLLM's reload entry points, with vLLM's own DFlash classes in-process
(`python -m support.vllm_writes_runs LAYOUT WORKDIR`), for tests/vllm_plugin/reload/test_vllm_writes.py: verl-speco's
draft update (`draft_model.model.load_weights(...)`, then `draft_model.model._build_fused_kv_buffers()` by hand), a
parameter's weight loader called directly, and the builder called by hand on a usable and on a quarantined draft.

Every check stands beside the action it checks (`expect`), in this process: the first one that fails ends the run,
and its line and message are the result (the test shows them), not a key of a dict of observations.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from support.vllm_inprocess import (
    CASES,
    ENV,
    backbone,
    build,
    derived_digests,
    gpu_weight_layout,
    identities,
    setup,
    weight_digests,
)
from support.vllm_trainer_paths import read

__all__ = ["run_writes"]

RESULT = "WRITES_RESULT "


def expect(condition: bool, message: str | Callable[[], str]) -> None:
    """An assertion whose failure names what was expected (the caller's line is in the traceback)."""
    if not condition:
        raise AssertionError(message() if callable(message) else message)


def _usable_and_current(model: Any, cold: dict[str, Any], pinned: dict[str, Any], what: str) -> None:
    """The draft serves B: usable, weights and every derived buffer bit-equal to a cold load of B, at the pinned
    addresses."""
    from lifecycle.vllm.serving.gate import drafting_allowed_for

    lc = backbone(model).lifecycle
    expect(lc.usable and lc.state.value == "GRAPH_CAPTURED", f"{what}: state {lc.state.value}, expected GRAPH_CAPTURED")
    expect(drafting_allowed_for(model), f"{what}: the drafting gate is closed on a usable draft")
    weights, derived = weight_digests(model), derived_digests(model)
    wrong_w = sorted(n for n in cold["weights"] if weights.get(n) != cold["weights"][n])
    wrong_d = sorted(n for n in cold["derived"] if derived.get(n) != cold["derived"][n])
    expect(not wrong_w, f"{what}: weights differ from a cold load of what was sent: {wrong_w}")
    expect(not wrong_d, f"{what}: derived buffers differ from a cold build of what was sent: {wrong_d}")
    moved = sorted(n for n, ident in identities(model).items() if pinned.get(n) != ident)
    expect(not moved, f"{what}: pinned storage moved: {moved}")


def _not_drafting(model: Any, what: str) -> None:
    from lifecycle.vllm.serving.gate import drafting_allowed_for

    lc = backbone(model).lifecycle
    expect(not lc.usable, f"{what}: the draft is {lc.state.value} (usable) with weights its buffers were not "
                          "built from")
    expect(not drafting_allowed_for(model), f"{what}: the drafting gate lets a draft that is not usable run")


def run_writes(work: Path, layout: str) -> dict[str, Any]:
    setup()
    from lifecycle.vllm.demo.tiny import make_dflash_draft, make_target

    if not (work / "target").exists():
        make_target(work / "target")
        make_dflash_draft(work / "dflashA", seed=1)
        make_dflash_draft(work / "dflashB", seed=2)
    case = CASES["dflash"]
    done: list[str] = []
    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        cold = {}
        for which in "AB":
            reference = build(case, work / f"dflash{which}", work / "target")
            cold[which] = {"weights": weight_digests(reference), "derived": derived_digests(reference)}
        expect(cold["A"]["derived"] != cold["B"]["derived"], "drafts A and B derive the same buffers")
        tensors = {w: read(work / f"dflash{w}") for w in "AB"}

        # verl-speco's update_draft_weights_from_ipc: the inner model's load_weights, then the builder by hand
        draft = build(case, work / "dflashA", work / "target")
        inner, b = draft.model, backbone(draft)
        b.capture_graphs()  # vLLM captured its graphs: every address is pinned
        pinned = identities(draft)
        inner.load_weights(tensors["B"])
        _not_drafting(draft, "after the inner model's load_weights")
        inner._build_fused_kv_buffers()
        _usable_and_current(draft, cold["B"], pinned, "after the builder called by hand")
        expect(b.lifecycle.epoch == 1, f"the push is not its own epoch: epoch {b.lifecycle.epoch}")
        done.append("inner load_weights, then the builder by hand: equal to a cold load, in place")

        # the same, one layer's tensors per call (verl-speco streams buckets), back to A
        for prefix in ("layers.1.", "layers.0.", ""):
            inner.load_weights([(n, t) for n, t in tensors["A"] if n.startswith(prefix) and (
                prefix or not n.startswith("layers."))])
            _not_drafting(draft, f"after the inner bucket {prefix or 'rest'!r}")
        inner._build_fused_kv_buffers()
        _usable_and_current(draft, cold["A"], pinned, "after bucketed inner writes and the builder")
        done.append("bucketed inner writes: equal to a cold load")

        # the builder by hand on a usable draft changes nothing
        inner._build_fused_kv_buffers()
        _usable_and_current(draft, cold["A"], pinned, "after the builder on a usable draft")
        done.append("the builder on a usable draft: nothing changed")

        # a partial inner push (layer 0 only), then the builder: partial='refuse' quarantines, naming what is missing
        inner.load_weights([(n, t) for n, t in tensors["B"] if n.startswith("layers.0.")])
        _not_drafting(draft, "after a partial inner push")
        try:
            inner._build_fused_kv_buffers()
        except Exception as e:
            expect(type(e).__name__ == "LayersNotReadyError" and "layers.1." in str(e),
                   f"the builder after a partial push raised {e!r}, not LayersNotReadyError naming layer 1")
        else:
            raise AssertionError("the builder finished an epoch that wrote layer 0 only (partial='refuse')")
        expect(b.lifecycle.quarantined, f"the refused epoch left {b.lifecycle.state.value}, not QUARANTINED")
        _not_drafting(draft, "after the builder refused the partial epoch")
        done.append("a partial inner push: the builder refuses it, naming layer 1; not drafting")

        # the builder by hand on a quarantined draft refuses, naming the call, and changes nothing
        try:
            inner._build_fused_kv_buffers()
        except Exception as e:
            expect("by hand" in str(e), f"the refusal does not name the call: {e}")
        else:
            raise AssertionError("the builder by hand on a quarantined draft did not refuse")
        _not_drafting(draft, "after the refused builder")

        # a complete push through the inner model recovers it
        inner.load_weights(tensors["B"])
        inner._build_fused_kv_buffers()
        _usable_and_current(draft, cold["B"], pinned, "after a complete push following the quarantine")
        done.append("quarantined: the builder refuses naming the call; a complete push recovers")

        # a linear layer's weight loader called directly, outside any load_weights
        name = "layers.0.self_attn.o_proj.weight"
        param = inner.get_parameter(name)
        refused = None
        try:
            param.weight_loader(param, dict(tensors["A"])[name])
        except Exception as e:
            refused = e
        if layout == "cpu":  # the repacked layer's emptied parameter: vLLM's loader refuses before writing
            expect(refused is not None, "vLLM's loader wrote into a repacked (emptied) parameter")
            _usable_and_current(draft, cold["B"], pinned, "after a refused direct write (rolled back exactly)")
            done.append("a direct write vLLM refuses (CPU layout): rolled back exactly, still serving B")
        else:
            expect(refused is None, lambda: f"the direct write was refused: {refused!r}")
            _not_drafting(draft, "after a weight loader called directly")
            try:
                inner._build_fused_kv_buffers()  # partial='refuse': one tensor of the draft written this epoch
            except Exception as e:
                expect(type(e).__name__ == "LayersNotReadyError", f"the builder raised {e!r}")
            else:
                raise AssertionError("the builder finished an epoch of one direct write (partial='refuse')")
            _not_drafting(draft, "after the builder refused the direct write's epoch")
            inner.load_weights(tensors["A"])
            inner._build_fused_kv_buffers()
            _usable_and_current(draft, cold["A"], pinned, "after a complete push following a direct write")
            done.append("a direct write: not drafting until a complete push; then equal to a cold load")
        done.extend(_structured(work, layout))
    return {"layout": layout, "done": done}


def _no_meta(model: Any, what: str) -> None:
    on_meta = sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta)
    expect(not on_meta, f"{what}: left on META: {on_meta}")


def _structured(work: Path, layout: str) -> list[str]:
    """A draft with its own lm_head and d2t (held by the ForCausalLM, out of the inner model's reach): an inner push
    keeps them and reloads the rest in place; an inner push failing part way leaves nothing on META, rolled back."""
    from safetensors.torch import save_file

    from lifecycle.vllm.reload.epoch import OUTCOME_QUARANTINED
    from support.vllm_inprocess import make_draft

    case = CASES["dflash"].with_structure()
    folders = {w: work / f"dflashS{w}" for w in "AB"}
    for folder, seed in zip(folders.values(), (1, 2), strict=True):
        if not folder.exists():
            make_draft(case, folder, seed, work / "target")
    a, b = dict(read(folders["A"])), dict(read(folders["B"]))
    outer_held = ("lm_head.", "d2t")
    mixed = {n: (a if n.startswith(outer_held) else b)[n] for n in a}  # B through the inner model, A's own heads
    mix = work / "dflashS-mix"
    mix.mkdir(exist_ok=True)
    (mix / "config.json").write_text((folders["A"] / "config.json").read_text())
    save_file(mixed, str(mix / "model.safetensors"))
    reference = build(case, mix, work / "target")
    cold = {"weights": weight_digests(reference), "derived": derived_digests(reference)}

    draft = build(case, folders["A"], work / "target")
    inner, b_ = draft.model, backbone(draft)
    b_.capture_graphs()
    pinned = identities(draft)
    inner_names = [(n, t) for n, t in b.items() if not n.startswith(outer_held)]
    inner.load_weights(inner_names)
    _not_drafting(draft, "after an inner push of a draft with its own heads")
    _no_meta(draft, "during an inner push (the ForCausalLM's heads out of the reload)")
    inner._build_fused_kv_buffers()
    _usable_and_current(draft, cold, pinned, "after an inner push keeping the draft's own heads")
    out = ["a draft with its own heads: the inner push keeps them, equal to a cold load of the mix"]

    bad = [(n, t) for n, t in b.items() if n.startswith("layers.0.")]
    bad.append(("layers.1.self_attn.o_proj.weight", torch.zeros(3, 5)))  # a wrong shape, after layer 0's tensors
    try:
        inner.load_weights(bad)
    except Exception:
        pass
    else:
        raise AssertionError("an inner push with a tensor of the wrong shape was accepted")
    _no_meta(draft, "after an inner push that failed part way")
    expect(b_.lifecycle.usable or b_.lifecycle_runtime.last_outcome == OUTCOME_QUARANTINED,
           f"the failed inner push left {b_.lifecycle.state.value}, neither serving nor quarantined")
    inner.load_weights(inner_names)
    inner._build_fused_kv_buffers()
    _usable_and_current(draft, cold, pinned, "after a complete inner push following a failed one")
    out.append("an inner push failing part way: nothing left on META; the next complete push is current")
    return out


def main() -> None:
    layout, work = sys.argv[1:]
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    try:
        result: dict[str, Any] = {"ok": True, **run_writes(Path(work), layout)}
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if f.filename.endswith("vllm_writes_runs.py") and f.name not in ("expect", "main")]
        where = " <- ".join(f"vllm_writes_runs.py:{f.lineno} {f.line}" for f in reversed(frames)) or "?"
        result = {"ok": False, "failed": f"{where}: {type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    print(RESULT + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
