"""Stored benchmark results cannot go stale unseen (issue 33 item 5): every result in benchmarks/results/ records the
commit it was measured on, its measured path (the modules a change of which can change its figures), the machine's
load, and the summary rows docs/generate.py renders; a result measured on a commit that is not an ancestor of the
checkout (another branch, a rewritten history) fails here, so its figures cannot pass for this code's.

The history is read with git. CI clones the repository fully (`.ci/run` runs in a clean, full clone), so every
commit a result names is there; in a shallow clone a commit beyond its boundary cannot be judged and the check says
so and skips (`git rev-parse --is-shallow-repository`), as it would for hardware that is absent.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def git(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=60, check=False)


def ancestry(commit: str, cwd: Path = ROOT) -> str:
    """"ancestor", "not an ancestor", or "unknown" (the history does not hold the commit)."""
    if git("cat-file", "-e", f"{commit}^{{commit}}", cwd=cwd).returncode != 0:
        return "unknown"
    return "ancestor" if git("merge-base", "--is-ancestor", commit, "HEAD", cwd=cwd).returncode == 0 \
        else "not an ancestor"


def shallow(cwd: Path = ROOT) -> bool:
    return git("rev-parse", "--is-shallow-repository", cwd=cwd).stdout.strip() == "true"


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_every_stored_result_records_its_commit_measured_path_load_and_summary(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    measured = data["measured_on"]
    assert re.fullmatch(r"[0-9a-f]{40}", measured["commit"] or ""), f"{path.name}: no commit recorded"
    assert measured["path"] and all(isinstance(p, str) for p in measured["path"]), path.name
    assert isinstance(measured["uncommitted"], list), path.name
    machine = data["machine"]
    assert machine.get("loadavg_start") and "busy" in machine, f"{path.name}: the machine's load is not recorded"
    summary = data["summary"]
    assert summary["tables"] or summary["notes"], f"{path.name}: nothing to show"
    for table in summary["tables"]:
        assert all(len(row) == len(table["columns"]) and all(isinstance(c, str) for c in row)
                   for row in table["rows"]), (path.name, table["columns"])
    assert all(t.keys() == {"what", "figure", "met"} for t in summary["targets"]), path.name


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_every_stored_result_was_measured_on_an_ancestor_of_this_checkout(path: Path) -> None:
    commit = json.loads(path.read_text(encoding="utf-8"))["measured_on"]["commit"]
    found = ancestry(commit)
    if found == "unknown" and shallow():
        pytest.skip(f"{path.name}: commit {commit} lies beyond this shallow clone's history (CI clones fully)")
    assert found == "ancestor", (
        f"{path.name} was measured on {commit}, which is {found} of HEAD in this repository: its figures are not "
        "this code's. Measure again on this history (`make bench`, then `python docs/generate.py`)")


def test_the_ancestry_check_tells_a_commit_of_another_branch_and_a_missing_one(tmp_path: Path) -> None:
    def run(*args: str) -> str:
        out = git(*args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    run("init", "-q", "-b", "main")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "base")
    base = run("rev-parse", "HEAD")
    run("checkout", "-q", "-b", "other")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "measured here")
    elsewhere = run("rev-parse", "HEAD")
    run("checkout", "-q", "main")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "head")
    assert ancestry(base, tmp_path) == "ancestor"
    assert ancestry(elsewhere, tmp_path) == "not an ancestor"
    assert ancestry("0" * 40, tmp_path) == "unknown" and not shallow(tmp_path)


def test_the_performance_page_counts_the_changes_to_a_results_measured_path_since_its_commit() -> None:
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    head = git("rev-parse", "HEAD").stdout.strip()
    first = git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0]
    here = {"measured_on": {"commit": head, "path": ["lifecycle"], "uncommitted": []}}
    assert gen.staleness(here) == (head[:10], 0)
    assert gen.staleness({**here, "measured_on": {**here["measured_on"], "uncommitted": ["lifecycle/x.py"]}})[1] == 1
    since_first = int(git("rev-list", "--count", f"{first}..HEAD", "--", "lifecycle").stdout)
    assert since_first > 0
    assert gen.staleness({"measured_on": {"commit": first, "path": ["lifecycle"], "uncommitted": []}}) == (
        first[:10], since_first)
    assert gen.stale_text(1) == "stale by 1 change" and gen.stale_text(None) == "stale by ? changes"
