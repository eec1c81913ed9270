"""torch's private APIs, each behind one small typed entry: the only module of the core and `models/` using them.

No other module of the core or of `models/` touches them (tests/core/test_torch_private.py fails on any other use).

What the framework relies on that torch does not promise:

- a module's own tables of tensors (`Module._parameters`, `_buffers`, `_modules`, `_non_persistent_buffers_set`):
  `own_parameters`, `own_buffers`, `own_tensor`, `own_children`, `non_persistent_buffers`, and `PARAMETERS_OF`,
  `BUFFERS_OF` for bulk reads in C. What `named_parameters()` and its kin cannot give: the slots that hold None, one
  module without its children, every name of a shared tensor, and the table itself, written in place;
- whether a global buffer-registration hook is registered (`buffer_registration_hooked`);
- the grad mode switched in C (`set_grad_mode`), without the Python frames of `torch.no_grad()`;
- a tensor subclass's data read without its `__torch_function__` (`torch_function_bypassed`, `as_plain_tensor`);
- fake tensors, the dry-run engine of `torch.compile` (`fake_mode`, `is_fake`, `DATA_DEPENDENT_ERRORS`);
- a dispatch mode that sees every op (`DispatchMode`) and the flattening of its arguments (`tree_leaves`).

Each entry has a test of what the framework relies on (tests/core/test_torch_private.py): a torch release that changes
one fails there, by name, instead of somewhere in a reload. The pin in pyproject.toml is the torch the suite runs.

Cost: these reads sit on per-tensor and per-bucket paths (pin checks, readiness scans, bucket writes, refreshes).
Every entry returns torch's own object (the table, the set: never a copy); a function costs one Python call (about
20 ns), and the entries meant for hot loops are torch's or the standard library's C callables themselves
(`set_grad_mode`, `PARAMETERS_OF`, `BUFFERS_OF`), so that going through this module costs nothing measurable.

>>> from torch import nn
>>> m = nn.Linear(2, 3, bias=False)
>>> own_parameters(m) is PARAMETERS_OF(m), sorted(own_parameters(m)), own_parameters(m)["bias"] is None
(True, ['bias', 'weight'], True)
>>> own_tensor(m, "weight") is m.weight, own_tensor(m, "bias"), own_tensor(m, "nothing")
(True, None, None)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from operator import attrgetter
from typing import Any, Final

import torch
import torch.nn.modules.module as _torch_module
import torch.utils._pytree as _pytree
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BUFFERS_OF", "DATA_DEPENDENT_ERRORS", "PARAMETERS_OF", "DispatchMode", "FakeTensorMode",
           "as_plain_tensor", "buffer_registration_hooked", "fake_mode", "is_fake", "non_persistent_buffers",
           "own_buffers", "own_children", "own_parameters", "own_tensor", "set_grad_mode", "torch_function_bypassed",
           "tree_leaves"]

Tensor = torch.Tensor


# ---- a module's own tables -------------------------------------------------------------------------------------


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """`module`'s own parameter table (`Module._parameters`), the dict itself: every slot it declares, those that
    hold None included (`register_parameter(name, None)`, a Linear without bias), none of its children's, each
    name once whatever tensor it holds (no deduplication of shared tensors). Writing into it replaces a slot's
    tensor as `Module.__setattr__` would, without its checks or hooks. No copy: as cheap as the attribute."""
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, Tensor | None]:
    """`module`'s own buffer table (`Module._buffers`), the dict itself: persistent and non-persistent buffers,
    None slots included, no children, no deduplication. No copy: as cheap as the attribute."""
    return module._buffers


#: `own_parameters` as a C callable, for bulk reads with `map` (a Python function per element costs about 40% more
#: in such a pass): `map(dict.get, map(PARAMETERS_OF, modules), leaves)`.
PARAMETERS_OF: Final[Callable[[nn.Module], dict[str, nn.Parameter | None]]] = attrgetter("_parameters")
#: `own_buffers` as a C callable, for bulk reads with `map`.
BUFFERS_OF: Final[Callable[[nn.Module], dict[str, Tensor | None]]] = attrgetter("_buffers")


def own_tensor(module: nn.Module, leaf: str) -> Tensor | None:
    """The tensor in `module`'s own slot `leaf`: its parameter when that slot holds one, else its buffer; None
    when neither holds a tensor. Reads the two tables directly (no `__getattr__`, no children)."""
    t = module._parameters.get(leaf)
    return t if t is not None else module._buffers.get(leaf)


def own_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """`module`'s own submodule table (`Module._modules`), the dict itself, in registration order (a
    `ModuleList`'s layers without running its Python `__iter__`). No copy."""
    return module._modules


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of `module`'s own buffers registered with `persistent=False` (`_non_persistent_buffers_set`),
    the set itself: read it, do not change it."""
    return module._non_persistent_buffers_set


def buffer_registration_hooked() -> bool:
    """Whether a global buffer-registration hook (`torch.nn.modules.module.register_module_buffer_registration_hook`)
    is registered now, so that registering a buffer again, even the same tensor, is seen by someone. True when
    torch no longer has that table (unknown: assume a hook)."""
    return bool(getattr(_torch_module, "_global_buffer_registration_hooks", True))


# ---- modes ---------------------------------------------------------------------------------------------------------


#: Switch autograd on or off for this thread (`torch._C._set_grad_enabled`): what `torch.no_grad()` does on entry
#: and exit, without its Python frames (a refresh switches it around bulk copies that leave the caches cold). The
#: caller restores the previous mode (`torch.is_grad_enabled()`), in a `finally`.
set_grad_mode: Final[Callable[[bool], None]] = torch._C._set_grad_enabled


def torch_function_bypassed() -> AbstractContextManager[None]:
    """A block in which tensor subclasses' `__torch_function__` overrides are not called (`torch._C.
    DisableTorchFunctionSubclass`): their methods and properties (`shape`, `dtype`) answer as a plain tensor's do.
    Modes (`DispatchMode`, fake tensors) still run."""
    return torch._C.DisableTorchFunctionSubclass()


def as_plain_tensor(value: Tensor) -> Tensor:
    """`value` viewed as a plain `torch.Tensor` (same storage, shape, dtype; no copy), its subclass's
    `__torch_function__` bypassed: what a tensor subclass really holds, whatever its overrides say about it."""
    with torch_function_bypassed():
        return value.as_subclass(Tensor)


def fake_mode(*, allow_non_fake_inputs: bool = False) -> FakeTensorMode:
    """A new fake-tensor mode: inside it, ops on fake tensors (`mode.from_tensor(t)`) compute shapes, dtypes and
    devices without allocating or touching data. `allow_non_fake_inputs`: real tensors may be read too (as fake).
    The first one made in a process imports `torch._dynamo`."""
    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def is_fake(t: object) -> bool:
    """Whether `t` is a fake tensor (of a dry run: it has no storage to count or read)."""
    return isinstance(t, FakeTensor)


#: What an op inside a fake mode raises when its result depends on values a fake tensor does not have: `.item()`,
#: `.tolist()` (data-dependent output), `nonzero()`, a boolean mask (dynamic output shape).
DATA_DEPENDENT_ERRORS: Final[tuple[type[Exception], ...]] = (DataDependentOutputException, DynamicOutputShapeException)


class DispatchMode(TorchDispatchMode):
    """Base of a mode that sees every op torch dispatches inside its `with` block, below autograd: a subclass
    defines `__torch_dispatch__(self, func, types, args=(), kwargs=None)`, runs `func(*args, **kwargs)` and
    returns its result. Modes nest; the innermost sees an op first."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: TorchDispatchMode has no annotations


def tree_leaves(tree: object) -> list[Any]:
    """The leaves of a nested structure of tuples, lists and dicts (an op's args and kwargs, its output), in
    order: the tensors among them and every other non-container value."""
    return _pytree.tree_leaves(tree)
