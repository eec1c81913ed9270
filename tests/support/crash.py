"""Crash consistency, in the spirit of SQLite's I/O-error and crash tests (which fail every I/O operation in turn):
an operation is interrupted at every write point in turn, and after each interrupt an invariant is checked.

A write point is a place where an operation changes something: an in-place op on a tensor (`copy_`, `fill_`, an
`out=` op, `__setitem__`, `.data =`), a tensor handed to the loader's writer, a buffer registered, a post-load hook
called, a trigger fired by the machine (before it, and after its state changed), a report to the lifecycle. Points
are found from outside the code (a `TorchFunctionMode`, wrapped functions and methods: `CORE_PROBES`), so the code
under test carries no injection point. A clean run counts them (deterministically: one thread, the same inputs);
then the run that fails point k raises there an injected `RuntimeError`, `KeyboardInterrupt` or `SystemExit` (the
classes of `INJECTED`, subclasses marked `Injected`: nothing mistakes them for genuine ones, and a genuine Ctrl-C
still stops the test).

    points = WritePoints()
    with instrumented(points):                  # CORE_PROBES; a harness adds its own probes with `probes=`
        with points.counting():
            operation(setup())                  # points.labels: every point, in order
        with points.failing(7, "KeyboardInterrupt"):
            operation(setup())                  # raises InjectedInterrupt at point 7

`sweep(Scenario(name, setup, operation, check))` does this for every point (with every kind, or one kind per point
in turn: `kinds="rotate"`) and returns a `SweepResult`: the points tried and the outcomes by kind. An interrupt
must come out of the operation (else `LOST`); then the scenario's `check` names the outcome: `USABLE` and
`REFUSED` are sound, `STALE` and `STRANDED` are violations (`support.crash_backbone` holds the backbones' check).
Every result is also kept in `RESULTS`, which the test session's summary prints (`tests/conftest.py`).
"""

from __future__ import annotations

import functools
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["CORE_PROBES", "INJECTED", "KINDS", "LOST", "REFUSED", "RESULTS", "STALE", "STRANDED", "USABLE",
           "Injected", "Outcome", "Probe", "Scenario", "SweepResult", "WritePoints", "after", "before",
           "instrumented", "interrupting", "post_load_hooks", "summarize", "sweep", "torch_writes"]

C = TypeVar("C")


class Injected:
    """Marks an exception the harness raised at a write point."""


class InjectedError(Injected, RuntimeError):
    pass


class InjectedInterrupt(Injected, KeyboardInterrupt):
    pass


class InjectedExit(Injected, SystemExit):
    pass


#: The kinds of interrupt, by the name of what they stand for.
INJECTED: dict[str, type[BaseException]] = {"RuntimeError": InjectedError, "KeyboardInterrupt": InjectedInterrupt,
                                            "SystemExit": InjectedExit}
KINDS = tuple(INJECTED)

# ---- outcomes ----------------------------------------------------------------------------------------------------
USABLE = "usable"  # usable after the interrupt, every derived buffer equal to a cold build of its weights
REFUSED = "refused"  # refuses forward use after the interrupt
STALE = "usable-but-stale"  # usable with some buffer that differs from a cold build (or usable after a shortcut)
STRANDED = "stranded"  # the documented retry did not reach a usable state equal to a cold build
LOST = "interrupt-lost"  # the injected exception did not come out of the operation
NOT_REACHED = "point-not-reached"  # the run that fails point k never reached it: the points are not deterministic
VIOLATIONS = frozenset({STALE, STRANDED, LOST, NOT_REACHED})


@dataclass(frozen=True)
class Outcome:
    kind: str
    detail: str = ""


class WritePoints:
    """The write points of the current run: ignored outside `counting()` / `failing()`; inside, each `hit` is
    recorded in `labels`, and the `failing` one raises. The injected exception is `injected`."""

    def __init__(self, only: str = "") -> None:
        self.labels: list[str] = []
        self.injected: BaseException | None = None
        self.only = only  # count only the points whose label starts with this
        self._recording = False
        self._fail_at = 0
        self._kind = ""

    def hit(self, label: str) -> None:
        if not self._recording or not label.startswith(self.only):
            return
        self.labels.append(label)
        if len(self.labels) == self._fail_at and self.injected is None:
            self.injected = INJECTED[self._kind](f"injected {self._kind} at write point {self._fail_at}: {label}")
            raise self.injected

    @contextmanager
    def counting(self) -> Iterator[WritePoints]:
        with self.failing(0, KINDS[0]):
            yield self

    @contextmanager
    def failing(self, k: int, kind: str) -> Iterator[WritePoints]:
        """Record the points of the block and raise `kind` (a name of `INJECTED`) at the k-th (k >= 1)."""
        self.labels, self.injected, self._fail_at, self._kind = [], None, k, kind
        self._recording = True
        try:
            yield self
        finally:
            self._recording = False


#: Installs one kind of instrumentation for as long as its context lasts; it reports points to the `WritePoints`.
Probe = Callable[[WritePoints], AbstractContextManager[None]]

