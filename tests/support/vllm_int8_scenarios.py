"""vLLM's CPU int8 kernel on each of its paths, in-process, no engine (`python -m support.vllm_int8_scenarios int8
WORKDIR`): one real compressed-tensors W8A8-int8 `QKVParallelLinear` (the tiny draft's layer 0 shape), loaded,
processed on the path forced (`quantized_drafts.force_int8_kernel_path`), then reloaded by vLLM's own layerwise
reload (draft A's values, then the cold ones again) while other small tensors reuse freed memory, as serving does.
Reports, per path, the function vLLM bound, what the layer computes warm against cold (an identity input: exact),
whether the parameters stayed at their addresses, and what the plugin's `reload_blocker` decides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from support.needs import needs

__all__ = ["run_int8", "scenario_int8"]


@needs("vllm", "slow")
def run_int8(work: Path) -> dict[str, Any]:
    """The scenario in its own process; glibc fills freed memory with a byte (`MALLOC_PERTURB_`), so what a freed
    tensor held is gone at once, whatever reuses it."""
    from support.vllm_runs import run_script

    return run_script("vllm_int8_scenarios", "int8", work, MALLOC_PERTURB_="165")


def _values(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {shard: (torch.randint(-127, 128, (n, 64), generator=g, dtype=torch.int8),
                    (torch.rand(n, 1, generator=g) * 0.01).float())
            for shard, n in (("q", 64), ("k", 32), ("v", 32))}


def _load(layer: torch.nn.Module, values: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for shard, (w, s) in values.items():
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, s, shard)


def _one_path(path: str) -> dict[str, Any]:
    from vllm.model_executor.layers.linear import QKVParallelLinear
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    from lifecycle.vllm.drafts.quantized import kernel_path, reload_blocker
    from support.quantized_drafts import _FORMATS, force_int8_kernel_path

    force_int8_kernel_path(path)
    config = CompressedTensorsConfig.from_config(_FORMATS["w8a8-int8"][1])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what the CPU int8 kernel computes in (the engine's dtype)
    try:
        holder = torch.nn.Module()  # reload_blocker walks a model; this one holds the layer only
        holder.qkv_proj = layer = QKVParallelLinear(64, 32, 2, 1, bias=False, quant_config=config,
                                                    prefix="layers.0.self_attn.qkv_proj")
        _load(layer, _values(2))
        record_metadata_for_reloading(layer)  # as vLLM's loader does, before processing
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.eye(64)
        cold = layer.quant_method.apply(layer, x).clone()
        addresses = {n: p.data_ptr() for n, p in layer.named_parameters()}
        taken = kernel_path(layer.scheme.kernel)
        blocker = reload_blocker(holder)
        reused: list[torch.Tensor] = []
        for seed in (1, 2):  # A, then the cold values again
            initialize_layerwise_reload(layer)
            _load(layer, _values(seed))
            finalize_layerwise_reload(layer, None)
            reused += [torch.full((n,), 7.0) for n in (128, 128, 64, 32) for _ in range(64)]
        warm = layer.quant_method.apply(layer, x)
        return {"path": list(taken) if taken else None, "blocker": blocker,
                "warm_equals_cold": bool(torch.equal(warm, cold)),
                "max_abs_diff": float((warm.float() - cold.float()).abs().max()),
                "same_addresses": addresses == {n: p.data_ptr() for n, p in layer.named_parameters()}}
    finally:
        torch.set_default_dtype(default)


def scenario_int8(work: Path) -> dict[str, Any]:
    from support.quantized_drafts import INT8_PATHS, sgl_kernel_compiled
    from support.vllm_inprocess import setup

    setup()
    out: dict[str, Any] = {"sgl_compiled": sgl_kernel_compiled(), "amx": bool(torch.cpu._is_amx_tile_supported())}
    for path in INT8_PATHS:
        if path == "sgl" and not out["sgl_compiled"]:
            continue
        out[path] = _one_path(path)
    return out


if __name__ == "__main__":
    from support.vllm_basic_scenarios import main

    main(globals())
