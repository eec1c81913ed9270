"""Property-based state-machine test: random sequences of loads, reloads, refreshes, captures, aborts, sessions,
recoveries and bad tensors, driven against a real DFlash draft and checked against a reference model.

The reference model (`Ref`) is written from the transition table and the documented rules, with no lifecycle
code: it predicts each operation's outcome (the new state, or which error refuses it) and what the weights
hold. After every step the invariants check:

- the state is the one the model predicts, and every transition event is a row of the table
  (`possible_destinations`), chained from the previous state;
- no derived buffer was built from META (built buffers and alias targets are real tensors) and a derived
  buffer's storage never changes once built (no rebuilds here); while graphs are captured, no storage identity
  pinned at capture changes;
- in DERIVED_REFRESHED and GRAPH_CAPTURED every derived buffer equals a cold build computed directly from the
  parameters, and the fused path agrees with the per-layer reference path; QUARANTINED refuses it with
  `QuarantinedError`, the other states with `LayersNotReadyError`;
- every parameter holds what the model says was last written (or rolled back to), or is still META;
- a refused operation changed nothing: state, epoch, readiness, dirty set, and every parameter and buffer (the
  same object, the same bits).

Profiles (tests/conftest.py): "ci" by default; `HYPOTHESIS_PROFILE=nightly` for the long run.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from structlog.testing import capture_logs

from lifecycle.errors import (
    IllegalTransitionError,
    LayersNotReadyError,
    LifecycleError,
    NonFiniteWeightError,
    QuarantinedError,
    RecoveryError,
    UnknownWeightError,
    WeightShapeError,
)
from lifecycle.loading import apply_bucket, load_safetensors, write_checkpoint
from lifecycle.readiness import layer_of
from lifecycle.states import LifecycleState, possible_destinations
from lifecycle.storage import StorageIdentity
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights
from support.reference import assert_derived_current

S = LifecycleState
CFG = DFlashConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, head_dim=16,
                   max_position_embeddings=32)
SEEDS = (0, 1, 2)
NAMES: tuple[str, ...] = tuple(DFlashQwen3Draft(CFG).lifecycle.specs)
LAYERS: dict[str, tuple[str, ...]] = {}
for _n in NAMES:
    LAYERS.setdefault(layer_of(_n), ())
    LAYERS[layer_of(_n)] += (_n,)
#: What ran: (rule, "ok" | error name) per step, states visited after each step, examples started.
STATS: Counter[tuple[str, str]] = Counter()
LOADABLE = (S.META, S.PARTIALLY_LOADED, S.FULLY_LOADED)
USABLE = (S.DERIVED_REFRESHED, S.GRAPH_CAPTURED)


class Ref:
    """What the lifecycle should do. Each method returns the error type that must refuse the operation (and
    then changes nothing) or None after applying the operation's effect."""

    def __init__(self) -> None:
        self.state = S.META
        self.epoch = 0
        self.loaded: set[str] = set()  # loaded or declared unchanged in this epoch
        self.written: set[str] = set()  # written in this epoch
        self.partly_written: set[str] = set()  # layers an aborted epoch wrote part of, not rolled back
        self.values: dict[str, torch.Tensor] = {}  # name -> what the parameter must hold; absent: still META
        self.rope_ready = False  # the cold_load hook ran
        self.pinned = False
        self.origin_current = False  # this reload began with current derived buffers
        self.recoverable = False

    def ready(self, loaded: set[str]) -> bool:
        return all(n in loaded and n in self.values for n in NAMES)

    def _complete(self, loaded: set[str]) -> set[str]:
        return {la for la, names in LAYERS.items() if loaded.issuperset(names)}

    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> type[LifecycleError] | None:
        if self.state not in LOADABLE:
            return IllegalTransitionError
        for n, v in pairs:
            self.values[n] = v
            self.loaded.add(n)
            self.written.add(n)
        self.partly_written -= self._complete(self.loaded)  # written in full
        if self.state is not S.FULLY_LOADED:
            self.state = S.FULLY_LOADED if self.ready(self.loaded) else S.PARTIALLY_LOADED
        return None

    def declare_unchanged(self, names: tuple[str, ...]) -> type[LifecycleError] | None:
        if self.state not in LOADABLE:
            return IllegalTransitionError
        if any(layer_of(n) in self.partly_written or n not in self.values for n in names):
            return LayersNotReadyError  # a layer an aborted reload wrote part of must be written; META has no value
        before = self._complete(self.loaded)
        self.loaded.update(names)
        if self._complete(self.loaded) - before and self.state is not S.FULLY_LOADED:  # a layer completed
            self.state = S.FULLY_LOADED if self.ready(self.loaded) else S.PARTIALLY_LOADED
        return None

    def finish(self, keep_untouched: bool) -> type[LifecycleError] | None:
        if self.state not in (S.PARTIALLY_LOADED, S.FULLY_LOADED, S.FINALIZED):
            return IllegalTransitionError
        loaded = set(self.loaded)
        if keep_untouched and self.epoch > 0:
            for layer, names in LAYERS.items():
                if not loaded.intersection(names) and layer not in self.partly_written:
                    loaded.update(names)  # declared unchanged; a META one stays missing (ready() checks values)
        if not self.ready(loaded):
            return LayersNotReadyError
        self.loaded = loaded
        self.state = S.FINALIZED
        self.rope_ready = True  # finalize_loading runs the cold_load hook until it ran once
        return None

    def refresh(self) -> type[LifecycleError] | None:
        if self.state in LOADABLE:  # missing tensors are named before the state is looked at
            return IllegalTransitionError if self.ready(self.loaded) else LayersNotReadyError
        if self.state is not S.FINALIZED:
            return IllegalTransitionError
        assert self.rope_ready  # FINALIZED: the cold_load hooks ran
        self.state = S.GRAPH_CAPTURED if self.pinned else S.DERIVED_REFRESHED
        return None

    def _close_epoch(self, rolled_back: bool) -> None:
        if not rolled_back:
            complete = self._complete(self.loaded)
            self.partly_written |= {layer_of(n) for n in self.written} - complete
        self.written = set()

    def begin(self) -> type[LifecycleError] | None:
        if self.state not in (S.FULLY_LOADED, S.FINALIZED, *USABLE, S.QUARANTINED):
            return IllegalTransitionError
        self.origin_current = self.state in USABLE or (self.state is S.QUARANTINED and self.recoverable)
        self._close_epoch(rolled_back=False)
        self.epoch += 1
        self.loaded = set()
        self.state = S.PARTIALLY_LOADED
        return None

    def abort(self, *, rolled_back: bool = False) -> type[LifecycleError] | None:
        if self.state not in (S.PARTIALLY_LOADED, S.FULLY_LOADED, S.FINALIZED):
            return IllegalTransitionError
        self._close_epoch(rolled_back)
        self.state = S.QUARANTINED
        self.recoverable = rolled_back and self.origin_current
        return None

    def recover(self) -> type[LifecycleError] | None:
        if self.state is not S.QUARANTINED:
            return IllegalTransitionError
        if not self.recoverable:
            return RecoveryError
        self.state = S.GRAPH_CAPTURED if self.pinned else S.DERIVED_REFRESHED
        self.loaded = set(NAMES)
        self.recoverable = False
        return None

    def capture(self) -> type[LifecycleError] | None:
        if self.state is not S.DERIVED_REFRESHED:
            return IllegalTransitionError
        self.state, self.pinned = S.GRAPH_CAPTURED, True
        return None

    def release(self) -> type[LifecycleError] | None:
        if self.state is not S.GRAPH_CAPTURED:
            return IllegalTransitionError
        self.state, self.pinned = S.DERIVED_REFRESHED, False
        return None


