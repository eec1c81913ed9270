"""`reload-lifecycle report`: one self-contained HTML file that shows a reload as a picture.

The logs are streamed once: every event goes to the `Auditor` (the verdict and the violations) and to a
`ReportCollector`, which keeps, per (rank, backbone), the latest `max_epochs` epochs: when each layer became
ready, the lifecycle's steps and refusals, and the derived buffers' addresses after each refresh (all bounded).
The page has no external reference at all: CSS, the small script and every picture (SVG, drawn here) are inline.

Sections: a summary with the verdict; the streams; the violations (filterable by kind); then one panel per
backbone with the state diagram (the path its ranks took highlighted, `svgdiagram.py`), a layers × time
readiness timeline per rank and epoch, and a table of derived-buffer addresses per epoch.
"""

from __future__ import annotations

import html
import re
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .logstream import LogEvent, iter_events
from .replay import VIOLATION_KINDS, Auditor, AuditResult, StreamReplay, Violation
from .svg import state_diagram_svg
from .views import result_line

#: Layers remembered per epoch, and steps (transitions, refusals) per epoch, at most.
MAX_LAYERS, MAX_MARKS = 512, 64
#: Lifecycle steps drawn as marks on the timeline (weights_loaded coincides with layer_ready: not drawn).
MARKED_TRIGGERS = frozenset({"begin_reload", "finish_loading", "refresh_derived", "graphs_verified", "capture_graphs",
                             "release_graphs", "abort_reload"})


@dataclass
class EpochTrace:
    """What one (rank, backbone) did in one epoch, for the pictures."""

    incarnation: int
    epoch: int
    start: float
    end: float
    layers_total: int | None = None
    layers: dict[str, tuple[float, str]] = field(default_factory=dict)  # layer -> (time, "ready" | "unchanged")
    unchanged_more: int = 0
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # (time, text, css class)
    states: list[str] = field(default_factory=list)
    buffers: dict[str, dict[str, Any]] = field(default_factory=dict)  # after the last refresh in this epoch
    refreshed_pinned: bool = False
    refused: int = 0


@dataclass
class StreamTrace:
    rank: int
    backbone: str
    epochs: deque[EpochTrace]
    dropped: int = 0  # older epochs not kept


class ReportCollector:
    """Collects the pictures' data from the events the auditor replays (call `observe` after `Auditor.feed`)."""

    def __init__(self, max_epochs: int = 12) -> None:
        self.max_epochs = max_epochs
        self.streams: dict[tuple[int, str], StreamTrace] = {}

    def _trace(self, r: StreamReplay, ev: LogEvent) -> EpochTrace:
        st = self.streams.get(r.key)
        if st is None:
            st = self.streams[r.key] = StreamTrace(r.rank, r.backbone, deque(maxlen=self.max_epochs))
        cur = st.epochs[-1] if st.epochs else None
        if cur is None or cur.epoch != r.epoch or cur.incarnation != r.incarnations:
            if len(st.epochs) == st.epochs.maxlen:
                st.dropped += 1
            cur = EpochTrace(r.incarnations, r.epoch, ev.ts, ev.ts, states=[] if ev.fields["event"] == "transition"
                             and ev.fields.get("trigger") == "begin_reload" else [r.state.value])
            st.epochs.append(cur)
        return cur

    def observe(self, ev: LogEvent, r: StreamReplay) -> None:
        f = ev.fields
        tr = self._trace(r, ev)
        tr.end = max(tr.end, ev.ts)
        total = f.get("layers_total")
        if isinstance(total, int):
            tr.layers_total = total
        name = f["event"]
        if name == "layer_ready":
            layer = f.get("layer")
            if isinstance(layer, str) and layer not in tr.layers and len(tr.layers) < MAX_LAYERS:
                tr.layers[layer] = (ev.ts, "ready")
        elif name == "layers_unchanged":
            for layer in f.get("layers") or []:
                if isinstance(layer, str) and layer not in tr.layers and len(tr.layers) < MAX_LAYERS:
                    tr.layers[layer] = (ev.ts, "unchanged")
            more = f.get("layers_more")
            tr.unchanged_more += more if isinstance(more, int) else 0
        elif name == "transition":
            trigger = str(f.get("trigger"))
            if trigger == "begin_reload" and not tr.states:
                tr.states.append(str(f.get("src")))
            dst = str(f.get("dst"))
            if (not tr.states or tr.states[-1] != dst) and len(tr.states) < MAX_MARKS:
                tr.states.append(dst)
            if trigger in MARKED_TRIGGERS:
                self._mark(tr, ev.ts, f"{trigger} {f.get('src')} → {dst}", f"mark-{trigger}")
        elif name == "refused":
            tr.refused += 1
            self._mark(tr, ev.ts, f"refused {f.get('trigger')} ({f.get('error')}) in {f.get('src')}", "mark-refused")
        elif name == "refresh" and isinstance(f.get("buffers"), list):
            tr.buffers = {b["name"]: b for b in f["buffers"][:MAX_LAYERS]
                          if isinstance(b, dict) and isinstance(b.get("name"), str)}
            tr.refreshed_pinned = r.pinned
        elif name == "storage_check" and f.get("ok") is False:
            self._mark(tr, ev.ts, f"storage check failed ({f.get('action')})", "mark-drift")

    @staticmethod
    def _mark(tr: EpochTrace, t: float, text: str, cls: str) -> None:
        if len(tr.marks) < MAX_MARKS:
            tr.marks.append((t, text, cls))


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


