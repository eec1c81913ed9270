"""What the logs cover, and what they should have held and did not: an input without a single event, and (with
expected ranks) a rank without events, a backbone some of them lack, a rank outside them. Each is an input
problem: the audit cannot speak for what it did not see, so it is never called clean.

>>> rank_ranges([0, 1, 2, 5, 7, 8])
'0-2, 5, 7-8'
>>> problems, missing = unseen(12, {"draft": {0, 1}, "other": {0}}, frozenset(range(3)))
>>> missing
(2,)
>>> print("\\n".join(problems))
no events of rank(s) 2 (expected ranks 0-2): their logs are missing, empty or unreadable
backbone other: no events of rank(s) 1 (expected ranks 0-2), although those ranks logged other backbones
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from .text import VALUE_CAP, clip

__all__ = ["NO_EVENTS", "rank_ranges", "unseen"]

#: The input problem of an input without a single event.
NO_EVENTS = ("no audit events in the input: nothing was audited, so nothing can be called clean (a worker that "
             "logged nothing? check that RELOAD_LIFECYCLE_AUDIT_DIR reached every worker process)")
#: Characters of a list of ranks in a message, at most.
RANKS_CAP = 400


def rank_ranges(ranks: Iterable[int]) -> str:
    """Sorted ranks as runs, for people: `0-2, 5`."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def unseen(events: int, ranks_by_backbone: Mapping[str, Collection[int]], expected: frozenset[int] | None
           ) -> tuple[list[str], tuple[int, ...]]:
    """The input problems of what the input lacks (messages), and the expected ranks without a single event."""
    problems = [] if events else [NO_EVENTS]
    if expected is None:
        return problems, ()
    seen = {rank for ranks in ranks_by_backbone.values() for rank in ranks}
    missing = tuple(sorted(expected - seen))
    spec = clip(rank_ranges(expected), RANKS_CAP)
    if missing and events:
        problems.append(f"no events of rank(s) {clip(rank_ranges(missing), RANKS_CAP)} (expected ranks {spec}): "
                        "their logs are missing, empty or unreadable")
    outside = seen - expected
    if outside:
        problems.append(f"events of rank(s) {clip(rank_ranges(outside), RANKS_CAP)}, outside the expected ranks "
                        f"{spec}: logs of another engine mixed in, or the wrong --expect-ranks")
    present = expected - set(missing)
    for backbone, ranks in sorted(ranks_by_backbone.items()):
        lacking = present - set(ranks)
        if lacking:
            problems.append(f"backbone {clip(backbone, VALUE_CAP)}: no events of rank(s) "
                            f"{clip(rank_ranges(lacking), RANKS_CAP)} (expected ranks {spec}), although those ranks "
                            "logged other backbones")
    return problems, missing
