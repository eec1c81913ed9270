"""What a stored result carries besides its figures, so that it cannot go stale unseen and renders without a
formatter of its own (issue 33 item 5); no torch here (`benchmarks.hostile_logs` runs without it).

- `measured_on(paths)`: the commit the run measured (`git rev-parse HEAD`), the files of its measured path that
  differed from that commit (a run on uncommitted changes counts as stale by one more change than the commits
  since: what it measured was never committed as it was), and the measured path itself: the modules and scripts a
  change of which can change its figures, declared by each benchmark (`MEASURED`, git pathspecs). `docs/generate.py`
  prints, per result, its commit and how many commits changed that path since ("stale by N changes");
  tests/project/test_results.py fails when a stored result's commit is not an ancestor of HEAD.
- `Summary`: the rows the benchmark itself chose to show (tables of text cells, notes, targets met or not), stored in
  the result as `summary`: `docs/generate.py` renders every result from it alone.
- `num`, `pct`, `iqr`: how a figure is written in those rows.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "Summary", "git", "iqr", "measured_on", "num", "pct", "verdict"]

#: Every benchmark's own helpers are on its path too.
SHARED = ("benchmarks/common.py", "benchmarks/stored.py")


def git(*args: str) -> str | None:
    """`git args...` in the repository, its output stripped; None where git or the repository is not there."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.rstrip() if out.returncode == 0 else None  # a status line begins with a space


def measured_on(paths: Sequence[str]) -> dict[str, Any]:
    """The commit this run measures, its measured path (`paths` and the shared helpers) and the files on that path
    that differ from the commit (module doc)."""
    path = [*paths, *(s for s in SHARED if s not in paths)]
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", *path) if commit else None
    uncommitted = sorted(line[3:] for line in (status or "").splitlines() if line.strip())  # "XY path"
    return {"commit": commit, "uncommitted": uncommitted, "path": path}


def warning(provenance: Mapping[str, Any]) -> str | None:
    """What to print when a run measures code that is not a commit (None when it is one)."""
    if provenance["commit"] is None:
        return "measured outside a git checkout: the result records no commit and counts as stale"
    if provenance["uncommitted"]:
        shown = ", ".join(provenance["uncommitted"][:4]) + (" ..." if len(provenance["uncommitted"]) > 4 else "")
        return (f"measured with uncommitted changes on its path ({shown}): the result counts as stale by one "
                "change more than the commits since; commit, then measure again to store a result that is current")
    return None


# ---- the rows a result shows -------------------------------------------------------------------------------------


@dataclass
class Summary:
    """The tables, notes and targets a benchmark shows of its run (module doc)."""

    tables: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None) -> None:
        self.tables.append({"title": title, "columns": list(columns),
                            "rows": [[c if isinstance(c, str) else num(c) for c in row] for row in rows]})

    def note(self, text: str) -> None:
        self.notes.append(text)

    def target(self, what: str, figure: str, met: bool | None) -> None:
        """`met` None: not judged in this run (shown, e.g. a check that needs a GPU)."""
        self.targets.append({"what": what, "figure": figure, "met": met})

    def as_dict(self) -> dict[str, Any]:
        return {"tables": self.tables, "notes": self.notes, "targets": self.targets}


def num(value: object, digits: int = 3) -> str:
    """A measured figure as shown: `digits` significant digits, thousands separated, '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        text = f"{value:,.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"
        return text.replace("e-0", "e-")
    return str(value)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def iqr(spread: Mapping[str, float], fmt: Callable[[float], str] = lambda v: f"{v:.2f}") -> str:
    """A paired ratio's median and interquartile range: `1.05 (1.01..1.09)`."""
    return f"{fmt(spread['median'])} ({fmt(spread['p25'])}..{fmt(spread['p75'])})"


def verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")
