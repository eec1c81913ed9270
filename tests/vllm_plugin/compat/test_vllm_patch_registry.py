"""The patch registry (issue 31 item 2): every change the plugin makes to vLLM is one record of
`lifecycle/vllm/compat/registry.py`, applied by `compat.patching` and nowhere else.

Before: `patches._wrap` returned False quietly when a name was missing (and `install()`'s result was discarded), the
front process had six more wrappers with their own marker, `nodes.py` replaced `Executor.__init__` by hand, quant
methods were wrapped per instance, a class was swapped by `__class__` and vLLM's worker got a private attribute
written, none of them declared anywhere the capability check or the docs read.
"""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifecycle.errors import UnsupportedVLLMError
from lifecycle.vllm.compat import patching
from lifecycle.vllm.compat.records import KINDS, READS, WRAPS, WRAPS_INSTANCE, WRITES, Patch
from lifecycle.vllm.compat.registry import PATCHES

ROOT = Path(__file__).resolve().parents[3]
FAKE = "fake_vllm_for_registry_test"


@pytest.fixture
def fake_vllm() -> Iterator[types.ModuleType]:
    """A module standing for vLLM's, with two functions and a class the records below wrap."""
    module = types.ModuleType(FAKE)

    def initialize(model: object) -> str:
        return "vllm's initialize"

    def finalize(model: object) -> str:
        return "vllm's finalize"

    class Worker:
        _weight_update_active = True

        def update_weights(self) -> str:
            return "vllm's update"

    module.initialize, module.finalize, module.Worker = initialize, finalize, Worker  # type: ignore[attr-defined]
    sys.modules[FAKE] = module
    yield module
    del sys.modules[FAKE]


def _records(*targets: str) -> list[Patch]:
    # any real maker does: what is checked is the resolution of the targets, before anything is patched
    return [Patch(WRAPS, FAKE, t, "test", "test", "reload.hooks:wrap_copy_back") for t in targets]


def test_a_missing_name_refuses_naming_it_and_nothing_is_patched(fake_vllm: types.ModuleType) -> None:
    del fake_vllm.finalize  # vLLM renamed it
    with pytest.raises(UnsupportedVLLMError) as info:
        patching.apply(_records("initialize", "finalize", "Worker.update_weights", "Missing.method"))
    message = str(info.value)
    assert f"{FAKE}.finalize: finalize not found" in message
    assert f"{FAKE}.Missing.method: Missing not found" in message
    assert "2 name(s)" in message and "Nothing was patched." in message
    assert fake_vllm.initialize(None) == "vllm's initialize"  # the present ones were not patched either
    assert not patching.is_wrapped(fake_vllm.initialize)
    assert not patching.is_wrapped(fake_vllm.Worker.update_weights)


def test_applying_wraps_each_target_once_keeping_its_original(fake_vllm: types.ModuleType) -> None:
    original = fake_vllm.initialize
    assert patching.apply(_records("initialize", "Worker.update_weights")) == [
        f"{FAKE}.initialize", f"{FAKE}.Worker.update_weights"]
    wrapped = fake_vllm.initialize
    assert patching.is_wrapped(wrapped) and patching.original_of(wrapped) is original
    assert patching.apply(_records("initialize")) == []  # a second activation changes nothing
    assert fake_vllm.initialize is wrapped


def test_an_unimportable_module_is_a_named_miss() -> None:
    records = [Patch(WRAPS, "no_such_vllm_module_here", "f", "test", "test", "reload.hooks:wrap_copy_back")]
    with pytest.raises(UnsupportedVLLMError, match=r"no_such_vllm_module_here\.f: module not importable"):
        patching.apply(records)


def test_changes_of_one_object_need_a_declared_record(fake_vllm: types.ModuleType) -> None:
    worker = fake_vllm.Worker()
    with pytest.raises(KeyError, match=r"no .writes. record .Worker\._undeclared."):
        patching.write_private("Worker._undeclared", worker, False)
    patching.write_private("Worker._weight_update_active", worker, False)
    assert worker._weight_update_active is False
    del fake_vllm.Worker._weight_update_active  # vLLM renamed it: never create a new attribute silently
    other = fake_vllm.Worker()
    with pytest.raises(AttributeError, match="vLLM moved it"):
        patching.write_private("Worker._weight_update_active", other, False)
    with pytest.raises(KeyError, match="no 'wraps per instance' record"):
        patching.wrap_instance("Worker.update_weights", worker, lambda f: f)
    with pytest.raises(TypeError, match="is not a subclass"):
        patching.swap_class("inner_model.__class__", worker, int)


def test_a_per_instance_wrapper_keeps_the_replaced_signature() -> None:
    # vLLM binds a weight loader's arguments by its signature to buffer a load and replay it
    class Param:
        def weight_loader(self, param: object, loaded_weight: object, loaded_shard_id: object = None) -> str:
            return f"loaded {loaded_shard_id}"

    import inspect

    p = Param()
    patching.wrap_instance("BasevLLMParameter.weight_loader", p, lambda f: lambda *a, **k: f(*a, **k))
    assert list(inspect.signature(p.weight_loader).parameters) == ["param", "loaded_weight", "loaded_shard_id"]
    assert p.weight_loader(p, 1, loaded_shard_id="q") == "loaded q"
    assert patching.is_wrapped(p.weight_loader)


def test_every_record_is_well_formed_and_every_wrapper_resolves() -> None:
    assert {p.kind for p in PATCHES} <= set(KINDS)
    for p in PATCHES:
        if p.kind == WRAPS:
            assert callable(patching.resolve_wrapper(p.wrapper)), p.where
        assert p.why and p.user, p.where
    keyed = [p.key for p in PATCHES if p.kind not in (WRAPS, READS)]
    assert len(keyed) == len(set(keyed)), "a record named twice"
    targets = [(p.module, p.target) for p in PATCHES if p.kind == WRAPS]
    assert len(targets) == len(set(targets)), "a target wrapped twice"


def _private_writes(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """`x._name = ...` and `setattr(x, "_name", ...)` on something other than `self`/`cls`."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr.startswith("_") and not t.attr.startswith("__") and not (
                    isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                yield node.lineno, t.attr
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_") and not str(node.args[1].value).startswith("__"):
            yield node.lineno, str(node.args[1].value)


def test_nothing_writes_a_private_attribute_of_vllms_objects_outside_the_registry() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {attr}"
             for path in sorted((ROOT / "lifecycle" / "vllm").rglob("*.py"))
             for line, attr in _private_writes(ast.parse(path.read_text()))]
    # the probe layer of `drafts.shadows` is the plugin's own module (vLLM's CPU dispatch reads the flag)
    allowed = {"lifecycle/vllm/drafts/shadows.py: _cpu_skip_gemm_dispatch"}
    assert {f.split(":")[0] + ": " + f.split(": ")[1] for f in found} <= allowed, found
    # ... and the scan sees one
    assert list(_private_writes(ast.parse("worker._weight_update_active = False\n"))) == [(1, "_weight_update_active")]
    declared = {p.target.rpartition(".")[2] for p in PATCHES if p.kind == WRITES}
    assert declared == {"_weight_update_active", "_do_torchao_reload", "_cpu_skip_gemm_dispatch", "load_numel_total"}
    assert any(p.kind == WRAPS_INSTANCE for p in PATCHES)
