"""`reload-lifecycle report` exits with the status it prints (lifecycle/cli.py; issue 25, item 12).

Before: on unreadable input it printed `RESULT: UNREADABLE INPUT (2 problem(s)) (0 events audited; exit status 2)`
and exited 0, so a CI step gating on `report` passed on garbage. Now `report` exits as `audit` does (0 clean,
1 violations, 2 unreadable or incomplete input), after writing the report either way; a report it cannot write is
a usage error (2) as before, said on stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.events import read_events

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("reload-lifecycle")


def report(*args: str) -> tuple[int, str, str]:
    """The installed console script, with this checkout first on the path."""
    proc = subprocess.run([str(SCRIPT), "report", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc.returncode, proc.stdout, proc.stderr


def printed_status(stdout: str) -> int:
    (status,) = re.findall(r"RESULT: .*exit status (\d)\)$", stdout, re.M)
    return int(status)


def test_unreadable_input_exits_2_as_printed(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n{\"also\": \"not an event\"}\n")
    code, out, err = report(str(garbage), "-o", str(tmp_path / "r.html"))
    assert "UNREADABLE INPUT (3 problem(s))" in out and printed_status(out) == 2  # two lines, and no event
    assert code == 2, (code, out, err)  # before: 0
    assert (tmp_path / "r.html").stat().st_size > 1000  # the report is written either way


def test_violations_exit_1_as_printed(real_logs: Path, tmp_path: Path) -> None:
    events = read_events(real_logs / "rank0.jsonl")
    i = next(i for i, e in enumerate(events) if e.get("trigger") == "graphs_verified" and e["epoch"] == 1)
    events[i].update(src="FULLY_LOADED", trigger="capture_graphs")  # a capture the table does not allow there
    log = tmp_path / "rank0.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    code, out, _ = report(str(log), "-o", str(tmp_path / "r.html"))
    assert "VIOLATION(S)" in out and printed_status(out) == 1
    assert code == 1


def test_a_clean_audit_exits_0(real_logs: Path, tmp_path: Path) -> None:
    code, out, _ = report(str(real_logs / "rank0.jsonl"), "-o", str(tmp_path / "r.html"))
    assert "RESULT: CLEAN" in out and printed_status(out) == 0 and code == 0


@pytest.mark.parametrize("where", ["a-folder", "a-file/r.html"])
def test_a_report_that_cannot_be_written_is_a_usage_error(real_logs: Path, tmp_path: Path, where: str) -> None:
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("")
    code, out, err = report(str(real_logs / "rank0.jsonl"), "-o", str(tmp_path / where))
    assert code == 2 and "reload-lifecycle report: error: -o" in err and "RESULT" not in out
