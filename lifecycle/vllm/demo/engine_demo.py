"""`reload-lifecycle demo --engine vllm`: a real in-process vLLM engine (CPU build) with a DFlash draft.

Builds a tiny Qwen3 target and two tiny DFlash drafts (A, B) on disk, starts the engine with speculative
decoding, generates, pins the draft's storage, reloads the draft with B in shuffled buckets through vLLM's
layerwise reload, generates again, and prints the lifecycle table and PASS/FAIL checks.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import torch

from ...states import LifecycleState

__all__ = ["expected_dflash_digests", "run_vllm_demo"]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def expected_dflash_digests(draft_dir: Path) -> dict[str, str]:
    """What the fused buffers must hold for a draft checkpoint, computed from the file alone."""
    from safetensors.torch import load_file

    t = load_file(str(draft_dir / "model.safetensors"))
    n = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("layers."))
    kv = torch.cat([torch.cat([t[f"layers.{i}.self_attn.k_proj.weight"], t[f"layers.{i}.self_attn.v_proj.weight"]])
                    for i in range(n)])
    k_norm = torch.stack([t[f"layers.{i}.self_attn.k_norm.weight"] for i in range(n)])
    return {"_fused_kv_weight": _digest(kv), "_k_norm_weights": _digest(k_norm),
            "_hidden_norm_weight": _digest(t["hidden_norm.weight"])}


def run_vllm_demo(out_dir: str | Path | None = None, *, bucket_size: int = 5, seed: int = 0,
                  stream: TextIO | None = None) -> bool:
    from .tiny import ENGINE_ENV, engine_kwargs, make_dflash_draft, make_target

    def say(s: str = "") -> None:
        print(s, file=stream or sys.stdout, flush=True)

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="reload-lifecycle-vllm-demo-"))
    os.environ.setdefault("RELOAD_LIFECYCLE_AUDIT_DIR", str((out / "audit").absolute()))  # it must be absolute
    say(f"reload-lifecycle demo --engine vllm: tiny Qwen3 target + DFlash draft, output in {out}")
    make_target(out / "target")
    make_dflash_draft(out / "draftA", seed=seed + 1)
    make_dflash_draft(out / "draftB", seed=seed + 2)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import lifecycle.vllm.plugin.activation as plugin

    llm = LLM(**engine_kwargs(out / "target", out / "draftA"))
    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)

    def generate() -> list[int]:
        return list(llm.generate([TokensPrompt(prompt_token_ids=[1, 5, 7, 9, 11])], params,
                                 use_tqdm=False)[0].outputs[0].token_ids)

    checks: list[tuple[str, bool, str]] = []
    say(f"\nplugin active: {plugin._active}")
    tokens_a = generate()
    say(f"[1] generate with draft A: {tokens_a}")
    cold = _draft(llm.collective_rpc("lifecycle_states"))
    pinned = llm.collective_rpc("lifecycle_pin")[0]["backbones"]
    say(f"[2] pinned the draft's storage identities: {pinned}")
    result = llm.collective_rpc("reload_draft_weights", args=(str(out / "draftB"),),
                                kwargs={"bucket_size": bucket_size, "shuffle": True, "seed": seed})[0]
    say(f"[3] reloaded draft B through vLLM's layerwise reload: {result['tensors']} tensors in "
        f"{result['buckets']} shuffled buckets")
    tokens_b = generate()
    say(f"[4] generate with draft B: {tokens_b}")
    after = _draft(llm.collective_rpc("lifecycle_states"))
    verify = llm.collective_rpc("lifecycle_verify")[0]["backbones"]
    digests = next(iter(llm.collective_rpc("lifecycle_derived_digests")[0]["backbones"].values()))
    expected = expected_dflash_digests(out / "draftB")

    say("\nbuffer               | kind  | data_ptr cold     | data_ptr after    | shape")
    say("---------------------+-------+-------------------+-------------------+-----------")
    kinds = {"_fused_kv_weight": "cat", "_k_norm_weights": "stack", "_rope_cos_sin_cache": "alias",
             "_hidden_norm_weight": "alias"}
    for name, ident in after["derived"].items():
        say(f"{name:<20} | {kinds.get(name, '?'):<5} | {cold['derived'][name]['data_ptr']:<17} | "
            f"{ident['data_ptr']:<17} | {ident['shape']}")
    say(f"\nlifecycle: {after['backbone']} rank {after['rank']} state {after['state']} epoch {after['epoch']} "
        f"layers {after['layers_ready']}/{after['layers_total']}")

    moved = [n for n in after["derived"] if after["derived"][n] != cold["derived"][n]]
    checks.append(("generation works after the bucketed draft reload", bool(tokens_b), f"{len(tokens_b)} tokens"))
    checks.append(("greedy output unchanged (speculative decoding is lossless)", tokens_a == tokens_b, ""))
    checks.append(("every derived buffer kept its storage identity", not moved, ", ".join(moved) or "all same"))
    checks.append(("every pinned identity verified", all(v["ok"] for v in verify.values()),
                   f"{sum(v['checked'] for v in verify.values())} checked"))
    wrong = [n for n, d in expected.items() if digests.get(n) != d]
    checks.append(("fused buffers equal draft B's checkpoint, bit for bit", not wrong, ", ".join(wrong) or "equal"))
    back = LifecycleState.GRAPH_CAPTURED  # the demo's expectation (the RPC answers plain data: the state's name)
    checks.append((f"lifecycle back in {back} after the reload", after["state"] == back, after["state"]))
    say("\nchecks:")
    for name, ok, detail in checks:
        say(f"  {'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""))
    ok = all(c[1] for c in checks)
    say(f"\naudit logs: {out / 'audit'}")
    say("\nRESULT: " + ("all checks passed" if ok else "SOME CHECKS FAILED"))
    return ok


def _draft(states: list[list[dict[str, Any]]]) -> dict[str, Any]:
    return next(s for s in states[0] if s["role"] == "draft")
