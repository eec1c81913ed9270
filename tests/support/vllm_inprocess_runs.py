"""The in-process scenario (`python -m support.vllm_scenarios inprocess WORKDIR [FAMILIES] [LAYOUTS]`): for each
family the CPU build cannot start an engine with, vLLM's own classes, loader and reload functions
(`support/vllm_inprocess.py`), every trainer path (`support/vllm_trainer_paths.py`), on both weight layouts.
"""

from __future__ import annotations

import gc
import weakref
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lifecycle.vllm.serving.gate import drafting_allowed
from support.vllm_inprocess import (
    CASES,
    HEAD,
    DraftCase,
    backbone,
    build,
    build_target,
    derived_digests,
    gpu_weight_layout,
    identities,
    make_draft,
    memory,
    setup,
    share_target,
    target_reload,
    transfer_session,
    vllm_builder_values,
    weight_digests,
)
from support.vllm_structure_runs import frozen_absent, optional_runs, structure_of
from support.vllm_trainer_paths import DRAFT_PATHS, PATHS, attempt, buckets, read, write_draft
from support.vllm_v2_runs import run_runner_v2

__all__ = ["INPROCESS_FAMILIES", "MEMORY_ONLY", "make_checkpoints", "run_inprocess"]

INPROCESS_FAMILIES = "qwen3_dspark,gemma4_dspark,dflash2,kimi_k3_dspark"
#: families the engine tests run: in-process only their memory beside stock vLLM's, on both layouts
MEMORY_ONLY = "dflash,laguna_dflash"


def make_checkpoints(work: Path) -> None:
    """The tiny target; DFlash drafts A and B without optional submodules (lifecycle.vllm.demo.tiny) and with every one
    (`dflashSA`, `dflashSB`); every other family's drafts A and B with every optional submodule it can have
    (`DraftCase.with_structure`); Qwen3 DSpark drafts with a confidence head only (`qwen3_dspark0A`, `...0B`)."""
    from lifecycle.vllm.demo.tiny import make_dflash_draft, make_target

    make_target(work / "target")
    make_dflash_draft(work / "dflashA", seed=1)
    make_dflash_draft(work / "dflashB", seed=2)
    for name, case in CASES.items():
        for which, seed in (("A", 1), ("B", 2)):
            folder = work / f"dflashS{which}" if name == "dflash" else _draft_dir(work, case, which)
            make_draft(case.with_structure(), folder, seed, work / "target")
            if name == "qwen3_dspark":
                make_draft(replace(case, config={**case.config, **HEAD}), work / f"qwen3_dspark0{which}", seed,
                           work / "target")


def run_inprocess(work: Path, families: str = INPROCESS_FAMILIES, layouts: str = "cpu,gpu") -> dict[str, Any]:
    setup()
    if not (work / "target").exists():
        make_checkpoints(work)
    out: dict[str, Any] = {}
    for fam in families.split(","):
        out[fam] = {}
        for name in layouts.split(","):
            with gpu_weight_layout() if name == "gpu" else nullcontext():
                out[fam][name] = attempt(lambda f=fam, n=name: _family(CASES[f].with_structure(), work, n))
    for fam in MEMORY_ONLY.split(","):  # run on live engines; here their bytes are compared with stock vLLM's
        out[fam] = {n: attempt(lambda f=fam, n=n: _memory_only(CASES[f].with_structure(), work, n))
                    for n in layouts.split(",")}
    out["runner_lookup"] = attempt(lambda: _runner_lookup(work))
    out["frozen_absent"] = attempt(lambda: frozen_absent(work))
    out["runner_v2"] = run_runner_v2(work)  # Model Runner V2's drafting gate and Gemma4 DSpark's own heads
    # last: a stock reload that fails half way leaves vLLM's shared modules (the cached RoPE) on META
    for fam in families.split(","):
        out[fam]["stock"] = attempt(lambda f=fam: _stock_bucketed_reload(CASES[f].with_structure(), work))
    return out


