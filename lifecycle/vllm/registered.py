"""The lifecycle-enabled draft classes by family name, for `ModelRegistry.register_model(arch, "lifecycle.vllm.
registered:<family>")`. Built on first access, so importing this module imports no vLLM model code."""

from __future__ import annotations

from typing import Any

#: Nothing to star-import: each family's class is made on first access (`__getattr__`), by name.
__all__: list[str] = []


def __getattr__(name: str) -> Any:
    from .drafts.families import FAMILIES
    from .reload.classes import lifecycle_class

    for family in FAMILIES:
        if family.name == name:
            return lifecycle_class(family)
    raise AttributeError(name)
