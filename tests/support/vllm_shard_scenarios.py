"""A payload that only looks complete (`python -m support.vllm_shard_scenarios shards WORKDIR`): vLLM's own DFlash
class in-process (`support/vllm_inprocess.py`), cold on draft A, then a reload toward B in which layer 0's `q_proj`
arrives twice and `k_proj` never does. With 2 query heads and 1 KV head the elements vLLM counts add up
(q + q = q + k + v), so stock vLLM processes the fused `qkv_proj` with K rows that were never sent.

Every way a trainer writes the draft, on both weight layouts, with both partial policies:
  layerwise  initialize_layerwise_reload, one load_weights per call ("|" separates calls), finalize (every order)
  plain      load_weights per call with no initialize, then process_weights_after_loading (trainer path iv)
  transfer   the plugin's transfer engine: one update_weights (one file) per call, then finish_weight_update
  alias      ONE load_weights call that carries layer 0's q_proj under both names vLLM's DFlash maps to it
             (`midlayer.` is vLLM's alias of `layers.0.`): a duplicate needs no second call
The last call of each sends the rest of the checkpoint; the order "q|q|k|v" is a retry that does send everything
(it must load). After a refused payload, the documented retry (a complete reload of B) must reach B everywhere.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from support.needs import needs

__all__ = ["CASES_RUN", "ORDERS", "SHORT_ORDERS", "run_shards", "scenario_shards"]

Q, K, V = (f"layers.0.self_attn.{p}_proj.weight" for p in "qkv")
ALIAS_Q = "midlayer.self_attn.q_proj.weight"  # vLLM's DFlash maps `midlayer.` to `layers.0.`
#: the load_weights calls for layer 0's attention projections, then one call with the rest
ORDERS = ("q|v|q", "q|q|v", "q|q", "q|q|k|v")
#: the orders run on the other paths: an incomplete one and the complete retry
SHORT_ORDERS = ("q|q|v", "q|q|k|v")
LAYOUTS = ("cpu", "gpu")
POLICIES = ("refuse", "keep")
Tensors = dict[str, torch.Tensor]


def _cases() -> list[tuple[str, str, str, str]]:
    """(path, layout, policy, order) of every case run."""
    out = [("layerwise", layout, policy, order) for layout in LAYOUTS for policy in POLICIES for order in ORDERS]
    for path in ("plain", "transfer"):
        out += [(path, layout, "refuse", order) for layout in LAYOUTS for order in SHORT_ORDERS]
        out.append((path, "gpu", "keep", "q|q|v"))
    out += [("alias", layout, "refuse", "q+alias") for layout in LAYOUTS] + [("alias", "gpu", "keep", "q+alias")]
    return out


CASES_RUN = _cases()


@needs("vllm", "slow")
def run_shards(work: Path) -> dict[str, Any]:
    """Every case in one process (no engine)."""
    from support.vllm_runs import run_script

    return run_script("vllm_shard_scenarios", "shards", work)


def _calls(tensors: Tensors, order: str) -> list[list[tuple[str, torch.Tensor]]]:
    if order == "q+alias":
        return [[(n, t) for n, t in tensors.items() if n != K] + [(ALIAS_Q, tensors[Q])]]
    by = {"q": (Q, tensors[Q]), "k": (K, tensors[K]), "v": (V, tensors[V])}
    return [[by[p]] for p in order.split("|")] + [[(n, t) for n, t in tensors.items() if n not in (Q, K, V)]]


def _write(model: Any, path: str, calls: list[list[tuple[str, torch.Tensor]]], policy: str, work: Path) -> None:
    """The calls, as `path` makes them."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from support.vllm_inprocess import backbone

    config = model.vllm_config.speculative_config.draft_model_config
    if path == "transfer":
        _transfer(model, calls, policy, work)
        return
    backbone(model).lifecycle_runtime.reload_partial = policy
    if path == "plain":
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for call in calls:
            model.load_weights(call)
        process_weights_after_loading(model, config, torch.device("cpu"))
        return
    initialize_layerwise_reload(model)
    for call in calls:
        model.load_weights(call)
    finalize_layerwise_reload(model, config)


