"""Running the vLLM scenarios (`tests/support/vllm_scenarios.py`) from the tests: each in its own process, its JSON
result returned. The session fixture `vllm_work` makes every checkpoint and runs the in-process families once (no
engine); the engine tests reuse its folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.needs import needs

ROOT = Path(__file__).resolve().parents[2]
#: what a scenario process needs on its path: the project and `support` (its workers unpickle helpers from it)
PYTHONPATH = os.pathsep.join((str(ROOT), str(ROOT / "tests")))

__all__ = ["PYTHONPATH", "ROOT", "run_inprocess", "run_scenario", "run_script", "vllm_work"]


def run_script(module: str, name: str, work: Path, *args: str, timeout: int = 900, **env: str) -> dict[str, Any]:
    """`python -m support.MODULE NAME WORK ARGS...` with `env` added; the JSON line it prints as SCENARIO_RESULT."""
    full_env = {**os.environ, **env, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run([sys.executable, "-m", f"support.{module}", name, str(work), *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("SCENARIO_RESULT "):
            return json.loads(line.removeprefix("SCENARIO_RESULT "))
    raise AssertionError(f"scenario {module} {name} printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


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
