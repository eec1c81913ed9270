"""reload-lifecycle: safe, in-place, audited weight reload for speculative-decoding draft backbones.

The names a user needs: declare a backbone (`DraftBackbone`, `concat` / `stack` / `alias` / `custom`,
`post_load_hook`, `Phase`), load it (`load_safetensors`, `write_checkpoint`), reload it (`ReloadSession`),
audit it (`configure_audit`), inspect it (`BackboneLifecycle`, `LifecycleState`, `RefreshReport`, ...), and
catch what it raises (the errors, grouped under `LifecycleError`: see `lifecycle.errors`). Everything else stays
importable from its module (`lifecycle.states.TRANSITIONS`, `lifecycle.storage.count_allocations`, ...).

Torch-only at import time; the vLLM integration lives in `lifecycle.vllm` and imports vLLM lazily.
"""

from .backbone import DraftBackbone
from .derived import DerivedSpec, alias, concat, custom, stack
from .errors import (
    CheckpointError,
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

__version__ = "0.1.0"

__all__ = [
    "BackboneLifecycle",
    "BufferReport",
    "CheckpointError",
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
