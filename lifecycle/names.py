"""One live lifecycle per (name, rank) in each audit file of a process, so that its events are one stream.

Two live backbones of one name and rank writing to one audit file (a second engine's draft in the same process,
a program that builds two drafts of one name) would write one interleaved stream, which the auditor cannot tell
apart. So a lifecycle claims its (name, rank) in the audit file when it first writes an event there (a file, not
a console or memory: only a file is audited); if a live lifecycle holds it, this one is named apart (`draft#2`,
`draft#3`, ...: the first free one; the name it asked for is kept in `requested_name`) and says so in its first
event there (`name_taken`). The first keeps its name; a name whose lifecycle was freed is free again.

Why at the first event and per file: a name only clashes where two lifecycles' events meet, and a program that
replaces a draft (`m = Draft("d")` again, in a loop or an engine rebuild) has dropped the old one by then. Why a
unique name and not a refusal: refusing would break such programs for a clash only the audit trail suffers from.
A lifecycle is freed by the cyclic collector, not when it is dropped: on a clash the collector runs first (the
young generations, then all), so "live" means reachable, not "not collected yet". Once per holder: one that
survived a full collection is reachable, and a later clash with it names the newcomer apart without collecting
again (a full collection of a large process costs hundreds of milliseconds, and it ran on every cold load that
clashed: issue 33 found the tracking benchmark's cold loads paying it each round).

>>> class Owner: pass
>>> a, b = Owner(), Owner()
>>> claim("draft", 0, a, "/logs/x.jsonl"), claim("draft", 0, b, "/logs/x.jsonl"), claim("draft", 0, b, "/logs/y")
('draft', 'draft#2', 'draft')
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

from . import events

__all__ = ["NAME_CAP", "REASON", "claim", "claim_for"]

#: Characters of a name at most (the audit events' string cap): a suffix replaces the end of a longer one.
NAME_CAP = 4096
#: What a `name_taken` event says.
REASON = ("a live backbone of this process writes that name and rank to this audit file; this one is named apart "
          "so that each has its own audit stream")
_live: dict[str, weakref.WeakValueDictionary[tuple[str, Any], Any]] = {}
#: holders a full collection found reachable (dropped from here when they are freed)
_survived: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def claim(name: str, rank: Any, owner: Any, scope: str) -> str:
    """`name`, or the first free `name#N` when another live owner holds (`name`, `rank`) in `scope` (an audit
    file); `owner` holds what it gets until it is freed."""
    with _lock:
        held = _live.setdefault(scope, weakref.WeakValueDictionary())
        holder = held.get((name, rank))
    if holder is not None and holder is not owner and holder not in _survived:
        holder = None  # no strong reference of ours while the collector decides whether it is still reachable
        gc.collect(1)
        if held.get((name, rank)) is not None:
            gc.collect()
            holder = held.get((name, rank))
            if holder is not None:
                _survived.add(holder)
    del holder
    with _lock:
        unique, n = name, 1
        while (other := held.get((unique, rank))) is not None and other is not owner:
            n += 1
            suffix = f"#{n}"
            unique = name[:NAME_CAP - len(suffix)] + suffix
        del other
        held[(unique, rank)] = owner
        return unique


def claim_for(lifecycle: Any, at_ns: int | None = None) -> None:
    """Claim a lifecycle's (`event_trail.AuditTrail`) name in the audit file its events go to now (none: nothing to
    claim); named apart there, it says so in a `name_taken` event, its first in that file, stamped `at_ns` when
    given (the time of the bucket event about to be numbered after it: the loader reports buckets after writing
    them, each with its own time)."""
    sink = lifecycle._named_in = events.route_sink()
    if sink is None or not isinstance(lifecycle.name, str):
        return
    name = claim(lifecycle.name, lifecycle.rank, lifecycle, str(sink.path))
    if name == lifecycle.name:
        return
    lifecycle.flush_events()  # anything held was numbered under the old name (none: the route changed since)
    taken, lifecycle.name = lifecycle.name, name
    if lifecycle._line_prefixes is not None:
        lifecycle._line_prefixes = {}  # encoded with the old name
    if at_ns is None:
        lifecycle._audit("name_taken", requested=taken, reason=REASON)
        return
    lifecycle._seq += 1
    record = events.bound_fields({"event": "name_taken", "backbone": name, "rank": lifecycle.rank,
                                  "epoch": lifecycle.epoch, "seq": lifecycle._seq, "requested": taken,
                                  "reason": REASON})
    events.emit_held([record], [at_ns])
    lifecycle._recent.append(record)
