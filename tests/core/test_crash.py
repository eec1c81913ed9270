"""Crash consistency of the core's write operations: each is interrupted at every write point in turn
(`support.crash`), with `RuntimeError`, `KeyboardInterrupt` and `SystemExit`, and after each interrupt the backbone
is usable with every buffer equal to a cold build of its weights, or it refuses forward use; then `recover()` or a
complete reload ends usable and equal to a cold build (`support.crash_backbone`).

The operations: the loader's bucket writes (both of its paths), `apply_bucket`, a selective finish, the finish with
its hooks, the cold load with its cold build, the in-place refresh, a reload session with and without rollback (by
checkpoint and by bucket), its abort, and `recover()`; over DFlash, Kimi-K3 MLA (computed stacks) and Gemma DSpark
(a constant, a cold hook's buffer, an `into=` writer), under captured graphs (and DFlash without).

The default run tries every point with one kind, the kinds in turn from point to point, and Kimi-K3 MLA and Gemma
DSpark with the operations their buffers make different; `CRASH=full` (`make crash`) tries every kind at every point
of every case. The test session's summary adds up the points tried and the outcomes by kind (`tests/conftest.py`).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lifecycle import DraftBackbone, Phase, write_checkpoint
from lifecycle.loading import apply_bucket, load_safetensors
from lifecycle.testing import cold_load
from models.registry import FAMILIES
from support.crash import STALE, VIOLATIONS, Scenario, sweep
from support.crash_backbone import Case, check_backbone

pytestmark = pytest.mark.slow

#: `CRASH=full` (`make crash`): every kind at every point of every case; else one kind per point, in turn
FULL = os.environ.get("CRASH", "") == "full"
KINDS: tuple[str, ...] | str = ("RuntimeError", "KeyboardInterrupt", "SystemExit") if FULL else "rotate"
SWEPT = ("dflash", "kimi-k3-mla", "gemma-dspark")


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], DraftBackbone]
    a: Path
    b: Path

    def buckets(self, path: Path, size: int = 3) -> list[list[tuple[str, torch.Tensor]]]:
        """The checkpoint's tensors, sorted, `size` to a bucket (read once)."""
        if path not in _READ:
            _READ[path] = sorted(load_file(path).items())
        items = _READ[path]
        return [items[i:i + size] for i in range(0, len(items), size)]


_READ: dict[Path, list[tuple[str, torch.Tensor]]] = {}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    out = {}
    folder = tmp_path_factory.mktemp("crash")
    for name in SWEPT:
        fam = FAMILIES[name]
        cfg = fam.config(num_hidden_layers=2)
        a, b = (write_checkpoint(fam.random_weights(cfg, s), folder / f"{name}-{s}.safetensors") for s in (0, 1))
        out[name] = Family(name, partial(fam.build, cfg, device="meta"), a, b)
    return out


def _rewrite_in_place(m: DraftBackbone) -> None:
    """A reload hook that writes a weight (with its own values): the finish's hooks write too."""
    t = m.live_tensor(sorted(m.lifecycle.specs)[-1])
    assert t is not None
    t.copy_(t.clone())


# ---- the states an operation starts from -------------------------------------------------------------------------
def loaded(f: Family, captured: bool) -> Case:
    m = cold_load(f.build(), f.a, capture_graphs=captured)
    m.register_post_load_hook(_rewrite_in_place, Phase.RELOAD)
    return Case(m, f.build, f.b)


def reloading(f: Family, captured: bool) -> Case:
    case = loaded(f, captured)
    case.model.begin_reload()
    return case


def reloaded(f: Family, captured: bool, *, finalized: bool) -> Case:
    case = reloading(f, captured)
    load_safetensors(case.model, f.b)
    if finalized:
        case.model.finalize_loading()
    return case


def half_reloaded(f: Family, captured: bool) -> Case:
    case = reloading(f, captured)
    load_safetensors(case.model, f.b, subset=lambda n: n.startswith("layers.1."))
    return case


