"""Reading vLLM's Python sources without importing vLLM: an installed package's files or a wheel's members.

`SourceIndex` answers what the capability check asks (does a module exist, does it bind a name, does a class
or one of its bases define a method or an attribute, what does a builder method assign and read) from the
parsed sources alone, so the same check runs on the installed vLLM at plugin activation and on a release wheel
that cannot run here (vLLM 0.33 is a CUDA-only build).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClassRef", "Reader", "SourceIndex", "installed_reader", "wheel_reader"]

#: A source reader: a path inside the distribution ("vllm/model_executor/...py") -> its text, or None if absent.
Reader = Callable[[str], "str | None"]


def installed_reader() -> Reader:
    """The installed vLLM's files (found without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("No module named 'vllm'")
    root = Path(next(iter(spec.submodule_search_locations))).parent

    def read(rel: str) -> str | None:
        p = root / rel
        return p.read_text(encoding="utf-8") if p.is_file() else None

    return read


def wheel_reader(wheel: str | Path) -> Reader:
    """The Python files of a wheel, read straight from the zip (nothing unpacked)."""
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())

    def read(rel: str) -> str | None:
        return zf.read(rel).decode("utf-8") if rel in names else None

    return read


@dataclass(frozen=True)
class ClassRef:
    module: str
    node: ast.ClassDef

    @property
    def name(self) -> str:
        return f"{self.module}.{self.node.name}"


class SourceIndex:
    """Parsed modules of one vLLM distribution, and the questions the capability check asks of them."""

    def __init__(self, read: Reader) -> None:
        self._read = read
        self._parsed: dict[str, tuple[ast.Module, bool] | None] = {}

    # ---- modules and top-level names -------------------------------------------------------------------------
    def _parse(self, module: str) -> tuple[ast.Module, bool] | None:
        if module not in self._parsed:
            base = module.replace(".", "/")
            found = None
            for rel, is_pkg in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self._read(rel)
                if text is not None:
                    found = (_parse(text), is_pkg)
                    break
            self._parsed[module] = found
        return self._parsed[module]

    def has_module(self, module: str) -> bool:
        return self._parse(module) is not None

    def tree(self, module: str) -> ast.Module | None:
        """The module's parsed source (None if the distribution has no such module)."""
        parsed = self._parse(module)
        return parsed[0] if parsed is not None else None

    def file_of(self, module: str) -> str | None:
        """The distribution's path of the module's source: `vllm/models/beam/__init__.py`."""
        parsed = self._parse(module)
        if parsed is None:
            return None
        base = module.replace(".", "/")
        return f"{base}/__init__.py" if parsed[1] else f"{base}.py"

    def attribute_names(self, module: str) -> set[str]:
        """Every attribute name the module's source reads or sets (`x.name`), anywhere in it."""
        parsed = self._parse(module)
        if parsed is None:
            return set()
        return {n.attr for n in ast.walk(parsed[0]) if isinstance(n, ast.Attribute)}

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parsed = self._parse(module)
        package = module if parsed is not None and parsed[1] else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def binding(self, module: str, name: str) -> ast.AST | tuple[str, str] | None:
        """What binds `name` at the top level of `module`: its def/class/assignment node, or (module, name) of
        an import; None if nothing does."""
        parsed = self._parse(module)
        if parsed is None:
            return None
        found: ast.AST | tuple[str, str] | None = None
        for node in _top_level(parsed[0]):
            if _binds(node, name):
                found = node
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        found = (self._absolute(module, node), a.name)
        return found

    def find_class(self, module: str, name: str, _depth: int = 0) -> ClassRef | None:
        """The class `name` as `module` sees it, following imports inside the distribution."""
        b = self.binding(module, name)
        if isinstance(b, ast.ClassDef):
            return ClassRef(module, b)
        if isinstance(b, tuple) and _depth < 8:
            src, orig = b
            if self.has_module(f"{src}.{orig}"):  # `from pkg import submodule`: not a class
                return None
            return self.find_class(src, orig, _depth + 1)
        return None

    # ---- classes ---------------------------------------------------------------------------------------------
    def mro(self, cls: ClassRef) -> list[ClassRef]:
        """The class and its bases found in the distribution, depth first, left to right, each once."""
        out: list[ClassRef] = []
        seen: set[str] = set()

        def visit(c: ClassRef) -> None:
            if c.name in seen:
                return
            seen.add(c.name)
            out.append(c)
            for base in c.node.bases:
                if isinstance(base, ast.Name):
                    found = self.find_class(c.module, base.id)
                    if found is not None:
                        visit(found)

        visit(cls)
        return out

    def method(self, cls: ClassRef, name: str, *, after: str | None = None
               ) -> tuple[ClassRef, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        chain = self.mro(cls)
        if after is not None:  # super(): start past the class that calls it
            names = [c.name for c in chain]
            chain = chain[names.index(after) + 1:] if after in names else chain
        for c in chain:
            for node in c.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return c, node
        return None

    def has_attribute(self, cls: ClassRef, name: str) -> bool:
        """Does the class or a base define `name`: a method, a class attribute, or an instance attribute its
        methods set (`self.name = ...`, `register_buffer("name", ...)`, `register_parameter`)?"""
        for c in self.mro(cls):
            for node in c.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return True
                if name in _class_level_names(node):
                    return True
            if name in _instance_attributes(c.node):
                return True
        return False

    @staticmethod
    def strings(fn: ast.AST) -> set[str]:
        """Every string literal in a function (implicitly joined literals are one)."""
        return {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    def builder_effects(self, cls: ClassRef, builders: tuple[str, ...]) -> tuple[set[str], set[str]]:
        """(attributes assigned on self, attribute names accessed) by `builders` and every method of the class
        they call on self (or through super()), as the class's MRO resolves them."""
        assigned: set[str] = set()
        accessed: set[str] = set()
        done: set[tuple[str, str]] = set()
        todo: list[tuple[str, str | None]] = [(b, None) for b in builders]
        while todo:
            name, after = todo.pop()
            found = self.method(cls, name, after=after)
            if found is None:
                continue
            owner, fn = found
            if (owner.name, name) in done:
                continue
            done.add((owner.name, name))
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute):
                    accessed.add(node.attr)
                    if _is_self(node.value) and isinstance(node.ctx, ast.Store):
                        assigned.add(node.attr)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    target = node.func.value
                    if _is_self(target):
                        todo.append((node.func.attr, None))
                    elif isinstance(target, ast.Call) and isinstance(target.func, ast.Name) \
                            and target.func.id == "super":
                        todo.append((node.func.attr, owner.name))
        return assigned, accessed


@functools.lru_cache(maxsize=64)
def _parse(text: str) -> ast.Module:
    return ast.parse(text)  # trees are only read, so one per distinct source text serves every index


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Top-level statements, including those inside top-level `if`/`try` blocks (guarded imports)."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.If, ast.Try)):
            inner = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            for h in getattr(node, "handlers", []):
                inner.extend(h.body)
            stack.extend(reversed(inner))
        else:
            yield node


def _binds(node: ast.stmt, name: str) -> bool:
    """Does this statement define `name` (def, class, assignment)?"""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    return name in _class_level_names(node)


def _class_level_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and _is_self(node.value) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value) \
                and node.func.attr in ("register_buffer", "register_parameter", "register_module") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names.add(node.args[0].value)
    return names


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"
