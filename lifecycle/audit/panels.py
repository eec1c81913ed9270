"""One backbone's panel of the HTML report: its state diagram, readiness timelines and derived buffers' addresses.

The panel (`backbone_panel`) holds the state diagram with the path the backbone's ranks took, a layers × time
readiness timeline per rank and epoch, the derived buffers' addresses per epoch, and the epochs grouped by the
trainer's `weight_version`; `label` and `slug` are the names and ids the whole page (`report`) shows values under.

Every value read from a log reaches the page through a MarkupSafe template (see `markup`). The figures drawn are
bounded across the report by the caller's budget (`backbone_panel(..., figure_budget=)`).
"""

from __future__ import annotations

import re
from collections import Counter

from markupsafe import Markup

from .markup import number
from .results import StreamReplay, Violation
from .svg import state_diagram_svg
from .text import abbreviate, clip
from .timeline import timeline_svg
from .traces import SHOWN_CAP, EpochTrace, StreamTrace

__all__ = ["backbone_panel", "label", "slug"]


def slug(*parts: object) -> str:
    """An HTML id made of `parts` (each clipped): letters, digits, `_` and `-` only."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", "-".join(clip(p, SHOWN_CAP) for p in parts)).strip("-")


def label(value: str) -> str:
    """A name read from a log (a backbone, a node, a weight_version) as the page shows it: abbreviated."""
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
    uid = slug("timeline", "r", st.rank, *(("n", node) if node else ()), st.backbone, "i", tr.incarnation, "e",
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
    return f"{rank} on {label(node)}" if node else rank


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
    return _BUFFERS.format(id=slug("buffers", "r", st.rank, *(("n", node) if node else ()), st.backbone),
                           head=head, rows=Markup().join(rows),
                           more=_BUFFERS_MORE.format(n=more) if more else "")


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


def backbone_panel(backbone: str, replays: list[StreamReplay], traces: list[StreamTrace],
                   violations: list[Violation], open_: bool, figure_budget: list[int]) -> Markup:
    """The panel of `backbone` (its streams' `replays` and, of those the collector traced, their `traces`; every
    violation of the audit, this backbone's picked out), open when `open_`. `figure_budget`: a one-item list, the
    timelines the report may still draw, lowered by those drawn here (each stream's latest epochs)."""
    taken: Counter[tuple[str, str, str]] = Counter()
    illegal: Counter[tuple[str, str, str]] = Counter()
    visited: set[str] = set()
    for r in replays:
        taken.update(r.edges)
        illegal.update(r.illegal_edges)
        visited |= r.visited
    current = {r.state.value for r in replays}
    diagram = state_diagram_svg(taken, illegal=illegal, visited=visited, current=current,
                                uid=slug("diagram", backbone))
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
            rows = Markup().join(_VERSION_ROW.format(v=label(v), epochs=", ".join(map(str, e)))
                                 for v, e in versions.items())
            tables.append(_VERSIONS.format(id=slug("versions", "r", st.rank, *(("n", node) if node else ()),
                                                   backbone), rows=rows))
    verdict = _PANEL_BAD.format(n=len(bad)) if bad else _PANEL_CLEAN
    summary = _PANEL_SUMMARY.format(name=label(backbone), ranks=", ".join(str(r.rank) for r in replays),
                                    states=", ".join(sorted(current)), verdict=verdict)
    return _PANEL.format(slug=slug("backbone", backbone), open=Markup(" open") if open_ else "", summary=summary,
                         diagram=diagram, figures=Markup().join(figures), tables=Markup().join(tables))
