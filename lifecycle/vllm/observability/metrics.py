"""The plugin's Prometheus metrics, in the engine's front process: what `vllm serve` exposes at `/metrics`.

One set per process, created at first use in `prometheus_client`'s default registry: the one `vllm serve` mounts
at `/metrics` with a single API server (vllm/v1/metrics/prometheus.py; only `--api-server-count > 1` switches to
a multiprocess registry, and then these are not collected). vLLM unregisters and re-creates only its own `vllm:`
collectors, so these live as long as the process. Names follow vLLM's conventions: units in the name (`_seconds`,
`_bytes`), counters end in `_total` (prometheus_client adds it), gauges for states (0 or 1), labels `kind`
(draft or policy), `outcome`, `error` (an exception class name), `backbone` (the draft's lifecycle name) and
`engine` (the data-parallel engine index, as vLLM's own). The trainer's `weight_version` is never a label of a
counter (it has no bound): `reload_lifecycle_weight_version_info` carries the current one only, bounded in length
(`online.pushes.check_label`), with `push`, the draft push the draft serves by the plugin's own name (`epoch N`).

prometheus_client comes with vLLM; it is imported when the metrics are first used, never at import.
"""

from __future__ import annotations

__all__ = ["PUSH_SECONDS_BUCKETS", "ReloadMetrics", "metrics"]

#: Push durations (seconds): a tiny draft over a file takes tens of ms, a large one over a network seconds.
PUSH_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)


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
        self.refusals = Counter(p + "refusals", "Weight calls refused, by kind and the error's class.",
                                ["kind", "error"])
        self.written_bytes = Counter(p + "written_bytes", "Bytes of draft tensors written by reloads (all ranks).",
                                     ["backbone"])
        self.usable = Gauge(p + "draft_usable", "1 while every rank's draft backbone may draft.", ["backbone"])
        self.quarantined = Gauge(p + "draft_quarantined", "1 while a rank's draft backbone is quarantined.",
                                 ["backbone"])
        self.paused = Gauge(p + "drafting_paused", "1 while the engine serves without the draft (it is not usable "
                            "and a step came).", ["backbone"])
        self.epoch = Gauge(p + "draft_epoch", "The draft backbone's reload epoch (the highest of its ranks).",
                           ["backbone"])
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
        self.acceptance = Gauge(p + "acceptance_ratio", "Accepted / draft tokens of the current serving period "
                                "(since the last push).", ["engine"])
        self.period_tokens = Gauge(p + "acceptance_period_draft_tokens", "Draft tokens the current serving period "
                                   "verified (the acceptance ratio's weight).", ["engine"])
        self.collapsed = Gauge(p + "acceptance_collapsed", "1 while an acceptance collapse after a push stands.",
                               ["engine"])
        self.collapses = Counter(p + "acceptance_collapses", "Acceptance collapses after a push.", ["engine"])
        self.weight_version = Gauge(p + "weight_version_info", "The weight_version the trainer gave last, and the "
                                    "draft push the draft serves (epoch N) (1; one series).",
                                    ["weight_version", "push"])
        self._labels: tuple[str, str] | None = None

    def set_weight_version(self, version: str | None = None, push: str | None = None) -> None:
        """The one series of `weight_version_info`: the trainer's version given last (empty before any) and the
        push the draft serves; None keeps the current value of either."""
        now = self._labels or ("", "")
        labels = (now[0] if version is None else version, now[1] if push is None else push)
        if labels == self._labels:
            return
        if self._labels is not None:
            self.weight_version.remove(*self._labels)
        self._labels = labels
        self.weight_version.labels(*labels).set(1)


_metrics: ReloadMetrics | None = None


def metrics() -> ReloadMetrics:
    """This process's metrics, created at the first call."""
    global _metrics
    if _metrics is None:
        _metrics = ReloadMetrics()
    return _metrics
