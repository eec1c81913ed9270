"""What the plugin keeps beside each draft's lifecycle, in two objects: one per draft (`DraftRuntime`, held by its
backbone as `backbone.runtime`, so a draft dropped takes its state with it) and one per worker process (`WORKER`:
the live drafts, the target's modules, what vLLM's reload machinery is doing right now, the open weight-update
sessions).

Nothing here decides anything: the reload, serving, online and observability layers read and write these fields.
They used to be module-level tables in eight modules and values stashed on vLLM's objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ...errors import LoadRefusedError
    from ..settings import PartialPolicy
    from .structure import DraftStructure

__all__ = ["WORKER", "DraftRuntime", "WorkerRuntime", "WrittenBytes"]


@dataclass
class WrittenBytes:
    """Bytes of checkpoint tensors reloads wrote, counted once per epoch (`observability.serving_state`)."""

    epoch: int = 0
    tensors: int = 0  # of the epoch, counted so far
    bytes: int = 0  # of the epoch
    before: int = 0  # of every epoch before it


@dataclass(eq=False)
class DraftRuntime:
    """One draft's runtime state (the fields say who writes them)."""

    #: the draft's ForCausalLM (ours: `reload.classes`), held weakly: it holds the backbone that holds this
    outer: weakref.ref[nn.Module]
    structure: DraftStructure
    #: the draft's ModelConfig, what `finalize_layerwise_reload` needs when an epoch is finished from inside
    model_config: Any = None
    #: module -> the tracked tensor names it holds (`reload.mixin`: the modules this draft owns)
    owned: dict[nn.Module, list[str]] = field(default_factory=dict)
    #: the outermost owned modules: what an implicit reload hands to vLLM's layerwise reload
    roots: list[nn.Module] = field(default_factory=list)
    #: modules whose processing moved a kept tensor after an in-place write: vLLM's copy back for them since
    #: (`reload.direct`)
    copied_back: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    #: linear module -> the name of the K/V shadow its processing fills (`drafts.shadows`)
    shadow_of: dict[nn.Module, str] = field(default_factory=dict)
    #: a call the frozen structure refused, raised by the next write (`reload.classes`)
    structure_refusal: LoadRefusedError | None = None
    #: a load_weights call wrote during the cold load (a dummy start never does)
    cold_load_written: bool = False
    #: the cold load's values came from vLLM's loader, not a checkpoint: the first reload writes every layer
    loader_values: bool = False
    #: this reload's partial policy when its caller chose one; None: the engine's setting
    reload_partial: PartialPolicy | None = None
    #: the epoch whose precompute metadata was recorded last (`reload.mixin._record_metadata`; -1: none yet)
    metadata_epoch: int = -1
    #: entry points into the draft's weights being run now (`reload.epoch.entered`): only the outermost acts
    entries: int = 0
    #: the innermost entry point a failure in progress left (what its reason names)
    failed_in: str | None = None
    #: how the last epoch that failed ended: "rolled back" (exactly, serving again) or "quarantined"
    last_outcome: str | None = None
    #: the reader's staging buffer, kept across pushes (`reload.staging.Staging`, made on the first push)
    staging: Any = None
    #: payloads that passed the header check (`reload.expected`): (headers, names, ranks) -> None, oldest first
    payloads_checked: dict[Any, None] = field(default_factory=dict)
    #: the push whose weights the draft serves: the epoch that last finished (0: the cold load; a rolled-back epoch
    #: is not one) and the trainer's `weight_version` of it, if it gave one (`reload.epoch`, `online.sessions`)
    serving_epoch: int = 0
    serving_version: str | None = None
    # ---- serving and observability ----------------------------------------------------------------------------
    #: steps the engine served without this draft since it stopped being usable (None: drafting)
    drafting_paused_steps: int | None = None
    #: steps served without this draft since the process started
    steps_without_draft_total: int = 0
    written: WrittenBytes = field(default_factory=WrittenBytes)
    #: module -> {parameter: sha256 as loaded, right before processing emptied it} (the weight checker, CPU tensors)
    digests_before_processing: dict[nn.Module, dict[str, str]] = field(default_factory=dict)
    #: module -> the parameters its last processing emptied (learnt at its first: only those are hashed since)
    emptied_by_processing: dict[nn.Module, set[str]] = field(default_factory=dict)
    #: linear module -> {K/V shadow name: what the rows captured into it hash to (`weight_checker.RowsDigest`)}
    captured_digests: dict[nn.Module, dict[str, Any]] = field(default_factory=dict)
    #: bytes the push path hashed for the weight checker, since the draft was built (tests count them per push)
    bytes_hashed: int = 0
    #: the front process's current serving period of this draft's engine, as the `acceptance` event it becomes:
    #: written when the worker stops before the next push ends the period (`observability.serving_state`); kept
    #: per draft, so that a period reaches only the drafts of the engine it was measured on
    at_stop: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)


