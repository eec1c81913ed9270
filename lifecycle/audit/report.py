"""`reload-lifecycle report`: one self-contained HTML file that shows a reload as a picture.

The logs are streamed once: every event goes to the `Auditor` (the verdict and the violations) and to a
`traces.ReportCollector`, which keeps, per (node, rank, backbone), the latest `max_epochs` epochs: when each layer
became ready, the lifecycle's steps and refusals, and the derived buffers' addresses after each refresh (all
bounded). The page has no external reference at all: the stylesheet and the small script (`assets/`) and every
picture (SVG, drawn by `svg.py` and `timeline.py`) are inline.

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
import re
from collections import Counter
from collections.abc import Collection, Sequence
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from pathlib import Path

from markupsafe import Markup

from .logstream import LogEvent, iter_events
from .markup import number
from .replay import MAX_STREAMS, Auditor
from .results import AuditResult, StreamReplay, Violation
from .rules import VIOLATION_KINDS, WARNING_KINDS
from .svg import state_diagram_svg
from .text import abbreviate, clip
from .timeline import timeline_svg
from .traces import SHOWN_CAP, EpochTrace, ReportCollector, StreamTrace
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


# ---- drawing ----------------------------------------------------------------------------------------------------


def _slug(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", "-".join(clip(p, SHOWN_CAP) for p in parts)).strip("-")


def _name(value: str) -> str:
    return abbreviate(value, SHOWN_CAP)


_FIGURE = Markup('<figure class="timeline-figure" id="fig-{uid}"><figcaption><b>rank {rank} · epoch {epoch}</b> '
                 '({what}{lifecycle}) · {facts}<div class="path">{path}</div></figcaption><div class="scroll">'
                 '{svg}</div><ol class="marks">{marks}</ol></figure>')
_MARK_ITEM = Markup('<li class="{cls}"><span class="t">+{ms:.3f} ms</span> {text}</li>')
_FACT_LAYERS = Markup("{ready}/{total} layers ready")
_FACT_MS = Markup("{ms:.2f} ms")
_FACT_REFRESH = Markup("refresh: {modes}")
_FACT_REFUSED = Markup("{n} refused")
_FACT_VIOLATIONS = Markup('<span class="bad">{n} violation(s)</span>')
_FACT_VERSION = Markup('weight_version <code class="weight-version">{v}</code>')


def _timeline_figure(st: StreamTrace, tr: EpochTrace, violations: int, node: str | None = None) -> Markup:
    """`node`: the stream's node, when ranks of this backbone run on several (two rank-0 streams)."""
    uid = _slug("timeline", "r", st.rank, *(("n", node) if node else ()), st.backbone, "i", tr.incarnation, "e",
                tr.epoch)
    modes = sorted({str(b.get("mode")) for b in tr.buffers.values()})
    facts: list[Markup] = [_FACT_VERSION.format(v=tr.weight_version)] if tr.weight_version is not None else []
    facts += [
        _FACT_LAYERS.format(ready=len(tr.layers) + tr.layers_more + tr.unchanged_more,
                            total=tr.layers_total if tr.layers_total is not None else "?"),
        _FACT_MS.format(ms=(tr.end - tr.start) * 1e3),
        _FACT_REFRESH.format(modes="/".join(modes) if modes else "none"),
    ]
    if tr.refused:
        facts.append(_FACT_REFUSED.format(n=tr.refused))
    if violations:
        facts.append(_FACT_VIOLATIONS.format(n=violations))
    marks = Markup().join(_MARK_ITEM.format(cls=cls, ms=(t - tr.start) * 1e3, text=text) for t, text, cls in tr.marks)
    return _FIGURE.format(uid=uid, rank=_rank(st.rank, node), epoch=tr.epoch,
                          what="cold load" if tr.epoch == 0 else "reload",
                          lifecycle=f", lifecycle {tr.incarnation}" if tr.incarnation > 1 else "",
                          facts=Markup(" · ").join(facts), path=" → ".join(tr.states), svg=timeline_svg(tr, uid),
                          marks=marks)


