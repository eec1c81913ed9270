"""What a vLLM draft derives from its weights, found in its sources (never imported): the drift check's eyes.

vLLM's speculative-decoding registry (`_SPECULATIVE_DECODING_MODELS` in `model_executor/models/registry.py`, read
as data: `speculative_registry`) names every draft class. `scan(index, module, cls)` reads the file that defines the
class and the bases of every class in it (not vLLM's shared layers, whose per-layer processing vLLM's layerwise
reload runs), and reports each place where the draft keeps state a reload must own (`Finding`):

- `NON_PERSISTENT`: a buffer registered with `persistent=False` (a checkpoint never carries it: derived, a
  constant, or a tensor its `load_weights` writes by hand);
- `DERIVED`: an attribute of `self` assigned, outside `forward`, from `torch.cat` / `torch.stack` (and their
  relatives) or from a view of parameters (`.weight` / `.bias` / a declared `nn.Parameter`, sliced, reshaped,
  transposed or aliased), directly or through a local or a method of the class that returns one;
- `DUPLICATED`: a generator over a load's weights that yields a tensor a second time under another module's name
  (DeepSeek-V4 DSpark's `_duplicate_context_wkv_weights`: every layer's WKV into the cross-layer projection);
- `BARE_WRITE`: a `copy_` into, or a `.data =` of, a parameter or buffer outside a weight loader (vLLM #57800: a
  write no readiness count sees). The attribute is the checkpoint name its `if "..." in name` test selects.

Each finding names the file, the class (or the module-level function) and the attribute; `plugin.drift` matches
them against the plugin's declarations.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from .sources import ClassRef, SourceIndex

__all__ = ["BARE_WRITE", "DERIVED", "DUPLICATED", "NON_PERSISTENT", "REGISTRY_MODULE", "RULES", "Finding", "scan",
           "speculative_registry"]

NON_PERSISTENT, DERIVED, DUPLICATED, BARE_WRITE = "non-persistent buffer", "derived", "duplicated", "bare write"
RULES = (NON_PERSISTENT, DERIVED, DUPLICATED, BARE_WRITE)
REGISTRY_MODULE = "vllm.model_executor.models.registry"
_MODELS = "vllm.model_executor.models"
_REGISTRY_NAME = "_SPECULATIVE_DECODING_MODELS"
#: torch functions whose result is a new tensor built from several (what vLLM's builders fuse layers with)
_COMBINERS = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "block_diag"})
#: tensor methods whose result shares the storage of (or is copied from) the tensor they are called on
_VIEWS = frozenset({"view", "reshape", "t", "transpose", "permute", "contiguous", "flatten", "unflatten", "narrow",
                    "chunk", "split", "unbind", "detach", "expand", "squeeze", "unsqueeze", "to", "clone", "float",
                    "half", "bfloat16", "view_as", "as_strided", "T", "mT", "data"})
_PARAMETER_LEAVES = frozenset({"weight", "bias"})


@dataclass(frozen=True, order=True)
class Finding:
    """One place a draft's sources keep state a reload must own."""

    file: str  # the distribution's path: vllm/model_executor/models/lilicorr.py
    owner: str  # the class (or module-level function) it is in
    attribute: str  # what it sets, or the checkpoint name it writes
    rule: str  # one of RULES
    where: str = ""  # the method or function
    line: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        """What a declaration matches (the line and method move between releases)."""
        return self.owner, self.attribute, self.rule

    def __str__(self) -> str:
        return f"{self.file}: {self.owner}.{self.attribute}: {self.rule} in {self.where} (line {self.line})"


