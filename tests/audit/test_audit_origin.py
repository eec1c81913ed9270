"""Events that arrived over RPC in the audit (issue 32 item 7): a worker writes the acceptance canary's events for the
engine's front process marked `origin: "rpc"` (lifecycle/vllm/observability/rpc_events.py checks them against this
schema first). The auditor lists their warnings as reported over RPC, never in the verdict, and a line that claims
that origin for any other kind, or another origin, is an input problem: no writer of this package makes it. Real
lifecycles write the log; the canary's events go through the same `audit_event` call the worker makes.

Before: `origin` was read by nothing, so a transition marked as coming over RPC was replayed as the lifecycle's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifecycle.audit.schema import RPC_ORIGIN
from lifecycle.cli import main
from lifecycle.loading import write_checkpoint
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.scenarios import logging_to

COLLAPSE = {"period": 3, "draft_tokens": 600, "accepted_tokens": 0, "accepted_share": 0.0, "previous_period": 2,
            "previous_share": 0.8, "push": "epoch 0", "previous_push": "epoch 0", "engine": 0}


@pytest.fixture
def canary_log(tmp_path: Path) -> Path:
    """A cold load, then a collapse the front process reported over RPC, as a worker writes it."""
    cfg = DFlashConfig(num_hidden_layers=2)
    a = write_checkpoint(random_weights(cfg, 0), tmp_path / "a.safetensors")
    log = tmp_path / "audit.jsonl"
    with logging_to(log):
        m = DFlashQwen3Draft(cfg, name="draft")
        cold_load(m, a, capture_graphs=True)
        m.lifecycle.audit_event("acceptance_collapse", level="warning", **COLLAPSE, origin=RPC_ORIGIN)
    return log


def _audit(log: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(["audit", "--json", str(log)])
    return code, json.loads(capsys.readouterr().out)


def test_a_warning_that_arrived_over_rpc_is_listed_as_such_and_the_audit_is_clean(
        canary_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _audit(canary_log, capsys)
    assert code == 0 and doc["warning_counts"] == {"acceptance_collapse": 1} and doc["input_problem_count"] == 0
    (w,) = doc["warnings"]
    assert "(epoch 0)" in w["detail"] and "[over RPC from the engine's front process]" in w["detail"]


@pytest.mark.parametrize("edit", ["transition", "another origin"])
def test_a_line_claiming_the_rpc_origin_for_another_kind_or_another_origin_is_an_input_problem(
        edit: str, canary_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = canary_log.read_text().splitlines()
    if edit == "transition":  # a lifecycle's own kind, as if it came over RPC
        i = next(i for i, x in enumerate(lines) if '"trigger":"capture_graphs"' in x.replace(" ", ""))
        lines[i] = json.dumps({**json.loads(lines[i]), "origin": RPC_ORIGIN})
    else:
        i = next(i for i, x in enumerate(lines) if "acceptance_collapse" in x)
        lines[i] = json.dumps({**json.loads(lines[i]), "origin": "front-process"})
    canary_log.write_text("\n".join(lines) + "\n")
    code, doc = _audit(canary_log, capsys)
    assert code == 2 and doc["input_problem_count"] == 1, doc
    (problem,) = doc["input_problems"]
    assert "field 'origin'" in problem["message"] and "was not written by reload-lifecycle" in problem["message"]
