"""Running the vLLM scenarios (`tests/vllm_scenarios.py`) from the tests: each in its own process, its JSON result
returned. The session fixture `vllm_work` makes every checkpoint and runs the in-process families once; the engine
tests reuse its folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "tests" / "vllm_scenarios.py"

__all__ = ["ROOT", "run_scenario", "vllm_work"]


def run_scenario(name: str, work: Path, *args: str, timeout: int = 900, **env: str) -> dict[str, Any]:
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))}
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, str(work), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("SCENARIO_RESULT "):
            return json.loads(line.removeprefix("SCENARIO_RESULT "))
    raise AssertionError(f"scenario {name} printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="session")
def vllm_work(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """(folder with the target and every family's drafts A and B, the in-process scenario's result)."""
    work = tmp_path_factory.mktemp("vllm")
    return work, run_scenario("inprocess", work)
