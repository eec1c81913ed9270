"""The offline audit tooling (`lifecycle.audit`) stands apart from the core: it reads the transition table
(`lifecycle.states`) and nothing else of the framework, and never imports torch, so that auditing a log or
drawing a report needs neither.

The first check runs in a fresh interpreter in which `lifecycle` is a bare namespace over the package folder and
any attempt to import torch raises; the second runs the console script's `main` itself (`import lifecycle` loads
its names on first use, so it imports nothing heavy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Every module of the audit package: each is imported by the probe (a new module is checked without a list to edit).
AUDIT_MODULES = tuple(sorted(p.stem for p in (ROOT / "lifecycle" / "audit").glob("*.py") if p.stem != "__init__"))


def test_the_probe_imports_every_audit_module() -> None:
    assert {"replay", "views", "report", "panels", "diagram", "svg", "logstream"} <= set(AUDIT_MODULES)

PROBE = r"""
import importlib, importlib.abc, json, sys, types
from pathlib import Path

attempts = []

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            attempts.append(name)
            raise ImportError(f"the audit tooling imported {name}")
        return None

sys.meta_path.insert(0, NoTorch())
root, logs, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
package = types.ModuleType("lifecycle")
package.__path__ = [str(root / "lifecycle")]
sys.modules["lifecycle"] = package
before = set(sys.modules)
for name in json.loads(sys.argv[4]):
    importlib.import_module(f"lifecycle.audit.{name}")

# and run every path the audit, report and diagram commands take, for imports done inside functions
from lifecycle.audit import diagram, replay, report, views
result = replay.audit_logs([logs])
views.render_text(result), views.render_json(result)
report.write_report([logs], out)
diagram.render("mermaid"), diagram.render("dot")
print(json.dumps({"status": result.status, "attempts": attempts, "report": out.stat().st_size,
                  "loaded": sorted(set(sys.modules) - before)}))
"""


def test_the_audit_tooling_imports_no_torch_and_no_core_module_but_the_table(real_logs: Path, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), str(real_logs), str(tmp_path / "r.html"),
                          json.dumps(AUDIT_MODULES)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    probe = json.loads(run.stdout)
    assert probe["status"] == 0 and probe["report"] > 100_000  # it really audited the logs and wrote the report
    assert probe["attempts"] == []
    loaded = set(probe["loaded"])
    assert "torch" not in loaded
    ours = {m for m in loaded if m.partition(".")[0] == "lifecycle"}
    assert {m for m in ours if not m.startswith("lifecycle.audit")} == {"lifecycle.states"}
    assert {f"lifecycle.audit.{name}" for name in AUDIT_MODULES} <= ours
    third_party = {m.partition(".")[0] for m in loaded} - set(sys.stdlib_module_names) - {"lifecycle"}
    # transitions (and its helper) draw the mermaid diagram; MarkupSafe escapes the report's HTML
    assert third_party <= {"transitions", "six", "markupsafe"}, third_party


CLI_PROBE = r"""
import importlib.abc, json, sys

attempts = []

class NoHeavyImports(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy", "safetensors", "structlog"):
            attempts.append(name)
            raise ImportError(f"the CLI imported {name}")
        return None

sys.meta_path.insert(0, NoHeavyImports())
from lifecycle.cli import main

status = main(json.loads(sys.argv[1]))
print(json.dumps({"status": status, "attempts": attempts,
                  "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "lifecycle"))}))
"""


@pytest.mark.parametrize("command", ["audit", "audit --json", "report", "diagram", "diagram --format dot"])
def test_the_cli_audit_report_and_diagram_never_import_torch(command: str, real_logs: Path, tmp_path: Path) -> None:
    """`import lifecycle` is light (its names load on first use), so the console script's offline commands run
    on a machine without torch: the real `main`, on real logs, with torch (and the core's other libraries)
    made unimportable."""
    argv = command.split()
    if argv[0] in ("audit", "report"):
        argv.insert(1, str(real_logs))
    if argv[0] == "report":
        argv += ["-o", str(tmp_path / "r.html")]
    run = subprocess.run([sys.executable, "-c", CLI_PROBE, json.dumps(argv)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["status"] == 0 and probe["attempts"] == []
    assert not [m for m in probe["loaded"] if m.partition(".")[0] == "torch"]
    assert {m for m in probe["loaded"] if m.startswith("lifecycle.")} <= {
        "lifecycle.cli", "lifecycle.states", *(m for m in probe["loaded"] if m.startswith("lifecycle.audit"))}
    if argv[0] == "report":
        assert (tmp_path / "r.html").stat().st_size > 100_000
