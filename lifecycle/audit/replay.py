"""Replay audit logs through the transition table and name every violation.

Each (node, rank, backbone) stream is replayed on its own, event by event, in bounded memory
(`results.StreamReplay`); one that two writers feed, which nothing tells apart, is an input problem (`identity`).
What the replay finds is recorded, bounded, by `findings.Findings`, the auditor's base.
What is legal comes from `lifecycle.states` alone, through `rules`: a transition is legal when its
(trigger, src, dst) is a row of `TRANSITIONS`, and a row whose guard or condition maps to a check (every layer
ready, graphs captured, an exact rollback) needs that check to hold in the replay too.

The auditor never calls clean what it did not see: an input without a single event, and (with `expect_ranks`)
an expected rank without events, are input problems (exit status 2), as unreadable lines are.

>>> from lifecycle.audit.logstream import LogEvent
>>> from lifecycle.states import LifecycleState as S
>>> def ev(n, **f):
...     base = {"backbone": "d", "rank": 0, "epoch": 0, "seq": n}
...     return LogEvent("log", n, {**base, **f}, float(n))
>>> a = Auditor()
>>> _ = a.feed(ev(1, event="transition", trigger="weights_loaded", src=S.META.value, dst=S.PARTIALLY_LOADED.value,
...               layers_ready=0, layers_total=1))
>>> _ = a.feed(ev(2, event="transition", trigger="capture_graphs", src=S.PARTIALLY_LOADED.value,
...               dst=S.GRAPH_CAPTURED.value))
>>> [(v.kind, v.where) for v in a.finish().violations]
[('illegal_transition', 'log:2')]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..states import TRIGGERS, allowed_sources, possible_destinations
from .coverage import unseen
from .findings import Findings
from .identity import behind, one_writer, order_key, withdraw
from .inputs import iter_events
from .logstream import InputProblem, Item, LogEvent
from .results import (
    MAX_BUFFERS,
    MAX_EDGES,
    MAX_LAYERS,
    MAX_NODES,
    AuditResult,
    StreamReplay,
    Violation,
    buffer_key,
)
from .rules import (
    ABORT,
    BEGIN,
    CAPTURE,
    INITIAL,
    LOADING_STATES,
    REFRESH,
    REFRESH_STATES,
    RELEASE,
    ROW_CHECKS,
    STATE_NAMES,
    VIOLATION_KINDS,
    WARNING_KINDS,
    WEIGHTS,
    WEIGHTS_STATES,
    Check,
    unknown_table_names,
)
from .text import clip, collapse_detail, shown

__all__ = ["MAX_STREAMS", "VIOLATION_KINDS", "WARNING_KINDS", "AuditResult", "Auditor", "StreamReplay", "Violation",
           "audit_logs", "unknown_table_names"]


#: (node, rank, backbone) streams replayed, at most: the events of further streams are counted, not audited (an
#: input problem: the audit is incomplete).
MAX_STREAMS = 1024


class Auditor(Findings):
    """Feed it events in log order (`feed`), then `finish()`. Memory: at most `max_streams` `StreamReplay`s (each
    bounded) plus what its `Findings` keep: at most `max_details` violations, warnings and input problems (each
    bounded).

    `expect_ranks`: the ranks whose events the input must hold (every backbone seen on one of them on each);
    one without events is an input problem naming it, and so is a rank outside them."""

    def __init__(self, *, max_details: int = 1000, max_streams: int = MAX_STREAMS,
                 expect_ranks: Collection[int] | None = None) -> None:
        super().__init__(max_details)
        if type(max_streams) is not int or max_streams < 1:
            raise ValueError(f"max_streams must be an int >= 1, got {max_streams!r:.40}")
        if expect_ranks is not None and (not expect_ranks or any(type(r) is not int or r < 0 for r in expect_ranks)):
            raise ValueError("expect_ranks must hold at least one rank, each an int >= 0")
        self.max_streams = max_streams
        self.expect_ranks = frozenset(expect_ranks) if expect_ranks is not None else None
        self.streams: dict[tuple[str | None, int, str], StreamReplay] = {}
        self.untracked_events = 0  # events of streams beyond `max_streams`
        self.clashed_events = 0  # events of streams two writers fed, not replayed
        self._first_untracked: LogEvent | None = None
        self.events = 0

    # ---- replay -------------------------------------------------------------------------------------------
    def feed(self, item: Item) -> StreamReplay | None:
        """Replay one event (or record one input problem). Returns the stream the event belongs to."""
        if isinstance(item, InputProblem):
            self.problem(item)
            return None
        ev = item
        f = ev.fields
        self.saw(ev.source)
        node = f.get("node")
        key = (node, f["rank"], f["backbone"])
        r = self.streams.get(key)
        if r is None:
            if len(self.streams) >= self.max_streams:
                self.untracked_events += 1
                if self._first_untracked is None:
                    self._first_untracked = ev
                return None
            r = self.streams[key] = StreamReplay(f["rank"], f["backbone"], node=node, source=ev.writer, first_ts=ev.ts)
        if r.clash or (not one_writer(r, ev) and withdraw(self, r, ev)):
            self.clashed_events += 1
            return None
        self.events += 1
        r.events += 1
        if node is not None and node not in r.nodes and len(r.nodes) < MAX_NODES:
            r.nodes[node] = None
        name = f["event"]
        is_begin = name == "transition" and f.get("trigger") == BEGIN
        self._order(r, ev, is_begin)
        if name == "transition":
            self._transition(r, ev)
        elif name == "refused":
            self._src_matches(r, ev, f"refused {clip(f['trigger'])}")
        elif name == "layer_ready" or name == "layers_unchanged":
            self._note_total(r, f)
            if self._in_state(r, ev, WEIGHTS_STATES, WEIGHTS):
                self._mark_ready(r, f["layers"])
                r.ready_extra += f.get("layers_more", 0)
        elif name == "refresh":
            self._refresh(r, ev)
        elif name == "storage_check":
            self._storage_check(r, ev)
        elif name == "acceptance_collapse":
            self.warn(r, "acceptance_collapse", ev.where, collapse_detail(f), f["epoch"])
        elif name == "weight_version":
            r.note_version(f["weight_version"], f["epoch"])
        r.last_where = ev.where
        return r

    @staticmethod
    def _mark_ready(r: StreamReplay, layers: Iterable[str]) -> None:
        limit = min(r.layers_total, MAX_LAYERS) if r.layers_total is not None else MAX_LAYERS
        for layer in layers:
            if len(r.ready) < limit:
                r.ready.add(hash(layer))

    def _note_total(self, r: StreamReplay, f: dict[str, Any]) -> None:
        total = f.get("layers_total")
        if isinstance(total, int) and not isinstance(total, bool):
            r.layers_total = total

    def _order(self, r: StreamReplay, ev: LogEvent, is_begin: bool) -> None:
        f = ev.fields
        back: list[str] = []
        seq = f.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool):
            if seq == 1 and r.seq > 0:  # a new lifecycle under this (node, rank, backbone)
                self._end_of_incarnation(r, f"lifecycle restarted at {ev.where}")
                r.restart()
            elif seq > r.seq + 1:
                gap = seq - r.seq - 1
                after = f"after {r.last_where} (seq {r.seq})" if r.seq else "at the start of this stream"
                self.violate(r, "missing_events", ev.where,
                              f"{gap} event(s) missing {after}: this event has seq {seq}", f["epoch"])
            elif seq <= r.seq:
                back.append(f"seq {seq} after seq {r.seq} ({'repeated' if seq == r.seq else 'goes back'})")
            r.seq = max(r.seq, seq)
        if r.last_ts is not None and ev.ts < r.last_ts:
            back.append(f"timestamp {f.get('ts')} is {(r.last_ts - ev.ts) * 1e3:.3f} ms before the previous "
                        f"event's ({r.last_where})")
        epoch = f["epoch"]
        if is_begin:
            if epoch <= r.epoch:
                back.append(f"begin_reload to epoch {epoch} after epoch {r.epoch}")
            elif epoch > r.epoch + 1:
                self.violate(r, "epoch_jump", ev.where,
                              f"begin_reload to epoch {epoch} from epoch {r.epoch} (expected {r.epoch + 1})", epoch)
        elif epoch < r.epoch:
            back.append(f"epoch went back from {r.epoch} to {epoch}")
        elif epoch > r.epoch:
            self.violate(r, "epoch_jump", ev.where,
                          f"epoch {r.epoch} -> {epoch} without begin_reload ({f['event']} {clip(f.get('trigger', ''))})"
                          .rstrip(), epoch)
            self._new_epoch(r, ev, epoch)
        if back:
            self.violate(r, "out_of_order", ev.where, "; ".join(back), epoch)
        if r.last_ts is None or ev.ts > r.last_ts:
            r.last_ts = ev.ts

    def _new_epoch(self, r: StreamReplay, ev: LogEvent, epoch: int) -> None:
        if r.epoch > 0 and not r.epoch_done:
            self.warn(r, "abandoned_epoch", ev.where,
                       f"epoch {r.epoch} (begun at {r.epoch_began or '?'}) was never refreshed or aborted before "
                       f"epoch {epoch} began (a restarted push; its writes stay dirty for the next refresh)", r.epoch)
        r.epoch = max(r.epoch, epoch)
        r.ready.clear()
        r.ready_extra = 0
        r.epoch_done = False
        r.epoch_began = ev.where

    def _src_matches(self, r: StreamReplay, ev: LogEvent, what: str) -> str | None:
        src: str | None = ev.fields.get("src")  # a string or absent: the schema checked the event's types
        if src not in STATE_NAMES:
            self.violate(r, "illegal_transition", ev.where, f"{what}: unknown src state {shown(src)}")
            return None
        if src != r.state_name:
            self.violate(r, "state_mismatch", ev.where,
                          f"{what}: the log says src {src}, the replay says {r.state_name}")
        return src

    def _in_state(self, r: StreamReplay, ev: LogEvent, states: frozenset[str], trigger: str) -> bool:
        if r.state_name in states:
            return True
        self.violate(r, "event_out_of_state", ev.where,
                      f"{ev.fields['event']} in state {r.state_name}, where {trigger} is not allowed "
                      f"(allowed from: {', '.join(s.value for s in allowed_sources(trigger))})")
        return False

    def _transition(self, r: StreamReplay, ev: LogEvent) -> None:
        f = ev.fields
        trigger: str | None = f.get("trigger")  # strings or absent: the schema checked the event's types
        dst: str | None = f.get("dst")
        if trigger not in TRIGGERS:
            self.violate(r, "illegal_transition", ev.where,
                          f"unknown trigger {shown(trigger)}; the table knows: {', '.join(TRIGGERS)}")
            return
        src = self._src_matches(r, ev, trigger)
        if dst is None or dst not in STATE_NAMES:
            self.violate(r, "illegal_transition", ev.where, f"{trigger}: unknown dst state {shown(dst)}")
            return
        if src is None:
            return
        self._note_total(r, f)
        edge = (trigger, src, dst)
        checks = ROW_CHECKS.get(edge)
        if checks is None:
            if edge in r.illegal_edges or len(r.illegal_edges) < MAX_EDGES:
                r.illegal_edges[edge] += 1
            dests = possible_destinations(trigger, STATE_NAMES[src])
            why = (f"{trigger} from {src} leads to {' or '.join(d.value for d in dests)}, not {dst}" if dests else
                   f"{trigger} is not allowed from {src} (allowed from: "
                   f"{', '.join(s.value for s in allowed_sources(trigger))})")
            self.violate(r, "illegal_transition", ev.where, why)
        else:
            r.edges[edge] += 1
            if Check.READY in checks:
                self._check_ready(r, ev, f"{trigger} {src} -> {dst}")
            if not r.pinned and Check.PINNED in checks:
                self.violate(r, "illegal_transition", ev.where,
                              f"{trigger} {src} -> {dst} without captured graphs")
            if not r.recoverable and Check.RECOVERABLE in checks:
                self.violate(r, "illegal_transition", ev.where,
                              f"{trigger} after an abort that was not recoverable (not rolled back exactly)")
        if trigger == BEGIN:
            self._new_epoch(r, ev, f["epoch"])
            r.epochs_begun += 1
        elif trigger == CAPTURE:
            r.pinned = True
            r.pinned_ptrs = dict(r.last_ptrs)
        elif trigger == RELEASE:
            r.pinned = False
            r.pinned_ptrs.clear()
        elif trigger == ABORT:
            r.recoverable = f.get("recoverable") is True
        if checks is not None and Check.RECOVERABLE in checks:
            r.recoverable = False  # recovered once; the next recover needs another exact rollback
        r.state_name = dst
        r.visited.add(dst)
        if dst not in LOADING_STATES and dst != INITIAL:
            r.epoch_done = True

    def _storage_check(self, r: StreamReplay, ev: LogEvent) -> None:
        f = ev.fields
        if f.get("ok") is not False:
            return
        problems = f.get("problems", [])
        more = max(0, len(problems) - 4) + f.get("problems_more", 0)
        self.violate(r, "storage_drift", ev.where,
                      f"storage_check ({clip(f.get('action'))}) failed: {'; '.join(clip(p) for p in problems[:4])}"
                      + (f" (+{more} more)" if more else ""))

    def _check_ready(self, r: StreamReplay, ev: LogEvent, what: str) -> None:
        total = r.layers_total
        if total is None or total > MAX_LAYERS:  # more layers than the replay tracks: not checked
            return
        replayed = r.layers_ready
        claimed = ev.fields.get("layers_ready", replayed)
        if min(replayed, claimed) < total:
            self.violate(r, "not_ready", ev.where,
                          f"{what} with layers missing: {replayed}/{total} ready by the replayed layer_ready events,"
                          f" {claimed}/{total} by the event")

    def _refresh(self, r: StreamReplay, ev: LogEvent) -> None:
        f = ev.fields
        self._in_state(r, ev, REFRESH_STATES, REFRESH)
        missing = f.get("missing")
        if missing:
            self.violate(r, "not_ready", ev.where,
                          f"refresh with {len(missing) + f.get('missing_more', 0)} tensor(s) missing: "
                          + ", ".join(clip(m) for m in missing[:4]))
        for b in f.get("buffers", ()):  # the schema made each a record with a name
            name, ptr = b["name"], b.get("data_ptr")
            if ptr is None or ptr in ("0x0", "0"):
                continue
            key = buffer_key(name)
            if r.pinned:
                pinned = r.pinned_ptrs.get(key)
                if pinned is None:
                    if len(r.pinned_ptrs) < MAX_BUFFERS:
                        r.pinned_ptrs[key] = ptr  # first seen after capture: recorded now
                elif pinned != ptr:
                    self.violate(r, "storage_drift", ev.where,
                                  f"derived buffer {clip(name)} moved under captured graphs: data_ptr {pinned} -> "
                                  f"{ptr} (mode {clip(b.get('mode'))})")
            if key in r.last_ptrs or len(r.last_ptrs) < MAX_BUFFERS:
                r.last_ptrs[key] = ptr

    # ---- end ----------------------------------------------------------------------------------------------
    def _end_of_incarnation(self, r: StreamReplay, how: str) -> None:
        if r.state_name in LOADING_STATES and r.epoch > 0:
            self.violate(r, "ends_mid_reload", r.last_where,
                          f"{how} in state {r.state_name}, epoch {r.epoch} (begun at {r.epoch_began or '?'}) "
                          "never refreshed or aborted")

    def finish(self, given: Sequence[str | Path] = ()) -> AuditResult:
        """End-of-log checks (mid-reload endings, cross-rank epochs) and the result; `given`: the inputs as named."""
        first = self._first_untracked
        if first is not None:  # the audit is incomplete: say so as an input problem (exit status 2)
            self.problem(InputProblem(first.source, first.line, (
                f"{self.untracked_events} event(s) of (rank, backbone) streams beyond the first {self.max_streams} "
                "were not audited (the stream limit, --max-streams: a stream is one node's rank and backbone); this is "
                "the first")))
            self._first_untracked = None
        by_backbone: dict[str, list[StreamReplay]] = {}
        for r in self.streams.values():
            if r.clash:
                continue
            self._end_of_incarnation(r, "log ends")
            by_backbone.setdefault(r.backbone, []).append(r)
        for group in by_backbone.values():
            for r, detail in behind(group):
                self.violate(r, "epoch_disagreement", r.last_where, detail)
        inputs = [str(p) for p in given] or self.inputs
        where = inputs[0] if len(inputs) == 1 else f"<{len(inputs)} inputs>"
        problems, missing = unseen(self.events, {b: {r.rank for r in g} for b, g in by_backbone.items()},
                                   self.expect_ranks)
        for message in problems:
            self.problem(InputProblem(where, None, message))
        return AuditResult(
            inputs=self.inputs, events=self.events,
            streams=sorted(self.streams.values(), key=lambda r: (r.backbone, *order_key(r))),
            violations=list(self.violations), violation_counts=Counter(self.counts),
            input_problems=list(self.input_problems), input_problem_count=self.input_problem_count,
            warnings=list(self.warnings), warning_counts=Counter(self.warning_counts),
            expected_ranks=self.expect_ranks, missing_ranks=missing,
        )


def audit_logs(paths: Sequence[str | Path], *, max_details: int = 1000, max_streams: int = MAX_STREAMS,
               expect_ranks: Collection[int] | None = None) -> AuditResult:
    """Audit JSON-lines logs (files, directories, `-` for stdin), streaming."""
    auditor = Auditor(max_details=max_details, max_streams=max_streams, expect_ranks=expect_ranks)
    for item in iter_events(paths):
        auditor.feed(item)
    return auditor.finish(paths)