def _memory_only(case: DraftCase, work: Path, layout: str) -> dict[str, Any]:
    """What a draft holds beside stock vLLM's of the same checkpoint (in the layout of the caller's block), cold
    and after a plain load_weights reload to draft B, whose derived buffers must equal a cold load of B's."""
    def folder(which: str) -> Path:
        return work / f"dflashS{which}" if case.family == "dflash" else _draft_dir(work, case, which)

    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        stock = memory(build(case, folder("A"), work / "target", stock=True), case.family)
        cold_b = derived_digests(build(case, folder("B"), work / "target"))
        warm = build(case, folder("A"), work / "target")
        out = {"stock": stock, "cold": memory(warm, case.family), "layout": _qkv_shape(warm)}
        draft_config = warm.vllm_config.speculative_config.draft_model_config
        out["reload"] = attempt(lambda: write_draft(warm, draft_config, read(folder("B")), "plain_load_weights"))
        out["reloaded"] = memory(warm, case.family)
        out["derived_differ"] = sorted(n for n, d in derived_digests(warm).items() if d != cold_b.get(n))
    return out


def _draft_dir(work: Path, case: DraftCase, which: str) -> Path:
    return work / f"{case.family}{which}"


class _Runner:
    """What the drafting gate reads of vLLM's model runner."""

    def __init__(self, draft: Any) -> None:
        self._draft = weakref.ref(draft)

    def get_draft_model(self) -> Any:
        return self._draft()


def _family(case: DraftCase, work: Path, layout: str) -> dict[str, Any]:
    target = build_target(work / "target")
    ref, cold_drafts = {}, []
    for which in "AB":
        cold = build(case, _draft_dir(work, case, which), work / "target")
        cold_drafts.append(weakref.ref(cold))
        drafting_allowed(_Runner(cold))  # the gate of every step: it must not keep the draft either
        ref[which] = {"derived": derived_digests(cold), "weights": weight_digests(cold)}
    warm = build(case, _draft_dir(work, case, "A"), work / "target")
    share_target(warm, target)
    b = backbone(warm)
    lc = b.lifecycle
    res: dict[str, Any] = {"cold_state": lc.state.value, "layout": _qkv_shape(warm),
                           "refs_differ": ref["A"]["derived"] != ref["B"]["derived"],
                           "cold_structure": structure_of(warm)}
    if layout == "gpu":
        res["same_as_vllm_builder"] = _same_as_vllm_builder(warm)
    stock = build(case, _draft_dir(work, case, "A"), work / "target", stock=True)
    share_target(stock, target)  # both count the target's shared modules alike
    res["memory"] = {"cold": memory(warm, case.family), "stock": memory(stock, case.family)}
    del stock
    res["pinned"] = b.capture_graphs()
    pinned = identities(warm)
    draft_config = warm.vllm_config.speculative_config.draft_model_config
    runs, cur = [], "A"
    for path in PATHS:
        dest = {"A": "B", "B": "A"}[cur] if path in DRAFT_PATHS else cur
        folder = _draft_dir(work, case, dest)
        tensors = read(folder) if path in DRAFT_PATHS else []
        result = attempt(lambda p=path, t=tensors, f=folder, w=warm: write_draft(
            w, draft_config, t, p, session=transfer_session(w, f), target_reload=target_reload(target)))
        runs.append({"path": path, "draft": dest, "result": result, **_observe(warm, ref[dest], pinned)})
        cur = dest
    res["runs"] = runs
    res["memory"]["reloaded"] = memory(warm, case.family)
    res["unfinished"] = _unfinished(warm, work, case, ref, pinned)
    res["optional"] = optional_runs(warm, work, case.family, ref, pinned, res["unfinished"]["draft"], _observe)
    res["dummy"] = attempt(lambda: _dummy_start(case, work, ref["B"]))
    # the cold drafts, cold-loaded by vLLM's loader, passed through the drafting gate and dropped: freed once the
    # cyclic collector ran (vLLM's modules have cycles of their own); the plugin's per-module table kept every
    # draft before, and so did the gate's table of backbones. (A draft that went
    # through vLLM's layerwise reload is kept by vLLM itself: its module-level table of reload infos holds
    # parameters whose weight loaders hold the model.)
    del cold
    gc.collect()
    res["cold_dropped_alive"] = sum(r() is not None for r in cold_drafts)
    return res