_BUFFER_HEAD = Markup("<th>epoch {epoch}{star}</th>")
_BUFFER_CELL = Markup('<td class="{cls}"><code>{ptr}</code><small>{mode}</small></td>')
_NO_BUFFER_CELL = Markup('<td class="no-refresh">—</td>')
_BUFFER_ROW = Markup('<tr data-buffer="{name}"><th><code>{name}</code></th><td>{kind}</td><td class="num">{nbytes}'
                     '</td>{cells}</tr>')
_BUFFERS = Markup('<table class="buffers" id="{id}"><thead><tr><th>buffer</th><th>kind</th><th>bytes</th>{head}</tr>'
                  '</thead><tbody>{rows}</tbody></table>{more}')
_BUFFERS_MORE = Markup('<p class="none">{n} more buffer(s) not listed</p>')
_NO_BUFFERS = Markup('<p class="none">no refresh in the epochs shown</p>')


def _rank(rank: int, node: str | None) -> str | int:
    return f"{rank} on {_name(node)}" if node else rank


def _buffers_table(st: StreamTrace, drift_epochs: set[int], node: str | None = None) -> Markup:
    epochs = list(st.epochs)
    names = list(dict.fromkeys(n for tr in epochs for n in tr.buffers))
    if not names:
        return _NO_BUFFERS
    head = Markup().join(_BUFFER_HEAD.format(epoch=tr.epoch, star="*" if tr.incarnation > 1 else "") for tr in epochs)
    rows = []
    for name in names:
        info = next(tr.buffers[name] for tr in epochs if name in tr.buffers)
        cells, prev = [], None
        for tr in epochs:
            b = tr.buffers.get(name)
            if b is None:
                cells.append(_NO_BUFFER_CELL)
                continue
            ptr = str(b.get("data_ptr"))
            if prev is None:
                cls = "ptr-first"
            elif ptr == prev:
                cls = "ptr-same"
            else:
                cls = "ptr-drift" if tr.refreshed_pinned or tr.epoch in drift_epochs else "ptr-moved"
            prev = ptr
            cells.append(_BUFFER_CELL.format(cls=cls, ptr=ptr, mode=str(b.get("mode"))))
        nbytes = number(info["nbytes"]) if "nbytes" in info else ""
        rows.append(_BUFFER_ROW.format(name=name, kind=str(info.get("kind")), nbytes=nbytes,
                                       cells=Markup().join(cells)))
    more = max(tr.buffers_more for tr in epochs)
    return _BUFFERS.format(id=_slug("buffers", "r", st.rank, *(("n", node) if node else ()), st.backbone),
                           head=head, rows=Markup().join(rows),
                           more=_BUFFERS_MORE.format(n=more) if more else "")


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
        rows = Markup().join(_VIOLATION.format(kind=v.kind, where=v.where, rank=v.rank, backbone=_name(v.backbone),
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
        rows = Markup().join(_WARNING.format(kind=w.kind, where=w.where, rank=w.rank, backbone=_name(w.backbone),
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
                           node=_name(", ".join(r.nodes) or "-"), slug=_slug("backbone", r.backbone),
                           backbone=_name(r.backbone), events=r.events, reloads=r.epochs_begun, epoch=r.epoch,
                           state=r.state.value, pinned="yes" if r.pinned else "no",
                           violations=sum(r.violations.values()), warnings=sum(r.warnings.values()))
        for r in result.streams[:STREAM_ROWS])
    more = len(result.streams) - STREAM_ROWS
    return _STREAMS.format(rows=rows, more=_STREAMS_MORE.format(n=more) if more > 0 else "")


_PANEL = Markup('<details class="backbone-panel" id="{slug}"{open}><summary>{summary}</summary><h3>State diagram</h3>'
                '<p class="hint">Drawn from the transition table; thick blue: transitions these ranks took (×count); '
                "dashed red: transitions the table does not allow; orange: final state.</p>"
                '<div class="scroll diagram-box">{diagram}</div><h3>Per-layer readiness</h3><p class="hint">Each row '
                "a layer: grey while it waits, green once every tensor arrived, blue-grey when declared unchanged, red "
                "if it never became ready. Numbered marks: the lifecycle's steps and refusals (listed under each "
                'picture).</p>{figures}<h3>Derived buffers</h3><p class="hint">data_ptr after each refresh; red: moved '
                "while graphs were captured (storage drift), yellow: moved while unpinned (allowed), — no refresh in "
                "that epoch.</p>{tables}</details>")
_NOT_DRAWN = Markup('<p class="dropped">rank {rank}: {n} earlier epoch(s) not drawn ({why})</p>')
_RANK_TABLE = Markup("<h4>rank {rank}</h4>{table}")
_VERSIONS = Markup('<table class="weight-versions" id="{id}"><thead><tr><th>weight_version</th><th>epochs</th></tr>'
                   "</thead><tbody>{rows}</tbody></table>")
_VERSION_ROW = Markup("<tr><td><code>{v}</code></td><td>{epochs}</td></tr>")
_PANEL_BAD = Markup(' · <span class="bad">{n} violation(s)</span>')
_PANEL_CLEAN = Markup(' · <span class="good">clean</span>')
_PANEL_SUMMARY = Markup('<span class="name">{name}</span> · rank(s) {ranks} · final state(s) {states}{verdict}')


def _backbone_panel(backbone: str, replays: list[StreamReplay], traces: list[StreamTrace],
                    violations: list[Violation], open_: bool, figure_budget: list[int]) -> Markup:
    taken: Counter[tuple[str, str, str]] = Counter()
    illegal: Counter[tuple[str, str, str]] = Counter()
    visited: set[str] = set()
    for r in replays:
        taken.update(r.edges)
        illegal.update(r.illegal_edges)
        visited |= r.visited
    current = {r.state.value for r in replays}
    diagram = state_diagram_svg(taken, illegal=illegal, visited=visited, current=current,
                                uid=_slug("diagram", backbone))
    bad = [v for v in violations if v.backbone == backbone]
    figures: list[Markup] = []
    tables: list[Markup] = []
    several = len({st.node for st in traces}) > 1  # then a rank alone does not say which stream
    for st in traces:
        node = st.node if several else None
        mine = [v for v in bad if (v.rank, v.node) == (st.rank, st.node)]
        per_epoch = Counter(v.epoch for v in mine)
        drift = {v.epoch for v in mine if v.kind == "storage_drift"}
        epochs = list(st.epochs)
        drawn = epochs[max(0, len(epochs) - figure_budget[0]):]
        figure_budget[0] -= len(drawn)
        not_drawn = st.dropped + len(epochs) - len(drawn)
        if not_drawn:
            figures.append(_NOT_DRAWN.format(
                rank=_rank(st.rank, node), n=not_drawn,
                why="--max-epochs" if len(drawn) == len(epochs) else "the figure limit of the report"))
        figures += [_timeline_figure(st, tr, per_epoch.get(tr.epoch, 0), node) for tr in drawn]
        tables.append(_RANK_TABLE.format(rank=_rank(st.rank, node), table=_buffers_table(st, drift, node)))
        versions = next((r.versions for r in replays if (r.rank, r.node) == (st.rank, st.node)), {})
        if versions:  # the epochs grouped by the trainer's weight_version of their push
            rows = Markup().join(_VERSION_ROW.format(v=_name(v), epochs=", ".join(map(str, e)))
                                 for v, e in versions.items())
            tables.append(_VERSIONS.format(id=_slug("versions", "r", st.rank, *(("n", node) if node else ()),
                                                    backbone), rows=rows))
    verdict = _PANEL_BAD.format(n=len(bad)) if bad else _PANEL_CLEAN
    summary = _PANEL_SUMMARY.format(name=_name(backbone), ranks=", ".join(str(r.rank) for r in replays),
                                    states=", ".join(sorted(current)), verdict=verdict)
    return _PANEL.format(slug=_slug("backbone", backbone), open=Markup(" open") if open_ else "", summary=summary,
                         diagram=diagram, figures=Markup().join(figures), tables=Markup().join(tables))


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
        panels.append(_backbone_panel(backbone, replays, traces, result.violations,
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
