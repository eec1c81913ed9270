"""`reload-lifecycle report`: one self-contained HTML file that shows a reload as a picture.

The logs are streamed once: every event goes to the `Auditor` (the verdict and the violations) and to a
`traces.ReportCollector`, which keeps, per (rank, backbone), the latest `max_epochs` epochs: when each layer
became ready, the lifecycle's steps and refusals, and the derived buffers' addresses after each refresh (all
bounded). The page has no external reference at all: the stylesheet and the small script (`assets/`) and every
picture (SVG, drawn by `svg.py` and `timeline.py`) are inline.

Sections: a summary with the verdict; the streams; the violations (filterable by kind); then one panel per
backbone with the state diagram (the path its ranks took highlighted), a layers × time readiness timeline per
rank and epoch, and a table of derived-buffer addresses per epoch.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from pathlib import Path

from .logstream import LogEvent, iter_events
from .replay import Auditor
from .results import AuditResult, StreamReplay, Violation
from .rules import VIOLATION_KINDS
from .svg import state_diagram_svg
from .timeline import timeline_svg
from .traces import EpochTrace, ReportCollector, StreamTrace
from .views import result_line

__all__ = ["collect", "render_html", "write_report"]


@cache
def _asset(name: str) -> str:
    """The text of one file of `assets/` (the page's stylesheet or script, inlined into it)."""
    return (resources.files("lifecycle.audit") / "assets" / name).read_text(encoding="utf-8")


def collect(paths: Sequence[str | Path], *, max_epochs: int = 12) -> tuple[AuditResult, ReportCollector]:
    auditor, collector = Auditor(), ReportCollector(max_epochs)
    for item in iter_events(paths):
        r = auditor.feed(item)
        if r is not None and isinstance(item, LogEvent):
            collector.observe(item, r)
    return auditor.finish(), collector


# ---- drawing ----------------------------------------------------------------------------------------------------

esc = html.escape


def _slug(*parts: object) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", "-".join(str(p) for p in parts)).strip("-")


def _timeline_figure(st: StreamTrace, tr: EpochTrace, violations: int) -> str:
    uid = _slug("timeline", "r", st.rank, st.backbone, "i", tr.incarnation, "e", tr.epoch)
    ready = len(tr.layers) + tr.unchanged_more
    total = tr.layers_total if tr.layers_total is not None else "?"
    what = "cold load" if tr.epoch == 0 else "reload"
    modes = sorted({str(b.get("mode")) for b in tr.buffers.values()})
    facts = [f"{ready}/{total} layers ready", f"{(tr.end - tr.start) * 1e3:.2f} ms",
             "refresh: " + ("/".join(modes) if modes else "none")]
    if tr.refused:
        facts.append(f"{tr.refused} refused")
    if violations:
        facts.append(f'<span class="bad">{violations} violation(s)</span>')
    marks = "".join(f'<li class="{cls}"><span class="t">+{(t - tr.start) * 1e3:.3f} ms</span> {esc(text)}</li>'
                    for t, text, cls in tr.marks)
    return (f'<figure class="timeline-figure" id="fig-{uid}"><figcaption><b>rank {st.rank} · epoch {tr.epoch}</b> '
            f'({what}{", lifecycle " + str(tr.incarnation) if tr.incarnation > 1 else ""}) · {" · ".join(facts)}'
            f'<div class="path">{esc(" → ".join(tr.states))}</div></figcaption>'
            f'<div class="scroll">{timeline_svg(tr, uid)}</div><ol class="marks">{marks}</ol></figure>')


def _buffers_table(st: StreamTrace, drift_epochs: set[int]) -> str:
    epochs = list(st.epochs)
    names = list(dict.fromkeys(n for tr in epochs for n in tr.buffers))
    if not names:
        return '<p class="none">no refresh in the epochs shown</p>'
    head = "".join(f"<th>epoch {tr.epoch}{'*' if tr.incarnation > 1 else ''}</th>" for tr in epochs)
    rows = []
    for name in names:
        info = next(tr.buffers[name] for tr in epochs if name in tr.buffers)
        cells, prev = [], None
        for tr in epochs:
            b = tr.buffers.get(name)
            if b is None:
                cells.append('<td class="no-refresh">—</td>')
                continue
            ptr = str(b.get("data_ptr"))
            if prev is None:
                cls = "ptr-first"
            elif ptr == prev:
                cls = "ptr-same"
            else:
                cls = "ptr-drift" if tr.refreshed_pinned or tr.epoch in drift_epochs else "ptr-moved"
            prev = ptr
            cells.append(f'<td class="{cls}"><code>{esc(ptr)}</code><small>{esc(str(b.get("mode")))}</small></td>')
        rows.append(f'<tr data-buffer="{esc(name)}"><th><code>{esc(name)}</code></th><td>{esc(str(info.get("kind")))}'
                    f'</td><td class="num">{info.get("nbytes", "")}</td>{"".join(cells)}</tr>')
    return (f'<table class="buffers" id="{_slug("buffers", "r", st.rank, st.backbone)}"><thead><tr><th>buffer</th>'
            f'<th>kind</th><th>bytes</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _violations_section(result: AuditResult) -> str:
    counts = result.violation_counts
    buttons = [f'<button type="button" data-kind="all" class="active">all ({result.total_violations})</button>']
    buttons += [f'<button type="button" data-kind="{k}">{k} ({n})</button>' for k, n in sorted(counts.items())]
    rows = "".join(
        f'<tr class="violation kind-{v.kind}" data-kind="{v.kind}"><td><code>{esc(v.where)}</code></td>'
        f'<td>{v.rank}</td><td>{esc(v.backbone)}</td><td>{v.epoch}</td><td class="kind">{v.kind}</td>'
        f'<td>{esc(v.detail)}</td></tr>' for v in result.violations)
    shown = len(result.violations)
    more = f"<p>first {shown} of {result.total_violations} listed</p>" if result.total_violations > shown else ""
    table = (f'<div id="violation-filter">{"".join(buttons)}</div><table id="violation-table"><thead><tr>'
             f'<th>where</th><th>rank</th><th>backbone</th><th>epoch</th><th>kind</th><th>detail</th></tr></thead>'
             f"<tbody>{rows}</tbody></table>{more}") if result.total_violations else \
        '<p class="clean" id="no-violations">No violations: every transition is a row of the table, every refresh ' \
        "had every layer ready, no pinned address moved, every reload finished, every rank agrees.</p>"
    kinds = "".join(f'<dt class="{"seen" if counts.get(k) else ""}">{k}</dt><dd>{esc(meaning)}</dd>'
                    for k, meaning in VIOLATION_KINDS.items())
    problems = ""
    if result.input_problem_count:
        items = "".join(f"<li><code>{esc(p.where)}</code> {esc(p.message)}</li>" for p in result.input_problems)
        problems = (f'<h3>Unreadable input ({result.input_problem_count})</h3><ul id="input-problems">{items}</ul>'
                    "<p>The rest of the input was audited.</p>")
    return (f'<section id="violations"><h2>Violations</h2>{table}{problems}'
            f'<details><summary>What the auditor checks</summary><dl id="kinds">{kinds}</dl></details></section>')


def _streams_table(result: AuditResult) -> str:
    rows = "".join(
        f'<tr class="{"bad" if sum(r.violations.values()) else "ok"}"><td>{r.rank}</td><td><a href="#'
        f'{_slug("backbone", r.backbone)}">{esc(r.backbone)}</a></td><td class="num">{r.events}</td>'
        f'<td class="num">{r.epochs_begun}</td><td class="num">{r.epoch}</td><td>{r.state.value}</td>'
        f'<td>{"yes" if r.pinned else "no"}</td><td class="num">{sum(r.violations.values())}</td></tr>'
        for r in result.streams)
    return (f'<section id="streams"><h2>Streams</h2><table id="stream-table"><thead><tr><th>rank</th><th>backbone</th>'
            f"<th>events</th><th>reloads</th><th>final epoch</th><th>final state</th><th>pinned</th>"
            f"<th>violations</th></tr></thead><tbody>{rows}</tbody></table></section>")


def _backbone_panel(backbone: str, replays: list[StreamReplay], traces: list[StreamTrace],
                    violations: list[Violation], open_: bool) -> str:
    taken: Counter[tuple[str, str, str]] = Counter()
    illegal: Counter[tuple[str, str, str]] = Counter()
    visited: set[str] = set()
    for r in replays:
        taken.update(r.edges)
        illegal.update(r.illegal_edges)
        visited |= r.visited
    current = {r.state.value for r in replays}
    ranks = ", ".join(str(r.rank) for r in replays)
    slug = _slug("backbone", backbone)
    diagram = state_diagram_svg(taken, illegal=illegal, visited=visited, current=current, uid=_slug("diagram",
                                                                                                   backbone))
    bad = [v for v in violations if v.backbone == backbone]
    figures, tables = [], []
    for st in traces:
        per_epoch = Counter(v.epoch for v in bad if v.rank == st.rank)
        drift = {v.epoch for v in bad if v.rank == st.rank and v.kind == "storage_drift"}
        if st.dropped:
            figures.append(f'<p class="dropped">rank {st.rank}: {st.dropped} earlier epoch(s) not drawn '
                           f"(--max-epochs)</p>")
        figures += [_timeline_figure(st, tr, per_epoch.get(tr.epoch, 0)) for tr in st.epochs]
        tables.append(f"<h4>rank {st.rank}</h4>{_buffers_table(st, drift)}")
    summary = (f'<span class="name">{esc(backbone)}</span> · rank(s) {ranks} · final state(s) '
               f'{", ".join(sorted(current))}' + (f' · <span class="bad">{len(bad)} violation(s)</span>' if bad else
                                                   ' · <span class="good">clean</span>'))
    return (f'<details class="backbone-panel" id="{slug}"{" open" if open_ else ""}><summary>{summary}</summary>'
            f'<h3>State diagram</h3><p class="hint">Drawn from the transition table; thick blue: transitions these '
            f"ranks took (×count); dashed red: transitions the table does not allow; orange: final state.</p>"
            f'<div class="scroll diagram-box">{diagram}</div>'
            f'<h3>Per-layer readiness</h3><p class="hint">Each row a layer: grey while it waits, green once every '
            f"tensor arrived, blue-grey when declared unchanged, red if it never became ready. Numbered marks: the "
            f"lifecycle's steps and refusals (listed under each picture).</p>{''.join(figures)}"
            f'<h3>Derived buffers</h3><p class="hint">data_ptr after each refresh; red: moved while graphs were '
            f"captured (storage drift), yellow: moved while unpinned (allowed), — no refresh in that epoch.</p>"
            f'{"".join(tables)}</details>')


def render_html(result: AuditResult, collector: ReportCollector, *, title: str = "reload-lifecycle report") -> str:
    """The whole page as one string."""
    if result.input_problem_count:
        status_cls, status = "status-unreadable", "UNREADABLE INPUT"
    elif result.total_violations:
        status_cls, status = "status-violations", f"{result.total_violations} VIOLATION(S)"
    else:
        status_cls, status = "status-clean", "CLEAN"
    by_backbone: dict[str, list[StreamReplay]] = {}
    for r in result.streams:
        by_backbone.setdefault(r.backbone, []).append(r)
    bad_per_backbone = Counter({b: sum(sum(r.violations.values()) for r in rs) for b, rs in by_backbone.items()})
    order = sorted(by_backbone, key=lambda b: (-bad_per_backbone[b], b))
    panels = []
    for i, backbone in enumerate(order):
        replays = sorted(by_backbone[backbone], key=lambda r: r.rank)
        traces = [collector.streams[r.key] for r in replays if r.key in collector.streams]
        panels.append(_backbone_panel(backbone, replays, traces, result.violations,
                                      open_=i == 0 or bad_per_backbone[backbone] > 0))
    inputs = "".join(f"<li><code>{esc(i)}</code></li>" for i in result.inputs[:50])
    more_inputs = f"<li>… {len(result.inputs) - 50} more</li>" if len(result.inputs) > 50 else ""
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!DOCTYPE html>
<html lang="en" data-rendered="no">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)}</title>
<style>
{_asset('report.css')}</style>
</head>
<body>
<main id="report">
<header id="summary">
<div><h1>{esc(title)}</h1><div class="facts"><b>{result.events}</b> events · <b>{len(result.streams)}</b> stream(s)
(rank, backbone) · <b>{len(by_backbone)}</b> backbone(s) · <b>{len(result.inputs)}</b> input(s) ·
<b>{result.total_violations}</b> violation(s) · <b>{result.input_problem_count}</b> unreadable line(s)</div></div>
<div class="status {status_cls}" id="status">{status}</div>
<details><summary>inputs</summary><ul id="inputs">{inputs}{more_inputs}</ul></details>
</header>
{_streams_table(result)}
{_violations_section(result)}
<h2 id="backbones">Backbones</h2>
{"".join(panels)}
<footer>{esc(result_line(result))} · generated by <code>reload-lifecycle report</code> at {generated}; self-contained,
no network.</footer>
</main>
<script>
{_asset('report.js')}</script>
</body>
</html>
"""


def write_report(paths: Sequence[str | Path], output: str | Path, *, title: str = "reload-lifecycle report",
                 max_epochs: int = 12) -> AuditResult:
    """Audit `paths` and write the HTML report to `output`. Returns the audit result."""
    result, collector = collect(paths, max_epochs=max_epochs)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(result, collector, title=title), encoding="utf-8")
    return result