def _layer_key(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


TL_W, TL_LEFT, TL_RIGHT, ROW, TL_TOP, TL_BOTTOM = 1240, 170, 24, 18, 30, 30


def timeline_svg(tr: EpochTrace, uid: str) -> str:
    """Layers × time for one epoch: grey while a layer waits, green once ready (blue-grey: declared unchanged),
    red for layers that never became ready; numbered vertical marks for the lifecycle's steps and refusals."""
    layers = sorted(tr.layers.items(), key=lambda kv: _layer_key(kv[0]))
    never = max(0, (tr.layers_total or 0) - len(layers) - tr.unchanged_more)
    rows = len(layers) + (1 if tr.unchanged_more else 0) + (1 if never else 0)
    height = TL_TOP + max(rows, 1) * ROW + TL_BOTTOM
    span = max(tr.end - tr.start, 1e-6)
    plot = TL_W - TL_LEFT - TL_RIGHT

    def x(t: float) -> float:
        return TL_LEFT + (t - tr.start) / span * plot

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" id="{uid}" viewBox="0 0 {TL_W} {height}" '
           f'width="{TL_W}" height="{height}" role="img" aria-label="per-layer readiness, epoch {tr.epoch}">']
    for i in range(6):  # time axis
        t = tr.start + span * i / 5
        out.append(f'<line class="tick" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TL_TOP - 4}" y2="{height - TL_BOTTOM}"/>'
                   f'<text class="tick-label" x="{x(t):.1f}" y="{height - TL_BOTTOM + 16}" text-anchor="middle">'
                   f'{(t - tr.start) * 1e3:.2f} ms</text>')
    y = TL_TOP
    for name, (t, kind) in layers:
        ready_x = x(t)
        out.append(f'<g class="layer-row" data-layer="{esc(name)}"><text class="layer-label" x="{TL_LEFT - 8}" '
                   f'y="{y + 13}" text-anchor="end">{esc(name)}</text>'
                   f'<rect class="waiting" x="{TL_LEFT}" y="{y + 3}" width="{max(ready_x - TL_LEFT, 0):.1f}" '
                   f'height="{ROW - 6}"/><rect class="{kind}" x="{ready_x:.1f}" y="{y + 3}" '
                   f'width="{max(TL_W - TL_RIGHT - ready_x, 1.5):.1f}" height="{ROW - 6}"><title>{esc(name)} '
                   f'{kind} at +{(t - tr.start) * 1e3:.3f} ms</title></rect></g>')
        y += ROW
    for label, cls, n in (("unchanged (not named)", "unchanged", tr.unchanged_more), ("never ready", "missing", never)):
        if n:
            out.append(f'<g class="layer-row {cls}-row"><text class="layer-label" x="{TL_LEFT - 8}" y="{y + 13}" '
                       f'text-anchor="end">{n} layer(s) {label}</text><rect class="{cls}" x="{TL_LEFT}" y="{y + 3}" '
                       f'width="{plot}" height="{ROW - 6}"/></g>')
            y += ROW
    for i, (t, text, cls) in enumerate(tr.marks, 1):
        mx = x(t)
        out.append(f'<g class="mark {cls}"><line x1="{mx:.1f}" x2="{mx:.1f}" y1="{TL_TOP - 10}" '
                   f'y2="{height - TL_BOTTOM}"/><circle cx="{mx:.1f}" cy="{TL_TOP - 16}" r="8"/>'
                   f'<text x="{mx:.1f}" y="{TL_TOP - 12}" text-anchor="middle">{i}</text>'
                   f'<title>{i}: {esc(text)} at +{(t - tr.start) * 1e3:.3f} ms</title></g>')
    out.append("</svg>")
    return "".join(out)


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


