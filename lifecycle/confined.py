"""Opening files beneath a folder without following links: what holds `RELOAD_LIFECYCLE_PATH_ROOT`.

A path is checked once, resolved (links inside the root are followed then, so `latest -> step-100` and the
Hugging Face cache's blob links work), and from then on only its resolved form is used: it is opened relative to
a descriptor of the root, and no component of it may be a link when it is opened. A link swapped in after the
check is refused, never followed; `..` cannot occur in a resolved path, and the kernel refuses it anyway.

- `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` where the kernel has it (Linux 5.6;
  Python has no wrapper: `syscall(437, ...)`, one number on every architecture's unified table);
- else a walk, component by component from the root's descriptor: each folder opened `O_PATH | O_NOFOLLOW` and
  refused if it is a link, the last component `O_NOFOLLOW`.

A folder is listed through the descriptor it was opened as (`os.scandir(fd)`), so the listing is of the folder
that was opened. Nothing of a refused file is read: not its bytes, not its size. `confined_files` and
`open_confined` are what `lifecycle.checkpoint` calls with a root: their refusals are `PathConfinementError`s
(a `CheckpointError` and a `PermissionError`) that name the path given and the root, never a link's target.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointError, PathConfinementError

__all__ = ["OPENAT2", "ConfinementRefused", "confined_files", "list_beneath", "open_beneath", "open_confined"]

_SYS_OPENAT2 = 437
_RESOLVE = 0x02 | 0x04 | 0x08  # RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_PATH = getattr(os, "O_PATH", 0)


class ConfinementRefused(OSError):
    """A component of a checked path is a link now, or leads outside the root: refused, nothing read."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _libc_syscall() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):  # 437 is openat2 on Linux only; another kernel's 437 is not
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_syscall = _libc_syscall()


def _openat2(dir_fd: int, rel: str, flags: int) -> int:
    how = _OpenHow(flags | _CLOEXEC, 0, _RESOLVE)
    assert _syscall is not None
    # syscall(2) is variadic and reads each argument as a long: pass them so, not as ctypes' default int
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dir_fd), ctypes.c_char_p(os.fsencode(rel)),
                  ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        if err in (errno.ELOOP, errno.EXDEV):
            raise ConfinementRefused(err, "a component of the path is a link now, or leads outside the root", rel)
        raise OSError(err, os.strerror(err), rel)
    return int(fd)


def _probe() -> bool:
    """Whether openat2 works here (a kernel without it, or a seccomp filter refusing it: ENOSYS, EPERM)."""
    if _syscall is None or not _NOFOLLOW:
        return False
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        os.close(_openat2(fd, ".", os.O_RDONLY | os.O_DIRECTORY))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


#: openat2 is used when True; tests set it False to run the walk.
OPENAT2 = _probe()


def _walk(root_fd: int, parts: list[str], flags: int) -> int:
    cur, opened = root_fd, []
    try:
        for part in parts[:-1]:
            try:
                cur = os.open(part, _PATH | _NOFOLLOW | _CLOEXEC, dir_fd=cur)
            except OSError as e:  # without O_PATH (not Linux) a link here is ELOOP, not a descriptor on the link
                if e.errno == errno.ELOOP:
                    raise ConfinementRefused(e.errno, "a component of the path is a link now", part) from None
                raise
            opened.append(cur)
            mode = os.fstat(cur).st_mode
            if stat.S_ISLNK(mode):
                raise ConfinementRefused(errno.ELOOP, "a component of the path is a link now", part)
            if not stat.S_ISDIR(mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), part)
        try:
            return os.open(parts[-1], flags | _NOFOLLOW | _CLOEXEC, dir_fd=cur)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfinementRefused(e.errno, "the file is a link now", parts[-1]) from None
            raise
    finally:
        for fd in opened:
            os.close(fd)


def open_beneath(root: Path, resolved: Path, flags: int) -> int:
    """Open `resolved` (absolute, links resolved, beneath `root`) with `flags`, following no link on the way:
    `ConfinementRefused` if a component is a link now; the open's own OSError otherwise (missing, ...)."""
    rel = resolved.relative_to(root)  # ValueError when not beneath: the caller checked
    parts = [p for p in rel.parts if p != "."]
    if ".." in parts:
        raise ConfinementRefused(errno.EXDEV, "'..' in a resolved path", str(resolved))
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)  # the root is the operator's: followed
    try:
        if not parts:
            return os.open(".", flags | _CLOEXEC, dir_fd=root_fd)
        return _openat2(root_fd, "/".join(parts), flags) if OPENAT2 else _walk(root_fd, parts, flags)
    finally:
        os.close(root_fd)


def list_beneath(root: Path, folder: Path) -> list[tuple[str, bool]] | None:
    """The entries of `folder` (resolved, beneath `root`) as (name, is a link), listed through a descriptor
    opened beneath the root; None when `folder` is not a folder."""
    fd = open_beneath(root, folder, os.O_RDONLY | os.O_NONBLOCK)  # not O_DIRECTORY: a file answers None
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            return None
        with os.scandir(fd) as entries:
            return [(e.name, e.is_symlink()) for e in entries]
    finally:
        os.close(fd)


def _outside(path: Path, root: Path, what: str) -> PathConfinementError:
    return PathConfinementError(f"cannot read checkpoint {path}: {what} (the allowed root is {root}); nothing of "
                                "it was read", backbone=None)


_NOW_A_LINK = "a component of its path is a symbolic link now (changed after the path was checked?)"


def _unreadable(path: Path, e: OSError) -> CheckpointError:
    return CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}", backbone=None)


def open_confined(path: Path, root: Path, flags: int) -> int:
    """`open_beneath`, its refusals as the loaders' errors: a `PathConfinementError` (saying nothing of the
    file) for a link or a path outside the root, a `CheckpointError` for the open's own failure."""
    try:
        return open_beneath(root, path, flags)
    except ConfinementRefused:
        raise _outside(path, root, _NOW_A_LINK) from None
    except ValueError:
        raise _outside(path, root, "it lies outside the allowed root") from None
    except OSError as e:
        raise _unreadable(path, e) from e


def confined_files(given: Path, root: Path) -> list[Path]:
    """`given` resolved beneath `root` (absolute, resolved): a file, or a folder's `*.safetensors`, sorted,
    listed through the descriptor it was opened as, each link among them resolved and checked too. Refused
    (`PathConfinementError`, saying nothing of the file): anything that resolves outside the root, or a component
    that became a link."""
    resolved = Path(os.path.realpath(given))
    if not resolved.is_relative_to(root):
        raise _outside(given, root, "it resolves outside the allowed root")
    try:
        entries = list_beneath(root, resolved)
    except ConfinementRefused:
        raise _outside(given, root, _NOW_A_LINK) from None
    except OSError as e:
        raise _unreadable(given, e) from e
    if entries is None:
        return [resolved]
    found = []
    for name, is_link in sorted(entries):
        if not fnmatch.fnmatchcase(name, "*.safetensors"):
            continue
        f = resolved / name
        if is_link:  # followed here, once, and checked; opened later by the resolved path, following nothing
            target = Path(os.path.realpath(f))
            if not target.is_relative_to(root):
                raise _outside(f, root, "it is a link leading outside the allowed root")
            f = target
        found.append(f)
    if not found:
        raise CheckpointError(f"cannot read checkpoint {given}: the folder holds no *.safetensors file",
                              backbone=None)
    return found
