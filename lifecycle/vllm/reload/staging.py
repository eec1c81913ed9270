"""A draft's staging buffer: every bucket a push reads is read into it, reused from bucket to bucket and from push
to push.

A fresh tensor per value read (what the checkpoint reader gives otherwise) is faulted in page by page and freed with
its bucket: at the size of a real draft the reads cost more than the copies. vLLM's layerwise reload keeps each
load it is handed until the load's layer is complete (the buffered weight loader's arguments), so a bucket's bytes
are free again only once every layer it reached completed: a bucket is read after the bytes still held
(`Staging.region`), and the buffer is used from its start again once nothing is held (`Staging.settle`, after
each `load_weights` call). A bucket that does not fit after the held bytes is read into fresh tensors, and the
buffer grows to the longest run seen before the next bucket that finds nothing held, so from the second push on
every read lands in it: whole-file buckets need the file's size, one layer or one tensor at a time about one
layer's. It is kept across pushes (by the draft's runtime: dropped with the draft); where the draft's tensors are
on CUDA it is pinned host memory (the copy to the device reads it directly).

Nothing may keep a view of the buffer past its layer's processing: a weight loader that bound a parameter to the
value it was handed instead of copying it would have the next read overwrite a live weight. `Staging.check`
refuses that at the end of each chunk (the push fails, so the draft is quarantined before it could serve) and the
draft reads into fresh tensors from then on. A loader runs when its layer completes, so the check reads the tensors
of the modules whose layer completed in the chunk (vLLM reset their reload records), or of every module when the
chunk began the reload itself.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError
from ...read_buffers import MappedBuffer, Region
from ...torch_private import own_buffers, own_parameters, torch_function_bypassed
from ..drafts.owners import drafts_of, modules_of
from ..drafts.runtime import DraftRuntime
from .unwind import infos

__all__ = ["Staging", "staging_for"]

_LOADS = attrgetter("loaded_weights")  # a layer's loads vLLM still holds (an empty list once it completed)


class Staging:
    """One draft's reused read buffer (module doc)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.mapped: MappedBuffer | None = None
        self.refused = False  # a loader kept a view of it: fresh reads from then on
        self._held = 0  # bytes at the start of the buffer that buffered loads still reference
        self._run = 0  # bytes read since nothing was held (what the buffer would need to hold them all)
        self._wanted = 0  # the longest such run seen: the size to grow to when nothing is held
        self._waiting: list[Any] | None = None  # vLLM's infos of the modules in the reload
        #: the modules in the reload when the chunk began: those whose layer completed since are the only ones a
        #: loader can have bound to the buffer (None: not known, every module is checked)
        self._started: list[tuple[nn.Module, Any]] | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        return None if self.mapped is None else self.mapped.buffer

    def region(self, need: int) -> Region | None:
        """`need` bytes to read the next bucket into, after the held ones; None: fresh tensors (it does not fit)."""
        run = self._run = self._run + need
        if run > self._wanted:
            self._wanted = run
        held, mapped = self._held, self.mapped
        if held == 0 and (mapped is None or len(mapped) < self._wanted):
            self.mapped = mapped = None  # nothing references it: the smaller one goes first
            self.mapped = mapped = MappedBuffer(torch.empty(self._wanted, dtype=torch.uint8, pin_memory=self.pinned))
        if mapped is None or held + need > len(mapped):
            return None
        self._held = held + need
        return Region(mapped, held)

    def settle(self, model: nn.Module) -> None:
        """After a `load_weights` call: whether any load it was handed is still held (its layer is not complete);
        if none is, the next bucket goes to the start of the buffer."""
        waiting = self._waiting
        if waiting is None:  # no reload was open when the chunk began: an implicit one began with this call
            waiting, self._started = [info for _, info in infos(model)], None
            self._waiting = waiting
        # vLLM resets a completed layer's info (no kernel tensors, no loads held). Layers complete mostly in the
        # payload's order, so the completed ones are dropped from the front only: one completed further on stays
        # until those before it did, holding nothing (this runs after every call of every push: the scan is C's)
        done = 0
        for info in waiting:
            if info.kernel_tensors is not None:
                break
            done += 1
        if done:
            del waiting[:done]
        if not any(map(_LOADS, waiting)):
            self._held = self._run = 0

    def start(self, model: nn.Module) -> None:
        """A chunk of `model`'s reload begins: the modules waiting in it now (one walk per chunk)."""
        waiting = infos(model)
        self._waiting, self._started = ([info for _, info in waiting], waiting) if waiting else (None, None)

    def drop(self) -> None:
        """After a failed call: a new buffer for the next bucket (views of this one may still be held)."""
        self.mapped, self._held, self._run, self._started = None, 0, 0, None

    def check(self, model: nn.Module) -> None:
        """At the end of a chunk: no parameter or buffer of `model` may live in the buffer (module doc)."""
        if self.mapped is None:
            return
        start = self.mapped.buffer.data_ptr()
        end = start + len(self.mapped)
        # the address of every tensor of the modules completed in this chunk (of every module, when those are not
        # known), read once (a META tensor's is 0); names only for the error
        started, self._started = self._started, None
        modules = [m for _, m in modules_of(model)] if started is None \
            else [m for m, info in started if info.kernel_tensors is None]
        with torch_function_bypassed():  # vLLM's parameters answer `data_ptr` through `__torch_function__`
            held = [t for m in modules for t in (*own_parameters(m).values(), *own_buffers(m).values())
                    if t is not None]
            if not any(start <= p < end for p in map(torch.Tensor.data_ptr, held)):
                return
            aliased = [n for n, t in (*model.named_parameters(), *model.named_buffers())
                       if start <= t.data_ptr() < end]
        if aliased:
            self.refused, self.mapped = True, None
            raise CheckpointError(f"reload-lifecycle: {', '.join(aliased[:4])} of the draft now live(s) in the "
                                  "reader's staging buffer (a weight loader kept the value it was handed instead "
                                  "of copying it): the next read would overwrite it. The push fails and the draft "
                                  "is quarantined; its later pushes read into fresh tensors", backbone=None)


def staging_for(model: object) -> Staging | None:
    """The staging buffer of `model`'s lifecycle draft (made on first use), or None (no draft: the target reads
    into fresh tensors, as vLLM's loaders do)."""
    drafts = drafts_of(model) if isinstance(model, nn.Module) else []
    if not drafts:
        return None
    runtime: DraftRuntime = drafts[0].lifecycle_runtime
    if runtime.staging is None:
        on_cuda = any(t.device.type == "cuda" for t in drafts[0].parameters())
        runtime.staging = Staging(pinned=on_cuda and torch.cuda.is_available())
    staging: Staging = runtime.staging
    return None if staging.refused else staging