CSS = """
:root{--ink:#263238;--muted:#78909c;--line:#cfd8dc;--blue:#1565c0;--bad:#c62828;--good:#2e7d32;--warn:#ef6c00}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:var(--ink);
 background:#f5f7f8}
main{max-width:1320px;margin:0 auto;padding:18px 22px 60px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:26px 0 8px}h3{font-size:15px;margin:18px 0 4px}
h4{margin:10px 0 4px;font-size:13px}
code{font:12px ui-monospace,"DejaVu Sans Mono",monospace}
header#summary{background:#fff;border:1px solid var(--line);border-radius:10px;padding:14px 18px;display:flex;
 gap:20px;align-items:center;flex-wrap:wrap}
.status{font-weight:700;font-size:15px;padding:6px 14px;border-radius:18px;color:#fff}
.status-clean{background:var(--good)}.status-violations{background:var(--bad)}.status-unreadable{background:#6a1b9a}
.facts{color:var(--muted)}.facts b{color:var(--ink)}
section,details.backbone-panel{background:#fff;border:1px solid var(--line);border-radius:10px;padding:6px 18px 14px;
 margin-top:16px}
details.backbone-panel>summary{cursor:pointer;font-size:16px;padding:8px 0}
details.backbone-panel>summary .name{font-weight:700}
table{border-collapse:collapse;margin:6px 0}
th,td{border-bottom:1px solid #eceff1;padding:4px 10px;text-align:left;vertical-align:top}
thead th{background:#eceff1;font-weight:600}
td.num{text-align:right}
tr.bad td{background:#ffebee}
.bad{color:var(--bad);font-weight:600}.good{color:var(--good);font-weight:600}
.hint{color:var(--muted);margin:2px 0 6px;font-size:12.5px}
.scroll{overflow-x:auto}
svg{max-width:100%;height:auto;display:block}
.state rect{fill:#fff;stroke:#90a4ae;stroke-width:1.5}
.state text{font:600 12px system-ui,"DejaVu Sans",sans-serif;fill:#37474f}
.state.visited rect{fill:#e3f2fd;stroke:var(--blue)}
.state.current rect{fill:#fff3e0;stroke:var(--warn);stroke-width:3.5}
.edge{fill:none;stroke:#b0bec5;stroke-width:1.4}
.edge.taken{stroke:var(--blue);stroke-width:3.2}
.edge.illegal{stroke:var(--bad);stroke-width:2.6;stroke-dasharray:7 5}
.arrow-plain{fill:#b0bec5}.arrow-taken{fill:var(--blue)}.arrow-illegal{fill:var(--bad)}
.initial{fill:#37474f}
.edge-label{font:11px ui-monospace,"DejaVu Sans Mono",monospace;fill:#78909c;paint-order:stroke;stroke:#fff;
 stroke-width:4px;stroke-linejoin:round}
.edge-label .taken{fill:#0d47a1;font-weight:700}.edge-label .cond{font-style:italic;fill:#90a4ae}
.edge-label.illegal{fill:var(--bad);font-weight:700}
.timeline-figure{margin:10px 0 16px;border-top:1px dashed var(--line);padding-top:8px}
.timeline-figure figcaption{font-size:13px}
.timeline-figure .path{color:var(--muted);font:11.5px ui-monospace,"DejaVu Sans Mono",monospace}
.layer-label{font:11px ui-monospace,"DejaVu Sans Mono",monospace;fill:#455a64}
rect.waiting{fill:#e0e0e0}rect.ready{fill:#43a047}rect.unchanged{fill:#90a4ae}rect.missing{fill:#e53935}
.tick{stroke:#eceff1}.tick-label{font:10px system-ui,"DejaVu Sans",sans-serif;fill:#90a4ae}
.mark line{stroke:#546e7a;stroke-width:1.2}.mark circle{fill:#546e7a}
.mark text{font:700 10px system-ui,"DejaVu Sans",sans-serif;fill:#fff}
.mark-refused line{stroke:var(--bad);stroke-dasharray:4 3}.mark-refused circle{fill:var(--bad)}
.mark-drift line{stroke:#6a1b9a;stroke-width:2}.mark-drift circle{fill:#6a1b9a}
.mark-refresh_derived line,.mark-graphs_verified line{stroke:var(--good)}
.mark-refresh_derived circle,.mark-graphs_verified circle{fill:var(--good)}
.mark-begin_reload line,.mark-capture_graphs line{stroke:var(--blue)}
.mark-begin_reload circle,.mark-capture_graphs circle{fill:var(--blue)}
.mark-abort_reload line{stroke:var(--warn);stroke-width:2}.mark-abort_reload circle{fill:var(--warn)}
ol.marks{margin:2px 0 0;padding-left:28px;columns:2;font-size:12px;color:#455a64}
ol.marks .t{color:var(--muted);font:11px ui-monospace,"DejaVu Sans Mono",monospace}
ol.marks .mark-refused,ol.marks .mark-drift{color:var(--bad)}
table.buffers td small{display:block;color:var(--muted);font-size:11px}
td.ptr-same{background:#f1f8e9}td.ptr-first{background:#fafafa}td.ptr-moved{background:#fff8e1}
td.ptr-drift{background:#ffcdd2;outline:2px solid var(--bad)}td.no-refresh{color:#b0bec5}
#violation-filter button{border:1px solid var(--line);background:#fff;border-radius:14px;padding:3px 10px;
 margin:0 6px 6px 0;cursor:pointer;font:12px system-ui,sans-serif}
#violation-filter button.active{background:var(--ink);color:#fff}
#violation-table td.kind{font-weight:600;color:var(--bad);white-space:nowrap}
#violation-table td{font-size:12.5px}
p.clean{color:var(--good);font-weight:600}
dl#kinds dt{font:600 12px ui-monospace,"DejaVu Sans Mono",monospace;margin-top:6px}
dl#kinds dt.seen{color:var(--bad)}dl#kinds dd{margin:0 0 0 18px;color:#546e7a;font-size:12.5px}
footer{color:var(--muted);font-size:12px;margin-top:24px}
"""

