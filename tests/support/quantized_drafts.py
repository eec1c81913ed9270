"""Tiny DFlash draft checkpoints in quantized formats that the vLLM CPU build loads (for the engine tests).

`QUANTIZED` maps a name to how the draft is quantized: a checkpoint format (compressed-tensors: its
`quantization_config` in config.json and the quantized tensors it names) or an online method (the checkpoint
stays unquantized; `speculative_config["quantization"]` quantizes it at load). Values are random: the engine
tests compare a reloaded engine with a cold one on the same file, so only the format has to be right.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lifecycle.loading import write_checkpoint
from lifecycle.vllm.demo.tiny import dflash_draft_tensors, make_dflash_draft

__all__ = ["INT8_PATHS", "QUANTIZED", "force_int8_kernel_path", "kernel_paths", "make_quantized_draft",
           "sgl_kernel_compiled"]

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc")


def _group(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if inputs is not None:
        group["input_activations"] = inputs
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}


def _int8_w8a8(name: str, w: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": torch.randint(-127, 128, w.shape, generator=g, dtype=torch.int8),
            f"{name}.weight_scale": (w.abs().amax(dim=1, keepdim=True) / 127).float()}


def _w4a16(name: str, w: torch.Tensor, g: torch.Generator, group: int = 32) -> dict[str, torch.Tensor]:
    n, k = w.shape
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)  # unsigned nibbles (value + 8)
    packed = torch.zeros(n, k // 8, dtype=torch.int32)
    for i in range(8):
        packed |= q[:, i::8] << (4 * i)
    return {f"{name}.weight_packed": packed, f"{name}.weight_scale": torch.full((n, k // group), 0.01).bfloat16(),
            f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def _fp8_w8a8(name: str, w: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    scale = (w.abs().amax(dim=1, keepdim=True) / 448).float()
    return {f"{name}.weight": (w / scale).to(torch.float8_e4m3fn), f"{name}.weight_scale": scale}


def _int4_awq(name: str, w: torch.Tensor, g: torch.Generator, group: int = 32) -> dict[str, torch.Tensor]:
    n, k = w.shape
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    for i in range(8):
        qweight |= q[:, i::8] << (4 * i)
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int32)
    for i in range(8):
        qzeros |= torch.full((k // group, n // 8), 8, dtype=torch.int32) << (4 * i)
    return {f"{name}.qweight": qweight, f"{name}.qzeros": qzeros,
            f"{name}.scales": torch.full((k // group, n), 0.01).half()}


_FORMATS = {
    "w8a8-int8": (_int8_w8a8, _group({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                       "dynamic": False},
                                      {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}, "int-quantized")),
    "w4a16": (_w4a16, _group({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                              "group_size": 32, "dynamic": False}, None, "pack-quantized")),
    "w8a8-fp8": (_fp8_w8a8, _group({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                     "dynamic": False},
                                    {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                     "dynamic": True}, "float-quantized")),
    "awq": (_int4_awq, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
}
#: name -> (checkpoint format or None, `speculative_config["quantization"]` or None)
QUANTIZED: dict[str, tuple[str | None, str | None]] = {
    "fp8_per_channel": (None, "fp8_per_channel"),  # online: Fp8PtpcOnlineLinearMethod (fp8 weight, transposed)
    "w8a8-int8": ("w8a8-int8", None),  # compressed-tensors int8 W8A8 (CPUInt8ScaledMMLinearKernel)
    "w4a16": ("w4a16", None),  # compressed-tensors pack-quantized int4 (`weight_packed`; CPUWNA16LinearKernel)
    "w8a8-fp8": ("w8a8-fp8", None),  # compressed-tensors fp8 weights and activations
    "awq": ("awq", None),  # AutoAWQ int4 (qweight, qzeros, scales): AWQ-Marlin on CPU
}


def make_quantized_draft(folder: str | Path, seed: int, fmt: str | None) -> Path:
    """A DFlash draft folder; with `fmt`, every decoder linear layer stored quantized in that format."""
    folder = Path(folder)
    if fmt is None:
        return make_dflash_draft(folder, seed=seed)
    make_dflash_draft(folder, seed=seed)
    quantize, config = _FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in dflash_draft_tensors(seed).items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.rsplit(".", 1)[-1] in _LINEARS:
            tensors.update(quantize(base, t, g))
        else:
            tensors[name] = t
    write_checkpoint(tensors, folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = config
    cfg["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


# ---- vLLM's CPU int8 kernel: both of its paths on any CPU -----------------------------------------------------
#: the two paths of vLLM's `CPUInt8ScaledMMLinearKernel`: what `INT8_KERNEL_PATH` forces
INT8_PATHS = ("onednn", "sgl")


def force_int8_kernel_path(path: str) -> None:
    """Make vLLM's CPU int8 kernel take `path` in this process, whatever the CPU. Its
    `process_weights_after_loading` takes `_apply_weights_sgl` where `check_cpu_sgl_kernel(N, K, dtype)` holds
    (AMX and a shape the kernel tiles: on a Xeon with AMX, every layer of the tiny draft), else
    `_apply_weights_onednn`; it reads that function by the name its own module imported, so that name is the one
    replaced (replacing `layers.utils.check_cpu_sgl_kernel` would also flip vLLM's unquantized bf16 GEMM
    dispatch). vLLM's own code runs either way; with VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core runs in
    this process. The sgl kernel's ops are in vLLM's `_C` library (loaded on AVX512-BF16 CPUs: every CPU with AMX,
    and this project's AMD EPYC); they need no AMX."""
    import vllm.model_executor.kernels.linear.scaled_mm.cpu as cpu_int8

    if path not in INT8_PATHS:
        raise ValueError(f"INT8_KERNEL_PATH={path!r}: expected one of {', '.join(INT8_PATHS)}")
    sgl = path == "sgl"
    cpu_int8.check_cpu_sgl_kernel = lambda n, k, dtype: sgl


def sgl_kernel_compiled() -> bool:
    """vLLM's sgl int8 kernel is in the library this CPU loads (`_C`; not in `_C_AVX2` / `_C_AVX512`)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernels)

    return hasattr(torch.ops._C, "int8_scaled_mm_with_quant") and hasattr(torch.ops._C, "convert_weight_packed")


def kernel_paths(worker: Any) -> list[str]:
    """`Kernel.function` of every quantized layer of the draft: the function vLLM bound when it processed it."""
    out = set()
    for module in worker.model_runner.get_draft_model().modules():
        kernel = getattr(getattr(module, "scheme", None), "kernel", None)
        func = getattr(getattr(kernel, "linear_method", None), "__func__", None)
        if func is not None:
            out.add(f"{type(kernel).__name__}.{func.__name__}")
    return sorted(out)


# ---- the engine scenario (python -m support.quantized_drafts quantized WORKDIR, QUANTIZED_DRAFT=name) ------


def scenario_quantized(work: Path) -> dict[str, Any]:
    """One engine per method: cold on draft B (the reference), reload A, then B again in shuffled buckets; the
    warm B must equal the cold B."""
    import os

    from vllm import LLM

    from lifecycle.vllm.demo.tiny import engine_kwargs
    from support.vllm_basic_scenarios import _generate, _try, fingerprint

    name = os.environ["QUANTIZED_DRAFT"]
    if os.environ.get("INT8_KERNEL_PATH"):
        force_int8_kernel_path(os.environ["INT8_KERNEL_PATH"])
    fmt, online = QUANTIZED[name]
    a = make_quantized_draft(work / f"{name}-A", seed=1, fmt=fmt)
    b = make_quantized_draft(work / f"{name}-B", seed=2, fmt=fmt)
    kwargs = engine_kwargs(work / "target", b)
    kwargs["dtype"] = "bfloat16"  # what the CPU quantized kernels take
    if online:
        kwargs["speculative_config"]["quantization"] = online  # type: ignore[index]
    out: dict[str, Any] = {}
    try:
        llm = LLM(**kwargs)
    except Exception as e:  # refused at load: the message is the result
        return {"engine": {"ok": False, "error": type(e).__name__, "message": str(e)[:2000]}}
    out["engine"] = {"ok": True}
    out["quant_methods"] = llm.collective_rpc(lambda w: sorted({type(m.quant_method).__name__ for m in
                                                               w.model_runner.get_draft_model().modules()
                                                               if hasattr(m, "input_size_per_partition")}))
    out["kernel_paths"] = llm.collective_rpc(kernel_paths)
    out["generate_cold"] = _try(lambda: _generate(llm))
    out["states_cold"] = llm.collective_rpc("lifecycle_states")
    out["fingerprint_cold"] = llm.collective_rpc(fingerprint)
    out["digests_cold"] = llm.collective_rpc("lifecycle_derived_digests")
    out["pinned"] = llm.collective_rpc("lifecycle_pin")
    out["reload_a"] = _try(lambda: llm.collective_rpc("reload_draft_weights", args=(str(a),),
                                                      kwargs={"bucket_size": 7, "shuffle": True}))
    out["fingerprint_a"] = llm.collective_rpc(fingerprint)
    out["generate_a"] = _try(lambda: _generate(llm))
    out["reload_b"] = _try(lambda: llm.collective_rpc("reload_draft_weights", args=(str(b),),
                                                      kwargs={"bucket_size": 5, "shuffle": True, "seed": 3}))
    out["states_b"] = llm.collective_rpc("lifecycle_states")
    out["fingerprint_b"] = llm.collective_rpc(fingerprint)
    out["digests_b"] = llm.collective_rpc("lifecycle_derived_digests")
    out["verify"] = llm.collective_rpc("lifecycle_verify")
    out["generate_b"] = _try(lambda: _generate(llm))
    return out


if __name__ == "__main__":
    from support.vllm_basic_scenarios import main

    main(globals())
