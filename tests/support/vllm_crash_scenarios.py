"""Crash consistency of vLLM's reload through the plugin (`support.crash` for the vLLM paths; issue 24): vLLM's own
DFlash class in-process (`support/vllm_inprocess.py`), cold on draft A and pinned, then a reload toward B
interrupted at every write point in turn with RuntimeError, KeyboardInterrupt and SystemExit:

  layerwise  initialize_layerwise_reload, load_weights in three calls, finalize_layerwise_reload (trainer paths i-iii)
  plain      load_weights in three calls with no initialize, then process_weights_after_loading (trainer path iv)
  transfer   the plugin's transfer engine: start_weight_update, update_weights per file (three), finish (path v)

The write points (`support.crash.CORE_PROBES`, `vllm_probes`): every in-place write to a tensor (vLLM's loaders,
its copy back into the live kernel tensors, the plugin's in-place write of a completed layer (`reload.direct`:
before it, each copy of it, after it), the K/V shadows, the refresh), every parameter and buffer registered
(layers moved to META and back), vLLM's reload steps, the transfer calls, every post-load hook, every trigger the
lifecycle fires (before, and after its state changed) and every report to it. On the CPU layout the norms are
written in place and every linear layer by vLLM's copy back; on the GPU layout every layer in place.

After each interrupt (`check`): the draft is usable and then it is exactly draft A (nothing kept) or exactly draft B
(the reload completed): every linear layer's effective weight (an identity input through its quant method),
every other parameter and every derived buffer bit-equal to a cold build of that draft, at the pinned addresses;
or it refuses forward use (the drafting gate says no, `require_usable` raises). Then the documented retry, the same
call complete (a reload of B), must end usable and equal to a cold build of B, at the pinned addresses. The draft is
then reloaded to A for the next run (rebuilt if that fails), so one draft serves every run.

    python -m support.vllm_crash_scenarios crash WORKDIR     (LIFECYCLE_CRASH_FULL=1: every kind, both layouts)
"""

from __future__ import annotations

import hashlib
import os
import types
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from support.needs import needs

__all__ = ["FULL_ENV", "PATHS", "canaries", "run_crash", "scenario_crash"]

#: the sweeps' scope: unset, every point once with one interrupt kind in turn, on the CPU layout, and the layerwise
#: reload on the GPU layout (every layer written in place); "1": every point with every kind, on both layouts
FULL_ENV = "LIFECYCLE_CRASH_FULL"
PATHS = ("layerwise", "plain", "transfer")
#: the default run's sample: every point of the layerwise reload (one kind each, in turn), every 4th of the others;
#: on the GPU layout every 2nd point of the layerwise reload
STRIDE = {"layerwise": 1, "plain": 4, "transfer": 4}
GPU_STRIDE = 2
Tensors = list[tuple[str, torch.Tensor]]


@needs("vllm", "slow")
def run_crash(work: Path, *, full: bool = False) -> dict[str, Any]:
    """Every sweep in one process (no engine)."""
    from support.vllm_runs import run_script

    return run_script("vllm_crash_scenarios", "crash", work, timeout=3600, **{FULL_ENV: "1" if full else "0"})


