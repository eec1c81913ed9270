"""The runner of the engine scenarios (`support.vllm_runs.run_script`): a scenario's leftover processes cannot make
a test wait (CI waited 15 minutes on a Ray cluster a scenario left behind), and a scenario that hangs fails naming
where its threads stood."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.vllm_runs import run_script


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and waiting for its new parent to reap it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_grandchild_holding_the_output_neither_blocks_the_test_nor_outlives_it(tmp_path: Path) -> None:
    started = time.monotonic()
    assert run_script("runner_probe", "orphan", tmp_path, timeout=120) == {"scenario": "orphan"}
    assert time.monotonic() - started < 60  # the grandchild sleeps 600 s with the scenario's stdout open
    orphan = int((tmp_path / "orphan.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(orphan)


def test_a_scenario_that_does_not_end_fails_with_its_threads_stacks(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as failed:
        run_script("runner_probe", "hang", tmp_path, timeout=5)
    message = str(failed.value)
    assert "runner_probe hang" in message and "still ran after 5 s" in message
    assert "Current thread" in message and "runner_probe.py" in message  # faulthandler's dump of main()