# ---- strategies ------------------------------------------------------------------------------------------------

names_subset = st.one_of(
    st.just(NAMES),
    st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, unique=True).map(
        lambda layers: tuple(n for la in layers for n in LAYERS[la])),
    st.lists(st.sampled_from(NAMES), min_size=1, unique=True).map(tuple),
)
buckets_strategy = st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5), min_size=1, max_size=5)
bucket_by = st.one_of(st.just("layer"), st.integers(1, 7))


class DraftLifecycleMachine(RuleBasedStateMachine):
    """Set `ckpts` (seed -> (path, tensors)) on the class before running."""

    ckpts: ClassVar[dict[int, tuple[Path, dict[str, torch.Tensor]]]] = {}

    def __init__(self) -> None:
        super().__init__()
        STATS["example", "started"] += 1
        self.model = DFlashQwen3Draft(CFG)
        self.lc = self.model.lifecycle
        self.ref = Ref()
        self.derived_ids: dict[str, StorageIdentity] = {}  # first identity of each built (non-alias) buffer
        self.pinned_ids: dict[str, StorageIdentity] | None = None
        self.changed = True  # something may have changed since the fused path was last checked

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        tensors = {}
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            tensors[name] = (t, None if t.is_meta else t.detach().clone())
        return {"state": self.lc.state, "epoch": self.lc.epoch, "missing": self.lc.missing(),
                "dirty": self.lc.readiness.dirty_tensors(), "pinned": self.lc.pinned,
                "recovery": self.lc.recovery_blocker, "tensors": tensors}

    def _assert_unchanged(self, before: dict[str, Any]) -> None:
        after = self._snapshot()
        for key in ("state", "epoch", "missing", "dirty", "recovery"):
            assert after[key] == before[key], f"a refused operation changed {key}"
        assert after["pinned"] is before["pinned"]
        assert after["tensors"].keys() == before["tensors"].keys()
        for name, (obj, bits) in before["tensors"].items():
            obj2, bits2 = after["tensors"][name]
            assert obj2 is obj, f"a refused operation replaced {name}"
            assert (bits is None) == (bits2 is None) and (bits is None or torch.equal(bits, bits2)), name

    def _check_events(self, logs: list[dict[str, Any]], start: LifecycleState) -> None:
        state = start
        for e in logs:
            if e["event"] != "transition":
                continue
            src, dst = S(e["src"]), S(e["dst"])
            assert src is state, f"{e['trigger']} fired from {src}, but the state was {state}"
            assert dst in possible_destinations(e["trigger"], src), f"{e['trigger']}: {src} -> {dst} not in the table"
            state = dst
        assert state is self.lc.state

    def _run(self, rule_name: str, op: Any, expected: type[LifecycleError] | None, before: dict[str, Any]) -> None:
        """Run `op`; it must raise exactly `expected` (and change nothing) or succeed."""
        STATS[rule_name, "ok" if expected is None else expected.__name__] += 1
        start = before["state"]
        with capture_logs() as logs:
            if expected is None:
                op()
            else:
                with pytest.raises(LifecycleError) as ei:
                    op()
                assert type(ei.value) is expected, f"expected {expected.__name__}, got {ei.value!r}"
        self._check_events(logs, start)
        self.changed |= expected is None
        if expected is not None:
            self._assert_unchanged(before)
            assert any(e["event"] == "refused" for e in logs), "a refusal was not audited"
            assert not any(e["event"] == "transition" for e in logs)

    def _pairs(self, seed: int, names: tuple[str, ...] | list[str]) -> list[tuple[str, torch.Tensor]]:
        tensors = self.ckpts[seed][1]
        return [(n, tensors[n]) for n in names]

    # ---- where an example starts: META, or reached through the real steps (so deep states are common) -------
    @initialize(start=st.sampled_from(["META", "FULLY_LOADED", "FINALIZED", "DERIVED_REFRESHED", "GRAPH_CAPTURED"]),
                seed=st.sampled_from(SEEDS))
    def start_from(self, start: str, seed: int) -> None:
        STATS["start", start] += 1
        if start == "META":
            return
        self.load_file(seed, NAMES, "layer", False, 0, 0)
        if start == "FULLY_LOADED":
            return
        self.finalize(False)
        if start != "FINALIZED":
            self.refresh(False)
        if start == "GRAPH_CAPTURED":
            self.capture()
        assert self.lc.state is S(start)

    # ---- rules -----------------------------------------------------------------------------------------------
    @rule(seed=st.sampled_from(SEEDS), subset=names_subset, by=bucket_by, shuffle=st.booleans(),
          order=st.integers(0, 99), duplicates=st.integers(0, 3))
    def load_file(self, seed: int, subset: tuple[str, ...], by: Any, shuffle: bool, order: int, duplicates: int
                  ) -> None:
        before = self._snapshot()
        expected = self.ref.load(self._pairs(seed, subset))
        path = self.ckpts[seed][0]
        # every name: no subset at all (a plan by layer of it takes the loader's per-layer count)
        chosen = None if subset is NAMES else list(subset)
        self._run("load_file", lambda: load_safetensors(self.model, path, subset=chosen, bucket_by=by,
                                                        shuffle=shuffle, seed=order, duplicates=duplicates),
                  expected, before)

    @rule(seed=st.sampled_from(SEEDS), buckets=buckets_strategy)
    def load_buckets(self, seed: int, buckets: list[list[str]]) -> None:
        """In-memory buckets, duplicates within and across buckets."""
        before = self._snapshot()
        if self.ref.state not in LOADABLE:
            pairs = self._pairs(seed, buckets[0])
            self._run("load_buckets", lambda: apply_bucket(self.model, pairs), IllegalTransitionError, before)
            return
        STATS["load_buckets", "ok"] += 1
        self.changed = True
        with capture_logs() as logs:
            for bucket in buckets:
                pairs = self._pairs(seed, bucket)
                assert self.ref.load(pairs) is None
                apply_bucket(self.model, pairs)
        self._check_events(logs, before["state"])

    @rule(kind=st.sampled_from(["unknown", "shape", "dtype", "nan", "inf"]), seed=st.sampled_from(SEEDS),
          good=st.lists(st.sampled_from(NAMES), max_size=3, unique=True), victim=st.sampled_from(NAMES))
    def bad_bucket(self, kind: str, seed: int, good: list[str], victim: str) -> None:
        before = self._snapshot()
        pairs = [p for p in self._pairs(seed, good) if p[0] != victim]
        value = self.ckpts[seed][1][victim]
        if kind == "unknown":
            bad: tuple[str, torch.Tensor] = ("layers.0.self_attn.bogus.weight", value)
            expected: type[LifecycleError] = UnknownWeightError
        elif kind == "shape":
            bad, expected = (victim, torch.zeros(*value.shape[:-1], value.shape[-1] + 1)), WeightShapeError
        elif kind == "dtype":
            bad, expected = (victim, value.to(torch.float64)), WeightShapeError
        else:
            poisoned = value.clone()
            poisoned.view(-1)[0] = float("nan") if kind == "nan" else float("inf")
            bad, expected = (victim, poisoned), NonFiniteWeightError
        if self.ref.state not in LOADABLE:
            expected = IllegalTransitionError
        self._run("bad_bucket", lambda: apply_bucket(self.model, [*pairs, bad], finite_check=True), expected, before)

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=8, unique=True).map(tuple))
    def declare_unchanged(self, names: tuple[str, ...]) -> None:
        """Single tensors declared unchanged (a selective reload that sends part of a layer)."""
        before = self._snapshot()
        self._run("declare_unchanged", lambda: self.model.weights_unchanged(names),
                  self.ref.declare_unchanged(names), before)

    @rule(keep_untouched=st.booleans())
    def finalize(self, keep_untouched: bool) -> None:
        before = self._snapshot()
        if self.ref.partly_written and keep_untouched:
            STATS["partly_written", "finalize"] += 1  # an aborted reload's half-written layer met a selective finish
        self._run("finalize", lambda: self.model.finalize_loading(keep_untouched=keep_untouched),
                  self.ref.finish(keep_untouched), before)

    @rule(full=st.booleans())
    def refresh(self, full: bool) -> None:
        before = self._snapshot()
        self._run("refresh", lambda: self.model.refresh_derived_buffers(full=full), self.ref.refresh(), before)

    @rule()
    def begin_reload(self) -> None:
        before = self._snapshot()
        self._run("begin_reload", self.model.begin_reload, self.ref.begin(), before)

    @rule()
    def capture(self) -> None:
        before = self._snapshot()
        self._run("capture", self.model.capture_graphs, self.ref.capture(), before)
        if self.lc.state is S.GRAPH_CAPTURED and self.pinned_ids is None:
            self.pinned_ids = self._identities()

    @rule()
    def release(self) -> None:
        before = self._snapshot()
        self._run("release", self.model.release_graphs, self.ref.release(), before)
        if not self.ref.pinned:
            self.pinned_ids = None

    @rule()
    def abort(self) -> None:
        before = self._snapshot()
        self._run("abort", lambda: self.model.abort_reload("property test abort"), self.ref.abort(), before)

    @rule()
    def recover(self) -> None:
        before = self._snapshot()
        self._run("recover", self.model.recover, self.ref.recover(), before)

    @rule(seed=st.sampled_from(SEEDS), subset=names_subset, by=bucket_by, rollback=st.booleans(),
          keep_untouched=st.booleans(), ending=st.sampled_from(["commit", "abort", "raise"]),
          then_recover=st.booleans())
    def session(self, seed: int, subset: tuple[str, ...], by: Any, rollback: bool, keep_untouched: bool,
                ending: str, then_recover: bool) -> None:
        before = self._snapshot()
        ref = self.ref
        if ref.state not in (S.META, S.FULLY_LOADED, S.FINALIZED, *USABLE, S.QUARANTINED):
            expected = IllegalTransitionError
            assert ref.begin() is expected
            self._run("session", lambda: self.model.reload_session(rollback=rollback).__enter__(), expected, before)
            return
        saved_values = dict(ref.values)
        self.changed = True
        if ref.state is not S.META:
            assert ref.begin() is None
        assert ref.load(self._pairs(seed, subset)) is None
        committed = ending == "commit" and ref.finish(keep_untouched) is None and ref.refresh() is None
        if not committed:
            assert ref.abort(rolled_back=rollback) is None
            if rollback:
                ref.values = saved_values
        with capture_logs() as logs, ExitStack() as stack:
            if not committed and ending != "abort":
                stack.enter_context(pytest.raises((LifecycleError, RuntimeError)))
            s = stack.enter_context(self.model.reload_session(rollback=rollback, keep_untouched=keep_untouched))
            s.load(self.ckpts[seed][0], subset=list(subset), bucket_by=by)
            if ending == "commit":
                s.commit()
            elif ending == "abort":
                s.abort("property test: session aborted")
            else:
                raise RuntimeError("property test: the trainer failed mid-session")
        self._check_events(logs, before["state"])
        assert s.status == ("committed" if committed else "aborted")
        STATS["session", f"{s.status}{'+rollback' if rollback else ''}"] += 1
        if not committed and rollback:  # every weight back, bit for bit, the same objects
            for name, (obj, bits) in before["tensors"].items():
                if name in self.lc.specs:
                    now = self.model.live_tensor(name)
                    assert now is obj and (bits is None or torch.equal(now, bits)), f"{name} not rolled back"
        if then_recover:  # what a trainer does next after an abort (refused unless rolled back from a usable state)
            self.recover()

    # ---- invariants ------------------------------------------------------------------------------------------
    def _identities(self) -> dict[str, StorageIdentity]:
        return {n: StorageIdentity.of(t) for n, t in self.model.graph_visible_tensors().items() if t is not None}

    @invariant()
    def state_is_the_models(self) -> None:
        STATS["state", self.lc.state.value] += 1
        assert self.lc.state is self.ref.state
        assert self.lc.epoch == self.ref.epoch
        assert self.lc.graphs_pinned is self.ref.pinned

    @invariant()
    def weights_are_what_was_written(self) -> None:
        for name in NAMES:
            t = self.model.live_tensor(name)
            assert t is not None
            want = self.ref.values.get(name)
            if want is None:
                assert t.is_meta, f"{name} should still be META"
            else:
                assert not t.is_meta and torch.equal(t, want), f"{name} does not hold what was last written"

    @invariant()
    def derived_buffers_never_from_meta_and_never_moved(self) -> None:
        for spec in self.model.derived_buffers:
            buf = self.model._buffers.get(spec.name)
            if buf is None:
                continue
            assert not buf.is_meta, f"{spec.name} was built from META"
            if spec.kind == "alias":
                continue
            ident = StorageIdentity.of(buf)
            assert self.derived_ids.setdefault(spec.name, ident) == ident, f"{spec.name} moved"
        if self.pinned_ids is not None:
            assert self.lc.state in (S.GRAPH_CAPTURED, S.PARTIALLY_LOADED, S.FULLY_LOADED, S.FINALIZED,
                                     S.QUARANTINED)
            assert self._identities() == self.pinned_ids, "a storage identity pinned at capture changed"

    @invariant()
    def usable_exactly_when_refreshed(self) -> None:
        ctx, pos = torch.linspace(-1, 1, 3 * CFG.hidden_size).view(3, CFG.hidden_size), torch.arange(3)
        state = self.lc.state
        if not self.changed:  # a refused operation changed nothing (checked bit for bit): nothing new to see
            return
        self.changed = False
        if state in USABLE:
            assert_derived_current(self.model)
            k, v = self.model.precompute_context_kv(ctx, pos)
            k_ref, v_ref = self.model.precompute_context_kv_reference(ctx, pos)
            torch.testing.assert_close(k, k_ref)
            torch.testing.assert_close(v, v_ref)
        else:
            err = QuarantinedError if state is S.QUARANTINED else LayersNotReadyError
            with pytest.raises(err):
                self.model.precompute_context_kv(ctx, pos)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict[str, torch.Tensor]]]:
    """Three checkpoints, written once for the whole module."""
    d = tmp_path_factory.mktemp("properties")
    out = {}
    for seed in SEEDS:
        tensors = random_weights(CFG, seed)
        out[seed] = (write_checkpoint(tensors, d / f"seed{seed}.safetensors"), tensors)
    return out


