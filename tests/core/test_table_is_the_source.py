"""The transition table in `lifecycle/states.py` is the only place that spells out state logic.

No module of `lifecycle/` or `models/` other than `states.py` may spell a state's name as a string (docstrings
aside: they document, they decide nothing); state checks elsewhere go through `BackboneLifecycle.can(trigger)`
or a predicate that reads a declaration of `states.py`. The guards and conditions the table names each have
their check, and the predicates that replaced hand-written state checks mean what those checks meant.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lifecycle.guards import CONDITIONS, GUARDS
from lifecycle.machine import BackboneLifecycle
from lifecycle.states import TRANSITIONS, Condition, Guard, LifecycleState, allowed_triggers
from lifecycle.types import TensorSpec

ROOT = Path(__file__).resolve().parents[2]
STATE_NAMES = frozenset(s.value for s in LifecycleState)
S = LifecycleState


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def state_names_spelled(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant, docstrings excluded, that equals a state's name."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                  and node.value in STATE_NAMES)


MODULES = sorted(p for pkg in ("lifecycle", "models") for p in (ROOT / pkg).rglob("*.py"))


def test_the_scan_sees_both_packages_and_finds_a_spelled_state() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in MODULES}
    assert {"lifecycle/states.py", "lifecycle/machine.py", "lifecycle/vllm/reload/mixin.py",
            "models/registry.py"} <= names
    # the check itself can fail: a comparison by name is found, the docstring and a longer message are not
    code = '"""Docs may say META."""\ndef f(lc):\n    """Or PARTIALLY_LOADED."""\n' \
           '    return lc.state.value in ("META", "FULLY_LOADED") or print("META placeholders")\n'
    assert state_names_spelled(code) == [(4, "FULLY_LOADED"), (4, "META")]
    assert len(state_names_spelled((ROOT / "lifecycle/states.py").read_text())) == len(LifecycleState)


@pytest.mark.parametrize("path", [p for p in MODULES if p != ROOT / "lifecycle/states.py"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_module_but_states_spells_a_state_name(path: Path) -> None:
    found = state_names_spelled(path.read_text(encoding="utf-8"))
    assert not found, (f"{path.relative_to(ROOT)} decides by state name {found}: use lc.can(trigger) or a "
                       "predicate reading lifecycle/states.py")


def test_every_guard_and_condition_the_table_can_name_has_its_check() -> None:
    assert set(GUARDS) == set(Guard) and set(CONDITIONS) == set(Condition)
    named = {g for t in TRANSITIONS for g in t.guards} | {t.condition for t in TRANSITIONS if t.condition}
    assert named <= {*Guard, *Condition}
    assert all(isinstance(g, Guard) for t in TRANSITIONS for g in t.guards)
    assert all(t.condition is None or isinstance(t.condition, Condition) for t in TRANSITIONS)


@pytest.mark.parametrize("state", list(S), ids=lambda s: s.value)
def test_the_predicates_mean_the_checks_they_replaced(state: LifecycleState) -> None:
    lc = BackboneLifecycle("toy", {"layers.0.w": TensorSpec((2,), torch.float32)})
    lc._machine.set_state(state, model=lc._model)
    assert lc.state is state
    for trigger in {t.trigger for t in TRANSITIONS}:
        assert lc.can(trigger) is (trigger in allowed_triggers(state))
    # what the code said by name before these predicates existed
    assert lc.usable is (state in (S.DERIVED_REFRESHED, S.GRAPH_CAPTURED))
    assert lc.quarantined is (state is S.QUARANTINED)
    assert lc.unloaded is (state is S.META)
    assert lc.awaiting_weights is (state in (S.META, S.PARTIALLY_LOADED, S.FULLY_LOADED))
    assert lc.can("finalize_loading") is lc.can("abort_reload") is (state in (S.PARTIALLY_LOADED, S.FULLY_LOADED,
                                                                           S.FINALIZED))
    assert lc.can("weights_loaded") is (state in (S.META, S.PARTIALLY_LOADED, S.FULLY_LOADED))
    assert lc.can("capture_graphs") is (state is S.DERIVED_REFRESHED)
