"""What the replay keeps and what it returns: the replayed lifecycle of one (node, rank, backbone), each violation
and warning found, and the audit's result.

Everything a `StreamReplay` holds is bounded: the layers ready in this epoch (at most `MAX_LAYERS`, kept as
hashes of their names), the derived buffers' addresses (at most `MAX_BUFFERS`, keyed by `buffer_key`), a counter
of the transitions taken (rows of the table, and at most `MAX_EDGES` illegal ones), the nodes (host names) its
events came from (at most `MAX_NODES`). A violation's or warning's detail is at most `DETAIL_CAP` characters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..states import LifecycleState
from .logstream import InputProblem
from .rules import INITIAL, STATE_NAMES

__all__ = ["DETAIL_CAP", "MAX_BUFFERS", "MAX_EDGES", "MAX_LAYERS", "MAX_NODES", "MAX_VERSIONS", "MAX_VERSION_EPOCHS",
           "AuditResult", "StreamReplay", "Violation", "buffer_key"]

#: Derived-buffer addresses remembered per stream, at most.
MAX_BUFFERS = 256
#: Layers whose readiness is tracked per stream and epoch, at most: a backbone declaring more layers is not checked
#: for readiness (a log's own `layers_total` cannot lift this).
MAX_LAYERS = 1024
#: Distinct illegal transitions counted per stream, at most (the rest are counted as violations all the same).
MAX_EDGES = 64
#: Characters of a violation's detail, at most.
DETAIL_CAP = 1000
#: Nodes (host names) remembered per stream, at most (a rank normally runs on one node; a restart may move it).
MAX_NODES = 4
#: Trainer weight versions remembered per stream (the latest), and epochs listed per version, at most.
MAX_VERSIONS, MAX_VERSION_EPOCHS = 64, 16


def buffer_key(name: str) -> str:
    """A derived buffer's name as a bounded key (a long name as its head and a hash of the whole)."""
    return name if len(name) <= 128 else f"{name[:64]}…#{hash(name) & 0xFFFFFFFFFFFF:012x}"


@dataclass(frozen=True)
class Violation:
    """A violation, or (in `AuditResult.warnings`) a warning: what was found, where, and in which stream."""

    kind: str
    rank: int
    backbone: str
    epoch: int
    where: str  # file:line of the event, or the last event of the stream for end-of-log findings
    detail: str
    node: str | None = None  # the node (host name) the stream's events name; None: they name none

    @property
    def stream(self) -> tuple[str | None, int, str]:
        return self.node, self.rank, self.backbone

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, "rank": self.rank, "backbone": self.backbone,
                "epoch": self.epoch, "where": self.where, "detail": self.detail}


