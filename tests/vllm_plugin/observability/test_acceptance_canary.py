"""The acceptance canary's bookkeeping (lifecycle.vllm.observability.canary) and its thresholds
(lifecycle.vllm.settings), without an engine. The live-engine tests are
tests/vllm_plugin/observability/test_vllm_canary.py (offline) and
tests/vllm_plugin/observability/test_vllm_online_metrics.py."""

from __future__ import annotations

import pytest

from lifecycle.env import EnvSettingError
from lifecycle.vllm.observability.canary import AcceptanceCanary
from lifecycle.vllm.settings import AcceptanceThresholds, acceptance_thresholds

T = AcceptanceThresholds(floor=0.05, healthy=0.15, min_tokens=30, every_steps=0)


def step(c: AcceptanceCanary, accepted: int, tokens: int = 30, *, drafting: bool = True) -> None:
    c.count(drafts=tokens // 3, draft_tokens=tokens, accepted_tokens=accepted, draft_per_pos=[tokens // 3] * 3,
            accepted_per_pos=[accepted // 3] * 3, drafting=drafting)


def push(c: AcceptanceCanary, outcome: str = "ok", kind: str = "draft") -> None:
    c.push_began(kind)
    c.push_ended(outcome)


def names(c: AcceptanceCanary) -> list[str]:
    return [name for name, _, _ in c.take_events()]


def test_a_collapse_needs_a_healthy_period_before_it() -> None:
    c = AcceptanceCanary(T)
    step(c, 3)  # 0.10: judged, but not healthy
    push(c)
    step(c, 0)
    assert "acceptance_collapse" not in names(c) and not c.collapsed
    push(c)
    step(c, 30)  # healthy again
    push(c)
    step(c, 0)
    assert names(c)[-1] == "acceptance_collapse" and c.collapsed


def test_nothing_is_judged_before_min_tokens_on_either_side() -> None:
    c = AcceptanceCanary(T)
    step(c, 29, tokens=29)  # 29 < 30: never judged, so never a reference
    push(c)
    step(c, 0)
    assert "acceptance_collapse" not in names(c)
    c = AcceptanceCanary(T)
    step(c, 30)
    push(c)
    step(c, 0, tokens=29)
    assert "acceptance_collapse" not in names(c)
    step(c, 0, tokens=1)  # the 30th draft token: judged now
    assert names(c)[-1] == "acceptance_collapse"


def test_the_collapse_stands_until_a_later_period_is_judged_above_the_floor() -> None:
    c = AcceptanceCanary(T)
    step(c, 30)
    push(c)
    step(c, 0)
    push(c)
    step(c, 1)  # 0.033: still at the floor, no recovery
    assert c.collapsed and "acceptance_recovered" not in names(c)
    push(c)
    step(c, 30)
    assert not c.collapsed and names(c)[-1] == "acceptance_recovered"


def test_steps_served_without_the_draft_are_counted_apart_and_never_judged() -> None:
    c = AcceptanceCanary(T)
    step(c, 30)
    push(c, "refused")
    for _ in range(5):
        step(c, 30, drafting=False)  # vLLM's placeholder zeros, all "accepted"
    p = c.period
    assert (p.draft_tokens, p.placeholder_draft_tokens, p.judged, p.push_outcome) == (0, 150, False, "refused")
    push(c)
    step(c, 0)  # the reference is still the last judged period (1.0), not the placeholder one
    assert names(c)[-1] == "acceptance_collapse"


def test_a_weight_version_labels_the_period_or_begins_one_after_counts() -> None:
    c = AcceptanceCanary(T)
    c.set_weight_version("v1")
    assert (c.period.index, c.period.weight_version) == (0, "v1")
    step(c, 30)
    c.set_weight_version("v2")
    assert (c.period.index, c.period.weight_version, c.period.since) == (1, "v2", "weight version")
    events = c.take_events()
    assert [(n, f["period"], f.get("weight_version"), f["final"]) for n, _, f in events] == [
        ("acceptance", 0, "v1", True)]


def test_every_n_steps_reports_the_period_so_far() -> None:
    c = AcceptanceCanary(AcceptanceThresholds(min_tokens=1000, every_steps=2))
    for _ in range(4):
        step(c, 30)
    assert [(n, f["final"], f["steps"]) for n, _, f in c.take_events()] == [("acceptance", False, 2),
                                                                             ("acceptance", False, 4)]


def test_the_thresholds_read_the_environment_and_refuse_what_is_not_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    assert acceptance_thresholds() == AcceptanceThresholds()
    monkeypatch.setenv("RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS", "40")
    monkeypatch.setenv("RELOAD_LIFECYCLE_ACCEPTANCE_HEALTHY", "0.5")
    assert acceptance_thresholds() == AcceptanceThresholds(floor=0.05, healthy=0.5, min_tokens=40, every_steps=1000)
    for name, raw, why in (("RELOAD_LIFECYCLE_ACCEPTANCE_MIN_TOKENS", "0", "must be >= 1"),
                           ("RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR", "nan", "must be from 0.0 to 1.0"),
                           ("RELOAD_LIFECYCLE_ACCEPTANCE_EVERY_STEPS", "ten", "is not an integer"),
                           ("RELOAD_LIFECYCLE_ACCEPTANCE_FLOOR", "0.6", "must lie below")):
        monkeypatch.setenv(name, raw)
        with pytest.raises(EnvSettingError, match=why):
            acceptance_thresholds()
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match="floor < healthy"):
        AcceptanceThresholds(floor=0.2, healthy=0.1)
