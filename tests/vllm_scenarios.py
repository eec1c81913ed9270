"""Engine scenarios for tests/test_vllm_engine.py, each run in its own process (one vLLM engine per process):

    python tests/vllm_scenarios.py SCENARIO WORKDIR      -> prints one JSON line: {"scenario": ..., ...}

The checkpoints (target, draft A, draft B) are made in WORKDIR by the test. vLLM is imported inside the
functions only: importing this module needs nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

PROMPT = [1, 5, 7, 9, 11]


def _engine(work: Path, draft: str, *, plugin: bool = True) -> Any:
    from vllm import LLM

    from lifecycle.vllm.tiny import engine_kwargs

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


def _raw_draft_reload(worker: Any, path: str, bucket: int) -> str:
    """The upstream sequence, no plugin help: initialize -> load_weights per bucket -> finalize."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    draft = worker.model_runner.drafter.model
    items = list(load_file(path).items())
    initialize_layerwise_reload(draft)
    for i in range(0, len(items), bucket):
        draft.load_weights(items[i:i + bucket])
    finalize_layerwise_reload(draft, worker.vllm_config.speculative_config.draft_model_config)
    return "reloaded"


def scenario_noplugin(work: Path) -> dict[str, Any]:
    llm = _engine(work, "draftA", plugin=False)
    out: dict[str, Any] = {"generate_before": _try(lambda: _generate(llm))}
    out["reload"] = _try(lambda: llm.collective_rpc(_raw_draft_reload, args=(str(work / "draftB" / "model.safetensors"),
                                                                              5)))
    out["draft_class"] = llm.collective_rpc(lambda w: type(w.model_runner.drafter.model).__name__)[0]
    out["generate_after"] = _try(lambda: _generate(llm))
    return out


def scenario_warm(work: Path) -> dict[str, Any]:
    """Cold A, pin, bucketed shuffled reload of B, generate; target reload; then an incomplete payload."""
    llm = _engine(work, "draftA")
    out: dict[str, Any] = {"generate_before": _try(lambda: _generate(llm))}
    out["states_cold"] = llm.collective_rpc("lifecycle_states")
    out["pinned"] = llm.collective_rpc("lifecycle_pin")
    out["reload"] = _try(lambda: llm.collective_rpc(
        "reload_draft_weights", args=(str(work / "draftB"),), kwargs={"bucket_size": 5, "shuffle": True}))
    out["states_reloaded"] = llm.collective_rpc("lifecycle_states")
    out["verify"] = llm.collective_rpc("lifecycle_verify")
    out["digests"] = llm.collective_rpc("lifecycle_derived_digests")
    out["generate_after"] = _try(lambda: _generate(llm))
    # the target reloads with the draft attached: the draft's lifecycle must stay valid
    out["target_reload"] = _try(lambda: llm.collective_rpc(
        "reload_weights", kwargs={"weights_path": str(work / "target"), "is_checkpoint_format": True}))
    out["states_after_target_reload"] = llm.collective_rpc("lifecycle_states")
    out["verify_after_target_reload"] = llm.collective_rpc("lifecycle_verify")
    out["generate_after_target_reload"] = _try(lambda: _generate(llm))
    # vLLM's native weight-transfer session for the draft (SkyRL / NeMo-RL style), back to draft A
    def draft_session() -> Any:
        llm.collective_rpc("start_draft_weight_update")
        llm.collective_rpc("update_weights", args=({"path": str(work / "draftA")},))
        return llm.collective_rpc("finish_weight_update")

    out["session"] = _try(draft_session)
    out["states_session"] = llm.collective_rpc("lifecycle_states")
    out["digests_session"] = llm.collective_rpc("lifecycle_derived_digests")
    out["generate_after_session"] = _try(lambda: _generate(llm))
    # an incomplete draft payload: layer 1 missing
    out["partial_reload"] = _try(lambda: llm.collective_rpc(
        "reload_draft_weights", args=(str(work / "draftA"),), kwargs={"bucket_size": 4,
                                                                      "exclude_prefixes": ["layers.1."]}))
    out["states_partial"] = llm.collective_rpc("lifecycle_states")
    out["digests_partial"] = llm.collective_rpc("lifecycle_derived_digests")
    out["events"] = llm.collective_rpc("lifecycle_events", kwargs={"last": 400})
    out["generate_quarantined"] = _try(lambda: _generate(llm))
    return out


def scenario_tp2(work: Path) -> dict[str, Any]:
    """Two tensor-parallel ranks: each rank's draft backbone reloads its own shard; events carry the rank."""
    from vllm import LLM

    from lifecycle.vllm.tiny import engine_kwargs

    llm = LLM(**engine_kwargs(work / "target", work / "draftA"), tensor_parallel_size=2,
              distributed_executor_backend="mp")
    return pinned_reload_on_every_rank(llm, work)


def pinned_reload_on_every_rank(llm: Any, work: Path) -> dict[str, Any]:
    """Generate, pin, a shuffled bucketed reload of draft B on every rank, then states, pins, digests and
    generate again (tests/ray_scenarios.py runs it under Ray)."""
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
            "digests": llm.collective_rpc("lifecycle_derived_digests")}


def main() -> None:
    scenario, work = sys.argv[1], Path(sys.argv[2])
    from lifecycle.vllm.tiny import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    result = {"scenario": scenario, **globals()[f"scenario_{scenario}"](work)}
    print("SCENARIO_RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
