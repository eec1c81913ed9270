"""A server's `/metrics`, parsed with prometheus_client's own parser, and what docs/operating.md promises of it (the
online metrics tests: tests/vllm_plugin/observability/test_vllm_online_metrics*.py).

    got = scrape(client)                              # {"families": {...}, "values": {(sample, labels): value}}
    value(got, "reload_lifecycle_draft_usable", backbone="dflash-draft")
    settled(client, "reload_lifecycle_draft_epoch", 3, backbone="dflash-draft")   # polls up to 15 s

Every scrape checks what holds of every scrape: no `reload_lifecycle_*` sample is NaN, none carries a `pid` label,
and each label holds a value of its documented set (`LABEL_VALUES`; `error` a class name).
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

__all__ = ["DOCUMENTED", "LABEL_VALUES", "missing_at_start", "scrape", "settled", "total", "value"]

#: every family docs/operating.md lists (prometheus_client's names: counters without `_total`) -> its type
DOCUMENTED = {
    "reload_lifecycle_pushes": "counter", "reload_lifecycle_push_duration_seconds": "histogram",
    "reload_lifecycle_refusals": "counter", "reload_lifecycle_stray_calls": "counter",
    "reload_lifecycle_written_bytes": "counter", "reload_lifecycle_draft_usable": "gauge",
    "reload_lifecycle_draft_quarantined": "gauge", "reload_lifecycle_drafting_paused": "gauge",
    "reload_lifecycle_draft_epoch": "gauge", "reload_lifecycle_steps_without_draft": "counter",
    "reload_lifecycle_spec_drafts": "counter", "reload_lifecycle_spec_draft_tokens": "counter",
    "reload_lifecycle_spec_accepted_tokens": "counter", "reload_lifecycle_spec_accepted_tokens_per_pos": "counter",
    "reload_lifecycle_spec_placeholder_draft_tokens": "counter", "reload_lifecycle_acceptance_ratio": "gauge",
    "reload_lifecycle_acceptance_period_draft_tokens": "gauge", "reload_lifecycle_acceptance_collapsed": "gauge",
    "reload_lifecycle_acceptance_collapses": "counter", "reload_lifecycle_weight_version_info": "gauge"}
#: the families whose series appear later than the start, and why: a refusal's error class, the first version
LATER = {"reload_lifecycle_refusals", "reload_lifecycle_weight_version_info"}
#: label -> the values docs/operating.md allows (a pattern for the open sets)
LABEL_VALUES = {"kind": {"draft", "policy"}, "outcome": {"ok", "refused", "abandoned"},
                "call": {"update_weights", "finish_weight_update"},
                "error": re.compile(r"[A-Z]\w*(Error|Exception)|WeightUpdateRefused"),
                "engine": re.compile(r"\d+"), "position": re.compile(r"\d+"), "backbone": re.compile(r"\S+"),
                "le": re.compile(r".+"), "weight_version": re.compile(r".*"), "push": re.compile(r"(epoch \d+.*)?")}


def scrape(c: Any) -> dict[str, Any]:
    """{family name: family} and {(sample name, sorted labels): value} of /metrics, prometheus_client's parser; the
    invariants of the module doc asserted."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(c.metrics_text())}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    for (name, labels), v in values.items():
        if not name.startswith("reload_lifecycle_"):
            continue
        assert not math.isnan(v), (name, labels)
        for label, got in labels:
            allowed = LABEL_VALUES.get(label)
            assert allowed is not None, (name, label, got)  # no `pid`, nothing undocumented
            assert got in allowed if isinstance(allowed, set) else allowed.fullmatch(got), (name, label, got)
    return {"families": families, "values": values}


def value(scraped: dict[str, Any], name: str, **labels: str) -> float | None:
    return scraped["values"].get((name, tuple(sorted(labels.items()))))


def total(scraped: dict[str, Any], name: str) -> float:
    """The sum of every sample of `name` (vLLM's own carry labels of their own: model_name, engine)."""
    return sum(v for (n, _), v in scraped["values"].items() if n == name)


def settled(c: Any, name: str, expected: float, timeout_s: float = 15.0, **labels: str) -> dict[str, Any]:
    """/metrics once `name{labels}` reads `expected` (the front process pulls the workers' state in a task after
    the step that changed it, and vLLM's periodic stats tick, every 10 s, pulls): at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = scrape(c)
        if value(got, name, **labels) == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def missing_at_start(scraped: dict[str, Any], *, one_server: bool) -> list[str]:
    """The documented families without a series (those of `LATER` may lack one; weight_version_info is not exported
    with several API servers)."""
    have = {name for (name, _), _ in scraped["values"].items()}
    missing = []
    for family, kind in DOCUMENTED.items():
        if family in LATER:
            continue
        sample = family + ("_total" if kind == "counter" else "_count" if kind == "histogram" else "")
        if sample not in have:
            missing.append(family)
    if not one_server and any(n == "reload_lifecycle_weight_version_info" for n in have):
        missing.append("reload_lifecycle_weight_version_info exported with several API servers")
    return missing
