"""The engine basics the failure, quantized-draft and Ray scenarios share (support/vllm_failure_scenarios.py,
support/quantized_drafts.py, support/ray_scenarios.py): one engine on the tiny DFlash target and drafts (`target`,
`draftA`, `draftB`, made by conftest's `vllm_workdir`), greedy tokens for one prompt, a fingerprint of the draft as
the model computes with it, and the cold engine on draft B (`cold_b`) they compare with. Each script runs in its own
process:

    PYTHONPATH=.:tests python -m support.vllm_basic_scenarios SCENARIO WORKDIR   -> prints one JSON line

vLLM is imported inside the functions only: importing this module needs nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from support.needs import needs, refuse_engines

PROMPT = [1, 5, 7, 9, 11]


@needs("engine")
def run_scenario(name: str, work: Path, *, script: str = "vllm_basic_scenarios", **env: str) -> dict[str, Any]:
    """Run one scenario of `support/SCRIPT.py` in its own process (one engine) and return its JSON result."""
    from support.vllm_runs import run_script

    return run_script(script, name, work, **env)


def _engine(work: Path, draft: str, *, plugin: bool = True) -> Any:
    from vllm import LLM

    from lifecycle.vllm.demo.tiny import engine_kwargs

    return LLM(**engine_kwargs(work / "target", work / draft, plugin=plugin))


def _generate(llm: Any) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    return list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0].token_ids)


def _try(fn: Any) -> dict[str, Any]:
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e)[:2000], "cause": repr(e.__cause__)[:2000],
                "trace": traceback.format_exc()[-1500:]}


def pinned_reload_on_every_rank(llm: Any, work: Path) -> dict[str, Any]:
    """Generate, pin, a shuffled bucketed reload of draft B on every rank, then states, pins, digests and
    generate again (support/ray_scenarios.py runs it under Ray)."""
    out: dict[str, Any] = {"generate_before": _try(lambda: _generate(llm))}
    out["pinned"] = llm.collective_rpc("lifecycle_pin")
    out["reload"] = _try(lambda: llm.collective_rpc(
        "reload_draft_weights", args=(str(work / "draftB"),), kwargs={"bucket_size": 6, "shuffle": True}))
    out["states"] = llm.collective_rpc("lifecycle_states")
    out["verify"] = llm.collective_rpc("lifecycle_verify")
    out["digests"] = llm.collective_rpc("lifecycle_derived_digests")
    out["generate_after"] = _try(lambda: _generate(llm))
    return out


def scenario_cold(work: Path) -> dict[str, Any]:
    llm = _engine(work, "draftB")
    return {"generate": _try(lambda: _generate(llm)), "states": llm.collective_rpc("lifecycle_states"),
            "digests": llm.collective_rpc("lifecycle_derived_digests"),
            "fingerprint": llm.collective_rpc(fingerprint)}


def fingerprint(worker: Any) -> dict[str, str]:
    """sha256 per draft tensor as the model computes with it: every linear layer's effective weight, read as
    its output on an identity input (exact: one nonzero product per element, in any layout, packed or not),
    and every other non-empty parameter's bytes. Two engines with equal fingerprints hold the same draft."""
    import hashlib

    import torch

    def sha(t: torch.Tensor) -> str:
        t = t.detach().contiguous().cpu()
        return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    draft = worker.model_runner.get_draft_model()
    out: dict[str, str] = {}
    with torch.inference_mode():
        for name, module in draft.named_modules():
            quant = getattr(module, "quant_method", None)
            if quant is not None and hasattr(module, "input_size_per_partition"):
                eye = torch.eye(module.input_size_per_partition, dtype=module.params_dtype)
                out[f"{name}(x)"] = sha(quant.apply(module, eye))
                continue
            for leaf, p in module.named_parameters(recurse=False):
                if p.numel() and leaf != "mask_embedding":  # not in the checkpoint: uninitialised memory
                    out[f"{name}.{leaf}"] = sha(p)
    return out


def main(namespace: dict[str, Any] | None = None) -> None:
    scenario, work = sys.argv[1], Path(sys.argv[2])
    refuse_engines()  # started by a test not marked `engine`: no engine may start here
    from lifecycle.vllm.demo.tiny import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    result = {"scenario": scenario, **(namespace or globals())[f"scenario_{scenario}"](work)}
    print("SCENARIO_RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
