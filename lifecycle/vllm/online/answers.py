"""The weight-update calls of the engine's front process (the RL routes call `AsyncLLM`; the offline `LLM`): the
plugin's refusals answered as the HTTP errors that name them, and a finish that carries the trainer's
`weight_version` to the workers with the finish itself.

The worker's refusal crosses two processes as a string inside vLLM's wrapped error ("Call to collective_rpc method
failed: Worker failed with error '<message>', please check the stack trace above ..."); the wrappers of
`AsyncLLM.start_weight_update`, `start_draft_weight_update`, `update_weights` and `finish_weight_update` find its
`REFUSED` prefix and answer `GracefulHTTPError` with the plugin's message alone: 409 for a refused start or a call
of another push (`CONFLICT`), 422 for a refused chunk or finish. vLLM's own handler answers it on the same
connection (a raw exception reaches Starlette's ServerErrorMiddleware, and uvicorn then closes the keep-alive
connection under the trainer's next request).

`weight_version`: vLLM sets it in the engine core only after a successful finish, and never tells the workers.
vLLM's `finish_weight_update` is two calls, the workers' finish, then `update_weight_version`; the wrappers make
the same two calls, the first carrying the version (`sessions.LIFECYCLE_KW`), so the draft's epoch audits it and
its `weight_update_session_ended` carries it, without another round trip. A `weight_version` that is not a bounded
label (`pushes.check_label`: at most 128 characters of a fixed set) is refused (422) before any call: nothing
changes, and neither `/weight_info` nor `/metrics` ever carries more than that of what a trainer sent.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from .pushes import CONFLICT, check_label
from .sessions import LIFECYCLE_KW, REFUSED

__all__ = ["answer_conflict", "answer_unprocessable", "checked_version", "wrap_async_finish", "wrap_offline_finish"]


def _answer_refusal(e: Exception, status: HTTPStatus) -> Exception | None:
    """The plugin's refusal inside vLLM's wrapped error ("Call to collective_rpc method failed: Worker failed with
    error '<message>', please check the stack trace above ..."), as the HTTP error vLLM answers; None otherwise."""
    message = str(e)
    at = message.find(REFUSED)
    if at < 0:
        return None
    from vllm.exceptions import GracefulHTTPError

    inner = message[at:]
    end = inner.rfind("', please check")
    if inner.startswith(CONFLICT):  # a call of another push: the open push goes on
        status = HTTPStatus.CONFLICT
    return GracefulHTTPError(inner[:end] if end > 0 else inner, status)  # type: ignore[no-any-return]  # vLLM's class


def checked_version(version: object, what: str = "weight_version", *, http: bool = True) -> str | None:
    """`version` when it is None or a bounded label; else the refusal: vLLM's `GracefulHTTPError` 422 (`http`) or
    the ValueError / TypeError itself, naming the limit. Nothing was called yet."""
    try:
        return check_label(version, what)
    except (TypeError, ValueError) as e:
        if not http:
            raise
        from vllm.exceptions import GracefulHTTPError

        raise GracefulHTTPError(f"{REFUSED} {what}: {e}", HTTPStatus.UNPROCESSABLE_ENTITY) from None


def _answered(status: HTTPStatus) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        async def call(engine: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await original(engine, *args, **kwargs)
            except Exception as e:
                answer = _answer_refusal(e, status)
                if answer is None:
                    raise
                raise answer from e

        return call

    return make


def _async_finish(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's body (`collective_rpc("finish_weight_update")`, then `update_weight_version`), the version carried
    async def finish_weight_update(engine: Any, weight_version: str | None = None) -> Any:
        checked_version(weight_version)
        try:
            await engine.collective_rpc("finish_weight_update",
                                        kwargs={LIFECYCLE_KW: {"weight_version": weight_version}})
        except Exception as e:
            answer = _answer_refusal(e, HTTPStatus.UNPROCESSABLE_ENTITY)
            if answer is None:
                raise
            raise answer from e
        if weight_version is not None:
            await engine.update_weight_version(weight_version)

    return finish_weight_update


def _offline_finish(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's body (`llm_engine.collective_rpc("finish_weight_update")`, then `set_weight_version`), the version carried
    def finish_weight_update(llm: Any, weight_version: str | None = None) -> Any:
        checked_version(weight_version, http=False)
        llm.llm_engine.collective_rpc("finish_weight_update", kwargs={LIFECYCLE_KW: {"weight_version": weight_version}})
        if weight_version is not None:
            llm.llm_engine.set_weight_version(weight_version)

    return finish_weight_update


#: the makers the registry names (`compat/registry.py`)
answer_conflict = _answered(HTTPStatus.CONFLICT)
answer_unprocessable = _answered(HTTPStatus.UNPROCESSABLE_ENTITY)
wrap_async_finish, wrap_offline_finish = _async_finish, _offline_finish
