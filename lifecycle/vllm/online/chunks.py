"""What a push's chunks wrote, tensor by tensor, so that a chunk sent again is safe (the safetensors_file backend).

A trainer whose `/update_weights` timed out sends the chunk again; vLLM's layerwise reload had already processed
the layers it completed (on the CPU layout their weights are repacked and emptied), so the second copy failed
("Attempted to load weight ([64, 128]) into parameter ([0])") and quarantined the draft. Each push records where
its bytes for each checkpoint tensor came from (`pushes.Source`: the file as it was when read, and the byte range).
A chunk's tensors that the push already wrote are checked before anything of the chunk is written (`admit`):

- from the same file, unchanged, and the same range: the same bytes; skipped, nothing read;
- from elsewhere: both read and compared byte for byte; the same bytes are skipped;
- other bytes (or the first file changed or gone, so they cannot be compared): `ChunkConflictError`, naming the
  tensor and both files. The chunk is refused and with it the push (fail closed: a second trainer's chunk looks
  exactly like this).

Only the chunks of a push run through the plugin's session wrapper are checked (`current`); the transfer engine
used on its own checks nothing. Cost: nothing for a chunk that sends no tensor twice; a tensor sent twice from
another file is read twice more.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import torch

from ...checkpoint import IndexEntry, checkpoint_index, iter_buckets
from ...errors import CheckpointError
from ..reload.payload import Payload
from .pushes import Push, Source

__all__ = ["ChunkConflictError", "admit", "current", "record", "running"]

_RUNNING: list[Push] = []


class ChunkConflictError(ValueError):
    """A chunk sends other bytes for a tensor its push already wrote (or bytes that cannot be compared)."""


@contextmanager
def running(push: Push | None) -> Iterator[None]:
    """The block runs a chunk of `push` (None: of no push the plugin keeps)."""
    if push is None:
        yield
        return
    _RUNNING.append(push)
    try:
        yield
    finally:
        _RUNNING.remove(push)


def current() -> Push | None:
    """The push whose chunk is being run now, if any."""
    return _RUNNING[-1] if _RUNNING else None


def _source(entry: IndexEntry) -> Source:
    return Source(str(entry.path), entry.identity, entry.start, entry.nbytes, str(entry.dtype), tuple(entry.shape))


def _read(index: dict[str, IndexEntry], name: str) -> torch.Tensor:
    with closing(iter_buckets(index, [[name]])) as read:
        ((_, tensor),) = next(read)
    return tensor.reshape(-1).view(torch.uint8)


def _same_bytes(name: str, old: Source, index: dict[str, IndexEntry], root: Path | None) -> bool:
    """Whether the bytes `index` holds for `name` are the ones `old` says the push wrote. Raises
    `ChunkConflictError` when they cannot be compared (the first file changed or is gone)."""
    new = index[name]
    if _source(new) == old:
        return True
    if (str(new.dtype), tuple(new.shape), new.nbytes) != (old.dtype, old.shape, old.nbytes):
        return False
    try:
        before = checkpoint_index(Path(old.path), root=root)
        entry = before.get(name)
        if entry is None or _source(entry) != old:
            raise CheckpointError(f"{old.path} changed since this push read {name} from it", backbone=None)
        return torch.equal(_read(before, name), _read(index, name))
    except (CheckpointError, OSError) as e:
        raise ChunkConflictError(
            f"this push wrote {name} from {old.path}, and this chunk sends it again from {new.path}; the bytes "
            f"cannot be compared ({type(e).__name__}: {str(e)[:300]}), so the push is refused (a chunk of another "
            "push looks exactly like this)") from None


def admit(push: Push, payload: Payload, root: Path | None) -> Payload:
    """`payload` without the tensors `push` already wrote with the same bytes (counted in `push.resent`); a tensor
    with other bytes refuses the chunk (`ChunkConflictError`) before anything of it is written."""
    if not push.written:
        return payload
    again = [n for bucket in payload.buckets for n in bucket if n in push.written]
    if not again:
        return payload
    differ = [n for n in again if not _same_bytes(n, push.written[n], payload.index, root)]
    if differ:
        name = differ[0]
        more = f" (and {len(differ) - 1} more tensor(s))" if len(differ) > 1 else ""
        raise ChunkConflictError(
            f"this chunk sends {name}{more} with other bytes than this push already wrote (from "
            f"{push.written[name].path}; now from {payload.index[name].path}): a push writes each tensor once, so "
            "the push is refused (a chunk of another push looks exactly like this)")
    push.resent += len(again)
    skipped = set(again)
    buckets = [kept for bucket in payload.buckets if (kept := [n for n in bucket if n not in skipped])]
    return Payload(payload.index, buckets)


def record(push: Push, payload: Payload) -> None:
    """The tensors of `payload`, written by `push`: where their bytes came from."""
    for bucket in payload.buckets:
        for name in bucket:
            push.written[name] = _source(payload.index[name])
