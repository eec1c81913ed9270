"""What a test helper needs, declared where the helper is defined, and the guards that hold every test to it.
Standard library only (the scenario processes import it).

A helper that starts a vLLM engine, runs vLLM in a child process or renders in Chromium says so with `needs(...)`;
`tests/conftest.py` marks every test that reaches it (directly, through another helper, through a fixture) and
`-m "not engine and not browser"` leaves those tests out. The decorated helper checks, when called, that the
running test carries the markers (a test that reached it by a path the marking did not see fails, naming the
marker), and a test not marked `engine` cannot start an engine anywhere: not here (vLLM's engine-core client
refuses) and not in a scenario process it starts (`LIFECYCLE_TEST_NO_ENGINE`, read by `refuse_engines`).

>>> @needs("browser")
... def render() -> str:
...     return "rendered"
>>> sorted(needs_of(render))
['browser', 'slow']
>>> with running_test("tests/test_page.py::test_renders", ["browser", "slow"]):
...     render()
'rendered'
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, TypeVar, cast

__all__ = ["NO_ENGINE_ENV", "EngineRefused", "needs", "needs_of", "refuse_engines", "refusing_engines",
           "running_test"]

F = TypeVar("F", bound=Callable[..., Any])

#: marker -> what it implies: a helper that starts an engine imports vLLM and takes seconds
IMPLIES = {"engine": {"vllm", "slow"}, "browser": {"slow"}, "vllm": set(), "slow": set()}
#: set in a scenario process a test not marked `engine` started: the test's id
NO_ENGINE_ENV = "LIFECYCLE_TEST_NO_ENGINE"
ENGINE_CLIENT = "vllm.v1.engine.core_client"  # every engine (LLM, AsyncLLM, `vllm serve`) gets its core here

_ATTR = "__test_needs__"
#: (node id, its markers) of the test running now; set by conftest.py around each test
_running: tuple[str, frozenset[str]] | None = None


class EngineRefused(RuntimeError):
    """A vLLM engine was started by a test not marked `engine`."""


def needs(*markers: str) -> Callable[[F], F]:
    """Declare that calling the decorated helper needs `markers` (and what they imply, `IMPLIES`)."""
    unknown = set(markers) - IMPLIES.keys()
    if unknown:
        raise ValueError(f"unknown test markers {sorted(unknown)}: known are {sorted(IMPLIES)}")
    wanted = frozenset(markers).union(*(IMPLIES[m] for m in markers))

    def declare(fn: F) -> F:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if _running is not None and not wanted <= _running[1]:
                import pytest  # here only: the scenario processes import this module without pytest

                missing = sorted(wanted - _running[1])
                pytest.fail(f"{_running[0]} calls {fn.__qualname__}, which needs the markers {missing}, but is not "
                            "marked with them: tests/conftest.py did not see the call (reach the helper by name, "
                            "from the test, a fixture or another helper)", pytrace=False)
            return fn(*args, **kwargs)

        setattr(checked, _ATTR, wanted | needs_of(fn))
        return cast(F, checked)

    return declare


def needs_of(obj: object) -> frozenset[str]:
    """The markers `obj` was declared to need (empty for anything not decorated by `needs`)."""
    return frozenset(getattr(obj, _ATTR, frozenset()))


@contextmanager
def running_test(nodeid: str, markers: Sequence[str]) -> Iterator[None]:
    """While the block runs, `nodeid` (with `markers`) is the running test: helpers check against it, a vLLM
    engine started here or in a scenario process raises unless it is marked `engine`."""
    global _running
    before, env_before = _running, os.environ.get(NO_ENGINE_ENV)
    _running = (nodeid, frozenset(markers))
    engine = "engine" in markers
    if engine:
        os.environ.pop(NO_ENGINE_ENV, None)
    else:
        os.environ[NO_ENGINE_ENV] = nodeid
    try:
        with refusing_engines(None if engine else nodeid):
            yield
    finally:
        _running = before
        if env_before is None:
            os.environ.pop(NO_ENGINE_ENV, None)
        else:
            os.environ[NO_ENGINE_ENV] = env_before


# ---- no engine where none is declared ---------------------------------------------------------------------------
_refusing: str | None = None  # the test whose engine starts are refused in this process, if any
_saved: dict[str, Any] = {}


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise EngineRefused(f"{_refusing} started a vLLM engine but is not marked `engine`: tests/conftest.py marks a "
                        "test `engine` when it reaches a helper declared @needs('engine') (tests/support/needs.py)")


def _patch(client_module: ModuleType) -> None:
    client = client_module.EngineCoreClient
    if not _saved:
        _saved.update(make_client=client.__dict__["make_client"],
                      make_async_mp_client=client.__dict__["make_async_mp_client"])
    client.make_client = staticmethod(_refuse)
    client.make_async_mp_client = staticmethod(_refuse)


def _unpatch(client_module: ModuleType) -> None:
    for name, original in _saved.items():
        setattr(client_module.EngineCoreClient, name, original)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Refuses engines as soon as vLLM's engine-core client is imported (so the guard itself imports no vLLM)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != ENGINE_CLIENT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            if _refusing is not None:
                _patch(module)

        loader.exec_module = exec_module
        return spec


_FINDER = _PatchOnImport()


@contextmanager
def refusing_engines(nodeid: str | None) -> Iterator[None]:
    """While the block runs, every vLLM engine start in this process raises `EngineRefused` naming `nodeid`
    (None: engines allowed)."""
    before = _refusing
    _set_refusing(nodeid)
    try:
        yield
    finally:
        _set_refusing(before)


def _set_refusing(nodeid: str | None) -> None:
    global _refusing
    _refusing = nodeid
    loaded = sys.modules.get(ENGINE_CLIENT)
    if loaded is not None:
        (_patch if nodeid is not None else _unpatch)(loaded)
    if nodeid is not None and loaded is None and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    elif nodeid is None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def refuse_engines() -> None:
    """In a scenario process: if the test that started it is not marked `engine` (`NO_ENGINE_ENV`), every vLLM
    engine start in this process raises for the rest of its life."""
    nodeid = os.environ.get(NO_ENGINE_ENV)
    if nodeid:
        _set_refusing(nodeid)
