"""The package layering of docs/architecture.md, checked on the source: who may import whom, and no cycles.

Every import counts, wherever it stands: at module level, inside a function, under `if TYPE_CHECKING:` (a
type-only import is a dependency of the design as much as any other; it only costs nothing at run time). Imports
are read with `ast`, relative ones resolved; `from p import x` imports the module `p.x` when there is one, else `p`
(the parent packages Python runs on the way are no dependency of the importing module). A rule broken here is a
design change: change docs/architecture.md with it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lifecycle", "models")

#: Where an import stands: it runs when the module is imported, when a function runs, or never (type checkers only).
MODULE, FUNCTION, TYPE_ONLY = "module", "function", "type-checking"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_in(source: str, module: str, *, is_package: bool = False) -> list[tuple[str, tuple[str, ...], str]]:
    """(imported module, the names taken from it, where the import stands: MODULE, FUNCTION or TYPE_ONLY) for every
    import of `source`, the source of `module`, relative imports resolved; `import a.b` takes no names. Whether a
    name taken is itself a module (`from . import events`) is for the caller to say."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, tuple[str, ...], str]] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and where == MODULE:
            where = FUNCTION
        if isinstance(node, ast.Import):
            found.extend((alias.name, (), where) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((target, tuple(alias.name for alias in node.names), where))
        if isinstance(node, ast.If) and _type_checking_block(node):
            for child in node.body:
                visit(child, TYPE_ONLY)
            for child in node.orelse:
                visit(child, where)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(source), MODULE)
    return found


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _project_module(target: str, modules: set[str]) -> str | None:
    """The project module an import of `target` runs: itself, or the closest package above it that is one."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def project_imports(name: str, *, runs_at_import: bool = False, modules: Iterable[str] = MODULES) -> set[str]:
    """The project modules `name` imports, every kind counted (`runs_at_import`: only those that run when it is
    imported: module level, outside `if TYPE_CHECKING:`). `from p import x` imports the module `p.x` when there is
    one, else `p`."""
    modules = set(modules)
    path = MODULES[name]
    out = set()
    for target, names, where in imports_in(path.read_text(), name, is_package=path.name == "__init__.py"):
        if runs_at_import and where != MODULE:
            continue
        submodules = {f"{target}.{n}" for n in names} & modules
        if len(submodules) < max(len(names), 1):  # some name (or the module itself) is taken from `target`
            submodules.add(target)
        for imported in submodules:
            found = _project_module(imported, modules)
            if found is not None and found != name:
                out.add(found)
    return out


#: The core's own layers, lowest first: (layer, what it holds, its modules; a package stands for its modules too).
#: A core module imports its own layer and those below, never one above.
CORE_LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("table", "the states and the transition table, the one source every other part reads",
     ("lifecycle.states",)),
    ("bookkeeping", "plain data, the errors, torch's private APIs (behind one module), and what is recorded per "
     "backbone: readiness per epoch, dirty since the last refresh, layers owed a full write, write leases, tensor "
     "slots, storage identities, hooks, the environment switches",
     ("lifecycle.types", "lifecycle.errors", "lifecycle.torch_private", "lifecycle.env", "lifecycle.readiness",
      "lifecycle.dirty", "lifecycle.full_writes", "lifecycle.leases", "lifecycle.slots", "lifecycle.storage",
      "lifecycle.hooks")),
    ("audit output", "audit events bounded, routed and written (JSON lines), each lifecycle's numbered trail, and "
     "one stream per backbone name in each audit file",
     ("lifecycle.event_bounds", "lifecycle.event_sink", "lifecycle.events", "lifecycle.names",
      "lifecycle.event_trail")),
    ("machine", "the state machine of one backbone: the guards, the firing of the table's rows, the writers' "
     "reports, the triggers", ("lifecycle.guards", "lifecycle.firing", "lifecycle.load_tracking",
                               "lifecycle.machine")),
    ("derived buffers", "declaring, planning and applying the derived buffers' refresh", ("lifecycle.derived",)),
    ("checkpoint I/O", "safetensors files read (headers checked, confined beneath a root when one is given) and "
     "written, and the loader that streams one into a backbone",
     ("lifecycle.header", "lifecycle.confined", "lifecycle.read_buffers", "lifecycle.checkpoint", "lifecycle.loading")),
    ("sessions", "transactional reloads (begin, apply, finalize, verify, commit or abort, with rollback)",
     ("lifecycle.session",)),
    ("backbone", "the nn.Module mixin that owns a lifecycle and its derived buffers and builds sessions",
     ("lifecycle.backbone",)),
    ("front", "the package's lazy exports, and the helpers for users' tests", ("lifecycle", "lifecycle.testing")),
)
CORE_ORDER = {layer: i for i, (layer, _, _) in enumerate(CORE_LAYERS)}

#: The vLLM layer's own layers, lowest first, as CORE_LAYERS: a module of `lifecycle.vllm` imports its own layer and
#: those below, never one above (the observability layer reads every layer below it; nothing below imports it).
VLLM_LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("settings", "the settings registry: every RELOAD_LIFECYCLE_* setting, parsed and checked",
     ("lifecycle.vllm.settings",)),
    ("compat", "vLLM as the plugin finds it: its sources read without importing it, its version, and the mechanics "
     "of changing it (patch records, the one function that applies them)", ("lifecycle.vllm.compat",)),
    ("drafts", "what a vLLM draft is: family declarations, owned modules, frozen structure, K/V shadows, quantized "
     "drafts, the per-draft and per-worker runtime", ("lifecycle.vllm.drafts",)),
    ("reload", "how a draft reloads: the lifecycle classes and their load paths, the epoch boundary, vLLM's "
     "layerwise-reload hooks, shards, partial payloads, payload planning", ("lifecycle.vllm.reload",)),
    ("serving", "whether the engine may run the draft in a step (both model runners)", ("lifecycle.vllm.serving",)),
    ("online", "trainers' pushes: vLLM's weight-update sessions, the file transfer engine, the worker RPCs",
     ("lifecycle.vllm.online",)),
    ("observability", "metrics, the acceptance canary, the front process's view, the weight checker, the stat "
     "logger", ("lifecycle.vllm.observability",)),
    ("plugin", "the composition root: activation, the patch registry, the capability check, the Ray nodes check",
     ("lifecycle.vllm.plugin",)),
    ("entry", "what vLLM and users name by string (the plugin entry point, the registered classes, the worker "
     "extension) and the demo", ("lifecycle.vllm", "lifecycle.vllm.registered", "lifecycle.vllm.worker",
                                 "lifecycle.vllm.demo")),
)
VLLM_ORDER = {layer: i for i, (layer, _, _) in enumerate(VLLM_LAYERS)}


def vllm_layer(name: str) -> str | None:
    """The vLLM layer of module `name` (inside `lifecycle.vllm`), None outside them."""
    for layer_name, _, members in VLLM_LAYERS:
        for member in members:
            if name == member or (member != "lifecycle.vllm" and name.startswith(member + ".")):
                return layer_name
    return None


def core_layer(name: str) -> str | None:
    """The core layer of module `name`, None outside the core's layers."""
    for layer, _, members in CORE_LAYERS:
        for member in members:
            if name == member or (member != "lifecycle" and name.startswith(member + ".")):
                return layer
    return None


