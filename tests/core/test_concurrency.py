"""A trainer loading from several threads: with `locked=True` readiness counts are exact, FULLY_LOADED fires
exactly once, and an abort waits for in-flight writes, refuses later ones, and rolls every write back.

Each test runs ROUNDS times with a tiny thread switch interval (so threads interleave inside the loader as much
as CPython allows), all threads released together by a barrier, and tensors dealt round-robin so that every
layer's tensors arrive from several threads at once.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from lifecycle.errors import IllegalTransitionError, LifecycleError, NonFiniteWeightError, SessionStateError
from lifecycle.loading import apply_bucket, load_safetensors, write_tensor
from lifecycle.states import LifecycleState
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.reference import assert_derived_current, assert_same, snapshot

S = LifecycleState
ROUNDS = 20
THREADS = 4


@pytest.fixture(autouse=True)
def fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def run_threads(work: list[Callable[[], Any]]) -> list[BaseException]:
    """Start every callable at once (barrier); return what they raised."""
    barrier = threading.Barrier(len(work))
    errors: list[BaseException] = []

    def run(fn: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            fn()
        except BaseException as e:  # collected, asserted by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a loader thread hung"
    return errors


def deal(names: list[str], n: int) -> list[list[str]]:
    """Round-robin: every layer's tensors end up in several threads' shares."""
    return [names[i::n] for i in range(n)]


def fully_loaded_transitions(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "transition" and e["dst"] == "FULLY_LOADED"
            and e["trigger"] == "weights_loaded" and e["src"] != "FULLY_LOADED"]


def assert_chain(logs: list[dict[str, Any]], start: LifecycleState) -> None:
    """Transition events form one chain: each starts where the previous ended (the machine was serialised)."""
    state = start.value
    for e in logs:
        if e["event"] == "transition":
            assert e["src"] == state, f"{e['trigger']}: src {e['src']} but the state was {state}"
            state = e["dst"]


def share_worker(m: DFlashQwen3Draft, weights: dict[str, torch.Tensor], share: list[str], how: str,
                 ckpt: Path, apply: Callable[..., Any] | None = None) -> Callable[[], None]:
    def work() -> None:
        if how == "file":  # the safetensors loader, one tensor per bucket
            load_safetensors(m, ckpt, subset=share, bucket_by=1)
        else:  # (name, tensor) buckets of two, straight from memory
            for i in range(0, len(share), 2):
                bucket = [(n, weights[n]) for n in share[i:i + 2]]
                (apply or (lambda b: apply_bucket(m, b)))(bucket)
    return work


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_cold_load_from_threads_reaches_fully_loaded_exactly_once(tiny_cfg: DFlashConfig, ckpt_a: Path,
                                                                  round_: int) -> None:
    m = DFlashQwen3Draft(tiny_cfg, locked=True)
    lc = m.lifecycle
    weights = random_weights(tiny_cfg, 0)  # what ckpt_a holds
    shares = deal(list(weights), THREADS)
    work = [share_worker(m, weights, share, "file" if i % 2 else "memory", ckpt_a) for i, share in enumerate(shares)]
    with capture_logs() as logs:
        errors = run_threads(work)
    assert errors == []
    assert lc.state is S.FULLY_LOADED
    assert len(fully_loaded_transitions(logs)) == 1
    ready = Counter(layer for e in logs if e["event"] == "layer_ready" for layer in e["layers"])
    assert ready == Counter(list(lc.readiness.tensors_of_layer))  # every layer completed exactly once
    assert lc.readiness.layers_ready == lc.readiness.layers_total and lc.missing() == {}
    assert_chain(logs, S.META)
    assert all(torch.equal(m.get_parameter(n), w) for n, w in weights.items())
    m.finalize_loading()
    m.refresh_derived_buffers()
    assert_derived_current(m)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_session_reload_from_threads_commits_in_place(tiny_cfg: DFlashConfig, ckpt_a: Path, ckpt_b: Path,
                                                      round_: int) -> None:
    m = cold_load(DFlashQwen3Draft(tiny_cfg, locked=True), ckpt_a, capture_graphs=True)
    lc = m.lifecycle
    weights = random_weights(tiny_cfg, 1)  # what ckpt_b holds
    with capture_logs() as logs, m.reload_session(rollback=True) as s:
        work = [share_worker(m, weights, share, "memory", ckpt_b, apply=s.apply)
                for share in deal(list(weights), THREADS)]
        assert run_threads(work) == []
        assert lc.readiness.layers_ready == lc.readiness.layers_total
        s.commit()
    assert lc.state is S.GRAPH_CAPTURED
    assert len(fully_loaded_transitions(logs)) == 1
    ready = Counter(layer for e in logs if e["event"] == "layer_ready" for layer in e["layers"])
    assert ready == Counter(list(lc.readiness.tensors_of_layer))
    assert_chain(logs, S.GRAPH_CAPTURED)
    assert s.snapshot_bytes == sum(p.numel() * 4 for p in m.parameters())
    assert all(torch.equal(m.get_parameter(n), w) for n, w in weights.items())
    assert_derived_current(m)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_abort_mid_threaded_reload_rolls_back_every_write(tiny_cfg: DFlashConfig, ckpt_a: Path, round_: int
                                                          ) -> None:
    """One thread sends a NaN; the trainer aborts while the others are still writing. Writes in flight finish
    first and are rolled back; writes after the abort are refused; nothing of the reload survives."""
    m = cold_load(DFlashQwen3Draft(tiny_cfg, locked=True), ckpt_a)
    before = snapshot(m)
    weights = random_weights(tiny_cfg, 1)
    poisoned_name = "layers.1.mlp.down_proj.weight"
    weights[poisoned_name] = weights[poisoned_name].clone()
    weights[poisoned_name][0, 0] = float("nan")
    failed = threading.Event()
    refused: list[BaseException] = []

    with m.reload_session(rollback=True, finite_check=True) as s:
        def worker(share: list[str]) -> Callable[[], None]:
            def work() -> None:
                for i in range(0, len(share), 2):
                    try:
                        s.apply([(n, weights[n]) for n in share[i:i + 2]])
                    except NonFiniteWeightError:
                        failed.set()
                        return
                    except (IllegalTransitionError, SessionStateError) as e:  # after the abort
                        refused.append(e)
                        return
            return work

        def trainer() -> None:
            assert failed.wait(timeout=30)
            s.abort("a bucket held NaN")

        errors = run_threads([*(worker(share) for share in deal(list(weights), THREADS)), trainer])
    assert errors == []
    assert m.lifecycle.state is S.QUARANTINED
    assert_same(m, before)  # every weight written before, during or racing the abort was rolled back
    assert m.recover() is S.DERIVED_REFRESHED
    assert_derived_current(m)


def test_abort_waits_for_a_write_in_flight_then_refuses_new_ones(tiny_cfg: DFlashConfig, ckpt_a: Path) -> None:
    m = cold_load(DFlashQwen3Draft(tiny_cfg, locked=True), ckpt_a)
    before = snapshot(m)
    weights = random_weights(tiny_cfg, 1)
    inside, proceed, aborted = threading.Event(), threading.Event(), threading.Event()

    def slow_writer(module: nn.Module, name: str, value: torch.Tensor, device: torch.device | str) -> None:
        inside.set()
        assert proceed.wait(timeout=30)
        write_tensor(module, name, value, device)

    s = m.reload_session(rollback=True, writer=slow_writer)
    s.begin()
    writer = threading.Thread(target=lambda: s.apply({"fc.weight": weights["fc.weight"]}))
    writer.start()
    assert inside.wait(timeout=30)  # the write lease is held, the write not done
    aborter = threading.Thread(target=lambda: (s.abort("stop"), aborted.set()))
    aborter.start()
    assert not aborted.wait(timeout=0.3)  # the abort waits for the write in flight
    assert m.lifecycle.state is S.PARTIALLY_LOADED
    proceed.set()
    writer.join(timeout=30)
    aborter.join(timeout=30)
    assert aborted.is_set() and m.lifecycle.state is S.QUARANTINED
    assert_same(m, before)  # the write finished, was reported, then rolled back
    with pytest.raises(LifecycleError):
        apply_bucket(m, [("fc.weight", weights["fc.weight"])])  # refused after the abort
    assert_same(m, before)