JS = """
(function () {
  var root = document.documentElement;
  var buttons = Array.prototype.slice.call(document.querySelectorAll('#violation-filter button'));
  buttons.forEach(function (b) {
    b.addEventListener('click', function () {
      var kind = b.getAttribute('data-kind');
      document.querySelectorAll('#violation-table tr.violation').forEach(function (tr) {
        tr.style.display = (kind === 'all' || tr.getAttribute('data-kind') === kind) ? '' : 'none';
      });
      buttons.forEach(function (x) { x.classList.toggle('active', x === b); });
    });
  });
  // hovering a layer highlights that layer in every timeline of its panel
  document.querySelectorAll('g.layer-row[data-layer]').forEach(function (g) {
    var panel = g.closest('details');
    g.addEventListener('mouseenter', function () {
      panel.querySelectorAll('g.layer-row[data-layer="' + g.getAttribute('data-layer') + '"]').forEach(
        function (x) { x.style.opacity = '1'; x.style.filter = 'drop-shadow(0 0 2px #1565c0)'; });
    });
    g.addEventListener('mouseleave', function () {
      panel.querySelectorAll('g.layer-row').forEach(function (x) { x.style.filter = ''; });
    });
  });
  root.setAttribute('data-rendered', 'yes');
})();
"""


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
<style>{CSS}</style>
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
<script>{JS}</script>
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
