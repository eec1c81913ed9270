"""Safetensors checkpoint files: read when they may change, vanish or lie while they are read, and written.

>>> import tempfile, torch
>>> path = write_checkpoint({"a": torch.ones(2, 3), "b": torch.arange(4)}, tempfile.mkdtemp() + "/x.safetensors")
>>> index = checkpoint_index(path)
>>> index["a"].shape, index["a"].dtype, index["b"].nbytes
((2, 3), torch.float32, 32)
>>> [[(n, t.tolist()) for n, t in bucket] for bucket in iter_buckets(index, [["b"]])]
[[('b', [0, 1, 2, 3])]]

A trainer writes checkpoints to a shared file system while the engine reads them, so nothing about a file is
trusted beyond what was checked:

- Only regular files are read: a FIFO, socket or device is refused before anything could block on it (a FIFO
  opened for reading waits for a writer forever). Files are opened non-blocking and checked on the descriptor.
- The header is parsed and checked as safetensors checks it (`lifecycle.header`: every problem a
  `CheckpointError` naming file and tensor), and the tensors' byte ranges must lie end to end over the data, to
  the file's last byte, before any data is read: a file truncated after its header, two entries over one range,
  bytes no tensor accounts for are refused from the index.
- Data is read with `os.preadv` into fresh tensors (or, for the loader, which copies each value, one buffer
  reused from bucket to bucket), never memory-mapped: a file truncated under a mapping kills the process with
  SIGBUS; under a read it comes up short, which is a `CheckpointError`.
- Each file's identity (size, mtime_ns, ctime_ns, inode, device) is recorded when its header is read and
  compared again when the file is opened for its data (through the descriptor, then the path) and after every
  bucket read from it, through the path: while it names the descriptor's file its stat is that file's, so a
  rewrite in place (size, mtime or ctime changed), a replaced or a removed path are each a change. A
  change is a `CheckpointError` naming the file and what changed, raised before the bucket that saw it is handed
  out: a load never mixes two versions of a file. ctime cannot be faked: the kernel sets it on every write,
  `utime` (a same-size rewrite with its old mtime put back), `chmod`, link or rename; user space cannot.
- A folder is read file by file; `iter_buckets` holds one bucket's tensors at a time.
- With a `root` (the plugin's `RELOAD_LIFECYCLE_PATH_ROOT`) every file is confined: the path and each link in a
  folder it names are resolved and must lie beneath the root; each file is opened by its resolved path beneath
  the root's descriptor following no link (`lifecycle.confined`), for its header and its data. A refusal
  (`PathConfinementError`) says nothing of the refused file: not its bytes, its size, nor where a link points.
- A tensor that appears in two files is refused, naming both.

`write_checkpoint` writes one file (tests, demos, benchmarks, a trainer's own checkpoints): the format the readers
here read, through safetensors itself.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from .confined import confined_files, open_confined
from .errors import CheckpointError
from .header import DTYPES, HEADER_LIMIT, checked_header
from .header import error as _error
from .read_buffers import MappedBuffer, ReadBuffer, Region
from .read_buffers import padded as _padded

__all__ = ["DTYPES", "CheckpointIndex", "FileIdentity", "IndexEntry", "ReadBuffer", "Region", "check_paths",
           "checkpoint_files", "checkpoint_index", "iter_buckets", "write_checkpoint"]

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class FileIdentity:
    """What says a file is still the one whose header was validated."""

    size: int
    mtime_ns: int
    inode: int
    device: int
    ctime_ns: int = 0  # the inode's change time: set by the kernel on every write, utime, chmod; never by a user

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)

    def changes(self, now: FileIdentity) -> list[str]:
        """`size 4096 -> 4032` etc. for every field that differs."""
        return [f"{f} {getattr(self, f)} -> {getattr(now, f)}" for f in _IDENTITY_FIELDS
                if getattr(self, f) != getattr(now, f)]


_IDENTITY_FIELDS = ("size", "mtime_ns", "ctime_ns", "inode", "device")


class IndexEntry(NamedTuple):
    """Where one tensor lives: its file, shape, dtype and byte range (`start`: absolute offset in the file).
    A named tuple: a checkpoint's index makes one per tensor, and a frozen dataclass cost several times more to
    build (about a sixth of a 2,000-tensor reload went to the index)."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int = 0
    nbytes: int = 0
    identity: FileIdentity | None = None


