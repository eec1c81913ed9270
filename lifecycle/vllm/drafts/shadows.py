"""Where a draft's fused K/V buffer reads its rows: the live weight, or per-layer shadows that are its own slices.

The fused K/V buffer is a concat (or stack) of each layer's K/V rows in checkpoint layout, the rows of an
attention projection (`Shadow` in `families.py`). What post-processing does to that projection decides where the
rows can be read once it ran, per projection, at construction:
- it keeps the weight in checkpoint layout (CUDA, unquantized): no shadow; the buffer is declared on the live
  weight rows (`Shadow.live`), as vLLM's own builder reads them: nothing beyond stock vLLM's buffer;
- it empties the weight (vLLM's CPU repack into a oneDNN or sgl-kernel handle): each layer gets a shadow
  (`ckpt_kv_weight`), filled right before the layer is processed. The family declares the buffer `backed`, so the
  cold build makes every shadow a view of its slice of the buffer: the buffer is the only copy of the rows, each
  later capture writes it, and the refresh after a reload verifies (0 elements written);
- it packs the weight (quantized): no shadow, no fused buffer (`quantized.py`).

Whether processing keeps the weight is asked of the projection's own quant method: a probe layer with a weight of
the same shape, dtype and device is processed and inspected (CPU dispatch picks its kernel from these, and falls
back to `torch.nn.functional.linear`, keeping the weight, where oneDNN is missing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...derived import DerivedSpec
from ...torch_private import own_buffers
from .families import SHADOW, VLLMModule
from .quantized import checkpoint_layout_readable, quantized_fallback

if TYPE_CHECKING:
    from ...backbone import DraftBackbone
    from .owners import VLLMDraftBackbone

__all__ = ["ShadowPlan", "plan_shadows", "processing_keeps_weight", "shadow_bytes_apart"]

#: linear module -> (rows of its weight, the shadow, the shadow's name): what the capture before processing copies
Capture = tuple[slice, torch.Tensor, str]


class ShadowPlan:
    """What `plan_shadows` decided for one backbone: its derived specs, the shadows to track, the captures."""

    def __init__(self, derived: tuple[DerivedSpec, ...]) -> None:
        self.derived = derived
        self.shadows: dict[str, torch.Tensor] = {}  # tracked name -> shadow
        self.captures: dict[nn.Module, Capture] = {}  # linear -> its capture


def processing_keeps_weight(linear: VLLMModule) -> bool:
    """Whether `linear`'s quant method leaves its weight in checkpoint layout after processing (same shape and
    dtype, still a tensor): asked of a probe layer, so a platform's choice (or a process-wide replacement of the
    method, such as the tests' simulated GPU layout) decides, not a guess from the platform's name."""
    weight = linear.weight
    if weight is None or weight.is_meta or weight.dim() != 2:
        return False  # nothing to probe with: a shadow is always correct
    quant_method = linear.quant_method
    probe: VLLMModule = nn.Module()  # a linear layer to vLLM's quant method, which may set any attribute on it
    probe.weight = nn.Parameter(torch.zeros_like(weight), requires_grad=False)
    probe.register_parameter("bias", None)
    if getattr(linear, "_cpu_skip_gemm_dispatch", False):
        probe._cpu_skip_gemm_dispatch = True
    try:
        type(quant_method).process_weights_after_loading(quant_method, probe)
    except Exception:
        return False
    after = probe.weight
    return isinstance(after, torch.Tensor) and not after.is_meta and after.shape == weight.shape \
        and after.dtype == weight.dtype


def plan_shadows(backbone: VLLMDraftBackbone) -> ShadowPlan:
    """Per the family's `shadow` and what processing does to its projections: register the shadows (CPU
    repack), read the live weight (kept), or leave the fused buffer to vLLM's non-fused path (quantized)."""
    family = backbone._family
    specs = family.derived()
    if family.shadow is None:
        return ShadowPlan(specs)
    shadow = family.shadow
    sources = [(i, layer.self_attn, shadow.of(layer.self_attn)) for i, layer in enumerate(backbone.layers)]
    quantized = {type(linear.quant_method).__name__ for _, _, (linear, _) in sources
                 if not checkpoint_layout_readable(linear)}
    if quantized:
        return ShadowPlan(quantized_fallback(backbone, family, quantized))
    # one probe per kind of projection (quant method, shape, dtype, device), not per layer
    kinds = {(type(lin.quant_method), tuple(lin.weight.shape), lin.weight.dtype, lin.weight.device,
              getattr(lin, "_cpu_skip_gemm_dispatch", False)): lin for _, _, (lin, _) in sources}
    if all(processing_keeps_weight(linear) for linear in kinds.values()):
        return ShadowPlan(tuple(shadow.live(s) for s in specs))
    plan = ShadowPlan(specs)
    for i, attn, (linear, rows) in sources:
        # its own storage until the cold build makes it a view of the fused buffer (backed) and frees this one
        buf = torch.zeros_like(linear.weight[rows])
        attn.register_buffer(SHADOW, buf, persistent=False)
        name = f"layers.{i}.self_attn.{SHADOW}"
        plan.shadows[name] = buf
        plan.captures[linear] = (rows, buf, name)
        backbone.lifecycle_runtime.shadow_of[linear] = name  # current only if its linear is
    return plan


def shadow_bytes_apart(backbone: DraftBackbone) -> int:
    """Bytes of the storages behind the backbone's K/V shadows that are not one of its derived buffers' storage:
    what the shadows cost beyond stock vLLM's own fused buffers (0 when they are views of the buffer, or absent)."""
    derived = {t.untyped_storage().data_ptr() for n in backbone.derived_buffer_names()
               if isinstance(t := own_buffers(backbone).get(n), torch.Tensor) and not t.is_meta}
    apart = {s.data_ptr(): s.nbytes() for m in backbone.modules()
             if isinstance(t := own_buffers(m).get(SHADOW), torch.Tensor) and not t.is_meta
             and (s := t.untyped_storage()).data_ptr() not in derived}
    return sum(apart.values())
