"""Which markers a test needs, read from what it uses (`tests/conftest.py` adds them at collection).

A test needs what the code it runs needs: its own function, every fixture in its closure (and a fixture it names by
a parameter for `request.getfixturevalue`), and, followed by name, the helpers these call in `support`, the test
modules and `lifecycle.vllm`. A helper declared with `support.needs.needs(...)` brings its markers; an
`import vllm...` or a `find_spec("vllm")` (reading the installed vLLM's files) anywhere in that code brings
`vllm`. A doctest brings `vllm` when its examples import it.

Names are resolved as the code's globals resolve them, through a module it names (`plugin.register`) and through a
function-level `from support.x import helper`; a call through an instance (`fam.cold()`) or `getattr` is not
followed, which is why the declared helpers also check, when called, that the running test has their markers.
"""

from __future__ import annotations

import ast
import dis
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FunctionType, ModuleType
from typing import Any

import pytest

from support.needs import needs_of

__all__ = ["imports_vllm_at_import", "markers_for", "needs_in"]

#: packages whose functions are followed (with the test modules, `test_*`): the tests' own code and the vLLM
#: integration, which imports vLLM inside its functions
FOLLOWED = ("support", "conftest", "lifecycle.vllm")
_VLLM_IMPORT = re.compile(r"^\s*(from|import)\s+vllm\b", re.M)

_memo: dict[CodeType, frozenset[str]] = {}


def _followed(module: str | None) -> bool:
    if not module:
        return False
    return module.startswith("test_") or any(module == p or module.startswith(p + ".") for p in FOLLOWED)


def _codes(code: CodeType) -> Iterator[CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _codes(const)


def _imports(code: CodeType) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(module, names taken from it) for each import in the code (a function-level `from X import y` too)."""
    for c in _codes(code):
        module: str | None = None
        taken: list[str] = []
        for ins in dis.get_instructions(c):
            if ins.opname == "IMPORT_NAME":
                if module is not None:
                    yield module, tuple(taken)
                module, taken = str(ins.argval), []
            elif ins.opname == "IMPORT_FROM" and module is not None:
                taken.append(str(ins.argval))
        if module is not None:
            yield module, tuple(taken)


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _finds_vllm(code: CodeType) -> bool:
    """`importlib.util.find_spec("vllm")`: reading the installed vLLM's files needs it installed, not imported."""
    return any("find_spec" in c.co_names and "vllm" in c.co_consts for c in _codes(code))


def needs_in(fn: Any, _active: set[CodeType] | None = None) -> frozenset[str]:
    """The markers calling `fn` needs: what it declares, or what its code and the helpers it names need."""
    declared = needs_of(fn)
    if declared:
        return declared
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, CodeType):
        return frozenset()
    if code in _memo:
        return _memo[code]
    active = set() if _active is None else _active
    if code in active:  # a cycle: what it needs is being found further up
        return frozenset()
    active.add(code)
    found: set[str] = set()
    names = {n for c in _codes(code) for n in c.co_names}
    scope: dict[str, Any] = getattr(fn, "__globals__", {})
    reached = [scope[n] for n in names if n in scope]
    if _finds_vllm(code):
        found.add("vllm")
    for module, taken in _imports(code):
        if _is_vllm(module):
            found.add("vllm")
        elif _followed(module):  # a function-level `from support.x import helper`, `import lifecycle.vllm.y as y`
            imported = importlib.import_module(module)
            reached += [imported, *(getattr(imported, n) for n in taken if hasattr(imported, n))]
    reached += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _filled(cell)]
    for obj in reached:
        found |= _needs_of_object(obj, names, active)
    active.discard(code)
    result = frozenset(found)
    _memo[code] = result
    return result


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _needs_of_object(obj: Any, names: set[str], active: set[CodeType]) -> frozenset[str]:
    declared = needs_of(obj)
    if declared:
        return declared
    if isinstance(obj, ModuleType):
        if _is_vllm(obj.__name__):
            return frozenset({"vllm"})
        if not _followed(obj.__name__):
            return frozenset()
        out: set[str] = set()
        for n in names:  # `module.helper(...)`: the names the code uses that the module has
            attr = getattr(obj, n, None)
            if attr is not None and not isinstance(attr, ModuleType):
                out |= _needs_of_object(attr, set(), active)
        return frozenset(out)
    if isinstance(obj, type):
        if not _followed(obj.__module__):
            return frozenset()
        out = set()
        for member in vars(obj).values():
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(member, FunctionType):
                out |= needs_in(member, active)
        return frozenset(out)
    if callable(obj) and _followed(getattr(obj, "__module__", None)):
        return needs_in(obj, active)
    return frozenset()


def _fixture_functions(item: pytest.Item) -> Iterator[Any]:
    # pytest has no public way from an item to its fixtures' functions; these two attributes have been stable
    # since pytest 3 (FixtureDef.func, Item._fixtureinfo) and are all this reads
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    names = dict(info.name2fixturedefs)
    callspec = getattr(item, "callspec", None)
    manager = item.session._fixturemanager
    for value in (callspec.params.values() if callspec else ()):
        if isinstance(value, str) and value not in names:  # a fixture named by a parameter (getfixturevalue)
            defs = manager.getfixturedefs(value, item)
            if defs:
                names[value] = defs
    for defs in names.values():
        for fixturedef in defs:
            yield fixturedef.func


def imports_vllm_at_import(path: Path) -> bool:
    """Whether the module at `path` imports vLLM when it is imported (a module-level `import vllm...`, outside
    functions and `if TYPE_CHECKING:`): importing it at all needs vLLM, so does every test of it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(_is_vllm(name) for name in names):
            return True
    return False


def markers_for(item: pytest.Item) -> frozenset[str]:
    """The markers `item` needs by what it uses."""
    found: set[str] = set()
    if isinstance(item, pytest.Function):
        found |= needs_in(item.function)
    elif hasattr(item, "dtest"):  # a doctest: what its examples import
        source = "\n".join(example.source for example in item.dtest.examples)
        if _VLLM_IMPORT.search(source):
            found.add("vllm")
    for fn in _fixture_functions(item):
        found |= needs_in(fn)
    return frozenset(found)