@pytest.mark.slow  # about 15-25 s on two cores (the ci profile's 300 runs)
def test_lifecycle_state_machine(ckpts: dict[int, tuple[Path, dict[str, torch.Tensor]]]) -> None:
    DraftLifecycleMachine.ckpts = ckpts
    STATS.clear()
    t0 = time.perf_counter()
    run_state_machine_as_test(DraftLifecycleMachine)
    elapsed = time.perf_counter() - t0
    steps = sum(n for (kind, _), n in STATS.items() if kind not in ("state", "example", "start"))
    cur = settings.default
    print(f"\n[properties] profile {settings.get_current_profile_name()} (max_examples {cur.max_examples}, "
          f"stateful_step_count {cur.stateful_step_count}): examples {STATS['example', 'started']}, "
          f"steps {steps}, {elapsed:.1f} s")
    for key, n in sorted(STATS.items()):
        print(f"[properties]   {key[0]:>13} {key[1]:<26} {n}")
    if cur.max_examples < 100:  # the "dev" smoke profile is too short to reach everything
        return
    # the run mattered: every state was reached, every operation both succeeded and was refused, and sessions
    # committed, aborted with rollback and were recovered
    assert {S(v) for (kind, v) in STATS if kind == "state"} == set(S)
    for rule_name in ("load_file", "declare_unchanged", "finalize", "refresh", "begin_reload", "capture", "release",
                      "abort", "recover"):
        outcomes = {o for (r, o) in STATS if r == rule_name}
        assert "ok" in outcomes and len(outcomes) > 1, f"{rule_name}: only {outcomes}"
    assert {"committed", "aborted+rollback", "aborted"} <= {o for (r, o) in STATS if r == "session"}
    assert STATS["partly_written", "finalize"], "no selective finish met a layer an aborted reload half wrote"
    assert {o for (r, o) in STATS if r == "bad_bucket"} >= {"UnknownWeightError", "WeightShapeError",
                                                            "NonFiniteWeightError"}
