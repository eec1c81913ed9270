"""Running the vLLM scenarios (`tests/support/vllm_scenarios.py`) from the tests: each in its own process, its JSON
result returned. The session fixture `vllm_work` makes every checkpoint and runs the in-process families once (no
engine); the engine tests reuse its folder."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from support.needs import needs

ROOT = Path(__file__).resolve().parents[2]
#: what a scenario process needs on its path: the project and `support` (its workers unpickle helpers from it)
PYTHONPATH = os.pathsep.join((str(ROOT), str(ROOT / "tests")))

__all__ = ["PYTHONPATH", "ROOT", "run_inprocess", "run_scenario", "run_script", "vllm_work"]


def run_script(module: str, name: str, work: Path, *args: str, timeout: int = 900, unset: tuple[str, ...] = (),
               **env: str) -> dict[str, Any]:
    """`python -m support.MODULE NAME WORK ARGS...` with `env` added and `unset` removed; the JSON line it prints as
    SCENARIO_RESULT.

    The scenario runs in its own process group, its output goes to files, and the test waits for that process
    only: a grandchild it leaves behind (Ray's head processes, an engine's workers) holds no pipe the test reads
    until EOF, and is killed with the group when the scenario ends. A scenario still running after `timeout`
    seconds is sent SIGABRT first, so its stderr (PYTHONFAULTHANDLER) shows where every thread waits."""
    full_env = {**os.environ, **env, "PYTHONPATH": PYTHONPATH, "PYTHONFAULTHANDLER": "1"}
    for key in unset:
        full_env.pop(key, None)
    command = [sys.executable, "-m", f"support.{module}", name, str(work), *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=full_env, cwd=ROOT,
                                start_new_session=True)
        hung = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if hung:
        raise AssertionError(f"scenario {module} {name} {' '.join(args)} still ran after {timeout} s (killed); "
                             f"its threads when stopped, and its last output:\n{stderr[-8000:]}\n"
                             f"--- stdout ---\n{stdout[-3000:]}")
    for line in stdout.splitlines():
        if line.startswith("SCENARIO_RESULT "):
            return json.loads(line.removeprefix("SCENARIO_RESULT "))  # type: ignore[no-any-return]
    raise AssertionError(f"scenario {module} {name} printed no result (exit {proc.returncode}):\n{stderr[-4000:]}")


@needs("engine")
def run_scenario(name: str, work: Path, *args: str, timeout: int = 900, **env: str) -> dict[str, Any]:
    """One engine scenario of `support/vllm_scenarios.py` in its own process."""
    return run_script("vllm_scenarios", name, work, *args, timeout=timeout, **env)


@needs("vllm", "slow")
def run_inprocess(work: Path, *args: str) -> dict[str, Any]:
    """The in-process scenario (vLLM's classes and loader, no engine: `support/vllm_inprocess_runs.py`)."""
    return run_script("vllm_scenarios", "inprocess", work, *args)


@pytest.fixture(scope="session")
def vllm_work(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """(folder with the target and every family's drafts A and B, the in-process scenario's result)."""
    work = tmp_path_factory.mktemp("vllm")
    return work, run_inprocess(work)
