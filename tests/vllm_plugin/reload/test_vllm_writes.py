"""Writes that reach a draft without vLLM's reload entry points (issue 31 item 3): verl-speco's own draft update
(the inner model's `load_weights`, then `_build_fused_kv_buffers()` by hand), a partial one, the builder by hand on
a usable and a quarantined draft, and a weight loader called directly, with vLLM's own DFlash classes on both
weight layouts. Before the epoch boundary enclosed these writes, the new weights landed, the lifecycle stayed at
epoch 0 and the engine served derived buffers older than its weights with a CLEAN audit.

The checks run beside the actions in the scenario's own process (`support/vllm_writes_runs.py`); a failure shows
the line and the message of the first check that failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.needs import needs
from support.vllm_runs import PYTHONPATH, ROOT
from support.vllm_writes_runs import RESULT


@needs("vllm", "slow")
def _run(layout: str, work: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "support.vllm_writes_runs", layout, str(work)], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line.removeprefix(RESULT)))
    raise AssertionError(f"the scenario printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_writes_outside_vllms_entry_points_never_leave_a_usable_stale_draft(layout: str, tmp_path: Path) -> None:
    result = _run(layout, tmp_path)
    assert result["ok"], f"{result['failed']}\n{result.get('trace', '')}"
    assert len(result["done"]) == 8, result["done"]  # every step ran
