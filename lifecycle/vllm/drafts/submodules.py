"""Derived state vLLM keeps on a submodule of a draft, owned as the draft's buffers (`declarations.SubmoduleBuffers`).

LiLiCorr's correlator head builds six tensors in its own `materialize_inference_buffers` (the fused edge projection,
the factor projection's input blocks, the attention bias over candidate slots, two constant feature columns), which
vLLM's `load_weights` calls at the end of every call: during a bucketed reload it reads placeholders still on META,
and every call gives the head new storage, under captured graphs. Here those tensors are derived buffers of the
backbone, declared by the family (`families.py`), built once every source is ready and refreshed in place; the
head's attributes point at them:

- `prepare(backbone)`, at construction: the builder is replaced on that head (a per-instance record of the registry)
  by `bind`, and the linears the buffers read keep their weight in checkpoint layout on CPU (vLLM's own
  `_cpu_skip_gemm_dispatch` flag, which its generic MLA sets on `kv_b_proj`: `F.linear` instead of a oneDNN repack
  that empties the weight);
- `bind(backbone)`, after every build and refresh of the derived buffers: each attribute is the backbone's buffer
  (one object for good: a refresh writes in place, so a captured graph keeps reading it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..compat.patching import set_flag, wrap_instance

if TYPE_CHECKING:
    from .owners import VLLMDraftBackbone

__all__ = ["bind", "prepare"]

_KEEP_LAYOUT = "layer._cpu_skip_gemm_dispatch"


def prepare(backbone: VLLMDraftBackbone) -> None:
    """At construction: each declared submodule's builder points it at the backbone's buffers instead, and the
    linears its buffers read keep their checkpoint layout through processing."""
    ref = weakref.ref(backbone)
    for declared in backbone._family.submodule_buffers:
        sub = backbone.get_submodule(declared.path)
        for linear in declared.keep_layout:
            set_flag(_KEEP_LAYOUT, getattr(sub, linear), True)
        wrap_instance(f"{declared.cls}.{declared.builder}", sub, _binding(ref))


def bind(backbone: VLLMDraftBackbone) -> None:
    """Point every declared submodule's attributes at the backbone's buffers (those built so far)."""
    for declared in backbone._family.submodule_buffers:
        declared.bind(backbone)


def _binding(ref: weakref.ref[VLLMDraftBackbone]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def materialize(*args: Any, **kwargs: Any) -> None:
            # vLLM's call at the end of load_weights: nothing is built here (the buffers are the lifecycle's)
            backbone = ref()
            if backbone is not None:
                bind(backbone)

        return materialize

    return make