def _dummy_start(case: DraftCase, work: Path, ref: dict[str, Any]) -> dict[str, Any]:
    """Loaded as veRL starts its rollout engine (`load_format="dummy"`: vLLM's random values, no load_weights),
    then the trainer's first sync of draft B, in buckets, later layers first: without layer 1 (refused), then
    complete (equals a cold load of B, in the buffers' storage of the start)."""
    model = build(case, _draft_dir(work, case, "B"), work / "target", load_format="dummy")
    lc, pinned = backbone(model).lifecycle, identities(model)
    out: dict[str, Any] = {"start": lc.state.value, "start_differs": derived_digests(model) != ref["derived"]}
    draft_config = model.vllm_config.speculative_config.draft_model_config
    tensors = read(_draft_dir(work, case, "B"))
    out["partial"] = attempt(lambda: write_draft(model, draft_config, [
        (n, t) for n, t in tensors if not n.startswith("layers.1.")], "buckets_later_layers_first"))
    out["partial_state"] = lc.state.value
    out["full"] = attempt(lambda: write_draft(model, draft_config, tensors, "buckets_later_layers_first"))
    return {**out, **_observe(model, ref, pinned)}


def _observe(model: Any, ref: dict[str, Any], pinned: dict[str, Any]) -> dict[str, Any]:
    b = backbone(model)
    lc = b.lifecycle
    derived, weights = derived_digests(model), weight_digests(model)
    return {"state": lc.state.value, "epoch": lc.epoch, "structure": structure_of(model),
            "derived_differ": sorted(n for n in derived if derived[n] != ref["derived"].get(n)),
            "weights_differ": sorted(n for n in weights if weights[n] != ref["weights"].get(n)),
            "moved": sorted(n for n, ident in identities(model).items() if pinned.get(n) != ident),
            "pin_problems": lc.pinned_changes(), "fused_path": attempt(lambda: b.require_usable("draft"))}


def _unfinished(model: Any, work: Path, case: DraftCase, ref: dict[str, Any], pinned: dict[str, Any]) -> dict[str, Any]:
    """Plain load_weights of every bucket, never finished: the draft must refuse; the next
    process_weights_after_loading from model_loader.utils finishes the epoch."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    b = backbone(model)
    draft_config = model.vllm_config.speculative_config.draft_model_config
    dest = "B" if derived_digests(model) == ref["A"]["derived"] else "A"
    written = attempt(lambda: write_draft(model, draft_config, read(_draft_dir(work, case, dest)), "plain_load_weights",
                                       finalize=False))
    open_state = {"state": b.lifecycle.state.value, "fused_path": attempt(lambda: b.require_usable("draft"))}
    finish = attempt(lambda: process_weights_after_loading(model, draft_config, torch.device("cpu")))
    return {"draft": dest, "written": written, "open": open_state, "finish": finish,
            **_observe(model, ref[dest], pinned)}


def _qkv_shape(model: Any) -> list[int]:
    b = backbone(model)
    attn = b.layers[0].self_attn
    linear = next(getattr(attn, n) for n in ("qkv_proj", "k_proj", "fused_qkv_a_proj") if hasattr(attn, n))
    return list(linear.weight.shape)


def _same_as_vllm_builder(model: Any) -> dict[str, bool]:
    """Does every buffer and metadata value the lifecycle set equal what vLLM's own builder computes now?"""
    b = backbone(model)
    theirs = vllm_builder_values(model)
    out = {}
    for name, value in theirs.items():
        mine = b._buffers.get(name) if name in b._buffers else getattr(b, name, None)
        if isinstance(value, torch.Tensor) or isinstance(mine, torch.Tensor):
            out[name] = isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor) \
                and mine.shape == value.shape and torch.equal(mine, value)
        elif isinstance(value, (list, tuple)):
            out[name] = len(value) == len(mine) and all(x is y or x == y for x, y in zip(value, mine, strict=True))
        else:
            out[name] = mine == value
    return out


