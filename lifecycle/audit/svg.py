"""The state diagram as inline SVG, laid out and drawn here from the transition table (no JS, no fonts, no network),
with the transitions a log actually took highlighted. Written as MarkupSafe templates (every value escaped).

Layout: a state's column is the longest path to it from the initial state over edges that lead to a state
declared later in `LifecycleState` (the forward direction of the lifecycle); states sharing a column stack in
rows. Edges of the table are grouped per (src, dst) and labelled with their triggers.

>>> from lifecycle.states import LifecycleState as S
>>> captured = S.GRAPH_CAPTURED.value
>>> svg = state_diagram_svg({("capture_graphs", S.DERIVED_REFRESHED.value, captured): 2}, current={captured})
>>> svg.count('class="edge taken"'), f'class="state current" data-state="{captured}"' in svg
(1, True)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cache

from markupsafe import Markup

from ..states import INITIAL_STATE, TRANSITIONS, LifecycleState

__all__ = ["Edge", "layout", "state_diagram_svg"]

COL_W, ROW_H = 310, 250  # distance between columns / rows
NODE_W, NODE_H = 150, 44
LEFT, TOP = 150, 280  # centre of column 0 / row 0
LINE_H = 13  # label line height
Edge = tuple[str, str, str]  # (trigger, src, dst)


@dataclass
class _Arc:
    src: str
    dst: str
    labels: list[str] = field(default_factory=list)  # one per table row: "trigger [condition]"
    triggers: list[str] = field(default_factory=list)


@cache
def layout() -> dict[str, tuple[int, int]]:
    """State -> (column, row)."""
    order = {s.value: i for i, s in enumerate(LifecycleState)}
    col = {s.value: 0 for s in LifecycleState}
    forward = {(s.value, t.dest.value) for t in TRANSITIONS for s in t.sources if order[t.dest.value] > order[s.value]}
    for _ in order:  # longest path over a DAG: relax |V| times
        for a, b in forward:
            col[b] = max(col[b], col[a] + 1)
    col[INITIAL_STATE.value] = 0
    rows: dict[int, int] = {}
    out = {}
    for s in LifecycleState:
        c = col[s.value]
        out[s.value] = (c, rows.get(c, 0))
        rows[c] = rows.get(c, 0) + 1
    return out


def _centre(state: str) -> tuple[float, float]:
    c, r = layout()[state]
    return LEFT + c * COL_W, TOP + r * ROW_H


@cache
def _arcs() -> tuple[_Arc, ...]:
    arcs: dict[tuple[str, str], _Arc] = {}
    for t in TRANSITIONS:
        for s in t.sources:
            arc = arcs.setdefault((s.value, t.dest.value), _Arc(s.value, t.dest.value))
            arc.labels.append(t.trigger + (f" [{t.condition}]" if t.condition else ""))
            arc.triggers.append(t.trigger)
    return tuple(arcs.values())


def _geometry(src: str, dst: str) -> tuple[str, float, float, str]:
    """(SVG path, label x, label y, where the label sits: 'above' or 'below' that point) for an edge."""
    (x1, y1), (x2, y2) = _centre(src), _centre(dst)
    hw, hh = NODE_W / 2, NODE_H / 2
    c1, r1 = layout()[src]
    c2, r2 = layout()[dst]
    span = abs(c2 - c1)
    if src == dst:  # a loop under the node
        return (f"M{x1 - 26},{y1 + hh} C{x1 - 60},{y1 + hh + 60} {x1 + 60},{y1 + hh + 60} {x1 + 26},{y1 + hh}",
                x1, y1 + hh + 50, "below")
    if r1 == r2:
        if c2 == c1 + 1:  # forward neighbour: straight, labelled above
            return f"M{x1 + hw},{y1} L{x2 - hw},{y2}", (x1 + x2) / 2, y1 - 8, "above"
        if c2 > c1:  # forward, skipping columns: under the row, deeper than the loops
            d = 2 * (60 + 35 * span)
            return (f"M{x1 + 30},{y1 + hh} Q{(x1 + x2) / 2},{y1 + hh + d} {x2 - 30},{y2 + hh}",
                    (x1 + x2) / 2, y1 + hh + d / 2 - 2, "below")
        h = 40 + 50 * span  # backward: over the row, wider spans higher; ends spread over the node's top
        sx, ex = x1 - 12 * span, x2 + 12 * span
        return (f"M{sx},{y1 - hh} Q{(sx + ex) / 2},{y1 - hh - 2 * h} {ex},{y2 - hh}",
                (sx + ex) / 2, y1 - hh - h - 5, "above")
    if r2 > r1:  # down a row: from the bottom right of src to the left side (or top, if adjacent) of dst
        sx = x1 + 48
        if span <= 1:
            return (f"M{sx},{y1 + hh} C{sx + 40},{y2 - 90} {x2 - 40},{y2 - hh - 60} {x2 - 40},{y2 - hh}",
                    (sx + x2) / 2 + 30, (y1 + y2) / 2 + 30, "above")
        return (f"M{sx},{y1 + hh} C{sx},{y2 - 10} {x2 - hw - 80},{y2} {x2 - hw},{y2}",
                x2 - hw - 70, y2 - 8, "above")
    # up a row: from the bottom of src round under everything to the bottom left of dst
    lowest = TOP + max(r for _, r in layout().values()) * ROW_H + hh
    return (f"M{x1},{y1 + hh} C{x1},{lowest + 90} {x2 - 70},{lowest + 90} {x2 - 52},{y2 + hh}",
            (x1 + x2) / 2, lowest + 58, "below")


_SPAN = Markup('<tspan x="{x:.1f}" y="{y:.1f}" class="{cls}">{line}</tspan>')
_LABEL = Markup('<text class="edge-label" text-anchor="middle">{spans}</text>')


def _label(x: float, y: float, side: str, lines: list[str], classes: list[str]) -> Markup:
    n = len(lines)
    first = y - (n - 1) * LINE_H if side == "above" else y + LINE_H
    spans = Markup().join(_SPAN.format(x=x, y=first + i * LINE_H, cls=classes[i], line=line)
                          for i, line in enumerate(lines))
    return _LABEL.format(spans=spans)


_SVG = Markup('<svg xmlns="http://www.w3.org/2000/svg" class="state-diagram" id="{uid}" viewBox="0 0 {w} {h:.0f}" '
              'width="{w}" height="{h:.0f}" role="img" aria-label="reload lifecycle state diagram"><defs>')
_MARKER = Markup('<marker id="{uid}-{kind}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="11" markerHeight="11" '
                 'orient="auto-start-reverse" markerUnits="userSpaceOnUse"><path d="M0,0 L10,5 L0,10 z" '
                 'class="arrow-{kind}"/></marker>')
_INITIAL = Markup('<circle class="initial" cx="{cx}" cy="{iy}" r="7"/><path class="edge" d="M{x1},{iy} L{x2},{iy}" '
                  'marker-end="url(#{uid}-plain)"/>')
_ARC = Markup('<path class="{cls}" d="{d}" data-src="{src}" data-dst="{dst}" marker-end="url(#{uid}-{marker})">'
              '<title>{src} → {dst}: {labels}</title></path>')
_ILLEGAL = Markup('<path class="edge illegal" d="M{x1},{y1} Q{cx},{cy} {x2},{y2}" marker-end="url(#{uid}-illegal)">'
                  '<title>illegal: {trigger} {src} → {dst}</title></path><text class="edge-label illegal" '
                  'x="{lx:.1f}" y="{ly:.1f}" text-anchor="middle">illegal: {trigger} ×{k}</text>')
_STATE = Markup('<g class="{cls}" data-state="{state}"><rect x="{x}" y="{y}" width="{w}" height="{h}" rx="10"/><text '
                'x="{cx}" y="{ty}" text-anchor="middle">{state}</text></g>')


def state_diagram_svg(taken: Mapping[Edge, int], *, illegal: Mapping[Edge, int] | None = None,
                      visited: Collection[str] = (), current: Collection[str] = (), uid: str = "d") -> Markup:
    """The table as an SVG state diagram. `taken`: (trigger, src, dst) -> how often the log took it (drawn
    thick, with the count); `illegal`: transitions the log took that the table does not have (red, dashed);
    `visited` and `current` states are filled and outlined."""
    illegal = illegal or {}
    cols = max(c for c, _ in layout().values()) + 1
    rows = max(r for _, r in layout().values()) + 1
    width = LEFT * 2 + (cols - 1) * COL_W
    height = TOP + (rows - 1) * ROW_H + NODE_H / 2 + 120
    parts = [
        _SVG.format(uid=uid, w=width, h=height),
        *(_MARKER.format(uid=uid, kind=kind) for kind in ("plain", "taken", "illegal")),
        Markup("</defs>"),
    ]
    ix, iy = _centre(INITIAL_STATE.value)
    parts.append(_INITIAL.format(cx=ix - NODE_W / 2 - 40, iy=iy, x1=ix - NODE_W / 2 - 33, x2=ix - NODE_W / 2, uid=uid))
    for arc in _arcs():
        d, lx, ly, side = _geometry(arc.src, arc.dst)
        counts = [taken.get((t, arc.src, arc.dst), 0) for t in arc.triggers]
        n = sum(dict(zip(arc.triggers, counts, strict=True)).values())  # a trigger on two rows counts once
        cls = "edge taken" if n else "edge"
        parts.append(_ARC.format(cls=cls, d=d, src=arc.src, dst=arc.dst, uid=uid, marker="taken" if n else "plain",
                                 labels=", ".join(arc.labels)))
        seen: set[str] = set()
        lines, classes = [], []
        for label, trig, k in zip(arc.labels, arc.triggers, counts, strict=True):
            head, _, cond = label.partition(" ")
            if k and trig not in seen:
                head += f" ×{k}"
            seen.add(trig)
            lines += [head, cond] if cond else [head]
            classes += ["taken" if k else "", "cond"] if cond else ["taken" if k else ""]
        parts.append(_label(lx, ly, side, lines, classes))
    for (trigger, src, dst), k in illegal.items():
        if src not in layout() or dst not in layout():
            continue
        (x1, y1), (x2, y2) = _centre(src), _centre(dst)
        y1, y2 = y1 + NODE_H / 2, y2 + NODE_H / 2
        depth = 70 + 25 * abs(x2 - x1) / COL_W
        parts.append(_ILLEGAL.format(x1=x1 + 10, y1=y1, cx=(x1 + x2) / 2, cy=max(y1, y2) + 2 * depth, x2=x2 - 10,
                                     y2=y2, uid=uid, trigger=trigger, src=src, dst=dst, lx=(x1 + x2) / 2,
                                     ly=max(y1, y2) + depth + 16, k=k))
    for state in LifecycleState:
        x, y = _centre(state.value)
        classes = ["state"] + (["visited"] if state.value in visited else []) + (
            ["current"] if state.value in current else [])
        parts.append(_STATE.format(cls=" ".join(classes), state=state.value, x=x - NODE_W / 2, y=y - NODE_H / 2,
                                   w=NODE_W, h=NODE_H, cx=x, ty=y + 4.5))
    parts.append(Markup("</svg>"))
    return Markup().join(parts)