class WorkerRuntime:
    """The worker process's state (one object: vLLM runs one worker per process)."""

    def __init__(self) -> None:
        #: every lifecycle draft alive in this process (`owners.VLLMDraftBackbone`s)
        self.drafts: weakref.WeakSet[Any] = weakref.WeakSet()
        #: module -> the drafts that claimed it, oldest first (`owners.claim`; each one's `DraftRuntime.owned` says
        #: with which names): `owners.owner_of` runs for every layer a push processes, and iterating a WeakSet
        #: costs microseconds
        self.owners: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[Any], ...]] = \
            weakref.WeakKeyDictionary()
        #: modules of the models the engine loaded that hold no lifecycle draft (the target)
        self.engine_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        #: model -> its submodules (name, module held weakly), walked once when a push begins and kept until its
        #: epoch ends (`owners.modules_of`): the push's every look at the model's modules reads this one walk
        self.walked: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, weakref.ref[nn.Module]]]] = (
            weakref.WeakKeyDictionary())
        #: a loader's layer (or a plain loader) -> its loader function -> the elements each load writes, by the load's
        #: arguments: what vLLM's dry run counted once; None: counted by a dry run every time (`reload.counting`)
        self.load_counts: weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, int] | None]] = (
            weakref.WeakKeyDictionary())
        #: modules whose live tensors the current reload began to write, recorded BEFORE the write: an interrupt
        #: after it leaves them partly written, which putting their kept tensors back cannot undo
        self.touched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        #: vLLM's own reload machinery is processing layers now (`_layerwise_process`, its finalize)
        self.in_vllm_reload = False
        #: a layer completed with its last values is being processed (`reload.partial`)
        self.completing = False
        #: while vLLM's `initialize_layerwise_reload` runs: each module's non-persistent buffer names before it (what
        #: an interrupted one, which left modules half-way, needs to put them back: `reload.unwind`)
        self.initializing: dict[nn.Module, set[str]] | None = None
        #: draft model -> its lifecycle drafts (`owners.drafts_of`: the drafting gate asks every engine step)
        self.backbones: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = (
            weakref.WeakKeyDictionary())
        #: vLLM worker -> the plugin's record of its open weight-update session: one push (`online.pushes`)
        self.sessions: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        #: vLLM worker -> the push an explicit take-over ended, until the next start (that push's trainer may still
        #: be calling: the next push is told it took over, `online.sessions`)
        self.taken_over: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        #: (worker, the finish's `lifecycle=` options) -> what a finish answers the front process besides vLLM's
        #: result: the draft's serving state (set by the outside view at activation; None: nothing)
        self.finish_report: Callable[[Any, Mapping[str, Any]], Any] | None = None

    @contextmanager
    def flag(self, name: str) -> Iterator[None]:
        """`in_vllm_reload` or `completing` set while the block runs (restored after, whatever happens)."""
        before = getattr(self, name)
        setattr(self, name, True)
        try:
            yield
        finally:
            setattr(self, name, before)


#: This worker process's runtime.
WORKER = WorkerRuntime()