def _transfer(model: Any, calls: list[list[tuple[str, torch.Tensor]]], policy: str, work: Path) -> None:
    """vLLM's native draft session with the plugin's safetensors_file engine, one file per update_weights."""
    from vllm.config.weight_transfer import WeightTransferConfig

    from lifecycle.loading import write_checkpoint
    from lifecycle.vllm.online.transfer import engine_class

    cfg = model.vllm_config
    files = []
    for i, call in enumerate(calls):
        files.append(write_checkpoint(dict(call), work / f"chunk-{id(model)}-{i}.safetensors"))
    engine = engine_class()(WeightTransferConfig(backend="safetensors_file"), cfg, torch.device("cpu"), model)
    engine.set_weight_update_target(model, cfg.speculative_config.draft_model_config)
    engine.start_weight_update()
    try:
        for f in files:
            engine.update_weights({"path": str(f), "partial": policy})
        engine.finish_weight_update()
    finally:
        engine.reset_weight_update_target()


def _rows(model: Any) -> dict[str, torch.Tensor]:
    """Layer 0's q, k, v rows as the layer computes with them (an identity input through its quant method: exact
    in any layout, repacked or not)."""
    attn = model.model.layers[0].self_attn
    layer = attn.qkv_proj
    with torch.inference_mode():
        out = layer.quant_method.apply(layer, torch.eye(layer.input_size_per_partition)).t()
    q, kv = attn.q_size, attn.kv_size
    return {"q": out[:q], "k": out[q:q + kv], "v": out[q + kv:]}


def _state(model: Any, ta: Tensors, tb: Tensors, layout: str) -> dict[str, Any]:
    from support.vllm_inprocess import backbone, vllm_builder_values

    draft = backbone(model)
    lc = draft.lifecycle
    of = {p: ("A" if torch.equal(r, ta[n]) else "B" if torch.equal(r, tb[n]) else "neither")
          for (p, r), n in zip(_rows(model).items(), (Q, K, V), strict=True)}
    fused = None
    if layout == "gpu" and lc.usable:  # what vLLM's own builder makes of the live weights
        fused = torch.equal(vllm_builder_values(model)["_fused_kv_weight"], draft._buffers["_fused_kv_weight"])
    return {"state": lc.state.value, "usable": lc.usable, "rows": of, "fused_is_vllms": fused}


def scenario_shards(work: Path) -> dict[str, Any]:
    from support.vllm_inprocess import CASES, build, gpu_weight_layout, make_draft, setup
    from support.vllm_trainer_paths import attempt, read

    setup()
    case = CASES["dflash"]
    a, b = make_draft(case, work / "A", 1), make_draft(case, work / "B", 2)
    ta, tb = dict(read(a)), dict(read(b))
    out: dict[str, Any] = {}
    for path, layout, policy, order in CASES_RUN:
        with gpu_weight_layout() if layout == "gpu" else nullcontext():
            model = build(case, a)
            res = attempt(lambda: _write(model, path, _calls(tb, order), policy, work))  # noqa: B023
            res.pop("value", None)
            res.update(_state(model, ta, tb, layout))
            if not res["ok"]:  # the documented retry: a complete reload of B, on the same draft
                retry = attempt(lambda: _write(model, "layerwise", [list(tb.items())], "refuse", work))  # noqa: B023
                res["retry"] = {"ok": retry["ok"], "error": retry.get("message"), **_state(model, ta, tb, layout)}
            res.pop("trace", None)
            out[f"{path}/{layout}/{policy}/{order}"] = res
    return out


if __name__ == "__main__":
    from support.vllm_basic_scenarios import main

    main(globals())
