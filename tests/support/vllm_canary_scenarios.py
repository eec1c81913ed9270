"""The acceptance canary and the reload_lifecycle_* metrics on one offline engine (`LLM`), for
tests/vllm_plugin/observability/test_vllm_canary.py (issue 26 items 3 and 4):

    PYTHONPATH=.:tests python -m support.vllm_canary_scenarios canary WORKDIR   -> prints one JSON line

A target/draft pair whose agreement is known (`controlled_pair`): target Z (the tiny target with its final
`model.norm.weight` zeroed: every logit is 0, greedy decoding emits token 0 for any input), draft Z (draft A with
its final `norm.weight` zeroed: it proposes token 0, which target Z always accepts) and draft B (a normal draft:
its proposals are rejected). One engine on target Z + draft Z runs every phase, each a batch of greedy requests:
cold, a good push (Z again), a bad push (B), the good draft again, a refused push (the draft quarantined: vLLM
verifies placeholder zeros), a corrected push. After each phase: vLLM's own spec-decode counters (the phase's
difference), the plugin's metrics as Prometheus text (the process's default registry, what `/metrics` serves
online), the canary's audit events. The audit goes to WORKDIR/canary_audit (the test audits it).

vLLM is imported inside the functions only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from support.vllm_basic_scenarios import main

PROMPTS = ([1, 5, 7, 9, 11], [3, 3, 3, 3], [200, 17, 44, 90, 91, 92, 93], [0, 1, 2, 3, 4, 5, 6, 7, 8])
MAX_TOKENS = 16
SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
#: the canary's thresholds here: a good phase verifies 48 draft tokens, a bad one 180; every_steps: a bad phase
#: runs 15 steps with draft tokens, so one periodic `acceptance` event falls inside it
THRESHOLDS = {"RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS": "40", "RELOAD_LIFECYCLE_ACCEPTANCE_EVERY_STEPS": "12"}
CANARY_EVENTS = ("acceptance", "acceptance_collapse", "acceptance_recovered")


def zeroed_copy(src: Path, dst: Path, tensor: str) -> Path:
    """A copy of checkpoint folder `src` with `tensor` zeroed."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    tensors[tensor] = tensors[tensor].zero_()
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def controlled_pair(work: Path) -> tuple[Path, Path]:
    """(target Z, draft Z) beside `work`'s target and draft A (see the module docstring)."""
    return (zeroed_copy(work / "target", work / "targetZ", "model.norm.weight"),
            zeroed_copy(work / "draftA", work / "draftZ", "norm.weight"))


def _counters(llm: Any) -> dict[str, int]:
    return {m.name: int(m.value) for m in llm.get_metrics() if m.name in SPEC}


def _metrics_text() -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def _push(llm: Any, draft: Path, version: str, exclude: list[str] | None = None) -> str | None:
    """start, update, finish with `version`; None, or the refusal's class and message."""
    info: dict[str, Any] = {"path": str(draft), **({"exclude_prefixes": exclude} if exclude else {})}
    llm.start_draft_weight_update()
    try:
        llm.update_weights({"update_info": info})
        llm.finish_weight_update(weight_version=version)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:600]}"
    return None


def scenario_canary(work: Path) -> dict[str, Any]:
    import os

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lifecycle.vllm.demo.tiny import engine_kwargs

    audit = work / "canary_audit"
    shutil.rmtree(audit, ignore_errors=True)
    audit.mkdir()
    os.environ.update({**THRESHOLDS, "RELOAD_LIFECYCLE_AUDIT_DIR": str(audit)})
    target_z, draft_z = controlled_pair(work)
    llm = LLM(**engine_kwargs(target_z, draft_z), disable_log_stats=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False, ignore_eos=True)
    seen = 0
    out: dict[str, Any] = {"audit_dir": str(audit), "phases": []}

    def phase(name: str, refusal: str | None = None) -> None:
        nonlocal seen
        before = _counters(llm)
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], params, use_tqdm=False)
        after = _counters(llm)
        events = llm.collective_rpc("lifecycle_events", kwargs={"last": 1000})[0]
        canary = [e for e in events if e.get("event") in CANARY_EVENTS]
        (rank0,) = llm.collective_rpc("lifecycle_states")
        out["phases"].append({
            "name": name, "refusal": refusal, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "vllm": {k.removeprefix("vllm:spec_decode_"): after.get(k, 0) - before.get(k, 0) for k in SPEC},
            "metrics": _metrics_text(), "events": canary[seen:] if len(canary) >= seen else canary,
            "draft_state": next(s["state"] for s in rank0 if s["role"] == "draft")})
        seen = len(canary)

    phase("cold")
    phase("good push", _push(llm, draft_z, "v1-good"))
    phase("bad push", _push(llm, work / "draftB", "v2-bad"))
    phase("good again", _push(llm, draft_z, "v3-good"))
    phase("refused push", _push(llm, draft_z, "v4-refused", exclude=["layers.1."]))
    phase("corrected push", _push(llm, draft_z, "v5-good"))
    phase("last push", _push(llm, draft_z, "v6-good"))  # ends the corrected period: its final `acceptance`
    llm.llm_engine.engine_core.shutdown()
    return out


if __name__ == "__main__":
    main(globals())
