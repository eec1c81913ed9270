"""Transactional reloads: BEGIN -> APPLY -> FINALIZE -> VERIFY -> COMMIT, or ABORT (the phases of vLLM RFC #48312).

>>> import tempfile, torch
>>> from lifecycle.bundled import qwen3_dflash as q
>>> from lifecycle.events import configure_audit; _ = configure_audit(console=False)
>>> from lifecycle.loading import load_safetensors, write_checkpoint
>>> cfg = q.DFlashConfig(num_hidden_layers=2)
>>> a = write_checkpoint(q.random_weights(cfg, seed=0), tempfile.mkdtemp() + "/a.safetensors")
>>> draft = q.DFlashQwen3Draft(cfg); _ = load_safetensors(draft, a); _ = draft.finalize_loading()
>>> _ = draft.refresh_derived_buffers(); fused = draft._fused_kv_weight.clone()
>>> with draft.reload_session(rollback=True) as s:
...     _ = s.apply({"layers.1.self_attn.qkv_proj.weight": torch.zeros(128, 64)})
...     s.abort("trainer went away")
>>> draft.lifecycle.state.value, torch.equal(draft._fused_kv_weight, fused), s.snapshot_bytes
('QUARANTINED', True, 32768)
>>> draft.recover().value      # the rollback was exact: the last good derived buffers match the weights again
'DERIVED_REFRESHED'

Inside `with backbone.reload_session(...) as s:`

- BEGIN (`__enter__`): `begin_reload()` (nothing for a cold load from META).
- APPLY: `s.apply({name: tensor})` or `s.apply([(name, tensor), ...])` per bucket, `s.load(path, ...)` for a
  checkpoint; any number, from several threads on a locked lifecycle. `s.weights_unchanged(names)` declares
  tensors this reload does not send (part of a layer).
- FINALIZE: `s.finalize_loading(keep_untouched=...)`: every layer ready, then the phase hooks.
- VERIFY: `s.verify()`: every pinned storage identity unchanged; with `finite_check`, no NaN/Inf in what was written.
- COMMIT: `s.commit()`: finalize and verify if not done yet, then refresh the derived buffers in place.
- ABORT: an exception, `s.abort(reason)`, or leaving the block without `commit()`: `abort_reload(reason)`, so the
  backbone is QUARANTINED (its fused path raises `QuarantinedError`), the derived buffers keep their last good
  values, and the reason is audited. The exception propagates. A load that never reported a tensor (still META)
  cannot be quarantined and is left META.

`rollback=True` copies each tensor once, just before its first write in the session (after its bucket was
validated). Memory: the bytes of the distinct tensors the reload touches (a tensor on META costs nothing; it
is put back as the META placeholder it was), held until commit or abort: up to one extra copy of the weights for
a full reload. On abort every one is restored exactly (same storage, same bits; a replaced tensor object is put
back), before the state changes and after every other writing thread finished. If the reload started with
current derived buffers (DERIVED_REFRESHED or GRAPH_CAPTURED), `backbone.recover()` then leaves QUARANTINED
without a reload.

A session drives any `ReloadTarget` (what it uses of a backbone: `DraftBackbone` is one); it never imports the
backbone, which builds sessions (`DraftBackbone.reload_session`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

import torch
from torch import nn

from .errors import NonFiniteWeightError, SessionStateError, raise_unheld
from .loading import LoadReport, LoadTarget, Writer, apply_bucket, load_safetensors, non_finite
from .torch_private import own_buffers, own_parameters
from .types import RefreshReport, describe_error

__all__ = ["ReloadSession", "ReloadTarget", "WeightSnapshot"]


class ReloadTarget(LoadTarget, Protocol):
    """What a reload session uses of the backbone it reloads, beside what the loader does (`LoadTarget`): its
    lifecycle steps, its live tensors, and where each tracked tensor lives (for the rollback snapshot). Every
    `DraftBackbone` is one."""

    def begin_reload(self) -> int: ...

    def finalize_loading(self, *, keep_untouched: bool = False) -> list[str]: ...

    def weights_unchanged(self, names: Iterable[str]) -> None: ...

    def refresh_derived_buffers(self, *, full: bool = False) -> RefreshReport: ...

    def live_tensor(self, name: str) -> torch.Tensor | None: ...

    def tensor_slot(self, name: str) -> tuple[nn.Module, str]: ...

Bucket = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Status = Literal["new", "open", "committed", "aborted"]


@dataclass
class _Saved:
    owner: nn.Module
    leaf: str
    is_param: bool
    original: torch.Tensor
    values: torch.Tensor | None  # None: the original was a META placeholder


class WeightSnapshot:
    """Each tensor's value before its first write (thread-safe). `nbytes`: what the copies hold."""

    def __init__(self, backbone: ReloadTarget) -> None:
        self._backbone = backbone
        self._saved: dict[str, _Saved] = {}
        self._by_tensor: dict[int, torch.Tensor] = {}  # one copy per distinct tensor (tied names share it)
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._saved)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._saved)

    @torch.no_grad()
    def capture(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                if name in self._saved:
                    continue
                owner, leaf = self._backbone.tensor_slot(name)
                params = own_parameters(owner)
                is_param = leaf in params
                t = params[leaf] if is_param else own_buffers(owner)[leaf]
                assert t is not None
                values = None
                if not t.is_meta:
                    values = self._by_tensor.get(id(t))
                    if values is None:
                        values = t.detach().clone()
                        self._by_tensor[id(t)] = values
                        self.nbytes += values.numel() * values.element_size()
                self._saved[name] = _Saved(owner, leaf, is_param, t, values)

    @torch.no_grad()
    def restore(self) -> list[str]:
        """Put every captured tensor back: the original object in its slot, its saved bits in its storage."""
        with self._lock:
            for s in self._saved.values():
                # the table the original came from (a parameter back among the parameters)
                slots: dict[str, Any] = own_parameters(s.owner) if s.is_param else own_buffers(s.owner)
                if slots.get(s.leaf) is not s.original:
                    slots[s.leaf] = s.original
                if s.values is not None:
                    s.original.copy_(s.values)
            return list(self._saved)

    def release(self) -> None:
        with self._lock:
            self._saved.clear()
            self._by_tensor.clear()


class ReloadSession:
    """One transactional reload of `backbone`. Use as a context manager (or call `begin` and then `commit` or
    `abort` yourself). See the module docstring for the phases and what rollback costs."""

    def __init__(self, backbone: ReloadTarget, *, rollback: bool = False, finite_check: bool = False,
                 keep_untouched: bool = False, device: torch.device | str = "cpu", writer: Writer | None = None
                 ) -> None:
        self.backbone = backbone
        self.rollback = rollback
        self.finite_check = finite_check
        self.keep_untouched = keep_untouched
        self.device = device
        self.writer = writer
        self.status: Status = "new"
        self.abort_reason: str | None = None
        self.epoch: int | None = None
        self._snapshot: WeightSnapshot | None = WeightSnapshot(backbone) if rollback else None
        self._snapshot_bytes = 0
        self._touched: set[str] = set()
        self._touched_lock = threading.Lock()
        self._finalized = False

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def touched(self) -> frozenset[str]:
        """Every tensor this session wrote (or started to write)."""
        with self._touched_lock:
            return frozenset(self._touched)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes the rollback snapshot holds (or held, once the session closed): the touched tensors' bytes."""
        return self._snapshot.nbytes if self._snapshot is not None else self._snapshot_bytes

    @property
    def recoverable(self) -> bool:
        """After an abort: whether `backbone.recover()` would succeed now (what it checks: the table, an exact
        rollback, every pinned storage identity unchanged). Checked again at each call."""
        return self.status == "aborted" and self.backbone.lifecycle.refusal("recover") is None

    def _require_open(self, what: str) -> None:
        if self.status == "open" and not self.backbone.lifecycle.session_open(self):
            self.status, self.abort_reason = "aborted", "abandoned: a later session of this backbone took over"
        if self.status != "open":
            lc = self.backbone.lifecycle
            raise SessionStateError(f"{what} refused: the reload session is {self.status}"
                                     + (f" ({self.abort_reason})" if self.abort_reason else ""),
                                     backbone=lc.name, state=lc.state.value)

    def _audit(self, phase: str, **fields: Any) -> None:
        self.backbone.lifecycle.audit_event("session", phase=phase, **fields)

    # ---- BEGIN ----------------------------------------------------------------------------------------------
    def begin(self) -> int:
        """`begin_reload()` (a cold load from META needs none). Returns the epoch."""
        lc = self.backbone.lifecycle
        if self.status == "open":  # sessions are single use
            raise SessionStateError("begin refused: the reload session has begun already", backbone=lc.name,
                                    state=lc.state.value)
        if self.status != "new":
            self._require_open("begin")
        lc.open_session(self)  # refuses while another session of this backbone is open
        try:
            self.epoch = lc.epoch if lc.unloaded else self.backbone.begin_reload()
        except BaseException:
            lc.close_session(self)
            raise
        self.status = "open"
        self._audit("begin", rollback=self.rollback, finite_check=self.finite_check)
        return self.epoch

    def __enter__(self) -> ReloadSession:
        self.begin()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if self.status != "open":
            return False
        reason = "the reload session ended without commit()" if exc is None else describe_error(exc)
        try:
            self.abort(reason)
        except Exception as e:  # never mask the exception that ended the block
            if exc is None:
                raise
            self._audit("abort_failed", error=repr(e))
        return False

    # ---- APPLY ----------------------------------------------------------------------------------------------
    def _before_write(self, names: Sequence[str]) -> None:
        with self._touched_lock:
            self._touched.update(names)
        if self._snapshot is not None:
            self._snapshot.capture(names)

    def apply(self, bucket: Bucket) -> list[str]:
        """Validate, snapshot (with rollback), write and report one bucket. Returns the layers it completed."""
        self._require_open("apply")
        pairs = list(bucket.items()) if isinstance(bucket, Mapping) else list(bucket)
        return apply_bucket(self.backbone, pairs, self.device, finite_check=self.finite_check, writer=self.writer,
                            before_write=self._before_write)

    def load(self, paths: str | Path | Sequence[str | Path], **options: Any) -> LoadReport:
        """Stream a checkpoint through the loader (`load_safetensors` options: bucket_by, shuffle, subset, ...)."""
        self._require_open("load")
        return load_safetensors(self.backbone, paths, device=self.device, finite_check=self.finite_check,
                                writer=self.writer, before_write=self._before_write, **options)

    def weights_unchanged(self, names: Iterable[str]) -> None:
        """Declare tensors this reload does not send unchanged (see `DraftBackbone.weights_unchanged`)."""
        self._require_open("weights_unchanged")
        self.backbone.weights_unchanged(names)

    # ---- FINALIZE, VERIFY -----------------------------------------------------------------------------------
    def finalize_loading(self, *, keep_untouched: bool | None = None) -> list[str]:
        """The backbone's `finalize_loading()`: every layer ready (untouched layers declared unchanged with
        keep_untouched), then the phase hooks. Returns the hooks that ran."""
        self._require_open("finalize_loading")
        keep = self.keep_untouched if keep_untouched is None else keep_untouched
        ran = self.backbone.finalize_loading(keep_untouched=keep)
        self._finalized = True
        return ran

    def verify(self, *, finite: bool | None = None) -> int:
        """Every pinned storage identity unchanged (`StorageDriftError`); with `finite` (default: the session's
        `finite_check`) every tensor written holds no NaN/Inf (`NonFiniteWeightError`). Returns how many
        tensors were checked."""
        self._require_open("verify")
        lc = self.backbone.lifecycle
        checked = lc.verify_pinned()
        if self.finite_check if finite is None else finite:
            names = sorted(self.touched)
            problems = non_finite((n, t) for n in names if (t := self.backbone.live_tensor(n)) is not None)
            checked += len(names)
            if problems:
                raise_unheld(self._refused_verify(problems))
        self._audit("verify", ok=True, checked=checked)
        return checked

    def _refused_verify(self, problems: list[str]) -> NonFiniteWeightError:
        """`verify`'s refusal of tensors written with NaN or Inf values, audited."""
        lc = self.backbone.lifecycle
        error = NonFiniteWeightError(problems, backbone=lc.name, state=lc.state.value, source="verify")
        self._audit("verify", ok=False, error=type(error).__name__, reason=error.reason)
        return error

    # ---- COMMIT, ABORT --------------------------------------------------------------------------------------
    def commit(self, *, full: bool = False) -> RefreshReport:
        """Finalize and verify (if not done yet), then refresh every derived buffer in place. On success the
        session is closed and the snapshot released; on failure it stays open (leaving the block aborts)."""
        self._require_open("commit")
        if not self._finalized:
            self.finalize_loading()
        self.verify()
        report = self.backbone.refresh_derived_buffers(full=full)
        self.status = "committed"
        self._close_snapshot()
        self.backbone.lifecycle.close_session(self)
        self._audit("commit", touched=len(self._touched), snapshot_bytes=self._snapshot_bytes,
                    elements_written=report.elements_written)
        return report

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Quarantine the backbone (`abort_reload(reason)`), restoring every touched tensor first when rollback
        is on. Waits for other writing threads; their later writes are refused. Stopped part way (a rollback
        interrupted), the session ends all the same."""
        self._require_open("abort")
        lc = self.backbone.lifecycle
        outcome = "stopped"
        try:
            restore = self._snapshot.restore if self._snapshot is not None else None
            with lc.quiesced():
                if lc.can("abort_reload"):
                    lc.abort_reload(reason, rollback=restore)
                    outcome = "quarantined"
                elif lc.unloaded:  # nothing was reported: put back what a failed write may have set
                    if restore is not None:
                        restore()
                    outcome = f"unchanged ({lc.state.value})"
                else:  # e.g. refreshed outside commit(), or quarantined by someone else: nothing safe to undo
                    outcome = f"left {lc.state.value}"
        finally:  # stopped part way too (a rollback interrupted: quarantined, not recoverable): the session ends
            if outcome == "stopped" and lc.quarantined:
                outcome = "quarantined (rollback incomplete)"
            self.status = "aborted"
            self.abort_reason = reason
            self._close_snapshot()
            lc.close_session(self)
            self._audit("abort", reason=reason, outcome=outcome, rollback=self.rollback,
                        touched=len(self._touched), snapshot_bytes=self._snapshot_bytes, recoverable=self.recoverable)

    def _close_snapshot(self) -> None:
        if self._snapshot is not None:
            self._snapshot_bytes = self._snapshot.nbytes
            self._snapshot.release()
            self._snapshot = None
