"""The `vllm.stat_logger_plugins` entry point (`reload_lifecycle_metrics`): vLLM's per-engine stat logger of the
front process. `AsyncLLM` (`vllm serve`) loads it through the entry point; an offline `LLM` loads no stat-logger
plugin, so the plugin adds it to `LLMEngine`'s own `stat_loggers` (`frontend.py`). Either way it runs only where
vLLM computes stats: always online (a stat-logger plugin turns them on), offline with `disable_log_stats=False`.

`record` runs once per engine step, on vLLM's output path: it hands the step's speculative-decoding counters to the
engine's `front_view.FrontendView` (a few additions) and, when the canary has events to audit, has them written.
`log` is vLLM's periodic tick (`VLLM_LOG_STATS_INTERVAL`, 10 s): a pull of the workers' state. This module imports vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from .front_view import FrontendView, logger, logger_created, pull_soon

__all__ = ["LifecycleStatLogger"]


class LifecycleStatLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM's class: read as Any
    """One per data-parallel engine of the front process."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.vllm_config = vllm_config
        self.engine = str(engine_index)
        self.view: FrontendView | None = None  # bound when the engine's __init__ returns
        logger_created(self)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        view = self.view
        if spec is None or view is None:
            return
        try:
            if view.record(self.engine, spec):
                pull_soon(view)
        except Exception:  # the metrics must never stop the engine's output path
            logger.exception("reload-lifecycle: counting a step's drafts failed")

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        if self.view is not None:
            try:
                pull_soon(self.view)
            except Exception:
                logger.exception("reload-lifecycle: the periodic pull failed")
