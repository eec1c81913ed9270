"""The trainer's `weight_version` in the audit (issue 26 item 5): a push's `weight_version` event (written by
`lifecycle.vllm.online.sessions.note_weight_version` in the draft's epoch) groups the epochs in `reload-lifecycle audit`
(text and JSON) and in the report. Real lifecycles write the log; the event is the one the vLLM session wrapper
emits, through the same `audit_event` call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifecycle.audit.replay import audit_logs
from lifecycle.cli import main
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.scenarios import logging_to


@pytest.fixture
def versioned_log(tmp_path: Path) -> Path:
    """Cold load (no version), then pushes under v-1, v-2, v-2 again (a retry), v-3."""
    cfg = DFlashConfig(num_hidden_layers=2)
    a = write_checkpoint(random_weights(cfg, 0), tmp_path / "a.safetensors")
    b = write_checkpoint(random_weights(cfg, 1), tmp_path / "b.safetensors")
    log = tmp_path / "audit.jsonl"
    with logging_to(log):
        m = DFlashQwen3Draft(cfg, name="draft")
        cold_load(m, a, capture_graphs=True)
        for version, ckpt in (("v-1", b), ("v-2", a), ("v-2", b), ("v-3", a)):
            m.begin_reload()
            m.lifecycle.audit_event("weight_version", weight_version=version)
            load_safetensors(m, ckpt)
            m.finalize_loading()
            m.refresh_derived_buffers()
    return log


def test_audit_groups_the_epochs_by_the_trainers_weight_version(versioned_log: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    result = audit_logs([versioned_log])
    assert result.status == 0  # the event is read, not a problem
    (stream,) = result.streams
    assert stream.versions == {"v-1": [1], "v-2": [2, 3], "v-3": [4]}
    assert main(["audit", str(versioned_log), "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)["streams"]
    assert summary["weight_versions"] == [{"weight_version": "v-1", "epochs": [1]},
                                          {"weight_version": "v-2", "epochs": [2, 3]},
                                          {"weight_version": "v-3", "epochs": [4]}]
    assert main(["audit", str(versioned_log)]) == 0
    text = capsys.readouterr().out
    assert "epochs by the trainer's weight_version" in text
    assert [[c.strip() for c in line.split("|")[2:]] for line in text.splitlines()
            if "| draft" in line and "v-" in line] == [["v-1", "1"], ["v-2", "2, 3"], ["v-3", "4"]]


def test_the_report_shows_each_epochs_weight_version_and_groups_them(versioned_log: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert main(["report", str(versioned_log), "-o", str(out)]) == 0
    page = out.read_text()
    assert page.count('class="weight-version"') == 4  # one caption per versioned epoch; the cold load has none
    assert '<tr><td><code>v-2</code></td><td>2, 3</td></tr>' in page


def test_a_weight_version_event_of_the_wrong_shape_is_an_input_problem(versioned_log: Path) -> None:
    lines = versioned_log.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if '"weight_version"' in line)
    event = json.loads(lines[i])
    event["weight_version"] = 7
    lines[i] = json.dumps(event)
    versioned_log.write_text("\n".join(lines) + "\n")
    result = audit_logs([versioned_log])
    assert result.status == 2 and "field 'weight_version'" in result.input_problems[0].message
