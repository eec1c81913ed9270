"""One exception hierarchy, grouped by what a caller does about it (as httpx groups its exceptions):

    LifecycleError                    every error the package raises
    ├── StateError                    refused in the current state; nothing changed
    │   ├── IllegalTransitionError    the table does not allow the trigger from this state
    │   ├── LayersNotReadyError       a finish, refresh or forward use needs every layer loaded (off META)
    │   ├── QuarantinedError          forward use after a failed or aborted reload
    │   ├── RecoveryError             `recover()` without an exact rollback to return to
    │   ├── SessionStateError         a reload session used out of order, or a second one opened on a backbone
    │   ├── ConcurrentUseError        an unlocked backbone written from a second thread
    │   └── IncompleteCheckpointError a reload epoch lacks what a whole checkpoint must include (also a ValueError)
    ├── LoadRefusedError              the loader refused a bucket or checkpoint before writing any of it
    │   ├── UnknownWeightError        names the backbone does not have
    │   ├── WeightTypeError           a value that is not a tensor, or a tensor that misreports its shape or dtype
    │   ├── WeightShapeError          a shape or dtype that differs from the parameter's
    │   ├── NonFiniteWeightError      NaN or Inf values (with the finite check on)
    │   ├── CheckpointError           a file that cannot be read, or subset names it lacks
    │   │   └── PathConfinementError  a path or a file of its folder leads outside RELOAD_LIFECYCLE_PATH_ROOT
    │   └── FrozenStructureError      tensors for an optional submodule the first load decided is absent
    ├── RefreshRefusedError           a derived buffer cannot be refreshed as declared; no buffer was written
    │   ├── SourceLayoutError         a source is not in the layout its builder expects
    │   ├── StorageReallocationError  the refresh would give a buffer new storage
    │   └── DerivedBuildError         a builder (`per_layer`, `build`) raised
    ├── PartialWriteError             a write failed part way: something WAS changed (the error names what)
    │   ├── WeightWriteError          a weight write, mid-bucket
    │   └── RefreshInterruptedError   a derived-buffer write, mid-refresh
    ├── StorageDriftError             a pinned storage identity moved behind the lifecycle's back
    ├── UnsupportedVLLMError          the vLLM plugin met a vLLM version it does not know
    └── NodeSetupError                a worker node of a Ray engine does not run the plugin

Raising: never from a local that still holds the error: its frame, in the traceback, would keep it, and with it
every caller's frame (the backbone and all its weights) until the cyclic collector runs. Raise the expression
(`raise lc.record_refusal(trigger, X(...))`) or hand a check's result to `raise_unheld`, never a local.

Each class says what state it leaves. Every message names the backbone, the state, and what was expected vs
found; the bar is PyTorch's cudagraph-trees message: "static input data pointer changed ... from X to Y".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .types import capped, clipped, layer_line

__all__ = ["MESSAGE_CAP", "MESSAGE_ITEMS_CAP", "MESSAGE_NAME_CAP", "CheckpointError", "ConcurrentUseError",
           "DerivedBuildError", "FrozenStructureError", "IllegalTransitionError", "IncompleteCheckpointError",
           "LayersNotReadyError", "LifecycleError", "LoadRefusedError", "NodeSetupError", "NonFiniteWeightError",
           "PartialWriteError", "PathConfinementError", "QuarantinedError", "RecoveryError", "RefreshInterruptedError",
           "RefreshRefusedError", "SessionStateError", "SourceLayoutError", "StateError", "StorageDriftError",
           "StorageReallocationError", "UnknownWeightError", "UnsupportedVLLMError", "WeightShapeError",
           "WeightTypeError", "WeightWriteError", "raise_unheld"]

#: How many offending items an error message spells out before it says "... and N more".
MESSAGE_ITEMS_CAP = 20
#: At most this many characters of a listed item and of the backbone's name (a header's tensor name can be 1 MB).
MESSAGE_NAME_CAP = 1024
#: At most this many characters in a whole message (and its `reason`).
MESSAGE_CAP = 16384


def _listing(items: Sequence[str]) -> str:
    """One item per line, at most `MESSAGE_ITEMS_CAP` of them (each cut at `MESSAGE_NAME_CAP` characters), then
    how many were left out."""
    shown, more = capped(items, MESSAGE_ITEMS_CAP)
    shown = [clipped(str(item), MESSAGE_NAME_CAP) for item in shown]
    return "\n  ".join([*shown, f"... and {more} more"] if more else shown)


def raise_unheld(error: BaseException | None) -> None:
    """Raise `error` (nothing when it is None) with no frame left holding it: pass the expression that makes it
    (`raise_unheld(refusal_of(bucket))`), not a local of the caller, which would keep it (see the module doc).

    >>> try:
    ...     raise_unheld(StateError("refused", backbone="d", state="META"))
    ... except StateError as e:
    ...     print(e, e.__traceback__.tb_next.tb_frame.f_locals)
    [backbone 'd', state META] refused {}
    >>> raise_unheld(None)
    """
    if error is None:
        return
    try:
        raise error
    finally:
        del error  # this frame is in the traceback too: it must not keep what it raised


class LifecycleError(RuntimeError):
    """Base of every error this package raises. Most are refusals that changed nothing (`StateError`,
    `LoadRefusedError`, `RefreshRefusedError`); a `PartialWriteError` means a write failed part way and changed
    what it names; a `StorageDriftError` reports a change made behind the lifecycle's back. `reason` is the
    message without the `[backbone, state]` prefix."""

    def __init__(self, message: str, *, backbone: str | None = "?", state: str | None = "?") -> None:
        message = clipped(message, MESSAGE_CAP)
        prefix = "" if backbone is None else f"[backbone {clipped(backbone, MESSAGE_NAME_CAP)!r}, state {state}] "
        super().__init__(prefix + message)
        self.backbone = backbone
        self.state = state
        self.reason = message


# ---- refused in the current state: nothing changed ------------------------------------------------------------
class StateError(LifecycleError):
    """The operation is not allowed in the backbone's (or the session's) current state. Nothing was changed:
    neither the state nor any weight or buffer; the refusal is audited."""


class IllegalTransitionError(StateError):
    """A trigger fired from a state where the transition table does not allow it. Nothing was changed."""

    def __init__(self, trigger: str, *, backbone: str, state: str, allowed_from: Sequence[str],
                 hint: str = "") -> None:
        super().__init__(
            f"trigger {trigger!r} is not allowed from state {state}; it is allowed from: {', '.join(allowed_from)}"
            + (f"; {hint}" if hint else ""),
            backbone=backbone,
            state=state,
        )
        self.trigger = trigger
        self.allowed_from = tuple(allowed_from)


class LayersNotReadyError(StateError):
    """A finish, build, refresh or forward use was asked for while some layer still lacks tensors (or holds
    META ones, or a write of one failed part way, or an aborted reload left the layer partly written); also a
    `weights_unchanged` declaration of such a tensor. `missing` names every one by layer. Nothing was changed (a
    refused finish with `keep_untouched` marks no layer either). Inside vLLM the plugin then quarantines the
    draft."""

    def __init__(self, action: str, missing: Mapping[str, Sequence[str]], *, backbone: str, state: str) -> None:
        lines = [layer_line(layer, names) for layer, names in missing.items()]
        n_tensors = sum(len(v) for v in missing.values())
        super().__init__(
            f"{action} refused: {len(missing)} layer(s) not ready, {n_tensors} tensor(s) missing or on META:\n  "
            + _listing(lines),
            backbone=backbone,
            state=state,
        )
        self.action = action
        self.missing = {k: tuple(v) for k, v in missing.items()}


class QuarantinedError(StateError):
    """Forward use of a quarantined backbone (a failed or aborted reload) was refused; it stays QUARANTINED
    until a successful reload or `recover()`. `quarantine_reason` is why the reload was aborted."""

    def __init__(self, message: str, *, backbone: str, state: str, quarantine_reason: str | None = None) -> None:
        super().__init__(message, backbone=backbone, state=state)
        self.quarantine_reason = quarantine_reason


class RecoveryError(StateError):
    """`recover()` was refused: the weights were not rolled back exactly to a set the derived buffers still match
    (no rollback, an incomplete one, a reload that did not start from a refreshed state, or derived buffers
    interrupted mid-write). The backbone stays QUARANTINED; a reload (`begin_reload` ...
    `refresh_derived_buffers`) is the way out."""


class SessionStateError(StateError):
    """A reload session was used out of order (begun twice, or used after it committed or aborted), or begun while
    another session of the same backbone is open (sessions do not nest). Nothing was changed."""


class ConcurrentUseError(StateError):
    """An unlocked backbone (its lifecycle is not thread-safe) was used from a second thread while another thread
    held a write lease on it: a write, or a transition that ends or aborts loading, was refused before anything was
    written or changed. `init_lifecycle(locked=True)` builds a backbone several threads may load."""


class IncompleteCheckpointError(StateError, ValueError):
    """A reload epoch's tensors (those written plus those kept) lack what a whole checkpoint must include: a
    validation vLLM's draft runs on every `load_weights` call (a reduced vocabulary needs `lm_head` and `d2t`),
    run once per epoch at finalize instead, with vLLM's own message. The finish is refused; inside vLLM the
    plugin then quarantines the draft. A `ValueError` too, as vLLM's check raised."""

    def __init__(self, message: str, *, backbone: str, state: str, needs: Sequence[str] = ()) -> None:
        super().__init__(message, backbone=backbone, state=state)
        self.needs = tuple(needs)


