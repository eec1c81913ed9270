"""The backbones' invariant after an interrupt, and their documented ways out (`support.crash`'s check for them).

After an interrupted operation a backbone is either usable, and then every buffer it holds beside its weights (each
derived buffer, each table a hook made) is bit-equal to a cold build from its current weights, at the addresses the
graphs pinned; or it refuses forward use. Then:

- the shortcuts that need no new data: `recover()` where it is allowed (the weights must then be those before the
  operation), else finishing what is open with `keep_untouched=True` and refreshing. Each may be refused; if it
  ends usable, the invariant holds;
- the documented retry: a complete reload (`abort_reload` first when a load is still open) in a reload session,
  which must end usable, with the checkpoint's weights, equal to a cold build and at the pinned addresses.

The cold build is a fresh backbone of the same class and config (`Case.build`) loaded with the current weights:
kept per weights (a digest of their bytes), so each distinct set is built once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from lifecycle import DraftBackbone, LifecycleError
from lifecycle.loading import apply_bucket
from lifecycle.session import ReloadSession
from lifecycle.storage import StorageIdentity
from support.crash import REFUSED, STALE, STRANDED, USABLE, Outcome

__all__ = ["Case", "check_backbone", "cold_buffers", "weights_of"]


@dataclass
class Case:
    """One interrupted run: the backbone, how to build a fresh one like it, the checkpoint a complete reload loads,
    the weights before the operation (what `recover()` must give back) and the pinned identities (if captured)."""

    model: DraftBackbone
    build: Callable[[], DraftBackbone]
    reload_from: Path
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    pins: dict[str, StorageIdentity] | None = None
    session: ReloadSession | None = None

    def __post_init__(self) -> None:
        self.before = weights_of(self.model)
        if self.model.lifecycle.graphs_pinned:
            self.pins = {n: StorageIdentity.of(t) for n, t in self.model.graph_visible_tensors().items()
                         if t is not None}


def weights_of(m: DraftBackbone) -> dict[str, torch.Tensor]:
    """Every tracked tensor as it is now, cloned (META ones as they are)."""
    out = {}
    for name in m.lifecycle.specs:
        t = m.live_tensor(name)
        assert t is not None, name
        out[name] = t if t.is_meta else t.detach().clone()
    return out


def _held(m: DraftBackbone) -> dict[str, torch.Tensor]:
    """What the backbone holds beside its weights: every derived buffer and every other buffer (a hook's table)."""
    specs = m.lifecycle.specs
    return {n: b for n, b in m.named_buffers(remove_duplicate=False) if n not in specs}


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name]
        h.update(name.encode())
        h.update(b"META" if t.is_meta else t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_COLD: dict[tuple[type, str, str], dict[str, torch.Tensor]] = {}


def cold_buffers(m: DraftBackbone, build: Callable[[], DraftBackbone]) -> dict[str, torch.Tensor]:
    """What a cold build from `m`'s current weights holds beside them (`_held`)."""
    weights = weights_of(m)
    key = (type(m), repr(getattr(m, "config", None)), _digest(weights))
    if key not in _COLD:
        fresh = build()
        apply_bucket(fresh, list(weights.items()))
        fresh.finalize_loading()
        fresh.refresh_derived_buffers()
        _COLD[key] = {n: b.detach().clone() for n, b in _held(fresh).items()}
    return _COLD[key]


def _stale(case: Case) -> str | None:
    """Why the backbone breaks the invariant now, or None."""
    m, lc = case.model, case.model.lifecycle
    if not lc.usable:
        try:
            m.require_usable()
        except LifecycleError:
            return None
        return f"{lc.state.value} is not usable, yet forward use is not refused"
    want, got = cold_buffers(m, case.build), _held(m)
    if want.keys() != got.keys():
        return f"buffers {sorted(got.keys() ^ want.keys())} differ from a cold build's"
    for name, w in want.items():
        g = got[name]
        if g.is_meta or g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            return f"{lc.state.value}: {name} differs from a cold build of the current weights"
    if case.pins is not None:
        now = m.graph_visible_tensors()
        moved = [n for n, ident in case.pins.items() if now.get(n) is None or StorageIdentity.of(now[n]) != ident]
        if moved:
            return f"{lc.state.value}: pinned tensors moved: {', '.join(moved[:5])}"
    return None


def _shortcut(case: Case) -> str | None:
    """Try the ways to usable that need no new data; why the result is stale, or None."""
    m, lc = case.model, case.model.lifecycle
    if lc.usable:
        return None
    if lc.quarantined and lc.refusal("recover") is None:
        m.recover()
        now = weights_of(m)
        changed = [n for n, t in now.items() if not torch.equal(t, case.before[n])]
        if changed:
            return f"recover() allowed, but the weights differ from before the operation: {', '.join(changed[:5])}"
        return _stale(case)
    try:
        if not lc.can("finalize_loading") and lc.can("begin_reload"):
            m.begin_reload()
        if lc.can("finalize_loading"):
            m.finalize_loading(keep_untouched=True)
        if lc.can("refresh_derived"):
            m.refresh_derived_buffers()
    except LifecycleError:
        pass
    stale = _stale(case)
    return None if stale is None else f"after finishing with keep_untouched=True: {stale}"


def _reload(case: Case) -> str | None:
    """A complete reload; why it did not end usable and equal to a cold build of the checkpoint, or None."""
    m, lc = case.model, case.model.lifecycle
    try:
        if not lc.unloaded and not lc.can("begin_reload"):
            m.abort_reload("crash harness: retry")
        with m.reload_session() as s:
            s.load(case.reload_from)
            s.commit()
    except LifecycleError as e:
        return f"the complete reload failed: {type(e).__name__}: {e}"
    if not lc.usable:
        return f"the complete reload ended {lc.state.value}"
    if case.pins is not None and not lc.graphs_pinned:
        return "the complete reload lost the captured graphs"
    want = load_file(case.reload_from)
    wrong = [n for n, t in weights_of(m).items() if n in want and not torch.equal(t, want[n])]
    if wrong:
        return f"after the complete reload the weights differ from the checkpoint: {', '.join(wrong[:5])}"
    return _stale(case)


def check_backbone(case: Case, raised: BaseException) -> Outcome:
    """The outcome of one interrupted run (see the module doc)."""
    stale = _stale(case)
    if stale is not None:
        return Outcome(STALE, stale)
    first = USABLE if case.model.lifecycle.usable else REFUSED
    stale = _shortcut(case)
    if stale is not None:
        return Outcome(STALE, stale)
    stranded = _reload(case)
    if stranded is not None:
        return Outcome(STRANDED, stranded)
    return Outcome(first)
