"""`reload-lifecycle report`: one self-contained HTML file that shows a reload as a picture.

The logs are streamed once: every event goes to the `Auditor` (the verdict and the violations) and to a
`traces.ReportCollector`, which keeps, per (node, rank, backbone), the latest `max_epochs` epochs: when each layer
became ready, the lifecycle's steps and refusals, and the derived buffers' addresses after each refresh (all
bounded). The page has no external reference at all: the stylesheet and the small script (`assets/`) and every
picture (SVG, drawn by `svg.py` and `timeline.py`) are inline. This module writes the page, its summary, streams and
violations; `panels` writes each backbone's panel.

Every value read from a log reaches the page through a MarkupSafe template (`Markup(TEMPLATE).format`, see
`markup`), which escapes it (one escaping path, no f-string HTML), and the page's Content-Security-Policy allows
no script or style but its own (by their sha256): an injected `<script>` or event handler would not run even if
a value slipped through. The page is bounded whatever the log: at most `STREAM_ROWS` streams listed, the
auditor's `max_details` violations and input problems, panels for the streams the collector traced,
`FIGURES_CAP` timelines in all.

Sections: a summary with the verdict and the ranks and nodes the logs cover (and, with expected ranks, the ones
they lack); the streams; the violations (filterable by kind) and warnings; then one panel per
backbone with the state diagram (the path its ranks took highlighted), a layers × time readiness timeline per
rank and epoch, and a table of derived-buffer addresses per epoch.
"""

from __future__ import annotations

import base64
import hashlib
from collections import Counter
from collections.abc import Collection, Sequence
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from pathlib import Path

from markupsafe import Markup

from .inputs import iter_events
from .logstream import LogEvent
from .panels import backbone_panel, label, slug
from .replay import MAX_STREAMS, Auditor
from .results import AuditResult, StreamReplay
from .rules import VIOLATION_KINDS, WARNING_KINDS
from .text import clip
from .traces import ReportCollector
from .views import coverage_line, result_line

__all__ = ["FIGURES_CAP", "STREAM_ROWS", "collect", "content_security_policy", "render_html", "write_report"]

#: Streams listed in the streams table, at most; timelines drawn in the whole report, at most.
STREAM_ROWS, FIGURES_CAP = 1000, 200
#: Inputs listed, at most.
INPUT_ROWS = 50


@cache
def _asset(name: str) -> Markup:
    """One file of `assets/` (the page's stylesheet or script), as it is inlined: after a newline."""
    return Markup("\n" + (resources.files("lifecycle.audit") / "assets" / name).read_text(encoding="utf-8"))


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def content_security_policy() -> str:
    """Nothing from anywhere, no plugin, no base or form target; the page's own style and script by hash."""
    return (f"default-src 'none'; script-src {_sha256(_asset('report.js'))}; style-src {_sha256(_asset('report.css'))}"
            "; base-uri 'none'; form-action 'none'")


def collect(paths: Sequence[str | Path], *, max_epochs: int = 12, max_streams: int = MAX_STREAMS,
            expect_ranks: Collection[int] | None = None) -> tuple[AuditResult, ReportCollector]:
    auditor, collector = Auditor(max_streams=max_streams, expect_ranks=expect_ranks), ReportCollector(max_epochs)
    for item in iter_events(paths):
        r = auditor.feed(item)
        if r is not None and isinstance(item, LogEvent):
            collector.observe(item, r)
    return auditor.finish(paths), collector


# ---- drawing (each backbone's panel: `panels`) ------------------------------------------------------------------


_VIOLATION = Markup('<tr class="violation kind-{kind}" data-kind="{kind}"><td><code>{where}</code></td><td>{rank}</td>'
                    '<td>{backbone}</td><td>{epoch}</td><td class="kind">{kind}</td><td>{detail}</td></tr>')
_FILTER_ALL = Markup('<button type="button" data-kind="all" class="active">all ({n})</button>')
_FILTER_KIND = Markup('<button type="button" data-kind="{k}">{k} ({n})</button>')
_VIOLATION_TABLE = Markup('<div id="violation-filter">{buttons}</div><table id="violation-table"><thead><tr><th>where'
                          '</th><th>rank</th><th>backbone</th><th>epoch</th><th>kind</th><th>detail</th></tr></thead>'
                          '<tbody>{rows}</tbody></table>{more}')
_FIRST_OF = Markup("<p>first {shown} of {n} listed</p>")
_FIRST = Markup("<p>first {k} listed</p>")
_KIND = Markup('<dt class="{cls}">{k}</dt><dd>{meaning}</dd>')
_WARNING_KIND = Markup('<dt class="{cls}">{k} (warning)</dt><dd>{meaning}</dd>')
_WARNING = Markup('<tr class="warning kind-{kind}" data-kind="{kind}"><td><code>{where}</code></td><td>{rank}</td>'
                  '<td>{backbone}</td><td>{epoch}</td><td class="kind">{kind}</td><td>{detail}</td></tr>')
