"""The package layering of docs/architecture.md, checked on the source: who may import whom, and no cycles.

Imports are read with `ast` (module-level and inside functions), relative imports resolved. A rule broken here is
a design change: change docs/architecture.md with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lifecycle", "models")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((target, id(node) in top_level))
            # `from . import x` may name a submodule
            found += [(f"{target}.{alias.name}", id(node) in top_level) for alias in node.names]
    return found


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def project_imports(name: str, *, module_level_only: bool = False) -> set[str]:
    out = set()
    for target, top in imports_of(MODULES[name]):
        if module_level_only and not top:
            continue
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def layer(name: str) -> str:
    if name == "lifecycle.cli":
        return "cli"
    for prefix in ("lifecycle.audit", "lifecycle.vllm", "models.demo", "models.registry"):
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    if name.startswith("models"):
        return "models.family" if name != "models" else "models"
    return "core"


#: layer -> the layers it may import (itself always allowed). The composition root (cli) imports lazily.
ALLOWED = {
    "core": {"core"},
    "lifecycle.audit": {"lifecycle.states"},  # and nothing else of the core: no torch for the offline tools
    "lifecycle.vllm": {"core"},
    "models.family": {"core", "models.family"},
    "models.registry": {"core", "models.family"},
    "models": {"core", "models.registry", "models.family"},
    "models.demo": {"core", "lifecycle.audit", "models", "models.registry", "models.family"},
    "cli": {"core", "lifecycle.audit", "lifecycle.vllm", "models", "models.demo"},
}


def allowed(src: str, dst: str) -> bool:
    src_layer, dst_layer = layer(src), layer(dst)
    if src_layer == dst_layer:
        return True
    rules = ALLOWED[src_layer]
    if src_layer == "lifecycle.audit":  # only the table, by module name
        return dst in rules or dst == "lifecycle"  # the package itself (namespace parent), never its exports
    return dst_layer in rules


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_the_layering(name: str) -> None:
    bad = sorted(dst for dst in project_imports(name) if not allowed(name, dst))
    assert not bad, f"{name} ({layer(name)}) imports {bad}: not allowed by docs/architecture.md"


def test_the_composition_root_imports_models_only_lazily() -> None:
    eager = {dst for dst in project_imports("lifecycle.cli", module_level_only=True) if dst.startswith("models")}
    assert not eager, f"lifecycle.cli imports {eager} at module level: the core CLI must start without models"


def test_no_import_cycle_between_project_modules() -> None:
    graph = {name: project_imports(name, module_level_only=True) for name in MODULES}
    # a package's __init__ importing its own submodules is not a cycle of design; drop parent -> child edges
    graph = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d):], d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    # the rules can fail: a core module importing the vLLM integration is refused
    assert not allowed("lifecycle.machine", "lifecycle.vllm.drafts")
    assert not allowed("lifecycle.audit.replay", "lifecycle.machine")
    assert not allowed("models.qwen3_dflash", "models.registry")
    assert allowed("models.qwen3_dflash2", "models.qwen3_dflash")
