"""What a draft-reload RPC or a transfer chunk asks for: validated before the model is touched, read bucket by bucket.

Every argument is checked, and the checkpoint's headers are read and checked (`lifecycle.checkpoint`), before
`initialize_layerwise_reload` moves anything to META: a wrong type, a non-positive bucket size, prefixes given as
one string (which Python would split into characters, excluding nearly everything), a path outside the allowed
root, a missing, empty, truncated or non-regular checkpoint, or nothing left to load is a clear error and the
model is untouched. A tensor larger than the machine's memory is refused from its header (it could never be
read), and with `model=` the payload of a lifecycle draft is checked against the draft from the headers alone
(`expected.check_payload`: the frozen structure, names, and sizes against what each loads into). Then `feed` reads
one bucket at a time from disk (the reader holds only that bucket; vLLM itself buffers the tensors of layers that
are not complete yet) and hands it to `model.load_weights`. Without a `bucket_size` a bucket is one layer
(`layers.N.`), and every other tensor is a bucket of its own: the reader never holds more than the largest layer
or tensor (before, the default was the whole payload in one bucket: a 1.5 GiB payload added 1.5 GiB of resident
memory). A draft whose `load_weights` needs every tensor in every call (`VLLMDraftFamily.whole_calls`) gets one. A
lifecycle draft's buckets are read into its staging buffer, reused from bucket to bucket and from push to push
(`staging.py`; the target's into fresh tensors).

What a path argument can reach: any file or folder the worker process can read, unless the engine was started
with `RELOAD_LIFECYCLE_PATH_ROOT=/abs/folder`, in which case every file is confined, not only the path: the path
and each link in the folder it names, resolved, must lie inside that folder, and each file is opened by its
resolved path beneath the root without following links (`lifecycle.confined`), so a link swapped in after the
check is refused, not followed. Only regular `*.safetensors` files are read (a folder: its `*.safetensors`
files); nothing is written, executed or unpickled.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from ...checkpoint import IndexEntry, checkpoint_index, iter_buckets
from ...errors import CheckpointError
from ...types import clipped
from .. import settings
from .expected import check_payload, needs_whole_calls
from .staging import staging_for

__all__ = ["Payload", "check_bucket_size", "check_path", "check_prefixes", "default_buckets", "feed", "plan_payload"]

T = TypeVar("T")


@dataclass(frozen=True)
class Payload:
    """The tensors to send, in buckets, and where each lives on disk."""

    index: dict[str, IndexEntry]
    buckets: list[list[str]]

    @property
    def tensors(self) -> int:
        return sum(map(len, self.buckets))


def check_path(path: object, what: str = "weights_path", root: Path | None = None) -> Path:
    """A non-empty str or PathLike, inside `root` when given (`RELOAD_LIFECYCLE_PATH_ROOT`, resolved): then the
    path is returned resolved, and only that is opened (beneath the root, following no link)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"{what} must be a non-empty path (str), got {path!r}")
    p = Path(path)
    if root is None:
        root = settings.allowed_root()
    if root is not None:
        resolved = p.resolve()
        if not resolved.is_relative_to(root):
            # never where it resolves to: a link's target, or through /proc/self/fd/N the engine's open files
            raise PermissionError(f"{what}={clipped(str(path), 1024)!r} resolves outside the allowed root {root} "
                                  f"({settings.PATH_ROOT_ENV}); nothing was read")
        return resolved
    return p


def check_prefixes(value: object, what: str = "exclude_prefixes") -> tuple[str, ...]:
    """A list (or tuple) of non-empty name prefixes; one string is refused, not split into characters."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a list of name prefixes, not one string: {value!r} would be read as its "
                        f"characters and leave out nearly every tensor; pass [{value!r}]")
    try:
        items = tuple(cast("Iterable[object]", value))  # of any type: one not iterable raises the TypeError
    except TypeError:
        raise TypeError(f"{what} must be a list of name prefixes, got {type(value).__name__}") from None
    bad = [x for x in items if not isinstance(x, str) or not x]
    if bad:
        raise TypeError(f"{what} must hold non-empty strings; got {bad!r}")
    return cast("tuple[str, ...]", items)  # every item a non-empty str: nothing `bad`


def check_bucket_size(value: object) -> int | None:
    """None: the default plan (a layer per bucket); else a positive int (tensors per bucket)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"bucket_size must be a positive int or None (a bucket per layer), got {value!r}")
    if value <= 0:
        raise ValueError(f"bucket_size must be a positive int or None (a bucket per layer), got {value}")
    return value


