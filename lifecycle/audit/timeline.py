"""The per-layer readiness timeline of one epoch as inline SVG: a row per layer, grey while it waits, then
green once ready (blue-grey: declared unchanged), red rows for layers that never became ready, and numbered
vertical marks for the lifecycle's steps and refusals.

>>> tr = EpochTrace(1, 0, 0.0, 0.002, layers_total=2, layers={"layers.0": (0.001, "ready")})
>>> svg = timeline_svg(tr, "t")
>>> svg.count('class="ready"'), svg.count('class="missing"'), "1 layer(s) never ready" in svg
(1, 1, True)
"""

from __future__ import annotations

import re
from html import escape as esc
from typing import Any

from .traces import EpochTrace

__all__ = ["timeline_svg"]


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
