"""The public surface: what the top level exports, `__all__` in every core module, the README's imports, and the
error hierarchy (grouped, every error under `LifecycleError`)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import lifecycle
from lifecycle import errors
from support.marking import imports_vllm_at_import

ROOT = Path(__file__).resolve().parents[2]
CORE_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for sub in ("", "derived/", "vllm/")
    for p in (ROOT / "lifecycle" / sub).glob("*.py")
)


def _source(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@pytest.mark.parametrize("module", [  # a module that imports vLLM when imported is a `vllm` test's
    pytest.param(m, marks=[pytest.mark.vllm] * imports_vllm_at_import(_source(m))) for m in CORE_MODULES])
def test_every_core_module_declares_all_and_every_name_in_it_exists(module: str) -> None:
    mod = importlib.import_module(module)  # the vLLM modules import vLLM lazily: this runs without it too
    assert isinstance(getattr(mod, "__all__", None), list), f"{module} has no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not define: {missing}"


def test_the_top_level_exports_what_users_need_and_not_the_internals() -> None:
    exported = set(lifecycle.__all__)
    assert {"DraftBackbone", "load_safetensors", "write_checkpoint", "ReloadSession", "configure_audit", "concat",
            "stack", "alias", "custom", "post_load_hook", "Phase", "LifecycleError"} <= exported
    assert not exported & {"count_allocations", "PinnedStorage", "Transition", "TRANSITIONS", "WeightSnapshot"}
    # ... which stay importable from their modules
    from lifecycle.session import WeightSnapshot  # noqa: F401
    from lifecycle.states import TRANSITIONS, Transition  # noqa: F401
    from lifecycle.storage import PinnedStorage, count_allocations  # noqa: F401
    error_classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, Exception)}
    assert error_classes <= exported, f"errors missing from the top level: {error_classes - exported}"


def _readme_imports() -> list[tuple[str, list[str]]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("lifecycle",
                                                                                                 "models"):
                out.append((node.module, [a.name for a in node.names]))
    return out


def test_every_name_the_readme_examples_import_exists() -> None:
    imports = _readme_imports()
    assert ("lifecycle", ["DraftBackbone", "Phase", "alias", "concat", "configure_audit", "load_safetensors",
                          "post_load_hook", "stack", "write_checkpoint"]) in imports
    for module, names in imports:
        mod = importlib.import_module(module)
        assert all(hasattr(mod, n) for n in names), (module, [n for n in names if not hasattr(mod, n)])


GROUPS = {
    errors.StateError: {errors.IllegalTransitionError, errors.LayersNotReadyError, errors.QuarantinedError,
                        errors.RecoveryError, errors.SessionStateError, errors.ConcurrentUseError,
                        errors.IncompleteCheckpointError},
    errors.LoadRefusedError: {errors.UnknownWeightError, errors.WeightTypeError, errors.WeightShapeError,
                              errors.NonFiniteWeightError, errors.CheckpointError, errors.FrozenStructureError,
                              errors.PathConfinementError},
    errors.RefreshRefusedError: {errors.SourceLayoutError, errors.StorageReallocationError,
                                 errors.DerivedBuildError},
    errors.PartialWriteError: {errors.WeightWriteError, errors.RefreshInterruptedError},
}


def test_errors_are_grouped_under_one_base() -> None:
    classes = [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, Exception)]
    assert all(issubclass(c, errors.LifecycleError) for c in classes)
    for group, members in GROUPS.items():
        assert {c for c in classes if c is not group and issubclass(c, group)} == members, group.__name__
    grouped = set(GROUPS).union(*GROUPS.values())
    # the rest hang directly under LifecycleError, and each says what state it leaves
    assert {c for c in classes if c not in grouped} == {errors.LifecycleError, errors.StorageDriftError,
                                                        errors.UnsupportedVLLMError, errors.NodeSetupError}
    assert all(c.__doc__ and len(c.__doc__) > 40 for c in classes)


def test_unsupported_vllm_is_a_lifecycle_error_importable_from_the_version_module() -> None:
    from lifecycle.vllm.compat.version import UnsupportedVLLMError
    from lifecycle.vllm.plugin.capabilities import check_vllm

    assert UnsupportedVLLMError is errors.UnsupportedVLLMError
    with pytest.raises(errors.LifecycleError) as info:
        check_vllm("0.40.1", lambda rel: None)  # a "vLLM" whose sources have nothing
    assert str(info.value).startswith("reload-lifecycle's vLLM plugin cannot run on vLLM 0.40.1: ")
