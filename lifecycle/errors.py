"""One exception hierarchy. Every message names the backbone, the state, and what was expected vs found.

The bar is PyTorch's cudagraph-trees message: "static input data pointer changed ... from X to Y".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .types import capped

#: How many offending items an error message spells out before it says "... and N more".
MESSAGE_ITEMS_CAP = 20


def _listing(items: Sequence[str]) -> str:
    """One item per line, at most `MESSAGE_ITEMS_CAP` of them, then how many were left out."""
    shown, more = capped(items, MESSAGE_ITEMS_CAP)
    return "\n  ".join([*shown, f"... and {more} more"] if more else shown)


class LifecycleError(RuntimeError):
    """Base of every error the lifecycle raises. A raised error means nothing was changed."""

    def __init__(self, message: str, *, backbone: str = "?", state: str = "?") -> None:
        super().__init__(f"[backbone {backbone!r}, state {state}] {message}")
        self.backbone = backbone
        self.state = state
        self.reason = message


class IllegalTransitionError(LifecycleError):
    """A trigger fired from a state where the transition table does not allow it."""

    def __init__(self, trigger: str, *, backbone: str, state: str, allowed_from: Sequence[str]) -> None:
        super().__init__(
            f"trigger {trigger!r} is not allowed from state {state}; it is allowed from: {', '.join(allowed_from)}",
            backbone=backbone,
            state=state,
        )
        self.trigger = trigger
        self.allowed_from = tuple(allowed_from)


class LayersNotReadyError(LifecycleError):
    """A build, refresh or finish was asked for while some layer still lacks tensors (or holds META ones)."""

    def __init__(self, action: str, missing: Mapping[str, Sequence[str]], *, backbone: str, state: str) -> None:
        lines = [f"{layer}: {', '.join(names)}" for layer, names in missing.items()]
        n_tensors = sum(len(v) for v in missing.values())
        super().__init__(
            f"{action} refused: {len(missing)} layer(s) not ready, {n_tensors} tensor(s) missing or on META:\n  "
            + _listing(lines),
            backbone=backbone,
            state=state,
        )
        self.action = action
        self.missing = {k: tuple(v) for k, v in missing.items()}


class StorageReallocationError(LifecycleError):
    """A refresh would give a derived buffer new storage (its shape, dtype, device or stride would change)."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str) -> None:
        super().__init__(
            "refresh refused, it would reallocate storage that must stay in place; no buffer was written:\n  "
            + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class StorageDriftError(LifecycleError):
    """A storage identity changed behind the lifecycle's back (a pinned address moved)."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str) -> None:
        super().__init__("storage identity changed:\n  " + _listing(problems), backbone=backbone, state=state)
        self.problems = tuple(problems)


class SourceLayoutError(LifecycleError):
    """A derived buffer's source is not in the layout its builder expects (emptied, packed, resized)."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str) -> None:
        super().__init__(
            "derived-buffer build refused, a source is not in the layout the builder expects; no buffer was "
            "written:\n  " + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class UnknownWeightError(LifecycleError):
    """Weights arrived under names the backbone does not have."""

    def __init__(self, names: Sequence[str], *, backbone: str, state: str, source: str = "") -> None:
        where = f" in {source}" if source else ""
        super().__init__(
            f"{len(names)} unknown tensor name(s){where}; nothing was loaded:\n  " + _listing(sorted(names)),
            backbone=backbone,
            state=state,
        )
        self.names = tuple(names)


class WeightShapeError(LifecycleError):
    """Weights arrived with a shape or dtype that differs from the parameter they are meant for."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str, source: str = "") -> None:
        where = f" in {source}" if source else ""
        super().__init__(
            f"{len(problems)} tensor(s) with the wrong shape or dtype{where}; nothing was loaded:\n  "
            + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class CheckpointError(LifecycleError):
    """A checkpoint file could not be read (missing, truncated, corrupt header)."""


class QuarantinedError(LifecycleError):
    """The backbone is quarantined after a failed or aborted reload; forward use is refused until a successful
    reload or `recover()`. `quarantine_reason` is why the reload was aborted."""

    def __init__(self, message: str, *, backbone: str, state: str, quarantine_reason: str | None = None) -> None:
        super().__init__(message, backbone=backbone, state=state)
        self.quarantine_reason = quarantine_reason


class DerivedBuildError(LifecycleError):
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


class RecoveryError(LifecycleError):
    """`recover()` was asked for, but the weights were not rolled back exactly to a set the derived buffers
    still match (no rollback, an incomplete one, a reload that did not start from a refreshed state, or derived
    buffers interrupted mid-write). A reload (`begin_reload` ... `refresh_derived_buffers`) is the way out."""


class NonFiniteWeightError(LifecycleError):
    """Weights with NaN or Inf values arrived while the finite check was on."""

    def __init__(self, problems: Sequence[str], *, backbone: str, state: str, source: str = "") -> None:
        where = f" in {source}" if source else ""
        super().__init__(
            f"{len(problems)} tensor(s) with NaN or Inf values{where}; nothing of this bucket was written:\n  "
            + _listing(problems),
            backbone=backbone,
            state=state,
        )
        self.problems = tuple(problems)


class WeightWriteError(LifecycleError):
    """Writing one tensor of a bucket failed after the bucket was validated. The tensors written before it are
    recorded as loaded; the failing one is recorded as possibly written (dirty) but not loaded."""

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


class RefreshInterruptedError(LifecycleError):
    """A validated refresh failed while writing (its plan was sound, a write raised). The buffers named in
    `touched` may hold a mix of old and new values: the refresh is refused (the state stays FULLY_LOADED),
    the next refresh rewrites them fully, and `recover()` is refused until then."""

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


class SessionStateError(LifecycleError):
    """A reload session was used out of order: begun twice, or used after it committed or aborted."""