def speculative_registry(index: SourceIndex) -> dict[str, tuple[str, str]]:
    """vLLM's speculative-decoding registry: architecture -> (module, class), modules made absolute as vLLM's
    `_LazyRegisteredModel` does (a bare name is under `vllm.model_executor.models`). Empty when not found."""
    tree = index.tree(REGISTRY_MODULE)
    out: dict[str, tuple[str, str]] = {}
    for node in tree.body if tree is not None else ():
        if not (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not any(isinstance(t, ast.Name) and t.id == _REGISTRY_NAME for t in targets):
            continue
        for key, value in zip(node.value.keys, node.value.values, strict=True):
            if isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and len(value.elts) == 2 \
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
                module, cls = (e.value for e in value.elts)  # type: ignore[attr-defined]  # checked: Constant
                out[str(key.value)] = (module if module.startswith("vllm.") else f"{_MODELS}.{module}", cls)
    return out


def scan(index: SourceIndex, module: str, cls: str) -> list[Finding] | None:
    """Every finding in the code a draft runs: the methods of the classes its file defines, the methods they
    inherit that those call (through `self.`, `super().` or a submodule: `self.model._build_fused_kv_buffers()`),
    and the file's module-level functions. None if the class is not found."""
    ref = index.find_class(module, cls)
    if ref is None:
        return None
    tree = index.tree(ref.module)
    assert tree is not None  # find_class found the class in it
    file = index.file_of(ref.module) or ref.module
    found: set[Finding] = set()
    for owner, fn in _reachable(index, [ClassRef(ref.module, n) for n in tree.body if isinstance(n, ast.ClassDef)]):
        found.update(_method_findings(index, owner, fn))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.update(_duplications(file, node.name, node))
    return sorted(found)


#: what vLLM itself calls on a draft (the model runner, the loader, the proposers): reachable whoever defines it
_ENTRY_POINTS = ("__init__", "forward", "load_weights", "process_weights_after_loading",
                 "precompute_and_store_context_kv", "compute_logits", "combine_hidden_states", "embed_input_ids")


def _reachable(index: SourceIndex, classes: list[ClassRef]
               ) -> list[tuple[ClassRef, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(defining class, method) for every method the file's classes define, every entry point they inherit, and
    every method those call on `self`, through `super()` or on an attribute, resolved in each class's MRO."""
    done: dict[tuple[str, str], tuple[ClassRef, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    todo: list[tuple[ClassRef, str, str | None]] = []
    for c in classes:
        todo += [(c, n.name, None) for n in c.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        todo += [(c, name, None) for name in _ENTRY_POINTS]
    while todo:
        c, name, after = todo.pop()
        found = index.method(c, name, after=after)
        if found is None or (found[0].name, name) in done:
            continue
        owner, fn = found
        done[(owner.name, name)] = found
        for call in _calls(fn):
            if not isinstance(call.func, ast.Attribute):
                continue
            target = call.func.value
            if _is_self(target):
                todo.append((c, call.func.attr, None))
            elif isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
                todo.append((c, call.func.attr, owner.name))
            elif isinstance(target, ast.Attribute) and _is_self(target.value):  # self.model.build(): any class
                todo += [(other, call.func.attr, None) for other in classes]
    return list(done.values())


# ---- per class ---------------------------------------------------------------------------------------------------
def _method_findings(index: SourceIndex, c: ClassRef, fn: ast.FunctionDef | ast.AsyncFunctionDef
                     ) -> Iterator[Finding]:
    file = index.file_of(c.module) or c.module
    owner, name = c.node.name, fn.name
    parameters, buffers = _declared_tensors(c.node)
    for call in _calls(fn):
        if _is_register_buffer(call) and _keyword_false(call, "persistent"):
            yield Finding(file, owner, _first_string(call) or "?", NON_PERSISTENT, name, call.lineno)
    if name == "forward":
        return
    methods = {n.name: n for n in c.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    tainted = _TaintedLocals(parameters, methods)
    for node in _statements(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            derived = tainted.derived(node.value)
            for target in targets:
                for attr in _self_targets(target):
                    if derived:
                        yield Finding(file, owner, attr, DERIVED, name, node.lineno)
                for local in _local_targets(target):
                    tainted.mark(local, derived)
    if not _is_loader(name):
        yield from _bare_writes(file, owner, name, fn, parameters | buffers)
    yield from _duplications(file, owner, fn, where=name)


def _declared_tensors(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(parameters, buffers) the class declares: `self.x = nn.Parameter(...)`, `register_parameter("x", ...)`,
    `register_buffer("x", ...)`."""
    parameters: set[str] = set()
    buffers: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and _called_name(node.value) == "Parameter":
            parameters.update(a for t in node.targets for a in _self_targets(t))
        elif isinstance(node, ast.Call) and _called_name(node) in ("register_parameter", "register_buffer"):
            first = _first_string(node)
            if first:
                (parameters if _called_name(node) == "register_parameter" else buffers).add(first)
    return parameters, buffers


class _TaintedLocals:
    """Within one method: which local names hold a tensor derived from parameters or combined by torch.cat."""

    def __init__(self, parameters: set[str], methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef],
                 depth: int = 0) -> None:
        self.parameters, self.methods, self.depth = parameters, methods, depth
        self.names: set[str] = set()

    def mark(self, name: str, derived: bool) -> None:
        (self.names.add if derived else self.names.discard)(name)

    def derived(self, expr: ast.AST) -> bool:
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                name = _called_name(node)
                if name in _COMBINERS and _is_torch(node.func):
                    return True
                if self._self_method_returns_derived(node):
                    return True
            if isinstance(node, ast.Name) and node.id in self.names:
                return True
            if self._parameter_view(node):
                return True
        return False

    def _parameter_view(self, node: ast.AST) -> bool:
        """`self.x.weight`, `self.layers[0].proj.bias`, `self.declared_param` (and views of them)."""
        if not isinstance(node, ast.Attribute):
            return False
        if node.attr in _PARAMETER_LEAVES or (_is_self(node.value) and node.attr in self.parameters):
            root = node.value
            while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
                root = root.value if not isinstance(root, ast.Call) else root.func
            return _is_self(root)
        return False

    def _self_method_returns_derived(self, call: ast.Call) -> bool:
        if self.depth > 2 or not (isinstance(call.func, ast.Attribute) and _is_self(call.func.value)):
            return False
        fn = self.methods.get(call.func.attr)
        if fn is None or fn.name == "forward":
            return False
        inner = _TaintedLocals(self.parameters, self.methods, self.depth + 1)
        for node in _statements(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                derived = inner.derived(node.value)
                for target in targets:
                    for local in _local_targets(target):
                        inner.mark(local, derived)
            elif isinstance(node, ast.Return) and node.value is not None and inner.derived(node.value):
                return True
        return False


def _bare_writes(file: str, owner: str, where: str, fn: ast.AST, tensors: set[str]) -> Iterator[Finding]:
    """`x.copy_(...)` and `x.data = ...` of a parameter or buffer of the model, outside a weight loader: named by
    the checkpoint name the enclosing `if "name" in ...` selects, else by the attribute written."""
    for node, tests in _with_conditions(fn):
        target: ast.AST | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "copy_":
            target = node.func.value
        elif isinstance(node, ast.Assign):
            target = next((t.value for t in node.targets if isinstance(t, ast.Attribute) and t.attr == "data"), None)
        written = _model_tensor(target, tensors) if target is not None else None
        if written is not None:
            yield Finding(file, owner, _selected_name(tests) or written, BARE_WRITE, where, getattr(node, "lineno", 0))


def _model_tensor(node: ast.AST, tensors: set[str]) -> str | None:
    """What a write target names when it is a tensor of the model: `self.mask_hidden` (a declared parameter or
    buffer), `self.x.weight`, `params_dict[name][:n]`, `param` (a parameter table or a parameter by name)."""
    chain: list[str] = []
    root = node
    while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(root, ast.Attribute):
            chain.append(root.attr)
        root = root.func if isinstance(root, ast.Call) else root.value
    if not isinstance(root, ast.Name):
        return None
    chain.reverse()
    if root.id == "self" and chain and (chain[0] in tensors or chain[-1] in _PARAMETER_LEAVES):
        return ".".join(chain)
    return ast.unparse(node) if "param" in root.id else None


def _duplications(file: str, owner: str, fn: ast.AST, where: str = "") -> Iterator[Finding]:
    """A loop over weights that yields each tensor and, for some, a second time under another name."""
    for loop in ast.walk(fn):
        if not isinstance(loop, ast.For):
            continue
        yields = [n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Yield) and n.value is not None]
        if len(yields) < 2:
            continue
        for y in yields[1:]:
            name = y.value.elts[0] if isinstance(y.value, ast.Tuple) and y.value.elts else None
            if isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant):
                yield Finding(file, owner, str(name.values[0].value).split(".")[0], DUPLICATED, where or owner,
                              y.lineno)


# ---- small AST helpers ---------------------------------------------------------------------------------------------
def _statements(fn: ast.AST) -> Iterator[ast.AST]:
    """The function's nodes in source order, without descending into nested functions or classes."""
    stack = list(reversed(list(ast.iter_child_nodes(fn))))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _with_conditions(fn: ast.AST) -> Iterator[tuple[ast.AST, tuple[ast.expr, ...]]]:
    """Every node of the function with the `if` tests that enclose it (innermost last; an `elif` has its own)."""

    def visit(node: ast.AST, tests: tuple[ast.expr, ...]) -> Iterator[tuple[ast.AST, tuple[ast.expr, ...]]]:
        yield node, tests
        if isinstance(node, ast.If):
            for stmt in node.body:
                yield from visit(stmt, (*tests, node.test))
            for stmt in node.orelse:
                yield from visit(stmt, tests)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, tests)

    for child in ast.iter_child_nodes(fn):
        yield from visit(child, ())


def _selected_name(tests: tuple[ast.expr, ...]) -> str | None:
    """The string of the innermost `"attn_sink" in name` (or `name.endswith("...")`) test."""
    for test in reversed(tests):
        for node in ast.walk(test):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                    and isinstance(node.left.value, str) and any(isinstance(o, ast.In) for o in node.ops):
                return node.left.value
            if isinstance(node, ast.Call) and _called_name(node) in ("endswith", "startswith") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                return node.args[0].value.strip(".")
    return None


def _calls(fn: ast.AST) -> Iterator[ast.Call]:
    return (n for n in ast.walk(fn) if isinstance(n, ast.Call))


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_torch(func: ast.AST) -> bool:
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch"


def _is_register_buffer(call: ast.Call) -> bool:
    return _called_name(call) == "register_buffer"


def _keyword_false(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is False for k in call.keywords)


def _first_string(call: ast.Call) -> str | None:
    first = call.args[0] if call.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _self_targets(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Attribute) and _is_self(target.value):
        return [target.attr]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [a for e in target.elts for a in _self_targets(e)]
    return []


def _local_targets(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [a for e in target.elts for a in _local_targets(e)]
    return []


def _is_loader(name: str) -> bool:
    """A weight loader (vLLM's own or a model's): writing into its parameter is what it is for."""
    return "loader" in name or name.startswith(("_load_", "load_shared_expert"))