# ---- the loader refused its input: nothing of the bucket was written --------------------------------------------
class LoadRefusedError(LifecycleError):
    """The loader refused a bucket (or a whole checkpoint, from its header) before writing any of it: nothing of
    it was written or recorded, and the state is unchanged. Buckets an earlier call (or an earlier bucket of the
    same `load_safetensors` call) wrote stay written; a `reload_session(rollback=True)` undoes them."""


class UnknownWeightError(LoadRefusedError):
    """Weights arrived under names the backbone does not have. Nothing of the bucket was loaded."""

    def __init__(self, names: Sequence[str], *, backbone: str, state: str, source: str = "") -> None:
        where = f" in {source}" if source else ""
        super().__init__(
            f"{len(names)} unknown tensor name(s){where}; nothing was loaded:\n  " + _listing(sorted(names)),
            backbone=backbone,
            state=state,
        )
        self.names = tuple(names)


class WeightTypeError(LoadRefusedError):
    """A bucket's value is not a tensor (None, a list, a number), the bucket is not a mapping or pairs of (name,
    tensor), or a tensor subclass reports a shape or dtype its data does not have. `problems` names each tensor and
    what it got. Nothing of the bucket was written."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str) -> None:
        super().__init__(
            f"{len(problems)} value(s) that are not tensors the loader can write; nothing of the bucket was "
            "written:\n  " + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class WeightShapeError(LoadRefusedError):
    """Weights arrived with a shape or dtype that differs from the parameter they are meant for. Nothing of the
    bucket (or, from a checkpoint header, of the checkpoint) was loaded."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str, source: str = "") -> None:
        where = f" in {source}" if source else ""
        super().__init__(
            f"{len(problems)} tensor(s) with the wrong shape or dtype{where}; nothing was loaded:\n  "
            + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class NonFiniteWeightError(LoadRefusedError):
    """Weights with NaN or Inf values arrived while the finite check was on: nothing of the bucket was written.
    Raised by a session's `verify()` too, about tensors already written: that verify changed nothing, and the
    session aborts (rollback restores them) when the error leaves its block."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str, source: str = "") -> None:
        where = f" in {source}" if source else ""
        super().__init__(
            f"{len(problems)} tensor(s) with NaN or Inf values{where}; nothing of this bucket was written:\n  "
            + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class CheckpointError(LoadRefusedError):
    """A checkpoint file could not be read (missing, truncated, corrupt header, an unsupported dtype), or a
    subset named tensors it lacks. Refused from the headers, before any of its tensors was written."""


class PathConfinementError(CheckpointError, PermissionError):
    """A checkpoint path, or a file or link in a folder it names, leads outside `RELOAD_LIFECYCLE_PATH_ROOT`, or
    a component of a checked path became a link: refused, nothing of the file read (neither bytes nor size).
    Also a `PermissionError`, as the refusal of a path outside the root always was."""


class FrozenStructureError(LoadRefusedError):
    """A bucket carries tensors for an optional submodule (a confidence head, own embeddings or lm_head, a
    draft-to-target id map) that the first load decided this draft does not have, or that it shares with the
    target: writing them would change its structure, or the target. Nothing of the bucket was written."""

    def __init__(self, tensors: Mapping[str, Sequence[str]], *, backbone: str, state: str) -> None:
        lines = [f"{module}: {', '.join(names)}" for module, names in tensors.items()]
        super().__init__(
            "bucket refused, it carries tensors for optional submodule(s) this draft does not have or shares with "
            "the target (its structure was decided by its first load); nothing of it was written:\n  "
            + _listing(lines),
            backbone=backbone,
            state=state,
        )
        self.tensors = {k: tuple(v) for k, v in tensors.items()}


# ---- a derived buffer cannot be refreshed as declared: no buffer was written ------------------------------------
class RefreshRefusedError(LifecycleError):
    """The refresh plan refused a derived buffer: every buffer is validated (and every builder run) before any
    is written, so no buffer was written and the state is unchanged (FINALIZED; a session quarantines when
    the error leaves its block). A refresh asked for before every layer is ready raises `LayersNotReadyError`
    (a `StateError`) instead."""


class SourceLayoutError(RefreshRefusedError):
    """A derived buffer's source is not in the layout its builder expects (emptied, packed, resized). No buffer
    was written."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str) -> None:
        super().__init__(
            "derived-buffer build refused, a source is not in the layout the builder expects; no buffer was "
            "written:\n  " + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class StorageReallocationError(RefreshRefusedError):
    """A refresh would give a derived buffer new storage (its shape, dtype, device or stride would change). No
    buffer was written."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str) -> None:
        super().__init__(
            "refresh refused, it would reallocate storage that must stay in place; no buffer was written:\n  "
            + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class DerivedBuildError(RefreshRefusedError):
    """A derived buffer's builder (`per_layer`, `build`) raised. Builders run while the refresh is planned, before
    any write: no buffer was written, the state is unchanged."""

    def __init__(self, buffer: str, step: str, cause: BaseException, *, backbone: str, state: str) -> None:
        super().__init__(
            f"building derived buffer {buffer} failed in {step}: {type(cause).__name__}: {cause}; no buffer was "
            "written",
            backbone=backbone,
            state=state,
        )
        self.buffer = buffer
        self.step = step


# ---- a write failed part way: something WAS changed ---------------------------------------------------------------
class PartialWriteError(LifecycleError):
    """A validated write failed part way (a device fault, a failing writer): some tensors or buffers WERE written
    and the error names them. The lifecycle records what it cannot vouch for, so nothing stale is ever used:
    see each subclass for the state it leaves."""


class WeightWriteError(PartialWriteError):
    """Writing one tensor of a bucket failed after the bucket was validated. The tensors written before it
    (`written`) are recorded as loaded (the state may have moved, e.g. to PARTIALLY_LOADED); the failing one
    (`name`) may be partly written: it is recorded as dirty, not loaded, so it must be sent again and a later
    refresh rewrites what reads it."""

    def __init__(self, name: str, written: Sequence[str], total: int, cause: BaseException, *, backbone: str,
                 state: str) -> None:
        super().__init__(
            f"writing {name} failed after {len(written)} of {total} tensor(s) of the bucket were written: "
            f"{type(cause).__name__}: {cause}",
            backbone=backbone,
            state=state,
        )
        self.name = name
        self.written = tuple(written)


class RefreshInterruptedError(PartialWriteError):
    """A validated refresh failed while writing (its plan was sound, a write raised). The buffers named in
    `touched` may hold a mix of old and new values: the refresh is refused (the state stays FINALIZED, not
    usable), the next refresh rewrites them fully, and `recover()` is refused until then."""

    def __init__(self, buffer: str, touched: Sequence[str], cause: BaseException, *, backbone: str,
                 state: str) -> None:
        super().__init__(
            f"refresh interrupted while writing {buffer}: {type(cause).__name__}: {cause}; buffer(s) possibly "
            f"torn, rewritten fully by the next refresh: {', '.join(touched)}",
            backbone=backbone,
            state=state,
        )
        self.buffer = buffer
        self.touched = tuple(touched)


# ---- changed behind the lifecycle's back --------------------------------------------------------------------------
class StorageDriftError(LifecycleError):
    """A storage identity that captured graphs read moved behind the lifecycle's back (`problems`: old -> new).
    Checked before a refresh under captured graphs, a `recover()` and a session's `verify()`: those are refused
    and change nothing. Found after a refresh wrote in place (the refresh's own storage check, or the
    `graphs_verified` follow-up), the buffers hold the new values but the state is not GRAPH_CAPTURED
    (FINALIZED, respectively DERIVED_REFRESHED): release and capture the graphs again."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str) -> None:
        super().__init__("storage identity changed:\n  " + _listing(problems), backbone=backbone, state=state)
        self.problems = tuple(problems)


# ---- engine integration -----------------------------------------------------------------------------------------
class UnsupportedVLLMError(LifecycleError):
    """The vLLM plugin refused a vLLM that lacks a name it relies on (each missing name is listed, with how to
    disable the plugin): it patched nothing and registered no draft class
    (`lifecycle.vllm.plugin.capabilities.check_vllm`). No backbone is involved."""

    def __init__(self, message: str) -> None:
        super().__init__(message, backbone=None, state=None)


class NodeSetupError(LifecycleError):
    """A worker of a vLLM engine under Ray runs without the plugin (the package is not installed on its node,
    cannot be imported there, or `VLLM_PLUGINS` leaves it out): the engine start is refused, naming each such
    node, rather than serve a draft there without the lifecycle (`lifecycle.vllm.plugin.nodes`). `nodes` holds what
    each failing worker reported. No backbone is involved."""

    def __init__(self, message: str, nodes: Sequence[Mapping[str, object]] = ()) -> None:
        super().__init__(message, backbone=None, state=None)
        self.nodes = tuple(dict(n) for n in nodes)
