"""What the report draws, collected while the auditor replays: per (node, rank, backbone), the latest epochs, each with
when every layer became ready, the lifecycle's steps and refusals, and the derived buffers' addresses after its
last refresh.

All of it is bounded whatever the log: the first `MAX_TRACED` streams are traced (the others are still audited
and listed), each keeps its latest `max_epochs` epochs (at most `MAX_EPOCHS`), each epoch at most `MAX_LAYERS`
layers (the rest counted), `MAX_MARKS` steps, `MAX_STATES` states and `MAX_BUFFERS` derived buffers, and every
name or text is kept cut at `SHOWN_CAP` characters (a layer or buffer name in the middle, where names of one
log differ least). Nothing holds on to an event's own fields.

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
from .text import abbreviate, clip

__all__ = ["MARKED_TRIGGERS", "MAX_BUFFERS", "MAX_EPOCHS", "MAX_LAYERS", "MAX_MARKS", "MAX_STATES", "MAX_TRACED",
           "SHOWN_CAP", "EpochTrace", "ReportCollector", "StreamTrace"]

#: Per epoch: layers drawn, steps (transitions, refusals) marked, states on the path, derived buffers, at most.
MAX_LAYERS, MAX_MARKS, MAX_STATES, MAX_BUFFERS = 256, 64, 64, 64
#: Streams traced (drawn), and epochs kept per stream, at most.
MAX_TRACED, MAX_EPOCHS = 32, 50
#: Characters of a name or text kept for the pictures, at most.
SHOWN_CAP = 160
#: Lifecycle steps drawn as marks on the timeline: every trigger of the table but the per-bucket bookkeeping
#: (`Transition.per_bucket`: weights_loaded, which the layer_ready rows already show).
MARKED_TRIGGERS: frozenset[str] = frozenset(TRIGGERS) - {t.trigger for t in TRANSITIONS if t.per_bucket}
#: The fields of a derived buffer's record the report shows.
BUFFER_SHOWN = ("kind", "mode", "nbytes", "data_ptr")


@dataclass
class EpochTrace:
    """What one (node, rank, backbone) did in one epoch, for the pictures."""

    incarnation: int
    epoch: int
    start: float
    end: float
    layers_total: int | None = None
    layers: dict[str, tuple[float, str]] = field(default_factory=dict)  # layer -> (time, "ready" | "unchanged")
    layers_more: int = 0  # layers that became ready beyond MAX_LAYERS (not drawn one by one)
    unchanged_more: int = 0
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # (time, text, css class)
    states: list[str] = field(default_factory=list)
    buffers: dict[str, dict[str, Any]] = field(default_factory=dict)  # after the last refresh in this epoch
    buffers_more: int = 0
    refreshed_pinned: bool = False
    refused: int = 0
    weight_version: str | None = None  # the trainer's, for this epoch's push (`weight_version` event)


@dataclass
class StreamTrace:
    rank: int
    backbone: str
    epochs: deque[EpochTrace]
    dropped: int = 0  # older epochs not kept
    node: str | None = None


class ReportCollector:
    """Collects the pictures' data from the events the auditor replays (call `observe` after `Auditor.feed`)."""

    def __init__(self, max_epochs: int = 12, *, max_traced: int = MAX_TRACED) -> None:
        if type(max_epochs) is not int or not 1 <= max_epochs <= MAX_EPOCHS:
            raise ValueError(f"max_epochs must be an int from 1 to {MAX_EPOCHS}, got {max_epochs!r:.40}")
        self.max_epochs = max_epochs
        self.max_traced = max_traced
        self.streams: dict[tuple[str | None, int, str], StreamTrace] = {}
        self.untraced: set[tuple[str | None, int, str]] = set()  # beyond max_traced (at most the auditor's)

    def _trace(self, r: StreamReplay, ev: LogEvent) -> EpochTrace | None:
        st = self.streams.get(r.key)
        if st is None:
            if len(self.streams) >= self.max_traced:
                self.untraced.add(r.key)
                return None
            st = self.streams[r.key] = StreamTrace(r.rank, r.backbone, deque(maxlen=self.max_epochs), node=r.node)
        cur = st.epochs[-1] if st.epochs else None
        if cur is None or cur.epoch != r.epoch or cur.incarnation != r.incarnations:
            if len(st.epochs) == st.epochs.maxlen:
                st.dropped += 1
            cur = EpochTrace(r.incarnations, r.epoch, ev.ts, ev.ts, states=[] if ev.fields["event"] == "transition"
                             and ev.fields["trigger"] == BEGIN else [r.state.value])
            st.epochs.append(cur)
        return cur

    def observe(self, ev: LogEvent, r: StreamReplay) -> None:
        tr = self._trace(r, ev)
        if tr is None:
            return
        f = ev.fields
        tr.end = max(tr.end, ev.ts)
        if "layers_total" in f:
            tr.layers_total = f["layers_total"]
        name = f["event"]
        if name == "layer_ready":
            self._layers(tr, f["layers"], "ready", ev.ts)
            tr.layers_more += f.get("layers_more", 0)
        elif name == "layers_unchanged":
            self._layers(tr, f["layers"], "unchanged", ev.ts)
            tr.unchanged_more += f.get("layers_more", 0)
        elif name == "transition":
            trigger, src, dst = (clip(f[k], SHOWN_CAP) for k in ("trigger", "src", "dst"))
            if trigger == BEGIN and not tr.states:
                tr.states.append(src)
            if (not tr.states or tr.states[-1] != dst) and len(tr.states) < MAX_STATES:
                tr.states.append(dst)
            if trigger in MARKED_TRIGGERS:
                self._mark(tr, ev.ts, f"{trigger} {src} → {dst}", f"mark-{trigger}")
        elif name == "refused":
            tr.refused += 1
            self._mark(tr, ev.ts, f"refused {clip(f['trigger'], SHOWN_CAP)} ({clip(f.get('error'), SHOWN_CAP)}) in "
                                  f"{clip(f['src'], SHOWN_CAP)}", "mark-refused")
        elif name == "refresh" and "buffers" in f:
            buffers = f["buffers"]
            tr.buffers = {abbreviate(b["name"], SHOWN_CAP): {k: clip(b[k], SHOWN_CAP) if type(b[k]) is str else b[k]
                                                       for k in BUFFER_SHOWN if k in b}
                          for b in buffers[:MAX_BUFFERS]}
            tr.buffers_more = max(0, len(buffers) - MAX_BUFFERS) + f.get("buffers_more", 0)
            tr.refreshed_pinned = r.pinned
        elif name == "weight_version":
            tr.weight_version = clip(f["weight_version"], SHOWN_CAP)
        elif name == "storage_check" and f["ok"] is False:
            self._mark(tr, ev.ts, f"storage check failed ({clip(f.get('action'), SHOWN_CAP)})", "mark-drift")
        elif name == "acceptance_collapse":
            self._mark(tr, ev.ts, f"acceptance collapse: {f['accepted_share']:.3f} of {f['draft_tokens']} draft "
                                  f"tokens accepted, {f['previous_share']:.3f} before", "mark-drift")
        elif name == "acceptance" and f.get("final") is True:
            share = f.get("accepted_share")
            self._mark(tr, ev.ts, f"acceptance {'-' if share is None else f'{share:.3f}'} "
                                  f"({f['accepted_tokens']}/{f['draft_tokens']} draft tokens)", "mark-acceptance")

    @staticmethod
    def _layers(tr: EpochTrace, layers: list[str] | tuple[str, ...], kind: str, t: float) -> None:
        for layer in layers:
            shown = abbreviate(layer, SHOWN_CAP)
            if shown in tr.layers:
                continue
            if len(tr.layers) < MAX_LAYERS:
                tr.layers[shown] = (t, kind)
            else:
                tr.layers_more += 1

    @staticmethod
    def _mark(tr: EpochTrace, t: float, text: str, cls: str) -> None:
        if len(tr.marks) < MAX_MARKS:
            tr.marks.append((t, text, cls))