_WARNINGS = Markup('<h3>Warnings ({n}; the verdict does not count them)</h3><table id="warning-table"><thead>'
                   "<tr><th>where</th><th>rank</th><th>backbone</th><th>epoch</th><th>kind</th><th>detail</th>"
                   "</tr></thead><tbody>{rows}</tbody></table>{more}")
_PROBLEM = Markup("<li><code>{where}</code> {message}</li>")
_PROBLEMS = Markup('<h3>Unreadable input ({n})</h3><ul id="input-problems">{items}</ul>{more}'
                   "<p>The rest of the input was audited.</p>")
_VIOLATIONS_SECTION = Markup('<section id="violations"><h2>Violations</h2>{table}{warnings}{problems}<details>'
                             '<summary>What the auditor checks</summary><dl id="kinds">{kinds}</dl></details>'
                             "</section>")
_NO_VIOLATIONS = Markup(
    '<p class="clean" id="no-violations">No violations: every transition is a row of the table, every refresh had '
    "every layer ready, no pinned address moved, every reload finished, every rank agrees.</p>")


def _violations_section(result: AuditResult) -> Markup:
    counts = result.violation_counts
    table = _NO_VIOLATIONS
    if result.total_violations:
        buttons = [_FILTER_ALL.format(n=result.total_violations)]
        buttons += [_FILTER_KIND.format(k=k, n=n) for k, n in sorted(counts.items())]
        rows = Markup().join(_VIOLATION.format(kind=v.kind, where=v.where, rank=v.rank, backbone=label(v.backbone),
                                               epoch=v.epoch, detail=v.detail) for v in result.violations)
        shown = len(result.violations)
        more = _FIRST_OF.format(shown=shown, n=result.total_violations) if result.total_violations > shown else ""
        table = _VIOLATION_TABLE.format(buttons=Markup().join(buttons), rows=rows, more=more)
    kinds = Markup().join([
        *(_KIND.format(cls="seen" if counts.get(k) else "", k=k, meaning=meaning)
          for k, meaning in VIOLATION_KINDS.items()),
        *(_WARNING_KIND.format(cls="seen" if result.warning_counts.get(k) else "", k=k, meaning=meaning)
          for k, meaning in WARNING_KINDS.items())])
    warnings: Markup | str = ""
    if result.total_warnings:
        rows = Markup().join(_WARNING.format(kind=w.kind, where=w.where, rank=w.rank, backbone=label(w.backbone),
                                             epoch=w.epoch, detail=w.detail) for w in result.warnings)
        shown = len(result.warnings)
        warnings = _WARNINGS.format(n=result.total_warnings, rows=rows,
                                    more=_FIRST.format(k=shown) if result.total_warnings > shown else "")
    problems: Markup | str = ""
    if result.input_problem_count:
        items = Markup().join(_PROBLEM.format(where=p.where, message=p.message) for p in result.input_problems)
        listed = len(result.input_problems)
        problems = _PROBLEMS.format(n=result.input_problem_count, items=items,
                                    more=_FIRST.format(k=listed) if result.input_problem_count > listed else "")
    return _VIOLATIONS_SECTION.format(table=table, warnings=warnings, problems=problems, kinds=kinds)


_STREAM_ROW = Markup('<tr class="{cls}"><td>{rank}</td><td>{node}</td><td><a href="#{slug}">{backbone}</a></td><td '
                     'class="num">{events}</td><td class="num">{reloads}</td><td class="num">{epoch}</td><td>{state}'
                     '</td><td>{pinned}</td><td class="num">{violations}</td><td class="num">{warnings}</td></tr>')
_STREAMS = Markup('<section id="streams"><h2>Streams</h2><table id="stream-table"><thead><tr><th>rank</th>'
                  "<th>node</th><th>backbone</th><th>events</th><th>reloads</th><th>final epoch</th><th>final state"
                  "</th><th>pinned</th><th>violations</th><th>warnings</th></tr></thead><tbody>{rows}</tbody></table>"
                  "{more}</section>")
_STREAMS_MORE = Markup("<p>{n} more stream(s) not listed</p>")