def aborting(f: Family, captured: bool, rollback: bool) -> Case:
    case = loaded(f, captured)
    case.session = s = case.model.reload_session(rollback=rollback)
    s.begin()
    for bucket in f.buckets(f.b)[:3]:
        s.apply(bucket)
    return case


def aborted(f: Family, captured: bool) -> Case:
    case = aborting(f, captured, rollback=True)
    assert case.session is not None
    case.session.abort("aborted before the sweep")
    return case


def meta(f: Family, captured: bool) -> Case:
    return Case(f.build(), f.build, f.b)


# ---- the operations ----------------------------------------------------------------------------------------------
def session_load(f: Family, rollback: bool, case: Case) -> None:
    with case.model.reload_session(rollback=rollback) as s:
        s.load(f.b)
        s.commit()


def session_apply(f: Family, rollback: bool, case: Case) -> None:
    with case.model.reload_session(rollback=rollback) as s:
        for bucket in f.buckets(f.b):
            s.apply(bucket)
        s.commit()


def session_selective(f: Family, case: Case) -> None:
    with case.model.reload_session(rollback=True, keep_untouched=True) as s:
        s.load(f.b, subset=lambda n: n.startswith("layers.1."))
        s.commit()


def cold_session(f: Family, case: Case) -> None:
    with case.model.reload_session(rollback=True) as s:
        s.load(f.a)
        s.commit()
    case.model.capture_graphs()


def cold(f: Family, case: Case) -> None:
    cold_load(case.model, f.a, capture_graphs=True)


def selective_finish(case: Case) -> None:
    case.model.finalize_loading(keep_untouched=True)
    case.model.refresh_derived_buffers()


def abort(case: Case) -> None:
    assert case.session is not None
    case.session.abort("aborted by the sweep")


#: name -> (the state it starts from: (family, captured) -> Case, the operation: (family) -> (case) -> None);
#: a cold start's graphs are captured by the operation itself
OPERATIONS: dict[str, tuple[Callable[..., Case], Callable[[Family], Callable[[Case], object]]]] = {
    "loader": (reloading, lambda f: lambda c: load_safetensors(c.model, f.b)),
    "loader-by-bucket": (reloading, lambda f: lambda c: load_safetensors(
        c.model, f.b, bucket_by=3, shuffle=True, progress=lambda p: None)),
    "apply_bucket": (reloading, lambda f: lambda c: [apply_bucket(c.model, b) for b in f.buckets(f.b)]),
    "finalize-with-hooks": (partial(reloaded, finalized=False), lambda f: lambda c: c.model.finalize_loading()),
    "selective-finish": (half_reloaded, lambda f: selective_finish),
    "in-place-refresh": (partial(reloaded, finalized=True), lambda f: lambda c: c.model.refresh_derived_buffers()),
    "cold-load-and-build": (meta, lambda f: partial(cold, f)),
    "cold-session-rollback": (meta, lambda f: partial(cold_session, f)),
    "session-selective-rollback": (loaded, lambda f: partial(session_selective, f)),
    "session-rollback": (loaded, lambda f: partial(session_load, f, True)),
    "session": (loaded, lambda f: partial(session_load, f, False)),
    "session-apply-rollback": (loaded, lambda f: partial(session_apply, f, True)),
    "session-apply": (loaded, lambda f: partial(session_apply, f, False)),
    "abort-rollback": (partial(aborting, rollback=True), lambda f: abort),
    "abort": (partial(aborting, rollback=False), lambda f: abort),
    "recover": (aborted, lambda f: lambda c: c.model.recover()),
}

#: without captured graphs (recover() to DERIVED_REFRESHED, aliases free to move): DFlash, the operations that differ
UNCAPTURED = ("loader", "in-place-refresh", "session-rollback", "session", "abort-rollback", "recover")
#: In the default run DFlash takes every operation; the other families the operations their own buffers make
#: different: Kimi-K3 MLA's computed stacks (evaluated per slice, in the cold build and the refresh), and Gemma
#: DSpark's constant, cold hook's buffer and `into=` writer (its refresh dry-runs the writer under a fake mode: tens
#: of ms a refresh)
OWN = {"dflash": tuple(OPERATIONS),
       "kimi-k3-mla": ("loader", "finalize-with-hooks", "selective-finish", "in-place-refresh", "cold-load-and-build",
                       "session-rollback", "abort-rollback", "recover"),
       "gemma-dspark": ("finalize-with-hooks", "in-place-refresh", "cold-load-and-build", "session-rollback",
                        "session-apply", "abort-rollback", "recover")}
