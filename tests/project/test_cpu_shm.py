"""The test scenarios' sweep of vLLM's CPU tensor-parallel buffers (tests/support/cpu_shm.py): it removes a killed
run's buffer, which would make a later TP=2 engine drawing the same port fail to start, and nothing in use."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import cpu_shm


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        (cpu_shm.SHM / name).unlink(missing_ok=True)


def _buffer(names: list[str], tag: str, age_s: float) -> Path:
    name = f"test{os.getpid()}{tag}-tp:0-[0-1]-cpushm_0"
    names.append(name)
    path = cpu_shm.SHM / name
    path.write_bytes(b"\0" * 64)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_stale_buffer_no_process_holds_is_removed_and_nothing_else(names: list[str]) -> None:
    stale = _buffer(names, "stale", cpu_shm.STALE_AFTER_S + 60)
    young = _buffer(names, "young", 1)
    held = _buffer(names, "held", cpu_shm.STALE_AFTER_S + 60)
    other = cpu_shm.SHM / f"test{os.getpid()}-not-a-tp-buffer"
    names.append(other.name)
    other.write_bytes(b"")
    os.utime(other, (0, 0))
    with held.open("rb"):
        removed = cpu_shm.remove_stale()
        assert held.exists() and held.name not in removed
    assert stale.name in removed and not stale.exists()
    assert young.exists() and other.exists()


def test_the_buffers_a_block_creates_are_removed_when_it_ends(names: list[str]) -> None:
    kept = _buffer(names, "before", 1)  # someone else's, young: not the block's
    kept_queue = _shared_memory(names, "0")
    with cpu_shm.buffers_removed(wait_s=2):
        mine = _buffer(names, "mine", 0)
        my_queue = _shared_memory(names, "1")  # a Ray engine's message queue its killed workers left
        held_queue = _shared_memory(names, "2")
        handle = held_queue.open("rb")
    handle.close()
    assert not mine.exists() and kept.exists()
    assert not my_queue.exists() and kept_queue.exists()
    assert held_queue.exists()  # a live process had it open until the wait ran out


def _shared_memory(names: list[str], tag: str) -> Path:
    name = f"psm_{os.getpid():x}ab{tag}"
    names.append(name)
    path = cpu_shm.SHM / name
    path.write_bytes(b"\0" * 64)
    return path