@dataclass(eq=False)
class StreamReplay:
    """The replayed lifecycle of one (node, rank, backbone): what the auditor keeps, all of it bounded. `source`:
    the input its current lifecycle's events come from; `clash`: two writers that cannot be told apart fed it,
    so it is no longer replayed (an input problem)."""

    rank: int
    backbone: str
    node: str | None = None
    source: str = ""
    clash: bool = False
    prev_seq: int = 0  # the last seq of the lifecycle before the current one (0: none)
    state_name: str = INITIAL
    epoch: int = 0
    seq: int = 0
    events: int = 0
    incarnations: int = 1
    first_ts: float | None = None
    last_ts: float | None = None
    last_where: str = ""
    layers_total: int | None = None
    ready: set[int] = field(default_factory=set)  # hashes of the names of the layers ready in this epoch
    ready_extra: int = 0
    pinned: bool = False
    recoverable: bool = False
    pinned_ptrs: dict[str, str] = field(default_factory=dict)
    last_ptrs: dict[str, str] = field(default_factory=dict)
    epoch_done: bool = True
    epoch_began: str = ""
    epochs_begun: int = 0
    edges: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    illegal_edges: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    visited: set[str] = field(default_factory=lambda: {INITIAL})
    violations: Counter[str] = field(default_factory=Counter)
    warnings: Counter[str] = field(default_factory=Counter)
    nodes: dict[str, None] = field(default_factory=dict)  # host names, in the order seen (at most MAX_NODES)
    #: the trainer's `weight_version` of each push (`weight_version` events) -> the epochs that carried it, in the
    #: order first seen; the latest MAX_VERSIONS kept (a retry under the same version lists several epochs)
    versions: dict[str, list[int]] = field(default_factory=dict)

    @property
    def state(self) -> LifecycleState:
        """The replayed state."""
        return STATE_NAMES[self.state_name]

    @property
    def key(self) -> tuple[str | None, int, str]:
        return self.node, self.rank, self.backbone

    @property
    def layers_ready(self) -> int:
        return len(self.ready) + self.ready_extra

    def note_version(self, version: str, epoch: int) -> None:
        """The push of `epoch` carried the trainer's `version`."""
        epochs = self.versions.pop(version, [])  # re-inserted: the latest version last
        if epoch not in epochs and len(epochs) < MAX_VERSION_EPOCHS:
            epochs.append(epoch)
        self.versions[version] = epochs
        if len(self.versions) > MAX_VERSIONS:
            del self.versions[next(iter(self.versions))]

    def restart(self) -> None:
        """A new lifecycle under the same (node, rank, backbone): `seq` started again at 1."""
        self.prev_seq = self.seq
        self.state_name, self.epoch, self.seq = INITIAL, 0, 0
        self.layers_total, self.ready_extra, self.pinned = None, 0, False
        self.ready.clear()
        self.pinned_ptrs.clear()
        self.last_ptrs.clear()
        self.epoch_done, self.epoch_began = True, ""
        self.incarnations += 1

    def summary(self) -> dict[str, Any]:
        return {
            "node": self.node, "rank": self.rank, "backbone": self.backbone, "nodes": list(self.nodes),
            "events": self.events,
            "incarnations": self.incarnations,
            "final_state": self.state_name, "final_epoch": self.epoch, "pinned": self.pinned,
            "reloads": self.epochs_begun, "layers_ready": self.layers_ready, "layers_total": self.layers_total,
            "violations": dict(self.violations), "warnings": dict(self.warnings),
            "weight_versions": [{"weight_version": v, "epochs": e} for v, e in self.versions.items()],
            "transitions": [{"trigger": t, "src": s, "dst": d, "count": n} for (t, s, d), n in self.edges.items()],
        }


@dataclass
class AuditResult:
    inputs: list[str]
    events: int
    streams: list[StreamReplay]
    violations: list[Violation]  # the first `max_details`; `violation_counts` counts all
    violation_counts: Counter[str]
    input_problems: list[InputProblem]  # likewise capped; `input_problem_count` counts all
    input_problem_count: int
    warnings: list[Violation] = field(default_factory=list)  # the first `max_details`; `warning_counts` counts all
    warning_counts: Counter[str] = field(default_factory=Counter)
    expected_ranks: frozenset[int] | None = None  # `--expect-ranks`, if given
    missing_ranks: tuple[int, ...] = ()  # expected ranks without a single event in the input

    @property
    def ranks(self) -> list[int]:
        """The ranks the input has events of."""
        return sorted({r.rank for r in self.streams})

    @property
    def nodes(self) -> list[str]:
        """The nodes (host names) the input's events came from, as their events name them."""
        return list(dict.fromkeys(n for r in self.streams for n in r.nodes))

    @property
    def total_warnings(self) -> int:
        return sum(self.warning_counts.values())

    @property
    def status(self) -> int:
        """0 clean, 1 violations, 2 unreadable or incomplete input (whatever else was found). Warnings do not
        change it."""
        if self.input_problem_count:
            return 2
        return 1 if sum(self.violation_counts.values()) else 0

    @property
    def total_violations(self) -> int:
        return sum(self.violation_counts.values())