def _checked(value: object, kind: type[T], what: str) -> T:
    """`value`, when it is a `kind` (a bool is no int here), else a TypeError naming `what`."""
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise TypeError(f"{what} must be {kind.__name__}, got {value!r}")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_sizes(index: dict[str, IndexEntry], names: list[str]) -> None:
    """A tensor larger than the machine's memory is refused from its header: reading it could only fail in
    `torch.empty` after trying (a sparse file can claim any size)."""
    limit = _physical_memory()
    if limit is None:
        return
    big = [n for n in names if index[n].nbytes > limit]
    if big:
        e = index[big[0]]
        raise CheckpointError(f"cannot read checkpoint {e.path}: tensor {big[0]} claims {e.nbytes:,} bytes "
                              f"({list(e.shape)}), more than this machine's memory ({limit:,} bytes)"
                              + (f"; and {len(big) - 1} more such tensor(s)" if len(big) > 1 else "")
                              + "; nothing was read", backbone=None)


def default_buckets(names: list[str]) -> list[list[str]]:
    """A bucket per layer (`layers.N.`, in the order the names come), every other tensor a bucket of its own.

    >>> default_buckets(["fc.weight", "layers.0.a", "layers.0.b", "layers.1.a", "norm.weight"])
    [['fc.weight'], ['layers.0.a', 'layers.0.b'], ['layers.1.a'], ['norm.weight']]
    """
    buckets: dict[str, list[str]] = {}
    for n in names:
        m = _LAYER.search(n)
        buckets.setdefault(f"layer {m.group(1)}" if m else n, []).append(n)
    return list(buckets.values())


def plan_payload(path: object, *, bucket_size: object = None, shuffle: object = False, seed: object = 0,
                 exclude_prefixes: Iterable[str] | object = (), what: str = "weights_path", model: Any = None,
                 whole_calls: bool = False) -> Payload:
    """Validate the arguments and the checkpoint's headers; plan the buckets (`bucket_size` None: a layer per
    bucket, or one bucket with `whole_calls`, for a draft whose load_weights needs every tensor in every call).
    `model`: the model the payload is for; a lifecycle draft's payload is checked against it
    (`expected.check_payload`, audited there) and its family says whether it needs whole calls. Writes nothing to
    the model."""
    size = check_bucket_size(bucket_size)
    shuffled = _checked(shuffle, bool, "shuffle")
    seed_value = _checked(seed, int, "seed")
    prefixes = check_prefixes(exclude_prefixes)
    root = settings.allowed_root()
    index = checkpoint_index(check_path(path, what, root), root=root)
    names = [n for n in index if not n.startswith(prefixes)]
    if not names:
        raise CheckpointError(f"nothing to load: {path} holds {len(index)} tensor(s) and exclude_prefixes "
                              f"{list(prefixes)} leaves out every one", backbone=None)
    _check_sizes(index, names)
    if model is not None:
        check_payload(index, names, model)  # before any data is read
        whole_calls = whole_calls or needs_whole_calls(model)
    if shuffled:
        random.Random(seed_value).shuffle(names)
    if size is None:
        return Payload(index, [names] if whole_calls else default_buckets(names))
    return Payload(index, [names[i:i + size] for i in range(0, len(names), size)])


def feed(model: Any, payload: Payload) -> None:
    """`model.load_weights(bucket)` per bucket, read from disk one bucket at a time (into the draft's staging
    buffer: `staging.py`)."""
    staging = staging_for(model)
    if staging is None:
        with closing(iter_buckets(payload.index, payload.buckets)) as read:
            for bucket in read:
                model.load_weights(bucket)
        return
    staging.start(model)
    try:
        with closing(iter_buckets(payload.index, payload.buckets, into=staging.region)) as read:
            for bucket in read:
                model.load_weights(bucket)
                staging.settle(model)
    except BaseException:
        staging.drop()  # what a failed call left held is unwound with its epoch; never read over it
        raise
    staging.check(model)
