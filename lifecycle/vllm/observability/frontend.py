"""The hooks of the engine's front process (process 0): every weight call a trainer makes reaches the workers
through the engine client's `collective_rpc` (AsyncLLM online: the RL routes and the dev `/collective_rpc`;
LLMEngine offline: `LLM.start_weight_update` and friends, `llm.collective_rpc("reload_draft_weights", ...)`), so
wrapping it sees every push: its kind, outcome and duration (`front_view.FrontendView`). After a call that can
change the draft, and on vLLM's periodic stats tick, the front process pulls the workers' state through the same
path (`serving_state.SERVING_RPC`) and hands them the canary's audit events; before a push it hands them the
ending period's (so they are audited in the epoch they belong to). The engine clients' `__init__` builds the view
(and adds the stat logger offline); `update_weight_version` / `set_weight_version` label the canary's period.

A wrapper never changes what the call does: its own bookkeeping failing is logged, never raised, and the call's
result or exception is the caller's. Installed in every vLLM process (cheap: the modules are vLLM's front end);
only process 0 builds an engine client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from ..online.answers import checked_version
from ..online.sessions import LIFECYCLE_KW
from .front_view import (
    FRONT,
    FrontendView,
    _safe,
    attach,
    metrics_plugin_allowed,
    pull_async,
    pull_soon,
    pull_sync,
)
from .push_book import Call

__all__ = ["FINAL_PULL_S", "wrap_async_init", "wrap_async_rpc", "wrap_async_shutdown", "wrap_async_version",
           "wrap_sync_init", "wrap_sync_rpc", "wrap_sync_version"]

#: How long the engine client's shutdown waits for the last pull (the serving period's `acceptance` event).
FINAL_PULL_S = 5.0
#: engine client -> the event loop its calls run on
_LOOPS: weakref.WeakKeyDictionary[Any, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()

# ---- the wrappers --------------------------------------------------------------------------------------------------
def _begin(engine: Any, method: Any) -> tuple[FrontendView, Call] | None:
    view = FRONT.views.get(engine)
    # the lifecycle's own RPCs change no draft (reload_draft_weights, a push, has no such prefix)
    if view is None or not isinstance(method, str) or method.startswith("lifecycle_"):
        return None
    call = _safe("booking a worker call", view.begin, method)
    return None if call is None else (view, call)


def _carrying(view: FrontendView, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any], list[list[Any]]]:
    """A finish's arguments with the plugin's options (`sessions.LIFECYCLE_KW`: the trainer's version when the
    finish wrapper put it there) carrying the canary's events too: the workers answer their state with vLLM's
    result, so the finish is the push's only round trip. Returns the events taken (handed back if it fails)."""
    kwargs = dict(kwargs)
    positional = len(args) > 2  # collective_rpc(method, timeout, args, kwargs): the RPC's kwargs by position
    rpc = dict((args[2] if positional else kwargs.get("kwargs")) or {})
    events = _safe("taking the canary's events", view.take_events) or []
    rpc[LIFECYCLE_KW] = {**(rpc.get(LIFECYCLE_KW) or {}), "events": events,
                         "at_stop": _safe("taking the serving period", view.at_stop) or []}
    if positional:
        args = (*args[:2], rpc, *args[3:])
    else:
        kwargs["kwargs"] = rpc
    return args, kwargs, events


def _answers(view: FrontendView, result: Any) -> Any:
    """vLLM's results of a carried finish (what its caller gets), the workers' states applied to the view."""
    if not isinstance(result, list) or not all(isinstance(r, dict) and "result" in r for r in result):
        return result
    states = [r[LIFECYCLE_KW] for r in result if isinstance(r.get(LIFECYCLE_KW), dict)]
    if states:
        _safe("booking the workers' state", view.apply, states)
    return [r["result"] for r in result]


