"""The lifecycle-enabled draft classes by family name, for `ModelRegistry.register_model(arch, "lifecycle.vllm.
registered:<family>")`. Built on first access, so importing this module imports no vLLM model code.

A family whose architectures vLLM's registry names through a per-platform package (`dispatched_by`: DeepSeek-V4
DSpark's `vllm.models.deepseek_v4` picks the CUDA, ROCm, XPU or CPU class) is the lifecycle class only where that
package picks the class the family declares; elsewhere vLLM's own class is returned, as vLLM would have served it
(the CPU build's stub, which raises that DSpark is not implemented there; the ROCm and XPU implementations, whose
sources the family was not checked against)."""

from __future__ import annotations

import importlib
from typing import Any

#: Nothing to star-import: each family's class is made on first access (`__getattr__`), by name.
__all__: list[str] = []


def __getattr__(name: str) -> Any:
    from .drafts.families import FAMILIES
    from .reload.classes import lifecycle_class

    for family in FAMILIES:
        if family.name != name:
            continue
        if family.dispatched_by:
            chosen = getattr(importlib.import_module(family.dispatched_by), family.causal_lm)
            if chosen.__module__ != family.module:
                return chosen  # this platform's implementation: vLLM's own
        return lifecycle_class(family)
    raise AttributeError(name)
