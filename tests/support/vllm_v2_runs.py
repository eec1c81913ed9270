"""Model Runner V2 on the CPU build, in-process (issue 26 item 7), for tests/vllm_plugin/serving/test_vllm_runner_v2.py;
part of the in-process scenario (`vllm_inprocess_runs.run_inprocess`, key `runner_v2`).

V2 (`vllm/v1/worker/gpu/`) cannot run on CPU: `VllmConfig` refuses it without Triton, `GPUModelRunner.__init__` and
the speculators' `__init__` need CUDA streams and events, and `propose` itself runs Triton kernels. Its classes
import, so what runs here is: the plugin's wrapper installed on vLLM's real `DFlashSpeculator.propose` (the one
DSpark and DFlash2 speculators inherit), called on a real `DSparkSpeculator` instance made without `__init__`,
holding a real Qwen3 DSpark lifecycle draft loaded by vLLM's loader; and V2's own loader functions
(`maybe_share_target_embed`, `_should_share`) on a real Gemma4 DSpark draft and the tiny target.
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from support.vllm_inprocess import CASES, backbone, build, build_target
from support.vllm_trainer_paths import buckets, read

REQS, K, VOCAB = 4, 3, 64  # the speculator's buffers: max requests, draft tokens per request, draft vocabulary
#: propose's other required arguments (the runner's tensors): None here, vLLM's propose is not run to its end
_TENSORS = ("attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states", "num_sampled", "num_rejected",
            "last_sampled", "next_prefill_tokens", "temperature", "seeds")


def _speculator(draft: Any) -> Any:
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    spec = object.__new__(DSparkSpeculator)  # its __init__ needs CUDA streams
    spec.model = draft
    spec.draft_tokens = torch.full((REQS, K), 9, dtype=torch.int64)
    return spec


def _batch(num_reqs: int, idx_mapping: list[int]) -> Any:
    return SimpleNamespace(num_reqs=num_reqs, idx_mapping=torch.tensor(idx_mapping), num_tokens=num_reqs)


def _call_installed(spec: Any, batch: Any) -> dict[str, Any]:
    """The installed wrapper, as the runner calls it (by keyword); whether vLLM's own propose was entered."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    try:
        out = DFlashSpeculator.propose(spec, input_batch=batch, **dict.fromkeys(_TENSORS), num_speculative_tokens=K)
    except Exception as e:  # vLLM's propose on an instance made without __init__, on CPU
        frames = traceback.extract_tb(e.__traceback__)
        return {"raised": type(e).__name__, "entered_vllms_propose": any(
            f.name == "propose" and f.filename.endswith("dflash/speculator.py") for f in frames)}
    return {"tokens": out.tolist(), "same_storage": out.data_ptr() == spec.draft_tokens.data_ptr()}


def _gate(work: Path) -> dict[str, Any]:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import DFlash2Speculator
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    from lifecycle.vllm.compat import patching
    from lifecycle.vllm.serving import runner_v2
    from lifecycle.vllm.serving.gate import steps_without_draft_total

    installed = DFlashSpeculator.propose
    out: dict[str, Any] = {
        "installed": bool(getattr(installed, patching.MARK, False)),
        "inherited_by": [c.__name__ for c in (DSparkSpeculator, DFlash2Speculator) if c.propose is installed]}
    case = CASES["qwen3_dspark"]
    draft = build(case, work / "qwen3_dsparkA", work / "target")
    b = backbone(draft)
    lc = b.lifecycle
    spec = _speculator(draft)
    batch = _batch(2, [2, 0])
    out["usable"] = {"state": lc.state.value, **_call_installed(spec, batch)}

    calls: list[Any] = []

    @functools.wraps(getattr(installed, patching.ORIGINAL))  # vLLM's signature: the gate reads positions from it
    def recorded(speculator: Any, *args: Any, **kwargs: Any) -> Any:  # what vLLM's propose would return on a GPU
        calls.append(kwargs.get("dummy_run", args[12] if len(args) > 12 else False))  # args[0]: input_batch
        speculator.draft_tokens[:2] = 7
        return speculator.draft_tokens[:2]

    gate = runner_v2.wrap_propose(recorded)
    gate(spec, batch)
    out["usable_recorded"] = {"calls": list(calls), "tokens": spec.draft_tokens.tolist()}
    initialize_layerwise_reload(draft)  # vLLM's own reload begins: the draft is not usable until it finishes
    calls.clear()
    before = steps_without_draft_total(b)
    out["mid_reload"] = {"state": lc.state.value, **_call_installed(spec, batch), "buffer": spec.draft_tokens.tolist(),
                         "paused_steps": b.lifecycle_runtime.drafting_paused_steps,
                         "steps_without_draft": steps_without_draft_total(b) - before}
    out["draft_model"] = _draft_model_speculator(draft, batch, "mid_reload")
    positional = [batch, None, None, None, None, None, None, None, None, None, None, None, True]  # dummy_run: 12th
    gate(spec, batch, dummy_run=True)
    gate(spec, *positional)
    out["mid_reload_dummy_runs"] = list(calls)
    # probabilistic rejection sampling: the draft distribution of the batch's request rows, one-hot at token 0
    spec.draft_logits = torch.randn(REQS, K, VOCAB)
    untouched = spec.draft_logits[[1, 3]].clone()
    spec.draft_token_confidence_probs = torch.ones(REQS, K)
    _call_installed(spec, batch)
    logits = spec.draft_logits
    out["probabilistic"] = {
        "one_hot_rows": [bool((logits[r, :, 0] == 0).all() and torch.isinf(logits[r, :, 1:]).all()) for r in (2, 0)],
        "other_rows_untouched": bool(torch.equal(logits[[1, 3]], untouched)),
        "confidence": spec.draft_token_confidence_probs.tolist()}
    del spec.draft_logits, spec.draft_token_confidence_probs
    # the reload completes (vLLM's own layerwise reload of draft A): the gate opens again
    for bucket in buckets(read(work / "qwen3_dsparkA"), "one_call"):
        draft.load_weights(bucket)
    finalize_layerwise_reload(draft, draft.vllm_config.speculative_config.draft_model_config)
    calls.clear()
    gate(spec, batch)
    out["reloaded"] = {"state": lc.state.value, "calls": list(calls), **_call_installed(spec, batch)}
    out["draft_model"].update(_draft_model_speculator(draft, batch, "reloaded"))
    out["events"] = [e["event"] for e in lc.recent_events if e["event"].startswith("drafting_")]
    return out