def _stock_bucketed_reload(case: DraftCase, work: Path) -> dict[str, Any]:
    """vLLM's own class (no lifecycle), reloaded A -> B in buckets, later layers first (the optional modules come
    with the rest, last), through vLLM's layerwise reload: what happens to its derived state and its structure.
    Then the same buckets as plain `load_weights` calls on the GPU layout (no META placeholders in the way):
    what vLLM's per-call decisions do on their own."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    stock = build(case, _draft_dir(work, case, "A"), work / "target", stock=True)
    draft_config = stock.vllm_config.speculative_config.draft_model_config

    def reload() -> int:
        initialize_layerwise_reload(stock)
        calls = buckets(read(_draft_dir(work, case, "B")), "buckets_later_layers_first")
        try:
            for bucket in calls:
                stock.load_weights(bucket)
        finally:
            finalize_layerwise_reload(stock, draft_config)  # puts back what the failed reload left on META
        return len(calls)

    out: dict[str, Any] = {"reload": attempt(reload), "confidence_head": _has_confidence_head(stock)}
    with gpu_weight_layout():
        plain = build(case, _draft_dir(work, case, "A"), work / "target", stock=True)
        calls = buckets(read(_draft_dir(work, case, "B")), "buckets_later_layers_first")
        # The cold tensors are held so their storage stays allocated: a new allocation cannot reuse the address
        # and pass for "in place".
        before = _stock_buffers(plain, case.family)
        out["plain_gpu"] = {"reload": attempt(lambda: [plain.load_weights(bucket) for bucket in calls] and None),
                            "confidence_head": _has_confidence_head(plain)}
        after = _stock_buffers(plain, case.family)
        out["plain_gpu"]["moved"] = sorted(
            n for n, t in after.items() if n not in before or before[n].data_ptr() != t.data_ptr())
        del before, after
    if case.family == "kimi_k3_dspark":  # built once after the cold load, never rebuilt: compare with B's norms
        from support.vllm_trainer_paths import read as read_tensors

        tb = dict(read_tensors(_draft_dir(work, case, "B")))
        n = len(stock.model.layers)
        expected = torch.stack([tb[f"layers.{i}.self_attn.kv_a_layernorm.weight"] for i in range(n)])
        out["norms_equal_B"] = bool(torch.equal(stock.model._context_kv_norm_weights, expected))
    return out


def _stock_buffers(model: Any, fam: str) -> dict[str, torch.Tensor]:
    """The tensors stock vLLM's builder holds for what the family derives (its declared buffers), now."""
    from lifecycle.vllm.drafts.families import family

    return {s.name: t for s in family(fam).derived()
            if isinstance(t := getattr(model.model, s.name, None), torch.Tensor)}


def _has_confidence_head(model: Any) -> bool | None:
    """Whether the draft still has its confidence head (None: the family builds none for this config)."""
    if not hasattr(model.model, "confidence_head"):
        return None
    return model.model.confidence_head is not None


def _runner_lookup(work: Path) -> dict[str, Any]:
    """The worker extension's discovery on each real model-runner class (instances made without __init__: no
    device), holding an in-process draft as each runner does: V1 in `drafter.model`, V2 in `speculator.model`."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as RunnerV1

    from lifecycle.vllm.worker import LifecycleWorkerExtension

    case = CASES["qwen3_dspark"]
    draft, target = build(case, _draft_dir(work, case, "A"), work / "target"), torch.nn.Linear(1, 1)
    v1 = object.__new__(RunnerV1)
    v1.model, v1.drafter = target, SimpleNamespace(model=draft)
    v2 = object.__new__(RunnerV2)
    speculator = object.__new__(DFlashSpeculator)  # V2's speculator for DFlash and DSpark drafts
    speculator.model = draft
    v2.model, v2.speculator = target, speculator
    out = {}
    for name, runner in (("v1", v1), ("v2", v2)):
        worker = type("Worker", (LifecycleWorkerExtension,), {})()  # the extension, as vLLM mixes it in
        worker.model_runner = runner  # type: ignore[attr-defined]
        models = worker._lifecycle_models()
        assert models["draft"] is draft and models["target"] is target
        out[name] = {"roles": list(models), "runner_class": f"{type(runner).__module__}.{type(runner).__name__}",
                     "states": worker.lifecycle_states()}
    return out
