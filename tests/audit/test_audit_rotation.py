"""Audit files rotated by size, and the auditor reading a rotated set (lifecycle/event_sink.py, lifecycle/audit/
rotation.py; issue 32, item 12: the audit grew 4.9 KB per push with no rotation, about 7 MB a day at a push a
minute).

A real lifecycle's log written through a sink that rotates every 16 KiB: the set (`x.jsonl.1`, `.2`, ..., then
`x.jsonl`) audits clean as one writer's input, in whatever order it is given, each file within its size; a file
removed from the middle or the start of the set is an input problem naming it (exit 2), not a clean audit.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from lifecycle.audit.replay import audit_logs
from lifecycle.cli import main
from lifecycle.events import configure_audit
from lifecycle.loading import write_checkpoint
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.scenarios import bucketed_reload

MAX = 16 * 1024
RELOADS = 16


@pytest.fixture(scope="module")
def rotated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rotated")
    cfg = DFlashConfig(num_hidden_layers=3)
    a = write_checkpoint(random_weights(cfg, 0), root / "a.safetensors")
    b = write_checkpoint(random_weights(cfg, 1), root / "b.safetensors")
    logs = root / "logs"
    sink = configure_audit(json_path=logs / "audit-h-1.jsonl", console=False, max_bytes=MAX)
    try:
        m = DFlashQwen3Draft(cfg, name="draft", rank=0)
        cold_load(m, a)
        for k in range(RELOADS):
            bucketed_reload(m, b if k % 2 == 0 else a, seed=k)
        assert sink is not None and sink.rotations >= 3
    finally:
        configure_audit(console=False)
    return logs


def test_a_rotated_set_is_named_in_order_each_file_within_its_size_and_audits_clean(rotated: Path) -> None:
    files = sorted(rotated.iterdir(), key=lambda f: int(f.suffix[1:]) if f.suffix[1:].isdigit() else 1 << 30)
    names = [f.name for f in files]
    assert names == [*(f"audit-h-1.jsonl.{n}" for n in range(1, len(files))), "audit-h-1.jsonl"]
    assert all(f.stat().st_size <= MAX for f in files), [f.stat().st_size for f in files]
    result = audit_logs([rotated])
    assert result.status == 0, ([str(v) for v in result.violations], [p.message for p in result.input_problems])
    assert main(["audit", str(rotated)]) == 0
    shuffled = [str(f) for f in files]
    random.Random(0).shuffle(shuffled)
    assert audit_logs(shuffled).status == 0  # the files given in any order: read as the set, oldest first


@pytest.mark.parametrize("which", ["middle", "first"])
def test_a_file_missing_from_the_set_is_an_input_problem_naming_it(rotated: Path, tmp_path: Path, which: str
                                                                  ) -> None:
    copy = tmp_path / "logs"
    shutil.copytree(rotated, copy)
    gone = copy / f"audit-h-1.jsonl.{2 if which == 'middle' else 1}"
    gone.unlink()
    result = audit_logs([copy])
    assert result.status == 2
    named = [p for p in result.input_problems if p.source == str(gone)]
    assert named and "missing from the rotated set" in named[0].message, [p.message for p in result.input_problems]
    # the stream goes on in the next file: one writer, a gap (what the file held), never "two writers"
    assert not any("two writers" in p.message for p in result.input_problems)
    assert main(["audit", str(copy)]) == 2


def test_a_sink_without_a_limit_never_rotates_and_a_bad_limit_is_refused(tmp_path: Path) -> None:
    sink = configure_audit(json_path=tmp_path / "a.jsonl", console=False)
    try:
        assert sink is not None and sink.max_bytes is None
        with pytest.raises(ValueError, match="max_bytes must be a positive int or None"):
            configure_audit(json_path=tmp_path / "b.jsonl", console=False, max_bytes=0)
    finally:
        configure_audit(console=False)