def _draft_model_speculator(draft: Any, batch: Any, when: str) -> dict[str, Any]:
    """V2's draft-model speculator (`StandaloneARSpeculator`, vLLM #43091) holding the draft: is its propose the
    plugin's gate, and what does a step get (`when`: mid-reload, zeros without running the draft; reloaded, vLLM's
    own propose, which needs CUDA)."""
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    from lifecycle.vllm.compat import patching

    spec = object.__new__(StandaloneARSpeculator)  # its __init__ needs CUDA
    spec.model = draft
    spec.draft_tokens = torch.full((REQS, K), 9, dtype=torch.int64)
    out: dict[str, Any] = {"installed": bool(getattr(StandaloneARSpeculator.propose, patching.MARK, False))}
    try:
        tokens = StandaloneARSpeculator.propose(spec, batch, *dict.fromkeys(_TENSORS).values(),
                                                num_speculative_tokens=K)
    except Exception as e:
        out[when] = {"raised": type(e).__name__, "entered_vllms_propose": any(
            f.name == "propose" and f.filename.endswith("standalone_ar/speculator.py")
            for f in traceback.extract_tb(e.__traceback__))}
    else:
        out[when] = {"tokens": tokens.tolist(), "same_storage": tokens.data_ptr() == spec.draft_tokens.data_ptr()}
    return out


def _own_heads(work: Path) -> dict[str, Any]:
    """Gemma4 DSpark through V2's loader decisions: does the draft keep its own embedding and lm_head?"""
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import _should_share, maybe_share_target_embed

    target = build_target(work / "target")
    out: dict[str, Any] = {}
    for name, stock in (("gemma4_dspark", False), ("gemma4_dspark_stock", True)):  # stock: vLLM's own class
        draft = build(CASES["gemma4_dspark"].with_structure(), work / "gemma4_dsparkA", work / "target", stock=stock)
        own_embed, own_head = getattr(draft.model, "embed_tokens", None), getattr(draft, "lm_head", None)
        flags = {f: getattr(draft, f, None) for f in ("has_own_embed_tokens", "has_own_lm_head")}
        maybe_share_target_embed(draft, draft.model, target.model)  # as load_dspark_model calls them
        share_head = own_head is not None and _should_share(draft, "has_own_lm_head", own_head, target.lm_head)
        out[name] = {"flags": flags, "had_own": [own_embed is not None, own_head is not None],
                    "embed_kept": own_embed is not None and draft.model.embed_tokens is own_embed,
                    "lm_head_kept": own_head is not None and not share_head}
        if not stock:  # equal to the target's: V2 shares them, as for every draft that declares its own
            with torch.no_grad():
                own_head.weight.copy_(target.lm_head.weight)
            out[name]["equal_lm_head_shared"] = bool(_should_share(draft, "has_own_lm_head", own_head, target.lm_head))
    return out


def run_runner_v2(work: Path) -> dict[str, Any]:
    from support.vllm_trainer_paths import attempt

    return {"gate": attempt(lambda: _gate(work)), "own_heads": attempt(lambda: _own_heads(work))}