def layer(name: str) -> str:
    if name in ("lifecycle.cli", "lifecycle.cli_demo"):
        return "cli"
    if name == "lifecycle.bundled":  # finds the families by where they are installed: imports nothing of ours
        return name
    for prefix in ("lifecycle.audit", "lifecycle.vllm", "models.demo", "models.registry"):
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    if name.startswith("models"):
        return "models.family" if name != "models" else "models"
    return "core"


#: The audit's modules the vLLM layer may import: events that arrive over RPC are checked against the auditor's own
#: schema before a worker writes one (issue 32; torch-free, so the offline tools stay as they are).
AUDIT_SCHEMA_READERS = frozenset({"lifecycle.audit.schema"})
#: layer -> the layers it may import (itself always allowed; "core": any of the core's layers). The composition
#: root (cli) imports lazily.
ALLOWED = {
    "core": {"core"},  # and inside the core, only downward (CORE_LAYERS)
    "lifecycle.audit": {"lifecycle.states"},  # and nothing else of the core: no torch for the offline tools
    "lifecycle.vllm": {"core"},
    "models.family": {"core", "models.family"},
    "models.registry": {"core", "models.family"},
    "models": {"core", "models.registry", "models.family"},
    "models.demo": {"core", "lifecycle.audit", "models", "models.registry", "models.family"},
    "lifecycle.bundled": set(),
    "cli": {"core", "lifecycle.audit", "lifecycle.vllm", "lifecycle.bundled"},
}


