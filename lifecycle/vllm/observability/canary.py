"""The acceptance canary: how well the draft is accepted, per serving period, and a warning when a push makes it
collapse (the symptom users report after a broken draft push: vLLM #52487, miles #1926, SGLang #31674).

Plain bookkeeping, fed by the engine's front process (`frontend.py`) with vLLM's per-step speculative-decoding
counters (`SpecDecodingStats`: drafts, draft tokens, accepted tokens, per position). A period begins at engine
start and at every push (draft or policy: either changes how the target and the draft agree) and carries the
trainer's `weight_version` once vLLM sets it, and the push whose weights the draft serves in it, by the plugin's own
name (`push`: `epoch N`, from the workers' answers: trainers that send no `weight_version` are told apart too).
Steps verified while the draft was kept out are counted apart (`placeholder_draft_tokens`): vLLM still schedules
the zero draft tokens the runner puts in place of a skipped draft and counts them (with a target that emits token 0,
every one is "accepted"), so they say nothing about the draft.

Judged once per period, when it has verified `min_tokens` draft tokens (`settings.AcceptanceThresholds`):

- accepted share <= `floor` while the last judged period before it was >= `healthy`: a collapse
  (`acceptance_collapse`, a warning); it stands until a later period is judged above the floor
  (`acceptance_recovered`);
- an `acceptance` event reports each period at the next push (`final`) and every `every_steps` steps.

>>> from lifecycle.vllm.settings import AcceptanceThresholds
>>> c = AcceptanceCanary(AcceptanceThresholds(min_tokens=30, every_steps=0))
>>> c.count(drafts=10, draft_tokens=30, accepted_tokens=30, draft_per_pos=[10, 10, 10], accepted_per_pos=[10] * 3)
>>> c.push_began("draft"); c.push_ended("ok")
>>> c.count(drafts=10, draft_tokens=30, accepted_tokens=0, draft_per_pos=[10, 10, 10], accepted_per_pos=[0] * 3)
>>> [(name, f["period"]) for name, _, f in c.take_events()]
[('acceptance', 0), ('acceptance_collapse', 1)]
>>> c.collapsed
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..settings import AcceptanceThresholds

__all__ = ["CANARY_EVENTS", "AcceptanceCanary", "Period"]

#: The audit events the canary asks the workers' lifecycles to write, and their levels.
CANARY_EVENTS = {"acceptance": "info", "acceptance_collapse": "warning", "acceptance_recovered": "info"}


def _add(into: list[int], values: Sequence[int]) -> None:
    if len(into) < len(values):
        into.extend([0] * (len(values) - len(into)))
    for i, v in enumerate(values):
        into[i] += int(v)


@dataclass
class Period:
    """One serving period: from engine start or a push to the next push."""

    index: int
    since: str  # "engine start", "draft push", "policy push", "weight version"
    weight_version: str | None = None
    push: str | None = None  # the draft push it served (`epoch N`), as the workers answer it
    push_outcome: str | None = None  # of the push that began it: ok, refused, abandoned
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_tokens_per_pos: list[int] = field(default_factory=list)
    accepted_tokens_per_pos: list[int] = field(default_factory=list)
    placeholder_draft_tokens: int = 0  # verified while the draft was kept out: not the draft's
    steps: int = 0  # steps with draft tokens from the draft
    judged: bool = False  # reached min_tokens
    collapsed: bool = False

    @property
    def share(self) -> float | None:
        """Accepted / draft tokens, or None before any."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def fields(self, *, final: bool, collapsed: bool) -> dict[str, Any]:
        share = self.share
        out: dict[str, Any] = {
            "period": self.index, "since": self.since, "final": final, "drafts": self.drafts,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "accepted_share": None if share is None else round(share, 4),
            "draft_tokens_per_pos": list(self.draft_tokens_per_pos),
            "accepted_tokens_per_pos": list(self.accepted_tokens_per_pos),
            "placeholder_draft_tokens": self.placeholder_draft_tokens, "steps": self.steps, "collapsed": collapsed,
        }
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        if self.push is not None:
            out["push"] = self.push
        if self.push_outcome is not None:
            out["push_outcome"] = self.push_outcome
        return out