_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_"})


def _is_write(func: Any, kwargs: dict[str, Any] | None) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__setitem__", "__set__"):
        return True
    return (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES) or bool(
        kwargs and kwargs.get("out") is not None)


class _TorchWrites(TorchFunctionMode):
    def __init__(self, points: WritePoints) -> None:
        super().__init__()
        self.points = points

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if self.points._recording and _is_write(func, kwargs):
            target = kwargs.get("out") if kwargs and kwargs.get("out") is not None else (args[0] if args else None)
            shape = tuple(target.shape) if isinstance(target, torch.Tensor) else ()
            self.points.hit(f"{getattr(func, '__name__', func)} {shape}")
        return func(*args, **(kwargs or {}))


def torch_writes() -> Probe:
    """Every in-place write to a tensor (`copy_`, `fill_`, `mul_`, `out=`, `__setitem__`, `.data =`)."""
    return _TorchWrites


@contextmanager
def _patched(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    had = attr in vars(owner)
    original = vars(owner)[attr] if had else getattr(owner, attr)
    setattr(owner, attr, functools.wraps(original)(make(original)))
    try:
        yield
    finally:
        if had:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)


def _label(label: str | Callable[..., str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return label(*args, **kwargs) if callable(label) else label


def before(owner: Any, attr: str, label: str | Callable[..., str]) -> Probe:
    """A point before each call of `owner.attr` (a function of a module, or a method of a class); `label` is the
    point's name, or makes it from the call's arguments."""
    def probe(points: WritePoints) -> AbstractContextManager[None]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                points.hit(_label(label, args, kwargs))
                return original(*args, **kwargs)
            return call
        return _patched(owner, attr, make)
    return probe


def after(owner: Any, attr: str, label: str | Callable[..., str]) -> Probe:
    """A point after each call of `owner.attr` that returned (its effects are done; its caller's next step is not)."""
    def probe(points: WritePoints) -> AbstractContextManager[None]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                points.hit(_label(label, args, kwargs))
                return result
            return call
        return _patched(owner, attr, make)
    return probe


def post_load_hooks() -> Probe:
    """A point before each post-load hook runs. The hooks are wrapped once per probe (a backbone remembers which
    hook functions completed: a wrapper must be the same object every time)."""
    from lifecycle.backbone import DraftBackbone
    from lifecycle.hooks import Hook

    def probe(points: WritePoints) -> AbstractContextManager[None]:
        wrapped: dict[Callable[..., Any], Callable[..., Any]] = {}

        def wrap(hook: Hook) -> Hook:
            fn = wrapped.get(hook.fn)
            if fn is None:
                def fn(backbone: Any, _original: Callable[..., Any] = hook.fn, _name: str = hook.name) -> Any:
                    points.hit(f"hook {_name}")
                    return _original(backbone)
                wrapped[hook.fn] = fn
            return Hook(hook.name, hook.phases, fn, hook.writes)

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> list[Hook]:
                return [wrap(h) for h in original(*args, **kwargs)]
            return call
        return _patched(DraftBackbone, "post_load_hooks", make)
    return probe


def _core_probes() -> tuple[Probe, ...]:
    import lifecycle.loading.write as write
    from lifecycle.firing import TableMachine
    from lifecycle.load_tracking import LoadTracking

    def trigger(prefix: str) -> Callable[..., str]:
        return lambda _self, trigger, *a, **k: f"{prefix} {trigger}"

    reports = [before(LoadTracking, m, f"report {m}") for m in (
        "weights_loaded", "weights_loaded_buckets", "weights_loaded_whole_layers", "weights_unchanged",
        "mark_dirty")]
    return (
        torch_writes(),
        before(write, "write_tensor", lambda _m, name, *a, **k: f"write_tensor {name}"),
        before(nn.Module, "register_buffer", lambda _m, name, *a, **k: f"register_buffer {name}"),
        post_load_hooks(),
        before(TableMachine, "_fire", trigger("fire")),
        after(TableMachine, "_fire", trigger("fired")),
        *reports,
    )


CORE_PROBES: tuple[Probe, ...] = _core_probes()


@contextmanager
def instrumented(points: WritePoints, probes: Sequence[Probe] = CORE_PROBES) -> Iterator[WritePoints]:
    """Install `probes` (reporting to `points`) for the block."""
    with ExitStack() as stack:
        for probe in probes:
            stack.enter_context(probe(points))
        yield points


@contextmanager
def interrupting(k: int, kind: str = "KeyboardInterrupt", *, probes: Sequence[Probe] = CORE_PROBES,
                 within: tuple[Any, str] | None = None, only: str = "") -> Iterator[WritePoints]:
    """Inside the block, the k-th write point raises `kind` (once): counting only the points whose label starts
    with `only` (`"copy_"`, `"write_tensor"`), and only while `within` (owner, attribute: a function or method)
    runs, if given (the k-th point of one call, each call counted afresh until one raises). Yields the
    `WritePoints` (its `labels`, its `injected`)."""
    points = WritePoints(only)
    with instrumented(points, probes):
        if within is None:
            with points.failing(k, kind):
                yield points
            return

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                if points.injected is not None or points._recording:  # once, the outermost call
                    return original(*args, **kwargs)
                with points.failing(k, kind):
                    return original(*args, **kwargs)
            return call

        with _patched(*within, make):
            yield points


# ---- the sweep ---------------------------------------------------------------------------------------------------
@dataclass
class Scenario(Generic[C]):
    """An operation to interrupt: `setup()` makes a fresh case, `operation(case)` runs the writes under test,
    `check(case, raised)` names the outcome once the interrupt `raised` came out of it."""

    name: str
    setup: Callable[[], C]
    operation: Callable[[C], object]
    check: Callable[[C, BaseException], Outcome]
    probes: Sequence[Probe] = CORE_PROBES


@dataclass
class SweepResult:
    scenario: str
    points: list[str]
    runs: int = 0
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (interrupt kind, outcome) -> runs
    violations: list[str] = field(default_factory=list)

    def by_outcome(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_, outcome), n in self.outcomes.items():
            out[outcome] += n
        return out

    def summary(self) -> str:
        kinds = sorted({k for k, _ in self.outcomes})
        per_kind = "; ".join(f"{k}: " + ", ".join(f"{o} {n}" for (kk, o), n in sorted(self.outcomes.items())
                                                 if kk == k) for k in kinds)
        return (f"{self.scenario}: {len(self.points)} write points, {self.runs} interrupted runs, "
                f"{self.by_outcome()[STALE]} usable-but-stale ({per_kind})")


#: Every sweep's result in this process (the test session's summary adds them up: `summarize`).
RESULTS: list[SweepResult] = []


def summarize(results: Sequence[SweepResult]) -> str:
    """One line for many sweeps: the points and runs, the usable-but-stale count, the outcomes by kind."""
    total: Counter[tuple[str, str]] = Counter()
    for r in results:
        total.update(r.outcomes)
    stale = sum(n for (_, o), n in total.items() if o == STALE)
    by_kind = "; ".join(f"{k}: " + ", ".join(f"{o} {n}" for (kk, o), n in sorted(total.items()) if kk == k)
                        for k in sorted({k for k, _ in total}))
    return (f"crash consistency: {len(results)} sweeps, {sum(len(r.points) for r in results)} write points, "
            f"{sum(r.runs for r in results)} interrupted runs: {stale} usable-but-stale out of "
            f"{sum(r.runs for r in results)} ({by_kind})")


def _carries(raised: BaseException | None, injected: BaseException) -> bool:
    """Whether the injected exception came out: as itself (an interrupt must), or, for an error, as the cause or
    context of what was raised instead (a `LifecycleError` naming it)."""
    if raised is injected:
        return True
    if not isinstance(injected, Exception) or not isinstance(raised, Exception):
        return False
    seen = set()
    e: BaseException | None = raised
    while e is not None and id(e) not in seen:
        if e is injected:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def sweep(scenario: Scenario[C], *, kinds: Sequence[str] | str = KINDS, points: Sequence[int] | None = None
          ) -> SweepResult:
    """Run `scenario` once to count its write points, then once per (point, kind), failing that point with that
    kind, and check each outcome. `kinds="rotate"`: one kind per point, in turn (every point, every kind over
    three consecutive points). `points`: only these (1-based), e.g. a sample. Prints the summary."""
    wp = WritePoints()
    with instrumented(wp, scenario.probes):
        case = scenario.setup()
        with wp.counting():
            scenario.operation(case)
        result = SweepResult(scenario.name, list(wp.labels))
        offset = zlib.crc32(scenario.name.encode())
        for k in points if points is not None else range(1, len(result.points) + 1):
            for kind in (KINDS[(k + offset) % len(KINDS)],) if kinds == "rotate" else kinds:
                case = scenario.setup()
                raised: BaseException | None = None
                with wp.failing(k, kind):
                    try:
                        scenario.operation(case)
                    except BaseException as e:  # the injected interrupts are what is tested
                        raised = e
                injected = wp.injected
                if isinstance(raised, KeyboardInterrupt) and not isinstance(raised, Injected):
                    raise raised  # a genuine Ctrl-C
                if injected is None:
                    outcome = Outcome(NOT_REACHED, f"{len(wp.labels)} points this time")
                elif not _carries(raised, injected):
                    outcome = Outcome(LOST, f"the operation {'returned' if raised is None else f'raised {raised!r}'}")
                else:
                    assert raised is not None
                    outcome = scenario.check(case, raised)
                result.runs += 1
                result.outcomes[kind, outcome.kind] += 1
                if outcome.kind in VIOLATIONS:
                    label = result.points[k - 1] if k <= len(result.points) else "?"
                    result.violations.append(f"point {k} ({label}), {kind}: {outcome.kind}: {outcome.detail}")
    RESULTS.append(result)
    print(result.summary())
    return result
