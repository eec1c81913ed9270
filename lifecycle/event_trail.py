"""The audit trail of one lifecycle: its numbered events, the last ones kept, the per-bucket ones written in batches.

Every info-level event is numbered (`seq`: 1, 2, ... per lifecycle, so the auditor sees a deleted, duplicated or
reordered line as a gap or a step back, and a restart as a new lifecycle) and kept, bounded as written, in
`recent_events` (the worker RPCs read it); once an audit write failed in this process, each kept event also says
how many have (`sink_failures`). Auditing never changes what the lifecycle does: a failed write is counted, not
raised.

The per-bucket events (`layer_ready`, `layers_unchanged`) are the hot path: where the route allows it
(`events.hold_events`) they are held as tuples and written in batches, their JSON lines formatted here from the
tuples (`_held_lines`); everything else goes through `lifecycle.events` one record at a time.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import deque
from typing import Any, cast

from . import events, names
from .events import HOLD_KEEP, HOLD_NONE, HOLD_WRITE, LIST_CAP
from .readiness import LayerReadiness

__all__ = ["AuditTrail"]


#: A string the JSON encoder writes as it is, between quotes (ensure_ascii escapes anything else).
_AS_IS_IN_JSON = re.compile(r'[ !#-\[\]-~]*')


class AuditTrail:
    """The audit trail of the lifecycle of backbone `name` on `rank` (see the module doc). `holds_events`: whether
    its per-bucket events may be held back (one thread only: an unlocked lifecycle); `recent_events`: how many
    events are kept."""

    def __init__(self, name: str, rank: int, readiness: LayerReadiness, *, holds_events: bool, recent_events: int
                 ) -> None:
        self.name = self.requested_name = name
        self._named_in: Any = None  # the audit file the name was claimed in (`names.claim_for`)
        self.rank = rank
        self.readiness = readiness
        # a held event is kept as its tuple (see `flush_events`) until `recent_events` is read; `_unbuilt`: how many
        # of the last kept entries may still be tuples
        self._recent: deque[dict[str, Any] | tuple[Any, ...]] = deque(maxlen=recent_events)
        self._unbuilt = 0
        # per-bucket events held back (see `_audit_layers`)
        self._held: list[tuple[Any, ...]] = []
        self._holds_events = holds_events
        if holds_events:
            events.register_holder(self)
        self._seq = 0
        # the per-bucket event is built field by field, without `events.bound_fields`, when every value it can
        # hold is known to be within the bounds: the backbone's name, its layer names, the rank
        self._plain_layer_events = (
            type(rank) is int and -(2 ** 63) <= rank < 2 ** 63 and len(name) <= events.STR_CAP
            and all(len(layer) <= events.STR_CAP for layer in readiness.tensors_of_layer))
        # ... and then, its names being strings, its line in a JSON file is formatted from the tuple held
        # (`_held_lines`), with the fields every such event of a kind begins with encoded once
        self._line_prefixes: dict[str, str] | None = (
            {} if self._plain_layer_events
            and all(isinstance(n, str) for n in (name, *readiness.tensors_of_layer)) else None)
        # ... and its layer names written between quotes as they are, when the JSON encoder would write them so
        # (printable ASCII, no quote or backslash: `layers.12`), else each encoded (`events.encode_string`)
        self._layers_as_is = self._line_prefixes is not None and all(
            map(_AS_IS_IN_JSON.fullmatch, readiness.tensors_of_layer))

    @property
    def recent_events(self) -> deque[dict[str, Any]]:
        """The last events, bounded as written (the worker RPCs read it); held events are written first. Read it
        anew after later events: the deque is the same object, but the held events it gains are built into
        records when it is read."""
        if self._held:
            self.flush_events()
        if self._unbuilt:
            self._build_kept()
        return cast("deque[dict[str, Any]]", self._recent)  # every entry a record now

    def _build_kept(self) -> None:
        """Replace the held events kept as tuples by their records, in place (the deque stays the same object,
        a record already built stays the same dict)."""
        recent = self._recent
        tail = [recent.pop() for _ in range(min(self._unbuilt, len(recent)))]
        recent.extend(self._held_record(item) if type(item) is tuple else item for item in reversed(tail))
        self._unbuilt = 0

    @property
    def epoch(self) -> int:
        return self.readiness.epoch

    def __del__(self) -> None:
        # held per-bucket events of a lifecycle dropped before its next event: written, not lost (the registry
        # of holders is weak, so the exit flush would not find them)
        if getattr(self, "_held", None):
            with contextlib.suppress(Exception):
                self.flush_events()

    def _readiness_fields(self) -> dict[str, Any]:
        return {"layers_ready": self.readiness.layers_ready, "layers_total": self.readiness.layers_total}

    def _audit(self, event: str, *, level: str = "info", **fields: Any) -> None:
        if self._named_in is not events.route_sink():  # one stream per name and audit file
            names.claim_for(self)
        if level == "debug":  # per-bucket detail: not numbered, a log at info level has no gaps in `seq`
            if events.enabled(level):  # checked first: a filtered event costs a comparison
                if self._held:
                    self.flush_events()
                events.emit(event, level=level, backbone=self.name, rank=self.rank, epoch=self.epoch, **fields)
            return
        self._seq += 1
        # bounded once: the same record is written and kept (a 5 MB reason is cut in memory too)
        self._keep(events.bound_fields({"event": event, "backbone": self.name, "rank": self.rank,
                                        "epoch": self.epoch, "seq": self._seq, **fields}), level)

    def _audit_layers(self, event: str, layers: list[str], tensors: int | None = None, at_ns: int | None = None
                      ) -> None:
        """A `layer_ready` or `layers_unchanged` event: the layers (at most `events.LIST_CAP`, the rest counted in
        `layers_more`), the bucket's `tensors` (layer_ready) and the readiness counts.

        The per-bucket hot path. When the route allows it (`events.hold_events`: a JSON file alone, or nothing)
        the event is held as a tuple, numbered and timed now, and written with the others of its batch (one
        `write(2)`) before this lifecycle's next other event, when `recent_events` is read, after
        `events.HOLD_MAX` events or `events.HOLD_NS`, before the route changes, and at exit. A process killed
        mid-load loses at most that batch of `layer_ready` lines (the epoch reads as unfinished either way)."""
        if self._named_in is not events.route_sink():  # one stream per name and audit file
            names.claim_for(self, at_ns)
        readiness = self.readiness
        self._seq = seq = self._seq + 1
        # the counts read from their fields (`layers_ready`, `layers_total`): properties cost a call each
        self._hold_layer_events([(event, seq, readiness.epoch, layers[:LIST_CAP], len(layers), tensors,
                                  readiness._complete, len(readiness.tensors_of_layer),
                                  time.time_ns() if at_ns is None else at_ns)])

    def _audit_whole_layers(self, layers: list[str], buckets: list[tuple[list[str], int]], ready_before: int
                            ) -> None:
        """One `layer_ready` event per bucket of `buckets`, `buckets[i]` being every tensor of `layers[i]` (written
        at its time), completing the layers in order from `ready_before` layers ready: the events
        `_audit_layers` makes for them one by one, made in one pass (a load's reports come in one call)."""
        if self._named_in is not events.route_sink():  # one stream per name and audit file
            names.claim_for(self, buckets[0][1] if buckets else None)
        readiness = self.readiness
        seq, epoch, total = self._seq, readiness.epoch, len(readiness.tensors_of_layer)
        self._seq = seq + len(layers)
        self._hold_layer_events([("layer_ready", seq + i, epoch, [layer], 1, len(names), ready_before + i, total, at_ns)
                                 for i, (layer, (names, at_ns)) in enumerate(zip(layers, buckets, strict=True), 1)])

    def _hold_layer_events(self, items: list[tuple[Any, ...]]) -> None:
        """Hold per-bucket events (tuples, in order) as `_audit_layers` says, and flush when a bound is reached."""
        hold = events.hold_events() if self._holds_events else HOLD_NONE
        if hold == HOLD_NONE:  # each written (and kept) as it comes
            for item in items:
                self._held.append(item)  # a flush replaces the list
                self.flush_events()
            return
        held = self._held
        held.extend(items)
        if hold == HOLD_KEEP:  # nothing is written: only the last `recent_events` are ever read
            if len(held) > 2 * (self._recent.maxlen or 0) + events.HOLD_MAX:
                del held[:len(held) - (self._recent.maxlen or 0)]
        elif len(held) >= events.HOLD_MAX or held[-1][-1] - held[0][-1] >= events.HOLD_NS:
            self.flush_events()

    def flush_events(self) -> None:
        """Write and keep the held per-bucket events, in order. Where nothing is written (audit off) or a JSON file
        alone gets lines formatted from the tuples (`_held_lines`), and no audit write failed yet, the tuples are
        kept as they are and built into records only when `recent_events` is read (most never are: the deque
        keeps the last ones); else each is built into its record (bounded unless plain), written and kept."""
        held = self._held
        if not held:
            return
        self._held = []
        # a locked lifecycle (writer threads) never keeps tuples: `recent_events` builds them without the lock
        hold = events.hold_events() if self._holds_events else HOLD_NONE
        if hold == HOLD_KEEP or (hold == HOLD_WRITE and self._line_prefixes is not None
                                 and events.emit_held_lines(lambda *frame: self._held_lines(held, *frame))):
            if not events.sink_failures():
                self._recent.extend(held)
                self._unbuilt += len(held)
                return
            records = [self._held_record(item) for item in held]
        else:
            records = [self._held_record(item) for item in held]
            events.emit_held(records, [item[-1] for item in held])
        failures = events.sink_failures()
        if failures:
            for record in records:
                record["sink_failures"] = failures
        self._recent.extend(records)
        if self._unbuilt:
            self._unbuilt += len(records)

    def _held_record(self, item: tuple[Any, ...]) -> dict[str, Any]:
        """The record of a held event: what `_audit` would have built for it (bounded, unless plain)."""
        event, seq, epoch, shown, count, tensors, ready, total, _ = item
        record = {"event": event, "backbone": self.name, "rank": self.rank, "epoch": epoch, "seq": seq,
                  "layers": shown, "layers_more": count - len(shown)}
        if tensors is not None:
            record["tensors"] = tensors
        record["layers_ready"] = ready
        record["layers_total"] = total
        return record if self._plain_layer_events else events.bound_fields(record)

    def _held_lines(self, held: list[tuple[Any, ...]], head: str, middle: str, end: str) -> str:
        """The held events' lines in a JSON file (`events.emit_held_lines`): each one's record as the JSON encoder
        writes it, formatted from the tuple. Only for plain events (`_line_prefixes`): every value is an int or a
        name within the bounds, written as is."""
        prefixes = cast("dict[str, str]", self._line_prefixes)  # plain events only: not None
        encode, as_is = events.encode_string, self._layers_as_is
        lines = []
        for (event, seq, epoch, shown, count, tensors, ready, total, _), stamp in zip(
                held, events.timestamps([item[-1] for item in held]), strict=True):
            prefix = prefixes.get(event) or self._line_prefix(prefixes, event)
            if len(shown) == 1:  # the common case: the bucket completed one layer
                layers = f'"{shown[0]}"' if as_is else encode(shown[0])
            else:
                layers = '"' + '","'.join(shown) + '"' if as_is and shown else ",".join(map(encode, shown))
            if tensors is None:
                lines.append(f'{head}{prefix}{epoch},"seq":{seq},"layers":[{layers}],"layers_more":'
                             f'{count - len(shown)},"layers_ready":{ready},"layers_total":{total}{middle}{stamp}{end}')
            else:
                lines.append(f'{head}{prefix}{epoch},"seq":{seq},"layers":[{layers}],"layers_more":'
                             f'{count - len(shown)},"tensors":{tensors},"layers_ready":{ready},"layers_total":{total}'
                             f'{middle}{stamp}{end}')
        return "".join(lines)

    def _line_prefix(self, prefixes: dict[str, str], event: str) -> str:
        """The fields a held `event`'s line begins with, up to its epoch, encoded (and kept in `prefixes`, the
        `_line_prefixes`, for the next ones)."""
        encode = events.encode_string
        prefix = prefixes[event] = (
            f'"event":{encode(event)},"backbone":{encode(self.name)},"rank":{self.rank},"epoch":')
        return prefix

    def _keep(self, record: dict[str, Any], level: str = "info") -> None:
        """Write a bounded, numbered record (if audit output is on) and keep it in `recent_events`."""
        if self._held:
            self.flush_events()  # the held events come first: `seq` stays in order in the file
        events.emit_record(record, level)  # never raises: a failed write is counted, not the lifecycle's problem
        failures = events.sink_failures()
        if failures:
            record["sink_failures"] = failures
        self._recent.append(record)
        if self._unbuilt:
            self._unbuilt += 1

    def audit_event(self, event: str, *, level: str = "info", **fields: Any) -> None:
        """Emit an event in this backbone's context (used by the backbone, loader and hooks)."""
        self._audit(event, level=level, **fields)
