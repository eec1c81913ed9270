"""What an engine's front process (an API server of `vllm serve`, or the process that built an `LLM`) knows of its
draft: the weight pushes it saw (`push_book`, shared by the API servers of one server), the draft's state it pulled
from the workers, and the acceptance canary's per-step counts (`FrontendView`, one per engine client); `frontend.py`
holds the hooks that feed it. Every weight call reaches the workers through the engine client's `collective_rpc`, so
wrapping it sees every push: kind, outcome, duration. After a call that can change the draft, and on vLLM's stats
tick, the front process pulls the workers' state (`serving_state.SERVING_RPC`) and hands them the canary's events.
While a push or another worker call is in flight, steps count as served without the draft (the canary counts only
steps where the draft served).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ... import errors as lifecycle_errors
from ..online.pushes import REFUSED, WeightUpdateRefused
from ..settings import acceptance_thresholds
from .canary import AcceptanceCanary
from .metrics import metrics, multiprocess
from .push_book import Call as _Call
from .push_book import PushBook
from .serving_state import SERVING_RPC

__all__ = ["FRONT", "GENERAL_PLUGIN", "METRICS_PLUGIN", "PUSH_CALLS", "FrontProcess", "FrontendView", "attach",
           "error_class", "logger", "logger_created", "metrics_plugin_allowed", "pull_async", "pull_soon", "pull_sync",
           "view_of"]

# under vLLM's own logger: its handler writes the server's log (a logger of ours alone reached nothing online)
logger = logging.getLogger("vllm.reload_lifecycle")
GENERAL_PLUGIN = "reload_lifecycle"  # entry point names (pyproject.toml)
METRICS_PLUGIN = "reload_lifecycle_metrics"
#: worker call -> (kind, step) of a push; the kind of `update_weights` / `finish_weight_update` is their session's
PUSH_CALLS: Mapping[str, tuple[str, str]] = {
    "start_draft_weight_update": ("draft", "start"), "start_weight_update": ("policy", "start"),
    "update_weights": ("", "update"), "finish_weight_update": ("", "finish"),
    "reload_draft_weights": ("draft", "once"), "reload_weights": ("policy", "once")}
#: exception classes that say nothing of the cause (vLLM's transport wraps the worker's error in them, and
#: sessions.WeightUpdateRefused the lifecycle's)
_GENERIC = frozenset({"Exception", "RuntimeError", "GracefulHTTPError", "EngineDeadError", "EngineGenerateError",
                      "WeightUpdateRefused"})
_KNOWN = frozenset(n for n, v in {**vars(builtins), **vars(lifecycle_errors)}.items()
                   if isinstance(v, type) and issubclass(v, BaseException))
_CLASS = re.compile(r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception|Interrupt|Exit))\b")


def error_class(error: BaseException, reasons: Iterable[str] = ()) -> str:
    """The class of what refused a call: the exception's own, unless it is one of vLLM's transport wrappers
    (a worker's error crosses processes as text), then the first known exception class its message or the
    quarantine reasons name. Always a class name of Python or of this package: a bounded label."""
    name = type(error).__name__
    if name not in _GENERIC:
        return name
    for text in (str(error), *reasons):
        for m in _CLASS.finditer(text):
            if m.group(1) in _KNOWN and m.group(1) not in _GENERIC:
                return m.group(1)
    # a call the plugin refused by itself (a start while a session is open): its class did not cross the transport
    return WeightUpdateRefused.__name__ if REFUSED in str(error) else name


def metrics_plugin_allowed() -> bool:
    """vLLM's `VLLM_PLUGINS` is one allowlist for every plugin group: set, it must name the metrics plugin too."""
    raw = os.environ.get("VLLM_PLUGINS")
    return raw is None or METRICS_PLUGIN in [p.strip() for p in raw.split(",")]


class FrontendView:
    """What one engine client (AsyncLLM or LLMEngine) of process 0 knows of its draft."""

    def __init__(self, engine: Any, *, is_async: bool) -> None:
        self.engine = weakref.ref(engine)
        self.is_async = is_async
        self.thresholds = acceptance_thresholds()
        self.canaries: dict[str, AcceptanceCanary] = {}
        self.drafting: bool | None = True  # a cold load that succeeded left the draft usable
        self.in_flight = 0  # worker calls other than pushes
        # the push in progress (`push_book`: shared by the API servers of one `vllm serve`)
        self.book = PushBook(os.environ.get("PROMETHEUS_MULTIPROC_DIR") if multiprocess() else None)
        self.applied: tuple[int, str | None] = (0, None)  # the push (seq, outcome) the canaries last heard of
        self.counts_workers = True  # whether the workers' totals are counted here (API server 0 of several)
        self.workers_answer = True  # False once a pull found no lifecycle RPC in the workers
        self.last: dict[tuple[str, str], int] = {}  # (backbone, counter) -> cumulative value last seen
        self.reasons: dict[str, str | None] = {}
        self.refused: tuple[str, BaseException] | None = None  # a refusal to classify after the next pull
        self.pulling = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.requeued: list[list[Any]] = []  # events taken for a call that failed: handed over with the next
        self.serving: str | None = None  # the push the draft serves (`epoch N`), as the workers last answered
        self.version: str | None = None  # the trainer's weight_version, as vLLM last set it

    def canary(self, engine: str) -> AcceptanceCanary:
        c = self.canaries.get(engine)
        if c is None:
            c = self.canaries[engine] = AcceptanceCanary(self.thresholds)
            if self.serving is not None:  # the push the draft serves, known before this engine's first step
                c.set_push(self.serving)
            if self.version is not None:
                c.set_weight_version(self.version)
        return c

    # ---- one engine step's verified drafts (the stat logger) -----------------------------------------------
    def record(self, engine: str, spec: Any) -> bool:
        """Count `spec` (vLLM's SpecDecodingStats of one step); True when the workers should be pulled now: audit
        events are due, or the first step served without the draft came (its paused state and steps)."""
        if self.book.shared:
            self.sync()
        idle = self.book.open_push() is None
        drafting = self.drafting is True and self.in_flight == 0 and idle
        c = self.canary(engine)
        first_without = not drafting and not c.period.placeholder_draft_tokens and idle and not self.in_flight
        per_pos = list(getattr(spec, "num_accepted_tokens_per_pos", ()) or ())
        c.count(drafts=spec.num_drafts, draft_tokens=spec.num_draft_tokens, accepted_tokens=spec.num_accepted_tokens,
                draft_per_pos=list(getattr(spec, "num_draft_tokens_per_pos", ()) or ()), accepted_per_pos=per_pos,
                drafting=drafting)
        m = metrics()
        if drafting:
            m.drafts.labels(engine).inc(spec.num_drafts)
            m.draft_tokens.labels(engine).inc(spec.num_draft_tokens)
            m.accepted_tokens.labels(engine).inc(spec.num_accepted_tokens)
            for pos, n in enumerate(per_pos):
                m.accepted_per_pos.labels(engine, str(pos)).inc(n)
        else:
            m.placeholder_tokens.labels(engine).inc(spec.num_draft_tokens)
        self._acceptance_gauges(engine, c)
        return self.events_due() or first_without

    def _acceptance_gauges(self, engine: str, c: AcceptanceCanary) -> None:
        m, p = metrics(), c.period
        if p.share is not None:  # else the ratio of the period before stands (NaN broke every rule reading it)
            m.acceptance.labels(engine).set(p.share)
        m.period_tokens.labels(engine).set(p.draft_tokens)
        m.collapsed.labels(engine).set(1 if c.collapsed else 0)
        self._inc_by_delta(m.collapses.labels(engine), (engine, "collapses"), c.collapses, own=True)

    def events_due(self) -> bool:
        return bool(self.requeued) or any(c._events for c in self.canaries.values())

    def requeue(self, events: list[list[Any]] | None) -> None:
        """Events taken for a worker call that failed: the next call or pull hands them over (none lost)."""
        if events:
            self.requeued = [*events, *self.requeued]

    def at_stop(self) -> list[list[Any]]:
        """Each engine's current period as its final `acceptance` event: the workers keep it and write it if they
        stop before the next push ends the period (handed over with every pull)."""
        return [["acceptance", "info", {**f, "engine": int(e)}] for e, c in self.canaries.items()
                if (f := c.provisional()) is not None]

    def take_events(self) -> list[list[Any]]:
        """The canary's events to audit, each `[event, level, fields]`; a collapse is also a warning in this
        process's log (the server's log, where an operator looks first)."""
        out, self.requeued = self.requeued, []
        for engine, c in self.canaries.items():
            for name, level, fields in c.take_events():
                f = {**fields, "engine": int(engine)}
                out.append([name, level, f])
                if name != "acceptance_collapse":
                    continue
                logger.warning("reload-lifecycle: acceptance collapse on engine %s after a push: %s of %s draft "
                               "tokens accepted (%s, weight_version %s), %s in the period before (%s, weight_version "
                               "%s): the push most likely broke the draft; outputs stay the target's", engine,
                               f["accepted_share"], f["draft_tokens"], f.get("push"), f.get("weight_version"),
                               f["previous_share"], f.get("previous_push"), f.get("previous_weight_version"))
        return out

    # ---- worker calls ----------------------------------------------------------------------------------------
    def begin(self, method: str) -> _Call:
        now = time.monotonic()
        push = PUSH_CALLS.get(method)
        if push is None:
            self.in_flight += 1
            return _Call("", "other", now, method)
        kind, step = push
        call = self.book.begin(method, kind, step, now)
        if step in ("start", "once"):
            self._push_began(call.kind, call.seq)
        self.drafting = None
        return call

    def end(self, call: _Call, error: BaseException | None) -> bool:
        """Book the call's end; True when the workers' state must be pulled now."""
        if call.step == "other":
            self.in_flight -= 1
            return True
        outcome = self.book.end(call, error, time.monotonic())
        if outcome is None:
            return False
        if outcome != "stray":
            self._push_ended(outcome, call.seq)
            if error is not None:
                self.refused = (call.kind, error)
        self.drafting = error is None  # what the workers' answer will confirm (or say otherwise)
        return True

    def _push_began(self, kind: str, seq: int) -> None:
        self.applied = (seq, None)
        for engine, c in self.canaries.items():
            c.push_began(kind)
            self._acceptance_gauges(engine, c)

    def _push_ended(self, outcome: str, seq: int) -> None:
        self.applied = (seq, outcome)
        for c in self.canaries.values():
            c.push_ended(outcome)

    def sync(self) -> None:
        """With several API servers: a push another server began or ended, as the shared book says, tells this
        server's canary (its periods follow every push), and its state is pulled before a step counts as drafted."""
        r = self.book.latest()
        if r is None or (r.seq, r.outcome) == self.applied:
            return
        if r.seq != self.applied[0]:
            self._push_began(r.kind, r.seq)
        if r.outcome is not None:
            self._push_ended(r.outcome, r.seq)
        self.drafting = None

    def weight_version(self, version: str) -> None:
        self.version = version
        for c in self.canaries.values():
            c.set_weight_version(version)
        metrics().set_weight_version(version=version)

    # ---- the workers' answers --------------------------------------------------------------------------------
    def apply(self, answers: Sequence[Mapping[str, Any]] | None) -> None:
        """The workers' `lifecycle_serving_state` answers (None: no answer) into the metrics and `drafting`."""
        m = metrics()
        merged: dict[str, dict[str, Any]] = {}
        for answer in answers or ():
            for name, b in (answer.get("backbones") or {}).items():
                into = merged.setdefault(name, {"usable": True, "quarantined": False, "paused": False, "epoch": 0,
                                                "steps": 0, "bytes": 0, "reasons": []})
                into["usable"] = into["usable"] and bool(b["usable"])
                into["quarantined"] = into["quarantined"] or bool(b["quarantined"])
                into["paused"] = into["paused"] or bool(b["drafting_paused"])
                into["epoch"] = max(into["epoch"], int(b["epoch"]))
                into["steps"] = max(into["steps"], int(b["steps_without_draft_total"]))  # ranks step together
                into["bytes"] += int(b["written_bytes_total"])  # each rank writes its own shard
                into.setdefault("push", b.get("serving_push"))  # every rank serves the same push
                if b.get("quarantine_reason"):
                    into["reasons"].append(str(b["quarantine_reason"]))
        new_reasons: list[str] = []
        for name, b in merged.items():
            m.usable.labels(name).set(1 if b["usable"] else 0)
            m.quarantined.labels(name).set(1 if b["quarantined"] else 0)
            m.paused.labels(name).set(1 if b["paused"] else 0)
            m.epoch.labels(name).set(b["epoch"])
            m.ensure_backbone(name)
            self._inc_by_delta(m.steps_without.labels(name), (name, "steps"), b["steps"])
            self._inc_by_delta(m.written_bytes.labels(name), (name, "bytes"), b["bytes"])
            reason = b["reasons"][0] if b["reasons"] else None
            if reason is not None and reason != self.reasons.get(name):
                new_reasons.append(reason)
            self.reasons[name] = reason
        if answers is not None:
            self.drafting = all(b["usable"] for b in merged.values())
        serving = [str(b["push"]) for _, b in sorted(merged.items()) if b.get("push")]
        if serving and self.book.open_push() is None:  # the push served labels the canary's period and the info
            self.serving = serving[0]
            for c in self.canaries.values():
                c.set_push(serving[0])
            m.set_weight_version(push=serving[0])
        if self.refused is not None:
            kind, error = self.refused
            self.refused = None
            m.refusals.labels(kind, error_class(error, new_reasons)).inc()

    def _inc_by_delta(self, counter: Any, key: tuple[str, str], total: int, own: bool = False) -> None:
        """`own`: a total of this process's (its canary's), else of the workers' (several API servers: server 0's)."""
        last = self.last.get(key, 0)
        if total > last and (own or self.counts_workers):
            counter.inc(total - last)
        self.last[key] = total  # lower: the workers restarted; count on from their value

    def no_answer(self, error: BaseException) -> None:
        if self.workers_answer and SERVING_RPC in str(error):
            self.workers_answer = False
            logger.warning("reload-lifecycle: the workers do not answer %s (%s: %.200s): the draft's state metrics "
                           "and the acceptance canary's audit events are off; start the engine with "
                           "worker_extension_cls='lifecycle.vllm.worker.LifecycleWorkerExtension'", SERVING_RPC,
                           type(error).__name__, error)
        else:
            logger.debug("reload-lifecycle: pulling the workers' state failed", exc_info=error)
        self.apply(None)


class FrontProcess:
    """The front process's state (one object): each engine client's view, and the stat loggers vLLM built inside
    an engine client's `__init__`, not yet bound to its view."""

    def __init__(self) -> None:
        self.views: weakref.WeakKeyDictionary[Any, FrontendView] = weakref.WeakKeyDictionary()
        self.loggers: list[weakref.ref[Any]] = []


#: This process's front state.
FRONT = FrontProcess()


def view_of(engine: Any) -> FrontendView | None:
    return FRONT.views.get(engine)


def logger_created(stat_logger: Any) -> None:
    """A stat logger was built (inside its engine's __init__): bound to the engine's view once that exists."""
    FRONT.loggers.append(weakref.ref(stat_logger))


def attach(engine: Any, is_async: bool) -> FrontendView:
    """The engine client's view, made now (its `__init__` returned), with the stat loggers built inside it bound."""
    view = FRONT.views[engine] = FrontendView(engine, is_async=is_async)
    bound_loggers = []
    for ref in list(FRONT.loggers):
        stat_logger = ref()
        if stat_logger is None:
            FRONT.loggers.remove(ref)
        elif stat_logger.vllm_config is engine.vllm_config:
            stat_logger.view = view
            FRONT.loggers.remove(ref)
            bound_loggers.append(stat_logger)
    bound = len(bound_loggers)
    view.counts_workers = getattr(engine, "_client_count", 1) <= 1 or getattr(
        getattr(engine, "engine_core", None), "client_index", 0) == 0
    spec = getattr(engine.vllm_config, "speculative_config", None)
    metrics().ensure(sorted({ref.engine for ref in bound_loggers}) or ["0"],
                     int(getattr(spec, "num_speculative_tokens", 0) or 0))
    if not metrics_plugin_allowed():
        logger.warning("reload-lifecycle: VLLM_PLUGINS=%r leaves out %r (vLLM's allowlist is one for every plugin "
                       "group): no reload_lifecycle_* acceptance metrics and no acceptance canary on this engine; "
                       "list it beside %r", os.environ.get("VLLM_PLUGINS"), METRICS_PLUGIN, GENERAL_PLUGIN)
    elif not bound and getattr(engine, "log_stats", False):
        logger.warning("reload-lifecycle: no %s stat logger reached this engine (is the package installed with its "
                       "entry points?): no acceptance metrics and no acceptance canary", METRICS_PLUGIN)
    return view


# ---- pulls ---------------------------------------------------------------------------------------------------------
def _safe(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None when the bookkeeping itself fails (logged): the call it books goes on."""
    try:
        return fn(*args)
    except Exception:
        logger.exception("reload-lifecycle: %s failed (the engine goes on; metrics may be off)", what)
        return None


def pull_sync(engine: Any, view: FrontendView) -> None:
    events = _safe("taking the canary's events", view.take_events) or []
    at_stop = _safe("taking the serving period", view.at_stop) or []
    if not view.workers_answer:
        _safe("booking the workers' state", view.apply, None)
        return
    try:
        answers = engine.collective_rpc(SERVING_RPC, kwargs={"events": events, "at_stop": at_stop})
    except Exception as e:
        _safe("booking a failed pull", view.no_answer, e)
        return
    _safe("booking the workers' state", view.apply, answers)


async def pull_async(engine: Any, view: FrontendView) -> None:
    events = _safe("taking the canary's events", view.take_events) or []
    at_stop = _safe("taking the serving period", view.at_stop) or []
    if not view.workers_answer:
        _safe("booking the workers' state", view.apply, None)
        return
    view.pulling = True
    try:
        answers = await engine.collective_rpc(SERVING_RPC, kwargs={"events": events, "at_stop": at_stop})
    except Exception as e:
        _safe("booking a failed pull", view.no_answer, e)
        return
    finally:
        view.pulling = False
    _safe("booking the workers' state", view.apply, answers)


def pull_soon(view: FrontendView) -> None:
    """From the stat logger: pull now (offline) or in a task of the running loop (online)."""
    engine = view.engine()
    if engine is None:
        return
    if not view.is_async:
        pull_sync(engine, view)
        return
    if view.pulling:
        return
    task = asyncio.get_running_loop().create_task(pull_async(engine, view))
    view.tasks.add(task)
    task.add_done_callback(view.tasks.discard)