# ---- what a draft computes with ---------------------------------------------------------------------------------
def _sha(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def state_of(model: Any) -> dict[str, str]:
    """Every linear layer's effective weight (its output on an identity input: exact, in any layout), every other
    non-empty parameter, every derived buffer: digests."""
    from support.vllm_inprocess import backbone

    b = backbone(model)
    tracked = b.lifecycle.specs  # the draft's own checkpoint tensors (not what it shares with a target)
    out: dict[str, str] = {}
    with torch.inference_mode():
        for name, module in b.named_modules():
            own = [leaf for leaf in module._parameters if f"{name}.{leaf}" in tracked]
            if not own:
                continue
            quant = getattr(module, "quant_method", None)
            if quant is not None and hasattr(module, "input_size_per_partition"):
                out[f"{name}(x)"] = _sha(quant.apply(module, torch.eye(module.input_size_per_partition)))
                continue
            for leaf in own:
                p = module._parameters[leaf]
                if p is not None and p.numel() and not p.is_meta:
                    out[f"{name}.{leaf}"] = _sha(p)
    for name in b.derived_buffer_names():
        t = b._buffers.get(name)
        out[f"derived {name}"] = "none" if t is None else _sha(t)
    return out


def _pins(model: Any) -> dict[str, Any]:
    from lifecycle.storage import StorageIdentity
    from support.vllm_inprocess import backbone

    return {n: StorageIdentity.of(t) for n, t in backbone(model).graph_visible_tensors().items() if t is not None}


# ---- the writes ------------------------------------------------------------------------------------------------
def _calls(tensors: Tensors) -> list[Tensors]:
    """Three calls: layer 0, layer 1, the rest (a trainer's buckets)."""
    by: dict[str, Tensors] = {"layers.0.": [], "layers.1.": [], "": []}
    for name, t in tensors:
        by["layers.0." if name.startswith("layers.0.") else "layers.1." if name.startswith("layers.1.") else ""
           ].append((name, t))
    return [c for c in by.values() if c]


def write(model: Any, path: str, tensors: Tensors, files: list[Path]) -> None:
    """Write `tensors` into `model` the way `path` does (`files`: the transfer session's chunks)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    config = model.vllm_config.speculative_config.draft_model_config
    if path == "transfer":
        _transfer(model, files)
        return
    if path == "plain":
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for call in _calls(tensors):
            model.load_weights(call)
        process_weights_after_loading(model, config, torch.device("cpu"))
        return
    initialize_layerwise_reload(model)
    for call in _calls(tensors):
        model.load_weights(call)
    finalize_layerwise_reload(model, config)


_ENGINE: list[type] = []


def transfer_engine() -> type:
    """The plugin's safetensors_file transfer engine class, made once (`engine_class` makes one per call)."""
    from lifecycle.vllm.online.transfer import engine_class

    if not _ENGINE:
        _ENGINE.append(engine_class())
    return _ENGINE[0]


def _transfer(model: Any, files: list[Path]) -> None:
    from vllm.config.weight_transfer import WeightTransferConfig

    cfg = model.vllm_config
    engine = transfer_engine()(WeightTransferConfig(backend="safetensors_file"), cfg, torch.device("cpu"), model)
    engine.set_weight_update_target(model, cfg.speculative_config.draft_model_config)
    try:
        engine.start_weight_update()
        for f in files:
            engine.update_weights({"path": str(f)})
        engine.finish_weight_update()
    finally:
        engine.reset_weight_update_target()


def vllm_probes() -> tuple[Any, ...]:
    """The write points of vLLM's reload beside the core's: parameters registered (layers moved to META and back),
    its reload steps, the calls a trainer makes."""
    from torch import nn
    from vllm.model_executor.model_loader.reload import layerwise

    from lifecycle.vllm.reload import direct
    from support.crash import after, before

    engine = transfer_engine()
    return (
        before(direct, "write_layer", lambda layer, *a, **k: f"direct write {type(layer).__name__}"),
        after(direct, "write_layer", lambda layer, *a, **k: f"direct written {type(layer).__name__}"),
        before(nn.Module, "register_parameter", lambda _m, name, *a, **k: f"register_parameter {name}"),
        before(layerwise, "materialize_layer", lambda layer, *a, **k: f"materialize {type(layer).__name__}"),
        before(layerwise, "_copy_and_restore_kernel_tensors",
               lambda layer, *a, **k: f"copy back {type(layer).__name__}"),
        before(layerwise, "_place_kernel_tensors", lambda layer, *a, **k: f"put back {type(layer).__name__}"),
        before(engine, "receive_weights", "transfer receive_weights"),
        before(engine, "finish_weight_update", "transfer finish_weight_update"),
    )


# ---- one sweep ---------------------------------------------------------------------------------------------------
@dataclass
class _Draft:
    """The draft every run of a sweep uses: the checkpoint it holds now (`at`), what a run writes (`to`) and the
    identities pinned at its capture."""

    model: Any
    pins: dict[str, Any]
    at: str = "A"
    to: str = "B"
    swallowed: bool = False  # this run's injected error was caught by vLLM's own code


class Harness:
    """A layout and a path: the shared draft, the cold references of drafts A and B, setup / operation / check.
    Runs alternate: A -> B, then B -> A (the same write points: the same tensors, shapes and calls)."""

    def __init__(self, work: Path, layout: str, path: str) -> None:
        from support.vllm_inprocess import CASES, build, make_draft
        from support.vllm_trainer_paths import read

        self.case, self.layout, self.path, self.work = CASES["dflash"], layout, path, work
        self.a = work / "A" if (work / "A").exists() else make_draft(self.case, work / "A", 1)
        self.b = work / "B" if (work / "B").exists() else make_draft(self.case, work / "B", 2)
        self.tensors = {"A": read(self.a), "B": read(self.b)}
        self.files = {w: self._chunks(w, t) for w, t in self.tensors.items()}
        with self._layout():
            self.cold = {"A": state_of(build(self.case, self.a)), "B": state_of(build(self.case, self.b))}
        assert self.cold["A"] != self.cold["B"]
        self.draft: _Draft | None = None

    def _layout(self) -> Any:
        from support.vllm_inprocess import gpu_weight_layout

        return gpu_weight_layout() if self.layout == "gpu" else nullcontext()

    def _chunks(self, which: str, tensors: Tensors) -> list[Path]:
        from lifecycle.loading import write_checkpoint

        folder = self.work / f"chunks-{which}"
        folder.mkdir(exist_ok=True)
        return [write_checkpoint(dict(c), folder / f"{i}.safetensors") for i, c in enumerate(_calls(tensors))]

    def _write(self, model: Any, which: str) -> None:
        write(model, self.path, self.tensors[which], self.files[which])

    def _fresh(self) -> _Draft:
        from vllm.model_executor.layers import rotary_embedding

        from support.vllm_inprocess import backbone, build

        # a rebuild stands for a restart (a new process): nothing vLLM caches between models (its rotary
        # embeddings, shared by equal configs) carries over from the draft a run stranded
        rotary_embedding._ROPE_DICT.clear()
        model = build(self.case, self.a)
        backbone(model).capture_graphs()
        self._write(model, "A")  # one reload first: every run starts from a draft that has reloaded
        d = _Draft(model, _pins(model))
        assert self._is("A", d)
        return d

    def setup(self) -> _Draft:
        """The shared draft, holding A or B as the last run left it (rebuilt when it holds neither)."""
        with self._layout():
            d = self.draft
            if d is None or not self._is(d.at, d):
                d = self._fresh()
            d.to, d.swallowed = "B" if d.at == "A" else "A", False
            self.draft = d
            return d

    def _is(self, which: str, d: _Draft) -> bool:
        from support.vllm_inprocess import backbone

        return bool(backbone(d.model).lifecycle.usable and state_of(d.model) == self.cold[which]
                    and _pins(d.model) == d.pins)

    def operation(self, d: _Draft) -> None:
        with self._layout():
            self._write(d.model, d.to)

    def check(self, d: _Draft, raised: BaseException) -> Any:
        """The invariant after the interrupt, then the documented retry (see the module docstring)."""
        from lifecycle.errors import LifecycleError
        from lifecycle.vllm.serving.gate import drafting_allowed
        from support.crash import REFUSED, STALE, STRANDED, USABLE, Outcome
        from support.vllm_inprocess import backbone

        lc = backbone(d.model).lifecycle
        runner = types.SimpleNamespace(get_draft_model=lambda: d.model)
        with self._layout():
            if lc.usable:
                now = state_of(d.model)
                if now not in (self.cold["A"], self.cold["B"]):
                    differ = sorted(n for n in now.keys() | self.cold["A"].keys()  # one gone (META) too
                                    if now.get(n) not in (self.cold["A"].get(n), self.cold["B"].get(n)))
                    return Outcome(STALE, f"{lc.state.value}, equal to neither cold A nor cold B: {differ[:4]}")
                if _pins(d.model) != d.pins:
                    return Outcome(STALE, f"{lc.state.value}: pinned identities moved")
                first = USABLE
            else:
                if drafting_allowed(runner):
                    return Outcome(STALE, f"{lc.state.value}: the drafting gate lets the draft run")
                try:
                    backbone(d.model).require_usable()
                except LifecycleError:
                    pass
                else:
                    return Outcome(STALE, f"{lc.state.value}: forward use is not refused")
                first = REFUSED
            try:  # the documented retry: the same call, complete
                self._write(d.model, d.to)
            except Exception as e:
                self.draft = None
                return Outcome(STRANDED, f"the complete retry failed: {type(e).__name__}: {str(e)[:300]}")
            if not self._is(d.to, d) or not drafting_allowed(runner):
                self.draft = None
                return Outcome(STRANDED, f"after the complete retry: {lc.state.value}, not equal to cold {d.to}")
            d.at = d.to
        return Outcome(first)


def _swallowed_by_vllm(injected: BaseException) -> bool:
    """An injected RuntimeError that vLLM's own code caught (its CPU GEMM dispatch catches RuntimeError from
    oneDNN and falls back): the frame that caught it is vLLM's. An interrupt is never caught there."""
    tb = injected.__traceback__
    if tb is None or not isinstance(injected, Exception):
        return False
    return "/vllm/" in tb.tb_frame.f_code.co_filename.replace("\\", "/")


def vllm_sweep(h: Harness, name: str, *, kinds: str | tuple[str, ...], stride: int = 1,
               pick: Callable[[list[str]], list[int]] | None = None) -> Any:
    """`support.crash.sweep` over the harness, every `stride`-th point (an offset per scenario), or the points
    `pick` chooses from the labels of the counting run (1-based). An injected
    RuntimeError that vLLM's own code caught (`_swallowed_by_vllm`) is raised again when the operation ends: the
    run is checked like the others, its outcome marked as such."""
    import zlib

    from support.crash import CORE_PROBES, VIOLATIONS, Outcome, Scenario, WritePoints, sweep

    seen: list[WritePoints] = []

    def grab(points: WritePoints) -> Any:  # a probe that only keeps the sweep's `WritePoints`
        seen.append(points)
        return nullcontext()

    def operation(d: _Draft) -> None:
        try:
            h.operation(d)
        except Exception as e:
            injected = seen[0].injected
            if injected is not None and e is not injected and _swallowed_by_vllm(injected):
                d.swallowed = True
                raise injected from e
            raise
        injected = seen[0].injected
        if injected is not None and _swallowed_by_vllm(injected):
            d.swallowed = True
            raise injected
        d.at = d.to  # it completed

    def check(d: _Draft, raised: BaseException) -> Outcome:
        out: Outcome = h.check(d, raised)
        return Outcome(f"{out.kind} (vLLM caught it)") if d.swallowed and out.kind not in VIOLATIONS else out

    def sampled() -> Any:  # iterated once the counting run is done: its points are known
        if pick is not None:
            yield from pick(list(seen[0].labels))
            return
        offset = zlib.crc32(name.encode())
        yield from range(1 + offset % stride, len(seen[0].labels) + 1, stride)

    scenario = Scenario(name, h.setup, operation, check, probes=(*CORE_PROBES, *vllm_probes(), grab))
    return sweep(scenario, kinds=kinds, points=None if stride == 1 and pick is None else sampled())


def inside_in_place_write(labels: list[str]) -> list[int]:
    """The points inside the first in-place write of a linear layer: each copy between `direct write` and
    `direct written` (1-based)."""
    start = next(i for i, label in enumerate(labels) if label.startswith("direct write") and "Linear" in label)
    end = next(i for i in range(start, len(labels)) if labels[i].startswith("direct written"))
    return [i + 1 for i in range(start + 1, end) if labels[i].startswith("copy_")]


def torn_write(work: Path) -> dict[str, Any]:
    """Every copy inside one linear layer's in-place write (GPU layout, vLLM's layerwise reload) interrupted with
    every kind: the layer is torn, so the draft must refuse (never usable), and the retry must recover it."""
    from support.crash import KINDS

    h = Harness(work, "gpu", "layerwise")
    result = vllm_sweep(h, "vllm layerwise (gpu layout), inside an in-place write", kinds=KINDS,
                        pick=inside_in_place_write)
    picked = inside_in_place_write(result.points)
    return {"scenario": result.scenario, "labels": [result.points[k - 1] for k in picked], "runs": result.runs,
            "outcomes": [[k, o, n] for (k, o), n in sorted(result.outcomes.items())],
            "violations": result.violations}


def _sweep(work: Path, layout: str, path: str, full: bool) -> dict[str, Any]:
    h = Harness(work, layout, path)
    kinds = ("RuntimeError", "KeyboardInterrupt", "SystemExit") if full else "rotate"
    stride = 1 if full else STRIDE[path] if layout == "cpu" else GPU_STRIDE
    result = vllm_sweep(h, f"vllm {path} ({layout} layout)", kinds=kinds, stride=stride)
    return {"scenario": result.scenario, "points": result.points, "runs": result.runs,
            "outcomes": [[k, o, n] for (k, o), n in sorted(result.outcomes.items())],
            "violations": result.violations}


def canaries(h: Harness) -> dict[str, str]:
    """The check itself, on drafts known to be wrong: a derived buffer one element off, and a weight left on META
    while the draft says it is usable. Each must be named usable-but-stale (else a sweep's 0 means nothing)."""
    from support.vllm_inprocess import backbone

    out = {}
    for name, spoil in (("derived buffer off by one element", _spoil_derived), ("weight on META", _spoil_weight)):
        d = h.setup()
        with h._layout():
            spoil(backbone(d.model))
        out[name] = h.check(d, RuntimeError("canary")).kind
        h.draft = None  # rebuilt for whatever runs next
    return out


def _spoil_derived(b: Any) -> None:
    with torch.no_grad():
        b._k_norm_weights.view(-1)[0] += 1


def _spoil_weight(b: Any) -> None:
    module = b.layers[0].input_layernorm
    module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)


def scenario_crash(work: Path) -> dict[str, Any]:
    from support.vllm_inprocess import setup

    setup()
    full = os.environ.get(FULL_ENV) == "1"
    runs = [(layout, path) for layout in ("cpu", "gpu") for path in PATHS] if full else \
        [*(("cpu", path) for path in PATHS), ("gpu", "layerwise")]
    sweeps = [_sweep(work, layout, path, full) for layout, path in runs]
    return {"full": full, "sweeps": sweeps, "torn": torn_write(work),
            "canaries": canaries(Harness(work, "cpu", "layerwise"))}


if __name__ == "__main__":
    from support.vllm_basic_scenarios import main

    main(globals())