CASES = [(fam, op, True) for fam in SWEPT for op in OPERATIONS if FULL or op in OWN[fam]] + [
    ("dflash", op, False) for op in UNCAPTURED]
#: the operations that write every tensor of a checkpoint: at least one write point each
WRITES_ALL = frozenset({"loader", "loader-by-bucket", "apply_bucket", "cold-load-and-build", "cold-session-rollback",
                        "session-rollback", "session", "session-apply-rollback", "session-apply"})


@pytest.mark.parametrize(("family", "operation", "captured"), CASES,
                         ids=[f"{f}-{o}-{'captured' if c else 'refreshed'}" for f, o, c in CASES])
def test_every_write_point_interrupted_leaves_the_backbone_usable_and_current_or_refusing(
        families: dict[str, Family], family: str, operation: str, captured: bool) -> None:
    f = families[family]
    start, op = OPERATIONS[operation]
    scenario = Scenario(f"{family}/{operation}/{'captured' if captured else 'refreshed'}",
                        partial(start, f, captured), op(f), check_backbone)
    result = sweep(scenario, kinds=KINDS)
    tensors = len(f.build().lifecycle.specs)
    least = tensors if operation in WRITES_ALL else 2
    assert len(result.points) >= least, (
        f"{len(result.points)} write points, fewer than {least}: the probes miss writes ({result.points})")
    assert result.runs == len(result.points) * (1 if KINDS == "rotate" else len(KINDS))
    assert result.by_outcome()[STALE] == 0 and not result.violations, result.summary() + "\n" + "\n".join(
        result.violations[:20])
    assert not set(result.by_outcome()) & VIOLATIONS


class Alarm(KeyboardInterrupt):
    """What the SIGALRM handler raises: a Ctrl-C at a moment of the timer's choosing."""


@pytest.mark.parametrize("operation", ["session-rollback", "loader", "session-apply", "cold-session-rollback"])
def test_a_real_sigalrm_anywhere_leaves_the_backbone_usable_and_current_or_refusing(
        families: dict[str, Family], operation: str) -> None:
    """Between any two bytecodes, not only at the write points: a real SIGALRM whose handler raises
    `KeyboardInterrupt`, at a delay drawn (seeded) over the operation's duration, 60 times; every outcome is sound
    (`check_backbone`), whatever the machine's timing made the draws land on."""
    f = families["dflash"]
    start, make = OPERATIONS[operation]
    op = make(f)
    timings = []
    for _ in range(3):
        case = start(f, True)
        t0 = time.perf_counter()
        op(case)
        timings.append(time.perf_counter() - t0)
    duration = min(timings)

    def alarm(signum: int, frame: object) -> None:
        raise Alarm

    rng = random.Random(24)
    outcomes: Counter[str] = Counter()
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        for _ in range(60):
            case = start(f, True)
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, duration))
                try:
                    op(case)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except Alarm as e:
                outcome = check_backbone(case, e)
                assert outcome.kind not in VIOLATIONS, outcome
                outcomes[outcome.kind] += 1
            else:
                outcomes["completed"] += 1
            if not torch.is_grad_enabled():  # an alarm inside a grad-mode switch (torch.no_grad's own __enter__ or
                outcomes["grad mode left off"] += 1  # __exit__) leaves the thread's mode off: not the backbone's state
                torch.set_grad_enabled(True)
    finally:
        signal.signal(signal.SIGALRM, previous)
    print(f"dflash/{operation}: 60 real SIGALRMs: {dict(outcomes)}")
    assert outcomes["completed"] < 60, "no alarm landed inside the operation: nothing was tested"