class CheckpointIndex(dict[str, IndexEntry]):
    """Name -> `IndexEntry`, as `checkpoint_index` reads it, with `headers`: each file's header bytes, in file
    order. Two indexes with equal `headers` list the same names, shapes, dtypes and byte ranges (a trainer's every
    push of one model), so what was checked against one holds for the other (`loading.validate_index` keeps the
    headers it checked in full and skips the per-tensor check when they come again)."""

    __slots__ = ("headers", "root")

    def __init__(self) -> None:
        super().__init__()
        self.headers: tuple[bytes, ...] = ()
        self.root: Path | None = None  # every file is opened beneath it (`checkpoint_index(root=)`)




def _open_regular(path: Path, root: Path | None = None) -> tuple[int, FileIdentity]:
    """An open descriptor on a regular file and its identity; anything else is refused without blocking. With a
    `root`, `path` is resolved and opened beneath it without following links (`lifecycle.confined`)."""
    if root is not None:
        return _checked_regular(open_confined(path, root, _OPEN_FLAGS), path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise _error(path, f"{e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise _error(path, f"not a regular file ({_kind(st.st_mode)}); only regular safetensors files are read")
    try:
        fd = os.open(path, _OPEN_FLAGS)  # non-blocking: a file swapped for a FIFO meanwhile cannot hang us
    except OSError as e:
        raise _error(path, f"{e.strerror or e}") from e
    return _checked_regular(fd, path)


def _checked_regular(fd: int, path: Path) -> tuple[int, FileIdentity]:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _error(path, f"not a regular file ({_kind(st.st_mode)}); only regular safetensors files are read")
    return fd, FileIdentity.of(st)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def _read_exact(fd: int, out: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise _error(path, f"the file ended after {offset + done} bytes while {offset + len(out)} were "
                               "expected (truncated while it was read?)")
        done += n


def _read_header(path: Path, root: Path | None = None) -> tuple[dict[str, IndexEntry], bytes]:
    fd, identity = _open_regular(path, root)
    try:
        if identity.size < 8:
            raise _error(path, f"{identity.size} bytes, shorter than a safetensors header")
        raw = bytearray(8)
        _read_exact(fd, memoryview(raw), 0, path)
        (length,) = struct.unpack("<Q", raw)
        if length > HEADER_LIMIT or 8 + length > identity.size:
            raise _error(path, f"header length {length} exceeds the file ({identity.size} bytes): truncated or not "
                               "a safetensors file")
        buf = bytearray(length)
        _read_exact(fd, memoryview(buf), 8, path)
        text = bytes(buf)
        del buf
        data_start, data_size = 8 + length, identity.size - 8 - length
        parsed = checked_header(text, data_size, path, data_start)  # its layout too: end to end over the data
        entries = {name: IndexEntry(path, shape, dtype, data_start + begin, end - begin, identity)
                   for name, shape, dtype, begin, end in parsed}
        return entries, text
    finally:
        os.close(fd)


def check_paths(paths: object) -> None:
    """A checkpoint path, or a sequence of them (str or os.PathLike); anything else is a TypeError naming it (an
    empty sequence passes here: `checkpoint_files` refuses it as a `CheckpointError`)."""
    ok = (str, PathLike)
    if isinstance(paths, ok) or (isinstance(paths, Sequence) and not isinstance(paths, (bytes, bytearray))
                                  and all(isinstance(p, ok) for p in paths)):
        return
    raise TypeError(f"checkpoint paths must be a str or os.PathLike, or a sequence of them; got "
                    f"{type(paths).__name__} {paths!r:.80}")


def checkpoint_files(paths: str | Path | Sequence[str | Path], *, root: Path | None = None) -> list[Path]:
    """The files a checkpoint argument names: a file, a folder (its `*.safetensors`, sorted), or a list of
    either; a file named twice is read once. An empty folder or list is a `CheckpointError`; a path of another
    type (bytes, None, ...) a `TypeError` naming it. With a `root` (absolute, resolved): the files' resolved
    paths, each beneath it (`confined.confined_files`)."""
    check_paths(paths)
    given = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not given:
        raise CheckpointError("no checkpoint file given", backbone=None)
    files: list[Path] = []
    for p in map(Path, given):
        if root is not None:
            files.extend(confined_files(p, root))
        elif p.is_dir():
            found = sorted(p.glob("*.safetensors"))
            if not found:
                raise _error(p, "the folder holds no *.safetensors file")
            files.extend(found)
        else:
            files.append(p)
    return list({f.resolve(): f for f in reversed(files)}.values())[::-1]  # first mention kept, in order


def checkpoint_index(paths: str | Path | Sequence[str | Path], *, root: Path | None = None) -> CheckpointIndex:
    """Name -> (file, shape, dtype, byte range) from the headers alone; no tensor data is read. Refused
    (`CheckpointError` naming the file): a path that is missing or not a regular file, a header that is
    corrupt, a dtype not supported, a byte range past the end of the file, a tensor in two files. `root`: every
    file confined beneath that folder (absolute, resolved; see the module doc), for its header and its data."""
    index = CheckpointIndex()
    index.root = root
    headers = []
    for p in checkpoint_files(paths, root=root):
        entries, header = _read_header(p, root)
        headers.append(header)
        for name, entry in entries.items():
            if name in index:
                raise CheckpointError(f"tensor {name} is in two checkpoint files, {index[name].path} and {p}; "
                                      "a checkpoint must hold each tensor once", backbone=None)
            index[name] = entry
    index.headers = tuple(headers)
    return index


class _OpenFile:
    def __init__(self, path: Path, expected: FileIdentity | None, root: Path | None = None) -> None:
        self.path = path
        self.root = root
        self.fd, self.identity = _open_regular(path, root)
        self.expected = expected or self.identity
        e, i = self.expected, self.identity
        self._fields = (e.size, e.mtime_ns, e.inode, e.device, e.ctime_ns)  # `check`'s compare, in stat's order
        # the descriptor's own file first: by the time the path is looked at it may name another one again
        if (i.size, i.mtime_ns, i.inode, i.device, i.ctime_ns) != self._fields:
            self._changed("opened for reading", self._path_stat())
        self.check("opened for reading")

    def _path_stat(self) -> os.stat_result | OSError:
        try:
            # beneath a root the path is resolved: a link there now is a change (and is not followed)
            return os.lstat(self.path) if self.root is not None else os.stat(self.path)
        except OSError as e:
            return e

    def check(self, when: str) -> None:
        """The file is still the one indexed: rewritten in place, replaced or removed is a change. Asked after
        every bucket of every read, so it is one stat of the path: while the path names the descriptor's file
        (its inode and device, checked on the descriptor when it was opened), that stat is the file's, its size
        and times included; the descriptor is asked only to describe a change."""
        st = self._path_stat()
        if not isinstance(st, OSError) and not stat.S_ISLNK(st.st_mode) \
                and (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns) == self._fields:
            return
        self._changed(when, st)

    def _changed(self, when: str, st: os.stat_result | OSError) -> None:
        expected = self.expected
        changes = expected.changes(FileIdentity.of(os.fstat(self.fd)))  # the descriptor's file: rewritten in place
        if isinstance(st, OSError):
            changes.append(f"the path is gone ({st.strerror or st})")
        elif stat.S_ISLNK(st.st_mode):
            changes.append("the path is a symbolic link now")
        elif (st.st_ino, st.st_dev) != (expected.inode, expected.device):
            # beneath a root the new file may lie outside it (a folder above swapped): say nothing of it
            shown = "" if self.root is not None else f" -> {st.st_ino}"
            changes.append(f"the path now names another file (inode {expected.inode}{shown})")
        if changes:
            raise CheckpointError(f"checkpoint {self.path} changed since its header was read ({when}): "
                                  f"{'; '.join(changes)}. Nothing read from it after the change was used; "
                                  "write the next checkpoint to a new path", backbone=None)


def iter_buckets(index: dict[str, IndexEntry], buckets: Sequence[Sequence[str]], *, reuse: bool = False,
                 into: Callable[[int], Region | torch.Tensor | None] | None = None
                 ) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
    """Stream the buckets from disk: only one bucket's tensors are in memory at a time. Each file is opened
    once, when a bucket first needs it; it must be the file the index describes, and it is checked again
    after each bucket's reads, before the bucket is handed out (see the module docstring).

    `reuse=True`: every bucket is read into one buffer (the size of the largest bucket so far), and its tensors
    are views of it, valid until the next bucket is asked for: for a reader that copies each value before it
    asks (the loader's `write_tensor`). Why: a fresh tensor per value is freed with its bucket, and depending on
    what else sits in the heap the allocator gives those pages back to the system and faults them in again for
    the next bucket, page by page: a real-size draft (1.5 GB bf16) reloaded in 820 ms, 300 ms with reuse.

    `into`: the caller's own buffers: asked for each bucket's bytes (the values `ALIGN`-byte aligned), it answers
    a `Region` of a reused buffer (`ReadBuffer`; the vLLM plugin's staging, which keeps the bytes a caller still
    holds: `lifecycle.vllm.reload.staging`) or a uint8 tensor of at least that many bytes to read the bucket into
    (its tensors are views of it), or None for fresh tensors. Values read into a `Region` are made one tensor
    each (`read_buffers.MappedBuffer`)."""
    files: dict[Path, _OpenFile] = {}
    root = getattr(index, "root", None)
    staging: torch.Tensor | None = None
    own: MappedBuffer | None = None  # reuse=True: this reader's own buffer
    try:
        for bucket in buckets:
            out = []
            used: dict[Path, _OpenFile] = {}
            entries = [index[name] for name in bucket]
            region: Region | None = None
            if into is not None:
                got = into(sum(_padded(e.nbytes) for e in entries))
                if isinstance(got, Region):
                    staging, region = None, got
                else:
                    staging = got  # a tensor, or None: fresh tensors
                del got  # not held while the next bucket asks: the caller may replace its buffer then
            elif reuse:
                need = sum(_padded(e.nbytes) for e in entries)
                if own is None or len(own) < need:
                    own = None  # the smaller buffer goes first: the peak stays one bucket
                    own = MappedBuffer(torch.empty(need, dtype=torch.uint8))
                region = Region(own, 0)
            offset = 0
            for name, entry in zip(bucket, entries, strict=True):
                f = files.get(entry.path)
                if f is None:
                    f = files[entry.path] = _OpenFile(entry.path, entry.identity, root)
                used[entry.path] = f
                if region is not None:
                    out.append((name, _read_tensor(f, entry, region=region, offset=offset)))
                    offset += _padded(entry.nbytes)
                elif staging is None:
                    out.append((name, _read_tensor(f, entry)))
                else:
                    out.append((name, _read_tensor(f, entry, staging[offset:offset + entry.nbytes])))
                    offset += _padded(entry.nbytes)
            region = None
            for f in used.values():
                f.check(f"after reading {len(bucket)} tensor(s)")
            yield out
    finally:
        for f in files.values():
            os.close(f.fd)


def _read_tensor(f: _OpenFile, entry: IndexEntry, into: torch.Tensor | None = None, *, region: Region | None = None,
                 offset: int = 0) -> torch.Tensor:
    """`entry`'s value: read into a fresh tensor, into `into` (a uint8 tensor of its size), or into `region` at
    `offset` bytes past the region's start (one tensor made: `MappedBuffer.value`)."""
    if region is not None:
        at = region.offset + offset
        if entry.nbytes:
            _read_exact(f.fd, region.buffer.bytes[at:at + entry.nbytes], entry.start, f.path)
        return region.buffer.value(entry.dtype, entry.shape, at)
    # the only allocation: the tensor's own bytes (or none: `into`, a slice of the caller's buffer)
    raw = torch.empty(entry.nbytes, dtype=torch.uint8) if into is None else into
    if entry.nbytes:
        # (numpy's stubs give ndarray `__buffer__` only where typing has it, Python >= 3.12)
        _read_exact(f.fd, memoryview(raw.numpy()), entry.start, f.path)  # type: ignore[arg-type]  # numpy's stubs
    return raw.view(entry.dtype).reshape(entry.shape)


def write_checkpoint(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
                     ) -> Path:
    """Save `tensors` as one safetensors file (contiguous CPU copies). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: _own_storage(v.detach().to("cpu").contiguous()) for k, v in tensors.items()}, str(path),
              metadata=metadata)
    return path


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy when it is a view of a larger storage (the weights of a backed derived buffer share it, and
    safetensors refuses tensors that share memory)."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()
