"""reload-lifecycle: safe, in-place, audited weight reload for speculative-decoding draft backbones.

The names a user needs: declare a backbone (`DraftBackbone`, `concat` / `stack` / `alias` / `custom`,
`post_load_hook`, `Phase`), load it (`load_safetensors`, `write_checkpoint`), reload it (`ReloadSession`),
audit it (`configure_audit`), inspect it (`BackboneLifecycle`, `LifecycleState`, `RefreshReport`, ...), and
catch what it raises (the errors, grouped under `LifecycleError`: see `lifecycle.errors`). Everything else stays
importable from its module (`lifecycle.states.TRANSITIONS`, `lifecycle.storage.count_allocations`, ...).

The names are loaded on first use (PEP 562 `__getattr__`): `import lifecycle` itself imports nothing heavy, so
the offline tools (`reload-lifecycle audit|report|diagram`, `lifecycle.audit`) start without torch; the first
`from lifecycle import DraftBackbone` loads the core (and torch). The vLLM integration lives in `lifecycle.vllm`
and imports vLLM lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers and editors; at run time they load on first use
    from .backbone import DraftBackbone
    from .derived import DerivedSpec, alias, concat, custom, stack
    from .errors import (
        CheckpointError,
        ConcurrentUseError,
        DerivedBuildError,
        FrozenStructureError,
        IllegalTransitionError,
        IncompleteCheckpointError,
        LayersNotReadyError,
        LifecycleError,
        LoadRefusedError,
        NodeSetupError,
        NonFiniteWeightError,
        PartialWriteError,
        PathConfinementError,
        QuarantinedError,
        RecoveryError,
        RefreshInterruptedError,
        RefreshRefusedError,
        SessionStateError,
        SourceLayoutError,
        StateError,
        StorageDriftError,
        StorageReallocationError,
        UnknownWeightError,
        UnsupportedVLLMError,
        WeightShapeError,
        WeightTypeError,
        WeightWriteError,
    )
    from .events import configure_audit
    from .hooks import Phase, post_load_hook
    from .loading import load_safetensors, write_checkpoint
    from .machine import BackboneLifecycle
    from .session import ReloadSession
    from .states import LifecycleState
    from .storage import StorageIdentity
    from .types import BufferReport, RefreshReport, TensorSpec

__version__ = "0.2.3"

#: Exported name -> the module that defines it (relative to this package).
_EXPORTS: dict[str, str] = {
    "DraftBackbone": ".backbone",
    **dict.fromkeys(("DerivedSpec", "alias", "concat", "custom", "stack"), ".derived"),
    **dict.fromkeys((
        "CheckpointError", "ConcurrentUseError", "DerivedBuildError", "FrozenStructureError", "IllegalTransitionError",
        "IncompleteCheckpointError", "LayersNotReadyError", "LifecycleError", "LoadRefusedError", "NodeSetupError",
        "NonFiniteWeightError", "PartialWriteError", "PathConfinementError", "QuarantinedError", "RecoveryError",
        "RefreshInterruptedError", "RefreshRefusedError", "SessionStateError", "SourceLayoutError", "StateError",
        "StorageDriftError", "StorageReallocationError", "UnknownWeightError", "UnsupportedVLLMError",
        "WeightShapeError", "WeightTypeError", "WeightWriteError"), ".errors"),
    "configure_audit": ".events",
    "Phase": ".hooks",
    "post_load_hook": ".hooks",
    "load_safetensors": ".loading",
    "write_checkpoint": ".loading",
    "BackboneLifecycle": ".machine",
    "ReloadSession": ".session",
    "LifecycleState": ".states",
    "StorageIdentity": ".storage",
    **dict.fromkeys(("BufferReport", "RefreshReport", "TensorSpec"), ".types"),
}

__all__ = [
    "BackboneLifecycle",
    "BufferReport",
    "CheckpointError",
    "ConcurrentUseError",
    "DerivedBuildError",
    "DerivedSpec",
    "DraftBackbone",
    "FrozenStructureError",
    "IllegalTransitionError",
    "IncompleteCheckpointError",
    "LayersNotReadyError",
    "LifecycleError",
    "LifecycleState",
    "LoadRefusedError",
    "NodeSetupError",
    "NonFiniteWeightError",
    "PartialWriteError",
    "PathConfinementError",
    "Phase",
    "QuarantinedError",
    "RecoveryError",
    "RefreshInterruptedError",
    "RefreshRefusedError",
    "RefreshReport",
    "ReloadSession",
    "SessionStateError",
    "SourceLayoutError",
    "StateError",
    "StorageDriftError",
    "StorageIdentity",
    "StorageReallocationError",
    "TensorSpec",
    "UnknownWeightError",
    "UnsupportedVLLMError",
    "WeightShapeError",
    "WeightTypeError",
    "WeightWriteError",
    "alias",
    "concat",
    "configure_audit",
    "custom",
    "load_safetensors",
    "post_load_hook",
    "stack",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lifecycle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
