"""In-process runs about the optional submodules of vLLM's drafts (`lifecycle/vllm/structure.py`): what the first
load froze, reloads that leave those modules out or send each in its own bucket, tensors for modules the draft
does not have, and what stock vLLM does with the same calls. Part of the in-process scenario
(`support/vllm_inprocess_runs.py`); vLLM is imported by the functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lifecycle.vllm.demo.tiny import HIDDEN, VOCAB
from support.vllm_inprocess import (
    CASES,
    backbone,
    build,
    build_target,
    digest,
    gpu_weight_layout,
    share_target,
    weight_digests,
)
from support.vllm_trainer_paths import attempt, buckets, read, write_draft

__all__ = ["frozen_absent", "optional_buckets", "optional_runs", "structure_of"]

Observe = Callable[[Any, dict[str, Any], dict[str, Any]], dict[str, Any]]


def structure_of(model: Any) -> dict[str, Any]:
    """What the first load froze (`lifecycle.structure`), which optional modules the draft holds now (its own
    copy), and the storage of their tensors."""
    from lifecycle.vllm.drafts.structure import observe

    live = observe(model)
    return {"frozen": backbone(model).lifecycle.structure, "holds": {m: v["present"] for m, v in live.items()},
            "storage": {n: p for v in live.values() for n, p in v["tensors"].items()}}


def optional_buckets(model: Any, tensors: list[tuple[str, Any]], plan: str) -> list[list[tuple[str, Any]]]:
    """`own_buckets_first`: each optional module's tensors in a bucket of its own, before the layer buckets;
    `left_out`: the layer buckets only (the optional modules are not sent at all)."""
    structure = backbone(model).lifecycle_runtime.structure
    by_module: dict[str, list[tuple[str, Any]]] = {}
    rest = []
    for name, t in tensors:
        module = structure.module_of(name)
        (by_module.setdefault(module, []) if module else rest).append((name, t))
    layered = buckets(rest, "buckets_later_layers_first")
    return layered if plan == "left_out" else [*by_module.values(), *layered]


def _optional_names(model: Any) -> list[str]:
    structure = backbone(model).lifecycle_runtime.structure
    return [n for m in structure.modules for n in structure.names_of(m) if n in backbone(model).lifecycle.specs]


def optional_runs(model: Any, work: Path, family: str, ref: dict[str, Any], pinned: dict[str, Any], cur: str,
                  observe: Observe) -> dict[str, Any]:
    """After the trainer paths, on the same pinned draft (holding draft `cur`): a bucketed reload of the other
    draft that leaves every optional module out (refused: the draft is quarantined naming them, keeps its
    structure and the old values), then one that sends each optional module in its own bucket (equals a cold
    load of that draft, serves again)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    draft_config = model.vllm_config.speculative_config.draft_model_config
    dest = {"A": "B", "B": "A"}[cur]
    tensors = read(work / f"{family}{dest}")

    def reload(calls: list[list[tuple[str, Any]]]) -> int:
        initialize_layerwise_reload(model)
        for bucket in calls:
            model.load_weights(bucket)
        finalize_layerwise_reload(model, draft_config)
        return len(calls)

    out: dict[str, Any] = {"previous": cur, "draft": dest, "optional": _optional_names(model)}
    left_out = attempt(lambda: reload(optional_buckets(model, tensors, "left_out")))
    now = weight_digests(model)
    out["left_out"] = {"result": left_out, **observe(model, ref[dest], pinned),
                       "optional_kept": {n: now[n] == ref[cur]["weights"][n] for n in out["optional"]}}
    own = attempt(lambda: reload(optional_buckets(model, tensors, "own_buckets_first")))
    out["own_buckets"] = {"result": own, **observe(model, ref[dest], pinned)}
    return out


def _target_heads(target: Any) -> dict[str, str]:
    return {"embed_tokens": digest(target.model.embed_tokens.weight), "lm_head": digest(target.lm_head.weight)}


def frozen_absent(work: Path) -> dict[str, Any]:
    """A Qwen3 DSpark draft whose first load had a confidence head and no other optional submodule (the target's
    vocabulary, embeddings and lm_head): a bucket that also carries tensors for those is refused before anything
    is written, naming each (the target's shared modules and the draft unchanged, no epoch begun); stock vLLM
    writes the embedding into the target's module, and its plain bucketed reload (GPU layout) loses the
    confidence head. Then a draft with its own embeddings that the proposer replaced with the target's after the
    load (as vLLM does when they are equal): a reload sending them is refused, one without them completes."""
    case = CASES["qwen3_dspark"]
    target = build_target(work / "target")
    g = torch.Generator().manual_seed(7)
    extra = [("embed_tokens.weight", torch.randn(VOCAB, HIDDEN, generator=g)),
             ("lm_head.weight", torch.randn(VOCAB, HIDDEN, generator=g)), ("d2t", torch.zeros(VOCAB, dtype=torch.long))]
    tensors_b = read(work / "qwen3_dspark0B")
    out: dict[str, Any] = {}

    draft = build(case, work / "qwen3_dspark0A", work / "target")
    share_target(draft, target)
    b = backbone(draft)
    lc = b.lifecycle
    b.capture_graphs()
    heads, weights = _target_heads(target), weight_digests(draft)
    refused = attempt(lambda: draft.load_weights([*tensors_b[:4], *extra]))
    out["plain"] = {"result": refused, "state": lc.state.value, "epoch": lc.epoch,
                    "structure": structure_of(draft)["frozen"], "target_unchanged": _target_heads(target) == heads,
                    "draft_unchanged": weight_digests(draft) == weights,
                    "refused_event": [e for e in lc.recent_events if e.get("event") == "refused"][-1:]}
    cfg = draft.vllm_config.speculative_config.draft_model_config
    out["then_complete"] = attempt(lambda: write_draft(draft, cfg, tensors_b, "buckets_later_layers_first"))
    out["then_state"] = lc.state.value

    stock = build(case, work / "qwen3_dspark0A", work / "target", stock=True)
    share_target(stock, target)
    saved = target.model.embed_tokens.weight.detach().clone()
    out["stock"] = attempt(lambda: stock.load_weights([extra[0]]))
    out["stock_target_embed_changed"] = _target_heads(target)["embed_tokens"] != heads["embed_tokens"]
    target.model.embed_tokens.weight.data.copy_(saved)
    with gpu_weight_layout():
        plain = build(case, work / "qwen3_dspark0A", work / "target", stock=True)
        calls = buckets(tensors_b, "buckets_later_layers_first")
        out["stock_plain"] = attempt(lambda: [plain.load_weights(bucket) for bucket in calls] and None)
        out["stock_confidence_head"] = plain.model.confidence_head is not None

    structured = build(case.with_structure(), work / "qwen3_dsparkA", work / "target")
    share_target(structured, target)
    inner = structured.model
    del inner.embed_tokens
    inner.embed_tokens = target.model.embed_tokens  # the proposer's sharing of an own copy equal to the target's
    sb = backbone(structured)
    sb.capture_graphs()
    full_b = read(work / "qwen3_dsparkB")
    cfg = structured.vllm_config.speculative_config.draft_model_config
    out["shared_sent"] = attempt(lambda: structured.load_weights(full_b))
    out["shared_left_out"] = attempt(lambda: write_draft(
        structured, cfg, [(n, t) for n, t in full_b if "embed_tokens" not in n], "buckets_later_layers_first"))
    out["shared_state"] = sb.lifecycle.state.value
    out["shared_structure"] = structure_of(structured)
    return out
