"""Offline (`LLM` + vLLM's weight-transfer session) scenarios for tests/vllm_plugin/online/test_vllm_sessions.py: the
same session semantics as the online server (a refused finish, an abandoned push, the takeover setting), the draft in
the weight checker on both weight layouts, and the trainer's `weight_version` in the audit. One process, two engines one
after the other (the CPU layout, then the GPU layout):

    PYTHONPATH=.:tests python -m support.vllm_session_scenarios offline WORKDIR   -> prints one JSON line

vLLM is imported inside the functions only.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

from support.vllm_basic_scenarios import _generate, _try, main

MISSING_LAYER1 = ["layers.1."]


def _engine(work: Path, draft: str) -> Any:
    from vllm import LLM

    from lifecycle.vllm.demo.tiny import engine_kwargs

    return LLM(**engine_kwargs(work / "target", work / draft))


def _draft(llm: Any) -> dict[str, Any]:
    (rank0,) = llm.collective_rpc("lifecycle_states")
    return next({k: s[k] for k in ("state", "epoch", "quarantine_reason")} for s in rank0 if s["role"] == "draft")


def _call(fn: Any) -> dict[str, Any]:
    """What a trainer sees of one call: ok, or the exception's class and message."""
    try:
        fn()
    except Exception as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e)[:4000]}
    return {"ok": True}


def _push(llm: Any, path: Path, version: str | None = None, *, draft: bool = True,
          exclude: list[str] | None = None) -> list[dict[str, Any]]:
    """start, update, finish; stops at the first call that raises."""
    info: dict[str, Any] = {"path": str(path), **({"exclude_prefixes": exclude} if exclude else {})}
    steps = []
    for step in (llm.start_draft_weight_update if draft else llm.start_weight_update,
                 lambda: llm.update_weights({"update_info": info}),
                 lambda: llm.finish_weight_update(weight_version=version)):
        steps.append(_call(step))
        if not steps[-1]["ok"]:
            break
    return steps