def _sync_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    def collective_rpc(engine: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        booked = _begin(engine, method)
        if booked is None:
            return original(engine, method, *args, **kwargs)
        view, call = booked
        carried: list[list[Any]] | None = None
        if method == "finish_weight_update":
            args, kwargs, carried = _carrying(view, args, kwargs)
        elif view.events_due():  # the period that ends: audited in the epoch it belongs to, before the push
            pull_sync(engine, view)
        try:
            result = original(engine, method, *args, **kwargs)
        except BaseException as e:
            view.requeue(carried)
            if _safe("booking a worker call", view.end, call, e):
                pull_sync(engine, view)
            raise
        pull = _safe("booking a worker call", view.end, call, None)
        if carried is not None:
            return _answers(view, result)
        if pull:
            pull_sync(engine, view)
        return result

    return collective_rpc


def _async_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    async def collective_rpc(engine: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        booked = _begin(engine, method)
        if booked is None:
            return await original(engine, method, *args, **kwargs)
        view, call = booked
        carried: list[list[Any]] | None = None
        if method == "finish_weight_update":
            args, kwargs, carried = _carrying(view, args, kwargs)
        elif view.events_due():
            await pull_async(engine, view)
        try:
            result = await original(engine, method, *args, **kwargs)
        except BaseException as e:
            view.requeue(carried)
            if _safe("booking a worker call", view.end, call, e):
                await pull_async(engine, view)
            raise
        pull = _safe("booking a worker call", view.end, call, None)
        if carried is not None:
            return _answers(view, result)
        if pull:
            await pull_async(engine, view)
        return result

    return collective_rpc


def _with_stat_logger(signature: inspect.Signature, engine: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """LLMEngine's arguments with the plugin's stat logger added to `stat_loggers` (an offline `LLM` loads no
    stat-logger plugin)."""
    from .stat_logger import LifecycleStatLogger

    bound = signature.bind(engine, *args, **kwargs)
    loggers = list(bound.arguments.get("stat_loggers") or [])
    if LifecycleStatLogger not in loggers:
        bound.arguments["stat_loggers"] = [*loggers, LifecycleStatLogger]
    return bound.args[1:], bound.kwargs


def _init(*, is_async: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def __init__(engine: Any, *args: Any, **kwargs: Any) -> None:
            if not is_async and metrics_plugin_allowed():
                args, kwargs = _safe("adding the stat logger", _with_stat_logger, signature, engine, args,
                                     kwargs) or (args, kwargs)
            original(engine, *args, **kwargs)
            view = _safe("building the front view", attach, engine, is_async)
            if view is not None and not is_async:
                pull_sync(engine, view)
            if is_async:
                with contextlib.suppress(RuntimeError):  # the loop its calls run on (a final pull at shutdown)
                    _LOOPS[engine] = asyncio.get_running_loop()
            if view is not None and is_async and _loop_running():  # the backbones' series from the start
                _safe("pulling the workers' state", pull_soon, view)

        return __init__

    return make


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _set_version(original: Callable[..., Any], *, is_async: bool) -> Callable[..., Any]:
    if is_async:
        async def update_weight_version(engine: Any, version: str, *args: Any, **kwargs: Any) -> Any:
            checked_version(version)  # bounded (422 naming the limit), before vLLM keeps it
            result = await original(engine, version, *args, **kwargs)
            if (view := FRONT.views.get(engine)) is not None:
                _safe("booking the weight version", view.weight_version, str(version))
            return result

        return update_weight_version

    def set_weight_version(engine: Any, version: str, *args: Any, **kwargs: Any) -> Any:
        checked_version(version, http=False)
        result = original(engine, version, *args, **kwargs)
        if (view := FRONT.views.get(engine)) is not None:
            _safe("booking the weight version", view.weight_version, str(version))
        return result

    return set_weight_version


def _async_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's API server stops the engine client from a thread of its loop's executor (`launcher.serve_http`), then
    # kills the engine at once (`shutdown_timeout` 0): the serving period's final `acceptance` event goes to the
    # workers first, in one last pull on the loop, waited for up to `FINAL_PULL_S`
    def shutdown(engine: Any, *args: Any, **kwargs: Any) -> Any:
        view, loop = FRONT.views.get(engine), _LOOPS.get(engine)
        if view is not None and loop is not None and loop.is_running() and _off_loop(loop):
            view.requeue(_safe("taking the serving period", view.at_stop) or [])
            _safe("the final pull at shutdown", _final_pull, engine, view, loop)
        return original(engine, *args, **kwargs)

    return shutdown


def _off_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is not loop
    except RuntimeError:
        return True


def _final_pull(engine: Any, view: FrontendView, loop: asyncio.AbstractEventLoop) -> None:
    asyncio.run_coroutine_threadsafe(pull_async(engine, view), loop).result(timeout=FINAL_PULL_S)


#: the makers the registry names (`compat/registry.py`)
wrap_async_init, wrap_sync_init = _init(is_async=True), _init(is_async=False)
wrap_async_shutdown = _async_shutdown
wrap_async_rpc, wrap_sync_rpc = _async_rpc, _sync_rpc
wrap_async_version = functools.partial(_set_version, is_async=True)
wrap_sync_version = functools.partial(_set_version, is_async=False)
