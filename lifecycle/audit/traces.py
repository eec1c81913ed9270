"""What the report draws, collected while the auditor replays: per (rank, backbone), the latest epochs, each with
when every layer became ready, the lifecycle's steps and refusals, and the derived buffers' addresses after its
last refresh (all bounded: `MAX_LAYERS` layers and `MAX_MARKS` steps per epoch, `max_epochs` epochs per stream).

>>> sorted(set(TRIGGERS) - MARKED_TRIGGERS)
['weights_loaded']
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..states import TRANSITIONS, TRIGGERS
from .logstream import LogEvent
from .results import StreamReplay
from .rules import BEGIN

__all__ = ["MARKED_TRIGGERS", "MAX_LAYERS", "MAX_MARKS", "EpochTrace", "ReportCollector", "StreamTrace"]

#: Layers remembered per epoch, and steps (transitions, refusals) per epoch, at most.
MAX_LAYERS, MAX_MARKS = 512, 64
#: Lifecycle steps drawn as marks on the timeline: every trigger of the table but the per-bucket bookkeeping
#: (`Transition.per_bucket`: weights_loaded, which the layer_ready rows already show).
MARKED_TRIGGERS: frozenset[str] = frozenset(TRIGGERS) - {t.trigger for t in TRANSITIONS if t.per_bucket}


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
                             and ev.fields.get("trigger") == BEGIN else [r.state.value])
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
            if trigger == BEGIN and not tr.states:
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
