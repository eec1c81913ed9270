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
from lifecycle.vllm.tiny import dflash_draft_tensors, make_dflash_draft

__all__ = ["QUANTIZED", "make_quantized_draft"]

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _group(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if inputs is not None:
        group["input_activations"] = inputs
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head", "fc"]}


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


_FORMATS = {
    "w8a8-int8": (_int8_w8a8, _group({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                       "dynamic": False},
                                      {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}, "int-quantized")),
    "w4a16": (_w4a16, _group({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                              "group_size": 32, "dynamic": False}, None, "pack-quantized")),
}
#: name -> (checkpoint format or None, `speculative_config["quantization"]` or None)
QUANTIZED: dict[str, tuple[str | None, str | None]] = {
    "fp8_per_channel": (None, "fp8_per_channel"),  # online: Fp8PtpcOnlineLinearMethod (fp8 weight, transposed)
    "w8a8-int8": ("w8a8-int8", None),  # compressed-tensors int8 W8A8 (CPUInt8ScaledMMLinearKernel)
    "w4a16": ("w4a16", None),  # compressed-tensors pack-quantized int4 (`weight_packed`; CPUWNA16LinearKernel)
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
