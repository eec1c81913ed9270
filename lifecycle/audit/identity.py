"""Which writer an event comes from: a stream is one (node, rank, backbone), and one writer feeds it.

Events carry the node (host name) that wrote them (`lifecycle.events`), so two nodes' rank-0 logs of one backbone
are two streams. What the fields cannot tell apart is a clash, an input problem (`clash_problem`): the inputs of
one stream interleave (each input is one process's file; a stream moves to another input only as a new lifecycle,
seq 1, a restart, or with the next seq, a rotated file), or, inside one input, the numbering of the lifecycle
before a restart resumes (two live writers of one name in one file). Events without `seq` are taken as they come.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .findings import Findings
from .logstream import InputProblem, LogEvent
from .results import DETAIL_CAP, StreamReplay
from .text import clip, shown

__all__ = ["behind", "clash_problem", "one_writer", "order_key", "withdraw"]


def one_writer(r: StreamReplay, ev: LogEvent) -> bool:
    """Whether `ev` can be the next event of the one writer of `r` (and, when it moves to another input, follow
    it there)."""
    seq = ev.fields.get("seq")
    if type(seq) is not int:
        return True
    if ev.writer != r.source:  # a rotated set's files are one input (`rotation`)
        if seq == 1 or seq == r.seq + 1:
            r.source = ev.writer
            return True
        return False
    return not (r.prev_seq and seq == r.prev_seq + 1 and seq != r.seq + 1 and seq != 1)


def clash_problem(r: StreamReplay, ev: LogEvent) -> InputProblem:
    """The input problem of a stream two writers feed, at the event that showed it."""
    where = (f"{shown(r.source)} and {shown(ev.writer)} interleave" if ev.writer != r.source else
             f"{shown(ev.source)} holds two lifecycles' numbering at once")
    node = "no node" if r.node is None else f"node {shown(r.node)}"
    return InputProblem(ev.source, ev.line, clip(
        f"two writers feed the stream of {node}, rank {r.rank}, backbone {shown(r.backbone)} and cannot be told "
        f"apart ({where}: seq {ev.fields.get('seq')} after seq {r.seq}): their events name no node, or the same "
        "node, rank and backbone (two processes, or two live backbones of one name). The stream is not audited "
        "from here on; audit each writer's log on its own", DETAIL_CAP))


def order_key(r: StreamReplay) -> tuple[int, str]:
    return r.rank, r.node or ""


def withdraw(findings: Findings, r: StreamReplay, ev: LogEvent) -> bool:
    """Two writers feed `r`: an input problem of `findings` (a `replay.Auditor`'s); the stream is not replayed
    further and what was found in it is withdrawn (one writer's events were read as the other's). True."""
    r.clash = True
    findings.withdraw(r)
    findings.problem(clash_problem(r, ev))
    return True


def behind(group: Iterable[StreamReplay]) -> Iterator[tuple[StreamReplay, str]]:
    """The streams of one backbone that end at an earlier epoch than others, each with the `epoch_disagreement`
    detail (nodes named when the streams span several)."""
    ordered = sorted(group, key=order_key)
    top = max(r.epoch for r in ordered)
    if len({r.epoch for r in ordered}) < 2:
        return
    several = len({r.node for r in ordered}) > 1

    def rank(r: StreamReplay) -> str:
        return f"{r.rank} on {clip(r.node)}" if several and r.node is not None else str(r.rank)

    ahead = clip(", ".join(rank(r) for r in ordered if r.epoch == top))
    for r in ordered:
        if r.epoch < top:
            yield r, (f"backbone {clip(r.backbone)}: rank {rank(r)} ends at epoch {r.epoch}, rank(s) {ahead} at "
                      f"epoch {top}")
