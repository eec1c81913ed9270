"""Views of an `AuditResult`: a readable summary for people, JSON for machines.

The text view prints values read from logs (names, file names, details): each goes through `text.printable`,
so a control character in a log can neither fake a line nor restyle the terminal, and each cell is cut at
`CELL_CAP` characters.

>>> from lifecycle.audit.replay import Auditor
>>> print(render_text(Auditor().finish()).splitlines()[-1])
RESULT: CLEAN (0 events audited; exit status 0)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .results import AuditResult
from .rules import VIOLATION_KINDS
from .text import clip, printable

__all__ = ["CELL_CAP", "JSON_FORMAT", "as_json", "cell_text", "render_json", "render_text", "result_line", "table"]

#: The JSON view's own format version.
JSON_FORMAT = 1
#: Characters of one table cell at most (a detail, a name from a log).
CELL_CAP = 400


def cell_text(value: Any) -> str:
    """One value of the text view: cut at `CELL_CAP` characters, control characters escaped."""
    return printable(clip(value, CELL_CAP))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, cell: Callable[[Any], str] = cell_text) -> str:
    """A plain-text table: the headers, a rule, a line per row, each column as wide as its widest cell, no
    trailing blanks. `cell` writes one value (default `cell_text`). The project's one text-table helper.

    >>> print(table(["kind", "count"], [["not_ready", 2], ["epoch_jump", 10]]))
    kind       | count
    -----------+------
    not_ready  | 2
    epoch_jump | 10
    """
    cells = [list(headers), *[[cell(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers).rstrip(), "-+-".join("-" * w for w in widths)]
    lines += [fmt.format(*r).rstrip() for r in cells[1:]]
    return "\n".join(lines)


def result_line(result: AuditResult) -> str:
    n = result.total_violations
    if result.input_problem_count:
        what = f"UNREADABLE INPUT ({result.input_problem_count} problem(s)" + (f"; {n} violation(s))" if n else ")")
    elif n:
        what = f"{n} VIOLATION(S)"
    else:
        what = "CLEAN"
    return f"RESULT: {what} ({result.events} events audited; exit status {result.status})"


def render_text(result: AuditResult, *, show: int = 100) -> str:
    out = [f"reload-lifecycle audit: {len(result.inputs)} input(s), {result.events} events, "
           f"{len(result.streams)} stream(s) (rank, backbone)"]
    if result.streams:
        rows = [[r.rank, r.backbone, r.events, r.incarnations, r.epochs_begun, r.epoch, r.state.value,
                 "yes" if r.pinned else "no", sum(r.violations.values())] for r in result.streams]
        out += ["", table(["rank", "backbone", "events", "lifecycles", "reloads", "final epoch", "final state",
                           "pinned", "violations"], rows)]
    if result.input_problem_count:
        out += ["", f"unreadable input ({result.input_problem_count}; exit status 2, the rest was audited):"]
        out += [f"  {cell_text(p.where)}: {cell_text(p.message)}" for p in result.input_problems[:show]]
        if result.input_problem_count > min(show, len(result.input_problems)):
            out.append(f"  ... {result.input_problem_count - min(show, len(result.input_problems))} more")
    if result.total_violations:
        counts = sorted(result.violation_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        out += ["", f"violations ({result.total_violations}):",
                table(["kind", "count", "meaning"], [[k, n, VIOLATION_KINDS.get(k, "")] for k, n in counts])]
        shown = result.violations[:show]
        out += ["", table(["where", "rank", "backbone", "epoch", "kind", "detail"],
                          [[v.where, v.rank, v.backbone, v.epoch, v.kind, v.detail] for v in shown])]
        if result.total_violations > len(shown):
            out.append(f"(first {len(shown)} of {result.total_violations} shown)")
    out += ["", result_line(result)]
    return "\n".join(out)


def as_json(result: AuditResult) -> dict[str, Any]:
    return {
        "format": JSON_FORMAT,
        "status": result.status,
        "inputs": result.inputs,
        "events": result.events,
        "streams": [r.summary() for r in result.streams],
        "violation_counts": dict(result.violation_counts),
        "violations": [v.as_dict() for v in result.violations],
        "violations_truncated": result.total_violations - len(result.violations),
        "input_problems": [{"where": p.where, "source": p.source, "line": p.line, "message": p.message}
                           for p in result.input_problems],
        "input_problem_count": result.input_problem_count,
        "kinds": VIOLATION_KINDS,
    }


def render_json(result: AuditResult) -> str:
    return json.dumps(as_json(result), indent=2)
