"""reload-lifecycle: safe, in-place, audited weight reload for speculative-decoding draft backbones.

Torch-only at import time; the vLLM integration lives in `lifecycle.vllm` and imports vLLM lazily.
"""

from .backbone import DraftBackbone
from .derived import DerivedSpec, alias, concat, custom, stack
from .errors import (
    CheckpointError,
    DerivedBuildError,
    IllegalTransitionError,
    LayersNotReadyError,
    LifecycleError,
    NonFiniteWeightError,
    QuarantinedError,
    RecoveryError,
    RefreshInterruptedError,
    SessionStateError,
    SourceLayoutError,
    StorageDriftError,
    StorageReallocationError,
    UnknownWeightError,
    WeightShapeError,
    WeightWriteError,
)
from .events import configure_audit
from .hooks import Phase, post_load_hook
from .machine import BackboneLifecycle
from .session import ReloadSession, WeightSnapshot
from .states import TRANSITIONS, LifecycleState, Transition
from .storage import PinnedStorage, StorageIdentity, count_allocations
from .types import BufferReport, RefreshReport, TensorSpec

__version__ = "0.1.0"

__all__ = [
    "TRANSITIONS",
    "BackboneLifecycle",
    "BufferReport",
    "CheckpointError",
    "DerivedBuildError",
    "DerivedSpec",
    "DraftBackbone",
    "IllegalTransitionError",
    "LayersNotReadyError",
    "LifecycleError",
    "LifecycleState",
    "NonFiniteWeightError",
    "Phase",
    "PinnedStorage",
    "QuarantinedError",
    "RecoveryError",
    "RefreshInterruptedError",
    "RefreshReport",
    "ReloadSession",
    "SessionStateError",
    "SourceLayoutError",
    "StorageDriftError",
    "StorageIdentity",
    "StorageReallocationError",
    "TensorSpec",
    "Transition",
    "UnknownWeightError",
    "WeightShapeError",
    "WeightSnapshot",
    "WeightWriteError",
    "alias",
    "concat",
    "configure_audit",
    "count_allocations",
    "custom",
    "post_load_hook",
    "stack",
]