class AcceptanceCanary:
    """The periods of one engine (a data-parallel engine index); `take_events` hands over what to audit."""

    def __init__(self, thresholds: AcceptanceThresholds) -> None:
        self.thresholds = thresholds
        self.period = Period(0, "engine start")
        self.reference: Period | None = None  # the last judged period before this one
        self.collapsed_in: Period | None = None  # the period whose collapse stands
        self.collapses = 0
        self._events: list[tuple[str, str, dict[str, Any]]] = []

    @property
    def collapsed(self) -> bool:
        return self.collapsed_in is not None

    # ---- counting -------------------------------------------------------------------------------------------
    def count(self, *, drafts: int, draft_tokens: int, accepted_tokens: int, draft_per_pos: Sequence[int],
              accepted_per_pos: Sequence[int], drafting: bool = True) -> None:
        """One engine step's verified drafts. `drafting`: the draft was usable when it proposed them (False:
        vLLM's placeholder zeros, counted apart)."""
        p = self.period
        if not drafting:
            p.placeholder_draft_tokens += int(draft_tokens)
            return
        p.drafts += int(drafts)
        p.draft_tokens += int(draft_tokens)
        p.accepted_tokens += int(accepted_tokens)
        _add(p.draft_tokens_per_pos, draft_per_pos)
        _add(p.accepted_tokens_per_pos, accepted_per_pos)
        p.steps += 1
        if not p.judged and p.draft_tokens >= self.thresholds.min_tokens:
            self._judge(p)
        every = self.thresholds.every_steps
        if every and p.steps % every == 0:
            self._report(p, final=False)

    def _judge(self, p: Period) -> None:
        t, share, ref = self.thresholds, p.share, self.reference
        p.judged = True
        assert share is not None  # judged only with min_tokens >= 1 draft tokens
        ref_share = ref.share if ref is not None else None
        if share <= t.floor and ref_share is not None and ref_share >= t.healthy and ref is not None:
            p.collapsed = True
            self.collapses += 1
            self.collapsed_in = p
            self._events.append(("acceptance_collapse", CANARY_EVENTS["acceptance_collapse"], {
                **{k: v for k, v in p.fields(final=False, collapsed=True).items()
                   if k in ("period", "since", "weight_version", "push", "draft_tokens", "accepted_tokens",
                            "accepted_share", "push_outcome")},
                "previous_period": ref.index, "previous_share": round(ref_share, 4),
                "previous_draft_tokens": ref.draft_tokens,
                **({"previous_weight_version": ref.weight_version} if ref.weight_version is not None else {}),
                **({"previous_push": ref.push} if ref.push is not None else {}),
                "floor": t.floor, "healthy": t.healthy, "min_tokens": t.min_tokens}))
        elif share > t.floor and self.collapsed_in is not None:
            gone = self.collapsed_in
            self.collapsed_in = None
            self._events.append(("acceptance_recovered", CANARY_EVENTS["acceptance_recovered"], {
                "period": p.index, "since": p.since, "accepted_share": round(share, 4),
                "draft_tokens": p.draft_tokens, "collapsed_period": gone.index,
                **({"weight_version": p.weight_version} if p.weight_version is not None else {}),
                **({"push": p.push} if p.push is not None else {})}))

    def _report(self, p: Period, *, final: bool) -> None:
        self._events.append(("acceptance", CANARY_EVENTS["acceptance"],
                             p.fields(final=final, collapsed=self.collapsed_in is p)))

    # ---- periods --------------------------------------------------------------------------------------------
    def push_began(self, kind: str) -> None:
        """A push starts (`kind`: draft or policy): the period ends (reported if it verified anything) and the
        next one begins."""
        self._next_period(f"{kind} push")

    def _next_period(self, since: str) -> None:
        p = self.period
        if p.draft_tokens or p.placeholder_draft_tokens:
            self._report(p, final=True)
        if p.judged:
            self.reference = p
        self.period = Period(p.index + 1, since)

    def push_ended(self, outcome: str) -> None:
        self.period.push_outcome = outcome

    def set_weight_version(self, version: str) -> None:
        """vLLM's `weight_version` is set (after the push that made it, or on its own): it labels the current
        period if nothing was verified in it yet, else a new period begins."""
        p = self.period
        if p.weight_version == version:
            return
        if p.draft_tokens or p.placeholder_draft_tokens:
            self._next_period("weight version")
        self.period.weight_version = version

    def provisional(self) -> dict[str, Any] | None:
        """The current period as its final `acceptance` event would report it now (`at_stop`: for the workers to
        write if the engine stops before the next push ends it), or None while it verified nothing."""
        p = self.period
        if not (p.draft_tokens or p.placeholder_draft_tokens):
            return None
        return {**p.fields(final=True, collapsed=self.collapsed_in is p), "at_stop": True}

    def set_push(self, push: str) -> None:
        """The workers answered which push the draft serves (`epoch N`): it labels the current period if nothing
        was verified in it yet (the period a push began), else a new period begins (weights changed by a path no
        push call showed)."""
        p = self.period
        if p.push == push:
            return
        if p.push is not None and (p.draft_tokens or p.placeholder_draft_tokens):
            self._next_period("draft push")
        self.period.push = push

    def take_events(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(event, level, fields) to audit, oldest first; handed over once."""
        events, self._events = self._events, []
        return events
