"""Views of an `AuditResult`: a readable summary for people, JSON for machines.

The text view prints values read from logs (names, file names, details): each goes through `text.printable`,
so a control character in a log can neither fake a line nor restyle the terminal, and each cell is cut at
`CELL_CAP` characters.

An audit that saw nothing is not clean:

>>> from lifecycle.audit.replay import Auditor
>>> print(render_text(Auditor().finish()).splitlines()[-1])
RESULT: UNREADABLE INPUT (1 problem(s)) (0 events audited; exit status 2)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .coverage import rank_ranges
from .results import AuditResult, Violation
from .rules import VIOLATION_KINDS, WARNING_KINDS
from .text import clip, printable

__all__ = ["CELL_CAP", "JSON_FORMAT", "as_json", "cell_text", "coverage_line", "render_json", "render_text",
           "result_line", "table"]

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
    warned = f"; {result.total_warnings} warning(s)" if result.total_warnings else ""
    return f"RESULT: {what} ({result.events} events audited{warned}; exit status {result.status})"


def coverage_line(result: AuditResult) -> str:
    """Which ranks and nodes the input covers, and (with expected ranks) which ranks it lacks."""
    ranks = rank_ranges(result.ranks) or "none"
    if result.expected_ranks is not None:
        missing = rank_ranges(result.missing_ranks) or "none"
        ranks += f" (expected {rank_ranges(result.expected_ranks)}; missing: {missing})"
    nodes = ", ".join(result.nodes) or "not named"
    return f"ranks: {ranks}; nodes: {nodes}"


def _findings(title: str, count: int, counts: dict[str, int], kinds: dict[str, str], found: list[Violation],
              show: int) -> list[str]:
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out = ["", f"{title} ({count}):",
           table(["kind", "count", "meaning"], [[k, n, kinds.get(k, "")] for k, n in ordered])]
    shown = found[:show]
    out += ["", table(["where", "rank", "backbone", "epoch", "kind", "detail"],
                      [[v.where, v.rank, v.backbone, v.epoch, v.kind, v.detail] for v in shown])]
    if count > len(shown):
        out.append(f"(first {len(shown)} of {count} shown)")
    return out


def render_text(result: AuditResult, *, show: int = 100) -> str:
    out = [f"reload-lifecycle audit: {len(result.inputs)} input(s), {result.events} events, "
           f"{len(result.streams)} stream(s) (node, rank, backbone)", cell_text(coverage_line(result))]
    if result.streams:
        rows = [[r.rank, ", ".join(r.nodes) or "-", r.backbone, r.events, r.incarnations, r.epochs_begun, r.epoch,
                 r.state.value, "yes" if r.pinned else "no", sum(r.violations.values()), sum(r.warnings.values())]
                for r in result.streams]
        out += ["", table(["rank", "node", "backbone", "events", "lifecycles", "reloads", "final epoch",
                           "final state", "pinned", "violations", "warnings"], rows)]
    versions = [[r.rank, r.backbone, v, ", ".join(map(str, e))] for r in result.streams for v, e in r.versions.items()]
    if versions:
        out += ["", "epochs by the trainer's weight_version (a push's `weight_version` events):",
                table(["rank", "backbone", "weight_version", "epochs"], versions[:show])]
        if len(versions) > show:
            out.append(f"(first {show} of {len(versions)} shown)")
    if result.input_problem_count:
        out += ["", f"unreadable input ({result.input_problem_count}; exit status 2, the rest was audited):"]
        out += [f"  {cell_text(p.where)}: {cell_text(p.message)}" for p in result.input_problems[:show]]
        if result.input_problem_count > min(show, len(result.input_problems)):
            out.append(f"  ... {result.input_problem_count - min(show, len(result.input_problems))} more")
    if result.total_violations:
        out += _findings("violations", result.total_violations, result.violation_counts, VIOLATION_KINDS,
                         result.violations, show)
    if result.total_warnings:
        out += _findings("warnings (the exit status does not count them)", result.total_warnings,
                         result.warning_counts, WARNING_KINDS, result.warnings, show)
    out += ["", result_line(result)]
    return "\n".join(out)


def as_json(result: AuditResult) -> dict[str, Any]:
    return {
        "format": JSON_FORMAT,
        "status": result.status,
        "inputs": result.inputs,
        "events": result.events,
        "ranks": result.ranks,
        "nodes": result.nodes,
        "expected_ranks": sorted(result.expected_ranks) if result.expected_ranks is not None else None,
        "missing_ranks": list(result.missing_ranks),
        "streams": [r.summary() for r in result.streams],
        "violation_counts": dict(result.violation_counts),
        "violations": [v.as_dict() for v in result.violations],
        "violations_truncated": result.total_violations - len(result.violations),
        "warning_counts": dict(result.warning_counts),
        "warnings": [w.as_dict() for w in result.warnings],
        "warnings_truncated": result.total_warnings - len(result.warnings),
        "input_problems": [{"where": p.where, "source": p.source, "line": p.line, "message": p.message}
                           for p in result.input_problems],
        "input_problem_count": result.input_problem_count,
        "kinds": VIOLATION_KINDS,
        "warning_kinds": WARNING_KINDS,
    }


def render_json(result: AuditResult) -> str:
    return json.dumps(as_json(result), indent=2)