def _worker_calls(llm: Any, fn: Any) -> list[str]:
    """The worker RPCs (round trips from the front process to the workers) `fn` makes, by method name."""
    core = llm.llm_engine.engine_core
    calls: list[str] = []
    original = core.collective_rpc

    def counted(method: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(method if isinstance(method, str) else getattr(method, "__name__", "?"))
        return original(method, *args, **kwargs)

    core.collective_rpc = counted
    try:
        fn()
    finally:
        del core.collective_rpc  # the class's method again
    return calls


def _checksums(llm: Any) -> dict[str, str]:
    (rank0,) = llm.collective_rpc("compute_weight_checksums")
    return dict(rank0)


def _expected(work: Path, draft: str) -> dict[str, str]:
    from safetensors.torch import load_file

    from lifecycle.vllm.observability.weight_checker import expected_checksums

    return expected_checksums(load_file(str(work / draft / "model.safetensors")))


def _draft_entries(checksums: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in checksums.items() if ":draft." in k}


def _tamper(worker: Any, name: str) -> None:
    """In the worker: one element of the draft's derived buffer `name` changed (what a stale buffer looks like)."""
    import torch

    from lifecycle.vllm.drafts.owners import backbones_in, draft_model_of

    (b,) = backbones_in(draft_model_of(worker.model_runner))
    t = b._buffers[name]
    worker.__dict__["_saved_" + name] = t.detach().clone()
    with torch.no_grad():
        t.view(-1)[0] += 1.0


def _untamper(worker: Any, name: str) -> None:
    import torch

    from lifecycle.vllm.drafts.owners import backbones_in, draft_model_of

    (b,) = backbones_in(draft_model_of(worker.model_runner))
    with torch.no_grad():
        b._buffers[name].copy_(worker.__dict__.pop("_saved_" + name))


def _stale(llm: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """Per buffer: the weight checker's verdicts with that buffer changed, then restored."""
    out = {}
    for name in names:
        llm.collective_rpc(_tamper, args=(name,))
        tampered = _draft_entries(_checksums(llm))
        llm.collective_rpc(_untamper, args=(name,))
        out[name] = {"tampered": {k.rpartition(".")[2]: v for k, v in tampered.items() if ".derived." in k},
                     "restored": {k.rpartition(".")[2]: v for k, v in _draft_entries(_checksums(llm)).items()
                                  if ".derived." in k}}
    return out


def _sessions(llm: Any, work: Path) -> dict[str, Any]:
    from lifecycle.vllm.online.sessions import TAKEOVER_IDLE_ENV

    out: dict[str, Any] = {"generate_cold": _try(lambda: _generate(llm))}
    # a refused finish (the payload misses layer 1), then a corrected push, then a policy sync
    out["refused"] = _push(llm, work / "draftB", "B-missing-layer", exclude=MISSING_LAYER1)
    out["refused_state"] = _draft(llm)
    out["refused_checksums"] = _draft_entries(_checksums(llm))
    out["refused_generate"] = _try(lambda: _generate(llm))
    out["corrected_calls"] = _worker_calls(llm, lambda: out.__setitem__("corrected", _push(
        llm, work / "draftB", "B-1")))
    out["corrected_state"] = _draft(llm)
    out["corrected_digests"] = llm.collective_rpc("lifecycle_derived_digests")
    out["corrected_checksums"] = _draft_entries(_checksums(llm))
    out["policy"] = _push(llm, work / "target", "policy-1", draft=False)
    # an abandoned push (the trainer died after update_weights), then the next push
    out["abandoned"] = [_call(llm.start_draft_weight_update),
                        _call(lambda: llm.update_weights({"update_info": {"path": str(work / "draftA")}}))]
    out["abandoned_state"] = _draft(llm)
    out["abandoned_checksums"] = _draft_entries(_checksums(llm))
    out["abandoned_refused_start"] = _call(llm.start_draft_weight_update)  # active: refused for 60 s by default
    out["abandoned_taken_over"] = llm.collective_rpc("lifecycle_take_over_push",
                                                     kwargs={"push": f"epoch {out['abandoned_state']['epoch']}"})
    out["next"] = _push(llm, work / "draftB", "B-2")
    out["next_state"] = _draft(llm)
    out["next_digests"] = llm.collective_rpc("lifecycle_derived_digests")
    # an abandoned draft push, then a policy start
    out["abandoned_policy"] = [_call(llm.start_draft_weight_update),
                               _call(lambda: llm.update_weights({"update_info": {"path": str(work / "draftA")}}))]
    llm.collective_rpc("lifecycle_take_over_push", kwargs={"push": f"epoch {_draft(llm)['epoch']}"})
    out["abandoned_policy"] += _push(llm, work / "target", "policy-2", draft=False)
    out["abandoned_policy_state"] = _draft(llm)
    out["after_policy"] = _push(llm, work / "draftB", "B-3")
    out["after_policy_state"] = _draft(llm)
    # a live session is not taken over under the takeover setting; its own finish still completes it
    os.environ[TAKEOVER_IDLE_ENV] = "600"
    try:
        out["live"] = [_call(llm.start_draft_weight_update),
                       _call(lambda: llm.update_weights({"update_info": {"path": str(work / "draftA")}})),
                       _call(llm.start_draft_weight_update), _call(llm.start_weight_update)]
        out["live_state"] = _draft(llm)
        out["live_finish"] = _call(lambda: llm.finish_weight_update(weight_version="A-1"))
        out["live_finish_state"] = _draft(llm)
    finally:
        del os.environ[TAKEOVER_IDLE_ENV]
    # a chunk the plugin refuses (a path that is not a checkpoint): the session ends, the next push proceeds
    out["bad_chunk"] = _push(llm, work / "no-such-checkpoint", "bad")
    out["bad_chunk_state"] = _draft(llm)
    out["after_bad_chunk"] = _push(llm, work / "draftB", "B-4")
    out["after_bad_chunk_state"] = _draft(llm)
    out["generate_end"] = _try(lambda: _generate(llm))
    out["stale"] = _stale(llm, ("_k_norm_weights", "_fused_kv_weight"))
    out["events"] = llm.collective_rpc("lifecycle_events", kwargs={"last": 400})
    return out


def scenario_offline(work: Path) -> dict[str, Any]:
    from support.vllm_inprocess import gpu_weight_layout

    out: dict[str, Any] = {"expected_A": _expected(work, "draftA"), "expected_B": _expected(work, "draftB")}
    llm = _engine(work, "draftA")
    out["cpu_cold_checksums"] = _draft_entries(_checksums(llm))
    out["cpu"] = _sessions(llm, work)
    del llm
    gc.collect()
    with gpu_weight_layout():
        llm = _engine(work, "draftA")
        out["gpu_cold_checksums"] = _draft_entries(_checksums(llm))
        out["gpu_push"] = _push(llm, work / "draftB", "B-gpu")
        out["gpu_checksums"] = _draft_entries(_checksums(llm))
        out["gpu_digests"] = llm.collective_rpc("lifecycle_derived_digests")
        out["gpu_stale"] = _stale(llm, ("_fused_kv_weight",))
    return out


if __name__ == "__main__":
    main(globals())