def _streams_table(result: AuditResult) -> Markup:
    rows = Markup().join(
        _STREAM_ROW.format(cls="bad" if sum(r.violations.values()) else "ok", rank=r.rank,
                           node=label(", ".join(r.nodes) or "-"), slug=slug("backbone", r.backbone),
                           backbone=label(r.backbone), events=r.events, reloads=r.epochs_begun, epoch=r.epoch,
                           state=r.state.value, pinned="yes" if r.pinned else "no",
                           violations=sum(r.violations.values()), warnings=sum(r.warnings.values()))
        for r in result.streams[:STREAM_ROWS])
    more = len(result.streams) - STREAM_ROWS
    return _STREAMS.format(rows=rows, more=_STREAMS_MORE.format(n=more) if more > 0 else "")


_PAGE = Markup("""<!DOCTYPE html>
<html lang="en" data-rendered="no">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<main id="report">
<header id="summary">
<div><h1>{title}</h1><div class="facts"><b>{events}</b> events · <b>{streams}</b> stream(s)
(node, rank, backbone) · <b>{backbones}</b> backbone(s) · <b>{inputs}</b> input(s) ·
<b>{violations}</b> violation(s) · <b>{warnings}</b> warning(s) · <b>{problems}</b> input problem(s)</div>
<div class="facts" id="coverage">{coverage}</div></div>
<div class="status {status_cls}" id="status">{status}</div>
<details><summary>inputs</summary><ul id="inputs">{input_items}</ul></details>
</header>
{streams_table}
{violations_section}
<h2 id="backbones">Backbones</h2>
{panels}{untraced}
<footer>{result} · generated by <code>reload-lifecycle report</code> at {generated}; self-contained,
no network.</footer>
</main>
<script>{js}</script>
</body>
</html>
""")
_UNTRACED = Markup('<p class="dropped">{n} stream(s) of {b} backbone(s) audited but not drawn (the report draws the '
                   "first {k})</p>")
_INPUT = Markup("<li><code>{name}</code></li>")
_INPUTS_MORE = Markup("<li>… {n} more</li>")


def render_html(result: AuditResult, collector: ReportCollector, *, title: str = "reload-lifecycle report") -> str:
    """The whole page as one string."""
    if result.input_problem_count:
        status_cls, status = "status-unreadable", "UNREADABLE INPUT"
    elif result.total_violations:
        status_cls, status = "status-violations", f"{result.total_violations} VIOLATION(S)"
    else:
        status_cls, status = "status-clean", "CLEAN"
    if result.total_warnings:
        status += f" · {result.total_warnings} WARNING(S)"
    by_backbone: dict[str, list[StreamReplay]] = {}
    for r in result.streams:
        by_backbone.setdefault(r.backbone, []).append(r)
    bad_per_backbone = Counter({b: sum(sum(r.violations.values()) for r in rs) for b, rs in by_backbone.items()})
    drawn = [b for b in by_backbone if any(r.key in collector.streams for r in by_backbone[b])]
    order = sorted(drawn, key=lambda b: (-bad_per_backbone[b], b))
    budget = [FIGURES_CAP]
    panels = []
    for i, backbone in enumerate(order):
        replays = sorted(by_backbone[backbone], key=lambda r: r.rank)
        traces = [collector.streams[r.key] for r in replays if r.key in collector.streams]
        panels.append(backbone_panel(backbone, replays, traces, result.violations,
                                     open_=i == 0 or bad_per_backbone[backbone] > 0, figure_budget=budget))
    untraced = (_UNTRACED.format(n=len(collector.untraced), k=collector.max_traced, b=len(by_backbone) - len(drawn))
                if collector.untraced else "")
    input_items = [_INPUT.format(name=i) for i in result.inputs[:INPUT_ROWS]]
    if len(result.inputs) > INPUT_ROWS:
        input_items.append(_INPUTS_MORE.format(n=len(result.inputs) - INPUT_ROWS))
    return str(_PAGE.format(
        csp=content_security_policy(), title=clip(title, 200), css=_asset("report.css"), events=result.events,
        streams=len(result.streams), backbones=len(by_backbone), inputs=len(result.inputs),
        violations=result.total_violations, warnings=result.total_warnings, problems=result.input_problem_count,
        coverage=coverage_line(result), status_cls=status_cls,
        status=status, input_items=Markup().join(input_items), streams_table=_streams_table(result),
        violations_section=_violations_section(result), panels=Markup().join(panels), untraced=untraced,
        result=result_line(result), generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        js=_asset("report.js")))


def write_report(paths: Sequence[str | Path], output: str | Path, *, title: str = "reload-lifecycle report",
                 max_epochs: int = 12, max_streams: int = MAX_STREAMS, expect_ranks: Collection[int] | None = None
                 ) -> AuditResult:
    """Audit `paths` and write the HTML report to `output`. Returns the audit result."""
    result, collector = collect(paths, max_epochs=max_epochs, max_streams=max_streams, expect_ranks=expect_ranks)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(result, collector, title=title), encoding="utf-8")
    return result
