"""The plugin's Prometheus metrics, in the engine's front process: what `vllm serve` exposes at `/metrics`.

One set per process, created when an engine client is built (`front_view.attach`), with every series whose labels
are known then (each push kind and outcome, each engine and draft position; each backbone at the first pull of the
workers' state, at once): an alert on `draft_usable == 0` or `absent(...)` sees them before the first push. They live
in `prometheus_client`'s default registry, the one `vllm serve` mounts at `/metrics` with one API server; with
`--api-server-count > 1` vLLM sets `PROMETHEUS_MULTIPROC_DIR` and `/metrics` reads every process's values from
there (prometheus_client's multiprocess mode): counters are summed over the API servers (each counts what it saw;
the workers' own totals are counted by API server 0 only), and each gauge says how its values are merged
(`multiprocess_mode`: the most recent value a live server set, or the highest), so no series carries a `pid`.

Names follow vLLM's conventions: units in the name (`_seconds`, `_bytes`), counters end in `_total`
(prometheus_client adds it), gauges for states (0 or 1), labels `kind` (draft or policy), `outcome` (ok, refused,
abandoned), `error` (an exception class name), `call` (a weight-update call), `backbone` (the draft's lifecycle name)
and `engine` (the data-parallel engine index, as vLLM's own). The trainer's `weight_version` is never a label of a
counter (it has no bound): `reload_lifecycle_weight_version_info` carries the current one only, bounded in length
(`online.pushes.check_label`), with `push`, the draft push the draft serves by the plugin's own name (`epoch N`), and
only with one API server (multiprocess mode cannot remove a series: each version pushed would stay).

prometheus_client comes with vLLM; it is imported when the metrics are first used, never at import.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["KINDS", "OUTCOMES", "PUSH_SECONDS_BUCKETS", "STRAY_CALLS", "ReloadMetrics", "metrics", "multiprocess"]

#: Push durations (seconds): a tiny draft over a file takes tens of ms, a large one over a network seconds.
PUSH_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
#: the label values of `kind` and `outcome` (every pair exists from the start)
KINDS = ("draft", "policy")
OUTCOMES = ("ok", "refused", "abandoned")
#: the calls a `stray_calls_total` counts
STRAY_CALLS = ("update_weights", "finish_weight_update")


def multiprocess() -> bool:
    """Whether this process writes its values for a multiprocess `/metrics` (vLLM sets the variable with several
    API servers; prometheus_client reads it when a metric is built)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class ReloadMetrics:
    """Every `reload_lifecycle_*` metric (built once per process: the registry refuses a name twice)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        p = "reload_lifecycle_"
        self.pushes = Counter(p + "pushes", "Weight pushes (start to finish, or one reload call) by kind and outcome "
                              "(ok, refused, abandoned).", ["kind", "outcome"])
        self.push_seconds = Histogram(p + "push_duration_seconds", "Duration of a weight push, from its start call "
                                      "to the end of its finish call.", ["kind", "outcome"],
                                      buckets=PUSH_SECONDS_BUCKETS)
        self.refusals = Counter(p + "refusals", "Weight calls of a push refused, by kind and the error's class.",
                                ["kind", "error"])
        self.stray_calls = Counter(p + "stray_calls", "Weight-update chunks and finishes that came with no "
                                   "weight-update session open (vLLM refused them; not pushes).", ["call"])
        self.written_bytes = Counter(p + "written_bytes", "Bytes of draft tensors written by reloads (all ranks).",
                                     ["backbone"])
        # the workers' state, as the freshest pull of any live API server saw it
        self.usable = Gauge(p + "draft_usable", "1 while every rank's draft backbone may draft.", ["backbone"],
                            multiprocess_mode="livemostrecent")
        self.quarantined = Gauge(p + "draft_quarantined", "1 while a rank's draft backbone is quarantined.",
                                 ["backbone"], multiprocess_mode="livemostrecent")
        self.paused = Gauge(p + "drafting_paused", "1 while the engine serves without the draft (it is not usable "
                            "and a step came).", ["backbone"], multiprocess_mode="livemostrecent")
        self.epoch = Gauge(p + "draft_epoch", "The draft backbone's reload epoch (the highest of its ranks).",
                           ["backbone"], multiprocess_mode="livemostrecent")
        self.steps_without = Counter(p + "steps_without_draft", "Engine steps served without the draft while it was "
                                     "not usable.", ["backbone"])
        self.drafts = Counter(p + "spec_drafts", "Drafts verified while the draft served.", ["engine"])
        self.draft_tokens = Counter(p + "spec_draft_tokens", "Draft tokens verified while the draft served.",
                                    ["engine"])
        self.accepted_tokens = Counter(p + "spec_accepted_tokens", "Draft tokens accepted while the draft served.",
                                       ["engine"])
        self.accepted_per_pos = Counter(p + "spec_accepted_tokens_per_pos", "Accepted draft tokens per position, "
                                        "while the draft served.", ["engine", "position"])
        self.placeholder_tokens = Counter(p + "spec_placeholder_draft_tokens", "Placeholder draft tokens vLLM "
                                          "verified while the draft was kept out (vllm:spec_decode_* count them as "
                                          "drafts).", ["engine"])
        self.acceptance = Gauge(p + "acceptance_ratio", "Accepted / draft tokens of the latest serving period that "
                                "verified a draft token (0 before any; never NaN).", ["engine"],
                                multiprocess_mode="livemostrecent")
        self.period_tokens = Gauge(p + "acceptance_period_draft_tokens", "Draft tokens the current serving period "
                                   "verified (0: the acceptance ratio is the period's before).", ["engine"],
                                   multiprocess_mode="livemostrecent")
        self.collapsed = Gauge(p + "acceptance_collapsed", "1 while an acceptance collapse after a push stands.",
                               ["engine"], multiprocess_mode="livemax")
        self.collapses = Counter(p + "acceptance_collapses", "Acceptance collapses after a push.", ["engine"])
        self.weight_version = None if multiprocess() else Gauge(
            p + "weight_version_info", "The weight_version the trainer gave last, and the draft push the draft "
            "serves (epoch N) (1; one series; with one API server only).", ["weight_version", "push"])
        self._labels: tuple[str, str] | None = None

    def set_weight_version(self, version: str | None = None, push: str | None = None) -> None:
        """The one series of `weight_version_info`: the trainer's version given last (empty before any) and the
        push the draft serves; None keeps the current value of either."""
        if self.weight_version is None:
            return
        now = self._labels or ("", "")
        labels = (now[0] if version is None else version, now[1] if push is None else push)
        if labels == self._labels:
            return
        if self._labels is not None:
            self.weight_version.remove(*self._labels)
        self._labels = labels
        self.weight_version.labels(*labels).set(1)

    def ensure(self, engines: Iterable[str] = (), positions: int = 0) -> None:
        """Make every series whose labels are known now (a counter's at 0, a gauge's at 0): present from the start."""
        for kind in KINDS:
            for outcome in OUTCOMES:
                self.pushes.labels(kind, outcome)
                self.push_seconds.labels(kind, outcome)
        for call in STRAY_CALLS:
            self.stray_calls.labels(call)
        for engine in engines:
            for counter in (self.drafts, self.draft_tokens, self.accepted_tokens, self.placeholder_tokens,
                            self.collapses):
                counter.labels(engine)
            for pos in range(positions):
                self.accepted_per_pos.labels(engine, str(pos))
            for gauge in (self.acceptance, self.period_tokens, self.collapsed):
                gauge.labels(engine).set(0)  # set: a gauge merged by its latest value shows only what was set

    def ensure_backbone(self, backbone: str) -> None:
        for counter in (self.steps_without, self.written_bytes):
            counter.labels(backbone)


_metrics: ReloadMetrics | None = None


def metrics() -> ReloadMetrics:
    """This process's metrics, created at the first call."""
    global _metrics
    if _metrics is None:
        _metrics = ReloadMetrics()
    return _metrics
