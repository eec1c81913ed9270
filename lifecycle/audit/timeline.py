"""The per-layer readiness timeline of one epoch as inline SVG: a row per layer, grey while it waits, then
green once ready (blue-grey: declared unchanged), red rows for layers that never became ready, and numbered
vertical marks for the lifecycle's steps and refusals. Written as MarkupSafe templates (every value escaped).

>>> tr = EpochTrace(1, 0, 0.0, 0.002, layers_total=2, layers={"layers.0": (0.001, "ready")})
>>> svg = timeline_svg(tr, "t")
>>> svg.count('class="ready"'), svg.count('class="missing"'), "1 layer(s) never ready" in svg
(1, 1, True)
"""

from __future__ import annotations

import re
from typing import Any

from markupsafe import Markup

from .traces import EpochTrace

__all__ = ["timeline_svg"]


def _layer_key(name: str) -> tuple[Any, ...]:
    """Natural order (layers.2 before layers.10): the digit runs (the odd parts of the split) compare as ints."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name)))


TL_W, TL_LEFT, TL_RIGHT, ROW, TL_TOP, TL_BOTTOM = 1240, 170, 24, 18, 30, 30

_SVG = Markup('<svg xmlns="http://www.w3.org/2000/svg" class="timeline" id="{uid}" viewBox="0 0 {w} {h}" width="{w}" '
              'height="{h}" role="img" aria-label="per-layer readiness, epoch {epoch}">')
_TICK = Markup('<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}"/><text class="tick-label" '
               'x="{x:.1f}" y="{label_y}" text-anchor="middle">{ms:.2f} ms</text>')
_LAYER = Markup('<g class="layer-row" data-layer="{name}"><text class="layer-label" x="{label_x}" y="{text_y}" '
                'text-anchor="end">{name}</text><rect class="waiting" x="{left}" y="{bar_y}" width="{wait:.1f}" '
                'height="{bar_h}"/><rect class="{kind}" x="{ready_x:.1f}" y="{bar_y}" width="{rest:.1f}" '
                'height="{bar_h}"><title>{name} {kind} at +{ms:.3f} ms</title></rect></g>')
_SUMMARY_ROW = Markup('<g class="layer-row {cls}-row"><text class="layer-label" x="{label_x}" y="{text_y}" '
                      'text-anchor="end">{n} layer(s) {label}</text><rect class="{cls}" x="{left}" y="{bar_y}" '
                      'width="{plot}" height="{bar_h}"/></g>')
_MARK = Markup('<g class="mark {cls}"><line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}"/><circle cx="{x:.1f}" '
               'cy="{cy}" r="8"/><text x="{x:.1f}" y="{ty}" text-anchor="middle">{i}</text><title>{i}: {text} at '
               '+{ms:.3f} ms</title></g>')


def timeline_svg(tr: EpochTrace, uid: str) -> Markup:
    """Layers × time for one epoch: grey while a layer waits, green once ready (blue-grey: declared unchanged),
    red for layers that never became ready; numbered vertical marks for the lifecycle's steps and refusals."""
    layers = sorted(tr.layers.items(), key=lambda kv: _layer_key(kv[0]))
    never = max(0, (tr.layers_total or 0) - len(layers) - tr.layers_more - tr.unchanged_more)
    summary = [(label, cls, n) for label, cls, n in (("ready (not drawn)", "ready", tr.layers_more),
                                                      ("unchanged (not named)", "unchanged", tr.unchanged_more),
                                                      ("never ready", "missing", never)) if n]
    height = TL_TOP + max(len(layers) + len(summary), 1) * ROW + TL_BOTTOM
    span = max(tr.end - tr.start, 1e-6)
    plot = TL_W - TL_LEFT - TL_RIGHT

    def x(t: float) -> float:
        return TL_LEFT + (t - tr.start) / span * plot

    out = [_SVG.format(uid=uid, w=TL_W, h=height, epoch=tr.epoch)]
    for i in range(6):  # time axis
        t = tr.start + span * i / 5
        out.append(_TICK.format(x=x(t), top=TL_TOP - 4, bottom=height - TL_BOTTOM, label_y=height - TL_BOTTOM + 16,
                                ms=(t - tr.start) * 1e3))
    y = TL_TOP
    for name, (t, kind) in layers:
        ready_x = x(t)
        out.append(_LAYER.format(name=name, label_x=TL_LEFT - 8, text_y=y + 13, left=TL_LEFT, bar_y=y + 3,
                                 wait=max(ready_x - TL_LEFT, 0), bar_h=ROW - 6, kind=kind, ready_x=ready_x,
                                 rest=max(TL_W - TL_RIGHT - ready_x, 1.5), ms=(t - tr.start) * 1e3))
        y += ROW
    for label, cls, n in summary:
        out.append(_SUMMARY_ROW.format(cls=cls, label_x=TL_LEFT - 8, text_y=y + 13, n=n, label=label, left=TL_LEFT,
                                       bar_y=y + 3, plot=plot, bar_h=ROW - 6))
        y += ROW
    for i, (t, text, cls) in enumerate(tr.marks, 1):
        out.append(_MARK.format(cls=cls, x=x(t), top=TL_TOP - 10, bottom=height - TL_BOTTOM, cy=TL_TOP - 16,
                                ty=TL_TOP - 12, i=i, text=text, ms=(t - tr.start) * 1e3))
    out.append(Markup("</svg>"))
    return Markup().join(out)
