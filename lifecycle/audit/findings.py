"""What an audit found, in bounded memory: violations, warnings and input problems, and the inputs seen.

Violations and warnings are counted in full, per kind, per stream and in all, and the first `max_details` kept with
their detail; input problems are counted and the first `max_details` kept; the inputs seen are kept in order. The
replay (`replay.Auditor`) decides what is a finding; this is where it is recorded, and where the findings of a
stream two writers fed are withdrawn (`withdraw`).

>>> from lifecycle.audit.results import StreamReplay
>>> f = Findings(max_details=1)
>>> r = StreamReplay(0, "d")
>>> f.violate(r, "not_ready", "log:3", "refresh with layers missing")
>>> f.violate(r, "not_ready", "log:4", "again")
>>> f.counts["not_ready"], r.violations["not_ready"], [v.where for v in f.violations]
(2, 2, ['log:3'])
>>> f.withdraw(r)
>>> f.counts, f.violations, r.violations
(Counter(), [], Counter())
"""

from __future__ import annotations

from collections import Counter

from .logstream import InputProblem
from .results import DETAIL_CAP, StreamReplay, Violation
from .text import clip

__all__ = ["Findings"]


class Findings:
    """The violations, warnings and input problems found so far, and the inputs seen. Memory: at most
    `max_details` violations, warnings and input problems (each detail clipped), plus one count per kind."""

    def __init__(self, max_details: int = 1000) -> None:
        if type(max_details) is not int or max_details < 0:
            raise ValueError(f"max_details must be an int >= 0, got {max_details!r:.40}")
        self.max_details = max_details
        self.violations: list[Violation] = []
        self.counts: Counter[str] = Counter()
        self.warnings: list[Violation] = []
        self.warning_counts: Counter[str] = Counter()
        self.input_problems: list[InputProblem] = []
        self.input_problem_count = 0
        self._sources: dict[str, None] = {}  # every input seen, in order

    def violate(self, r: StreamReplay, kind: str, where: str, detail: str, epoch: int | None = None) -> None:
        """A violation of `kind` in stream `r` at `where` (`epoch`: the stream's current one unless given)."""
        self.counts[kind] += 1
        r.violations[kind] += 1
        if len(self.violations) < self.max_details:
            self.violations.append(Violation(kind, r.rank, r.backbone, r.epoch if epoch is None else epoch,
                                             where, clip(detail, DETAIL_CAP), r.node))

    def warn(self, r: StreamReplay, kind: str, where: str, detail: str, epoch: int) -> None:
        """A warning of `kind` in stream `r` (not counted in the verdict)."""
        self.warning_counts[kind] += 1
        r.warnings[kind] += 1
        if len(self.warnings) < self.max_details:
            self.warnings.append(Violation(kind, r.rank, r.backbone, epoch, where, clip(detail, DETAIL_CAP), r.node))

    def problem(self, p: InputProblem) -> None:
        """An input problem (an unreadable line, a stream two writers feed, an input without events)."""
        self.input_problem_count += 1
        if len(self.input_problems) < self.max_details:
            self.input_problems.append(p)
        self._sources.setdefault(p.source, None)

    def saw(self, source: str) -> None:
        """An event of input `source` was read."""
        self._sources.setdefault(source, None)

    @property
    def inputs(self) -> list[str]:
        """Every input seen (in an event or an input problem), in the order first seen."""
        return list(self._sources)

    def withdraw(self, r: StreamReplay) -> None:
        """Withdraw every violation and warning found in stream `r`, from the counts and the details kept (one
        writer's events were read as another's: what was found in it means nothing)."""
        self.counts.subtract(r.violations)
        self.warning_counts.subtract(r.warnings)
        self.counts, self.warning_counts = +self.counts, +self.warning_counts  # drop the zeros
        self.violations = [v for v in self.violations if v.stream != r.key]
        self.warnings = [w for w in self.warnings if w.stream != r.key]
        r.violations.clear()
        r.warnings.clear()
