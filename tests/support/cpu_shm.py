"""vLLM's CPU tensor-parallel buffers in /dev/shm, for the scenarios that start a TP=2 engine.

vLLM's CPU communicator creates one buffer per rank, named `<ident>-<group>-[<ranks>]-cpushm_<rank>`, with O_EXCL.
Under Ray `<ident>` is a TCP port the OS picked, and Ray kills its workers without unlinking their buffers: a buffer
left by an earlier run whose port the OS hands out again makes a later engine's start fail ("create shm in
SHMManager failed. errno: 17"). A scenario that starts such an engine runs inside `buffers_removed()`: it removes
the buffers no live process holds that are older than a few minutes first (a killed run's), and its own when it ends.
Its own include the message queues vLLM's executor shares with the Ray workers (Python shared memory, `psm_<hex>`,
up to 240 MiB each), which a killed worker leaves too; only those the block created, as other programs use the name.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

SHM = Path("/dev/shm")
CPU_TP_BUFFER = re.compile(r"-cpushm_\d+$")
SHARED_MEMORY = re.compile(r"^psm_[0-9a-f]+$")  # multiprocessing.shared_memory's names: vLLM's message queues
STALE_AFTER_S = 300.0  # older than any engine start: a buffer no process holds for that long is a killed run's


def buffers(pattern: re.Pattern[str] = CPU_TP_BUFFER) -> set[str]:
    """The /dev/shm entries named like `pattern` now (vLLM's CPU tensor-parallel buffers by default)."""
    try:
        return {n for n in os.listdir(SHM) if pattern.search(n)}
    except OSError:
        return set()


def held(pids: Iterable[int] | None = None) -> set[str]:
    """The /dev/shm entries that a live process maps or holds open: one of `pids`, or any this user can read."""
    procs = [Path(f"/proc/{pid}") for pid in pids] if pids is not None else \
        [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    out: set[str] = set()
    for proc in procs:
        with contextlib.suppress(OSError):
            out |= {line.split(None, 5)[5].removesuffix(" (deleted)") for line in
                    (proc / "maps").read_text().splitlines() if "/dev/shm/" in line}
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    out.add(os.readlink(fd))
    return {h.removeprefix(f"{SHM}/") for h in out if h.startswith(f"{SHM}/")}


def _age_s(name: str) -> float:
    try:
        return time.time() - (SHM / name).stat().st_mtime
    except OSError:
        return 0.0


def remove_unheld(names: set[str]) -> set[str]:
    """Unlink those of `names` that no live process holds; returns them (gone already counts as removed)."""
    removed = set()
    for name in names - held():
        (SHM / name).unlink(missing_ok=True)
        removed.add(name)
    return removed


def remove_stale() -> set[str]:
    """Unlink the buffers no live process holds that are older than STALE_AFTER_S (a killed run's)."""
    return remove_unheld({n for n in buffers() if _age_s(n) > STALE_AFTER_S})


@contextlib.contextmanager
def buffers_removed(wait_s: float = 20.0) -> Iterator[None]:
    """Remove stale buffers, run the block, then remove the buffers it created once no process holds them (its
    engine's workers may take a moment to exit after the block shut them down)."""
    remove_stale()
    before = buffers() | buffers(SHARED_MEMORY)
    try:
        yield
    finally:
        mine = (buffers() | buffers(SHARED_MEMORY)) - before
        deadline = time.monotonic() + wait_s
        while mine:
            mine -= remove_unheld(mine)
            if not mine or time.monotonic() > deadline:
                break
            time.sleep(0.5)