def allowed(src: str, dst: str) -> bool:
    src_layer, dst_layer = layer(src), layer(dst)
    if src_layer == dst_layer == "core":
        below = core_layer(src), core_layer(dst)
        return None not in below and CORE_ORDER[below[1]] <= CORE_ORDER[below[0]]  # type: ignore[index]
    if src_layer == dst_layer == "lifecycle.vllm":
        inside = vllm_layer(src), vllm_layer(dst)
        return None not in inside and VLLM_ORDER[inside[1]] <= VLLM_ORDER[inside[0]]  # type: ignore[index]
    if src_layer == dst_layer:
        return True
    if src_layer == "lifecycle.audit":  # only the table, by module name
        return dst in ALLOWED[src_layer]
    if src_layer == "lifecycle.vllm" and dst in AUDIT_SCHEMA_READERS:
        return True
    return dst_layer in ALLOWED[src_layer]


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every import cycle of `graph` (module -> the modules it imports): its strongly connected components of more
    than one module, each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        on_stack.add(n)
        for d in sorted(graph.get(n, ())):
            if d not in index:
                visit(d)
                low[n] = min(low[n], low[d])
            elif d in on_stack:
                low[n] = min(low[n], index[d])
        if low[n] == index[n]:
            component = []
            while True:
                d = stack.pop()
                on_stack.discard(d)
                component.append(d)
                if d == n:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for n in sorted(graph):
        if n not in index:
            visit(n)
    return sorted(found)


def test_every_core_module_has_a_layer() -> None:
    unplaced = sorted(n for n in MODULES if layer(n) == "core" and core_layer(n) is None)
    assert not unplaced, f"core modules in no layer of CORE_LAYERS: {unplaced} (place each in this file)"


def test_every_vllm_module_has_a_layer() -> None:
    unplaced = sorted(n for n in MODULES if layer(n) == "lifecycle.vllm" and vllm_layer(n) is None)
    assert not unplaced, f"vLLM modules in no layer of VLLM_LAYERS: {unplaced} (place each in this file)"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_the_layering(name: str) -> None:
    bad = sorted(dst for dst in project_imports(name) if not allowed(name, dst))
    where = f"{layer(name)}" + (f", core layer {core_layer(name)!r}" if layer(name) == "core" else "") + (
        f", vLLM layer {vllm_layer(name)!r}" if layer(name) == "lifecycle.vllm" else "")
    assert not bad, f"{name} ({where}) imports {bad}: not allowed by docs/architecture.md"


def test_the_composition_root_imports_models_only_lazily() -> None:
    eager = {dst for dst in project_imports("lifecycle.cli", runs_at_import=True)
             if dst.startswith("models") or dst in ("lifecycle.cli_demo", "lifecycle.bundled")}
    assert not eager, f"lifecycle.cli imports {eager} at module level: the core CLI must start without models"


def test_the_package_never_imports_a_bare_models() -> None:
    """A `models/` folder in the working directory would answer it (docs/decisions.md): `lifecycle` reaches the
    bundled families through `lifecycle.bundled` only, by where they are installed."""
    bare = {name: sorted(d for d in project_imports(name) if d.split(".")[0] == "models")
            for name in MODULES if name.split(".")[0] == "lifecycle"}
    assert not {name: found for name, found in bare.items() if found}


def test_no_import_cycle_between_project_modules() -> None:
    found = cycles({name: project_imports(name) for name in MODULES})
    assert not found, "import cycles (every kind of import counted): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    # the rules can fail: a core module importing the vLLM integration is refused, and so is an upward import
    # inside the core
    assert not allowed("lifecycle.machine", "lifecycle.vllm.reload.mixin")
    assert not allowed("lifecycle.audit.replay", "lifecycle.machine")
    assert not allowed("models.qwen3_dflash", "models.registry")
    assert allowed("models.qwen3_dflash2", "models.qwen3_dflash")
    assert not allowed("lifecycle.readiness", "lifecycle.machine")
    assert not allowed("lifecycle.loading.load", "lifecycle.backbone")
    assert not allowed("lifecycle.session", "lifecycle.backbone")
    assert not allowed("lifecycle.states", "lifecycle.types")
    assert allowed("lifecycle.backbone", "lifecycle.session") and allowed("lifecycle.machine", "lifecycle.guards")
    assert not allowed("lifecycle.nowhere", "lifecycle.states")  # a module in no layer imports nothing of the core
    # ... and it reads every kind of import: a function-level and a type-only one count, and a cycle through them
    # is found
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .machine import BackboneLifecycle\n"
              "def f():\n    from ..backbone import DraftBackbone\n")
    assert imports_in(source, "lifecycle.loading.load") == [
        ("typing", ("TYPE_CHECKING",), MODULE), ("lifecycle.loading.machine", ("BackboneLifecycle",), TYPE_ONLY),
        ("lifecycle.backbone", ("DraftBackbone",), FUNCTION)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
