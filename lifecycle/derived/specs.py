"""Derived-buffer declarations: `concat`, `stack`, `alias`, `custom`, and how a spec finds its tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
from torch import nn

from ..torch_private import own_buffers, own_tensor

__all__ = ["DependsOn", "DerivedSpec", "Into", "Kind", "PerLayer", "alias", "concat", "current_buffer", "custom",
           "resolve_tensor", "stack"]

Kind = Literal["concat", "stack", "alias", "custom"]
T = TypeVar("T")
# The functions a declaration takes are given the user's own modules (a layer, the backbone): typed `Any`, since
# torch types every attribute of a plain `nn.Module` as `Tensor | Module`, and a lambda cannot name its class.
#: A layer's slice: one tensor, or several parts (separate K and V weights) laid out one after the other.
PerLayer = Callable[[Any], "torch.Tensor | Sequence[torch.Tensor]"]
Enabled = Callable[[Any], bool]
Build = Callable[[Any], torch.Tensor]
#: `custom(depends_on=)`: names (absolute, or with `*` for every index of a module list: `layers.*.mlp.w`), or a
#: function of the backbone returning names (for what its config decides).
DependsOn = Sequence[str] | Callable[[Any], Iterable[str]]
#: `custom(into=)`: writes the value into `out` and returns it; given `out=None` (the cold build, when there is no
#: `build`), returns a new tensor. `torch` ops with an `out=` argument do both: `torch.mm(a, b, out=out)`.
Into = Callable[[Any, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class DerivedSpec:
    """A derived buffer declaration. Build it with `concat`, `stack`, `alias` or `custom`.

    `sources`: for concat/stack, tensor names relative to each layer (`self_attn.k_norm.weight`); for alias,
    the one absolute tensor name it points at; for custom, the names it depends on (absolute, or with `*` for
    every index of a module list; `depends_fn` adds names computed from the backbone).
    `per_layer`: concat/stack, a layer's slice: a tensor (a view of its sources), or a sequence of parts (separate
    K and V weights) that the slice lays out one after the other along the concat dim (a stack: along the slice's
    first dim), each copied straight into its place in the buffer. A function of the layer's declared sources: a
    refresh evaluates it for the slices it writes, and a slice whose sources kept their storage identity keeps
    the layout its last evaluation validated (`lifecycle.derived.reuse`).
    `fallback`: when set, a source in the wrong layout disables the buffer (its last values stay, the model
    takes the named fallback path) instead of refusing the refresh. Never silent: the report and the audit
    event say so.
    `into`: custom only, an in-place writer `into(backbone, out) -> out` that a refresh uses instead of `build`
    (so no temporary the size of the buffer is created); without `build`, `into(backbone, None)` makes the cold
    value.
    `enabled`: a predicate on the backbone, evaluated once by `init_lifecycle`; a buffer it rejects is not
    registered, built or refreshed on that backbone (a head the config leaves out). None: always enabled.
    `backed`: concat/stack whose every part is one of the layer's sources as a whole: the cold build makes each
    source a view of its place in the buffer (`lifecycle.derived.backing`), so weights and buffer are one copy, a
    load writes the buffer, and a refresh only verifies that every source is still that view.
    """

    name: str
    kind: Kind
    sources: tuple[str, ...]
    per_layer: PerLayer | None = None
    build: Build | None = None
    dim: int = 0
    layers_attr: str = "layers"
    fallback: str | None = None
    computed: bool = False
    into: Into | None = None
    enabled: Enabled | None = None
    depends_fn: Callable[[Any], Iterable[str]] | None = None
    backed: bool = False

    def __post_init__(self) -> None:
        if self.computed and self.kind != "stack":
            raise ValueError(f"{self.name}: computed=True is only supported for stack specs (got {self.kind})")
        if self.backed and (self.kind not in ("concat", "stack") or self.computed):
            raise ValueError(f"{self.name}: backed=True is for concat and stack buffers of whole sources (got "
                             f"{'a computed stack' if self.computed else self.kind})")
        if self.backed and self.kind == "concat" and self.dim != 0:
            raise ValueError(f"{self.name}: backed=True needs dim=0 (a source must be a contiguous view of its "
                             f"place in the buffer; along dim {self.dim} it would not be)")
        if self.kind == "custom" and self.build is None and self.into is None:
            raise ValueError(f"{self.name}: custom needs build=, into=, or both")

    def is_enabled(self, backbone: nn.Module) -> bool:
        """Whether this backbone has the buffer (`enabled`, when given, decides from its config or modules)."""
        return self.enabled is None or bool(self.enabled(backbone))

    def source_names(self, backbone: nn.Module) -> list[str]:
        """Absolute names of every tensor this buffer reads."""
        if self.kind in ("concat", "stack"):
            n = len(_layers(backbone, self.layers_attr))
            return [f"{self.layers_attr}.{i}.{s}" for i in range(n) for s in self.sources]
        if self.kind == "alias":
            return list(self.sources)
        names = [n for pattern in self.sources for n in _expand(backbone, pattern)]
        if self.depends_fn is not None:
            names += list(self.depends_fn(backbone))
        return list(dict.fromkeys(names))

    def build_value(self, backbone: nn.Module) -> torch.Tensor:
        """The cold value: `build(backbone)`, or `into(backbone, None)` for a custom declared with `into` alone."""
        if self.build is not None:
            return self.build(backbone)
        assert self.into is not None
        return self.into(backbone, None)


def concat(name: str, *, sources: Sequence[str], per_layer: PerLayer, dim: int = 0, layers_attr: str = "layers",
           fallback: str | None = None, enabled: Enabled | None = None, backed: bool = False) -> DerivedSpec:
    """One slice per layer, concatenated along `dim` (e.g. the fused KV weight). `per_layer` returns the slice
    (a view of the layer's `sources`), or its parts: `per_layer=lambda l: (l.k_proj.weight, l.v_proj.weight)`
    lays each layer's K rows then V rows out along `dim`, each copied straight into its place (no per-layer
    `torch.cat`, no temporary). A refresh evaluates `per_layer` for the slices it writes, and for every slice
    when something the last plan read changed its identity (a replaced or resized source, a moved buffer); a
    `per_layer` that computes (a temporary) is evaluated for every slice at every refresh.

    `backed=True` (opt-in; `dim=0`, every part one of the layer's sources as a whole): after the cold build the
    sources ARE views of the buffer, so the weights and the buffer are one copy instead of two, a reload writes
    the buffer as it loads, and a refresh writes nothing: it verifies that every source is still its view (one
    that is not, because something replaced it, is copied in and made a view again; under captured graphs that
    replacement is refused as drift before). Like an `alias`, a backed buffer holds what an aborted reload wrote
    until a rollback."""
    return DerivedSpec(name, "concat", tuple(sources), per_layer=per_layer, dim=dim, layers_attr=layers_attr,
                       fallback=fallback, enabled=enabled, backed=backed)


def stack(name: str, *, sources: Sequence[str], per_layer: PerLayer, layers_attr: str = "layers",
          fallback: str | None = None, computed: bool = False, enabled: Enabled | None = None,
          backed: bool = False) -> DerivedSpec:
    """One slice per layer, stacked along a new leading dim (e.g. the k-norm weights). Parts, as for `concat`,
    are laid out along the slice's first dim.

    `computed=True`: `per_layer` computes its slice (a new slice-sized tensor, e.g. MLA's absorbed `W_UK_T`
    from `kv_b_proj.weight`) instead of returning a view. Slices are then evaluated one at a time and only
    where written (plan: to validate the layout, result dropped; apply: computed again and copied into the
    buffer's slice), so a refresh never holds more than one slice-sized temporary. `per_layer` must be a
    deterministic function of the layer's declared `sources`: a slice whose sources were not written is not
    re-evaluated (its layout is what the last refresh validated).

    `backed=True`: as for `concat` (a stacked norm weight: every layer's `k_norm.weight` a view of its row)."""
    return DerivedSpec(name, "stack", tuple(sources), per_layer=per_layer, layers_attr=layers_attr,
                       fallback=fallback, computed=computed, enabled=enabled, backed=backed)


def alias(name: str, *, source: str, enabled: Enabled | None = None) -> DerivedSpec:
    """The buffer IS the live source tensor (e.g. the RoPE cos/sin cache); re-validated at every refresh. Being
    the source itself, it follows every write to it: after an abort without rollback it holds what the aborted
    reload wrote (the fused path is refused then), unlike the other kinds, which keep their last good values."""
    return DerivedSpec(name, "alias", (source,), enabled=enabled)


def custom(name: str, *, build: Build | None = None, depends_on: DependsOn = (),
           fallback: str | None = None, into: Into | None = None, enabled: Enabled | None = None) -> DerivedSpec:
    """Any computation from the tensors `depends_on` names. `build(backbone)` makes the cold value.

    `depends_on`: absolute names, names with `*` standing for every index of a module list
    (`"layers.*.self_attn.k_norm.weight"`: one per layer, however many the config gives), or a function of the
    backbone returning names. A class-level declaration so covers a config-dependent layer count.

    A refresh (a dependency was written) copies a new `build` result into the buffer, or, when `into` is given,
    calls `into(backbone, out)`, which must write the new value into `out` and return it: no temporary of
    buffer size. The writer is first dry-run on a fake copy of the buffer (`FakeTensorMode`: no data is read or
    written) so that a value that would not fit is refused before any buffer is written; a dry run has no
    values, so the writer may not branch on data (`.item()`, `.tolist()`, `nonzero()`, boolean masks): that
    is a `DerivedBuildError` naming the buffer (use `torch.where` and friends, or leave out `into`). One function
    can serve both: without `build`, `into(backbone, None)` makes the cold value (a torch op with `out=` does:
    `into=lambda m, out: torch.mm(m.a, m.b, out=out)`).

    With no dependencies the buffer is a constant: built once at the cold build and never rewritten afterwards,
    not even by `full=True`. `rebuild=True` (graphs released) reallocates it only if its layout changed.
    """
    if callable(depends_on):
        names: tuple[str, ...] = ()
        fn: Callable[[Any], Iterable[str]] | None = depends_on
    else:
        if isinstance(depends_on, str):
            raise TypeError(f"{name}: depends_on takes a sequence of names, not the string {depends_on!r}")
        names, fn = tuple(depends_on), None
    return DerivedSpec(name, "custom", names, build=build, fallback=fallback, into=into, enabled=enabled,
                       depends_fn=fn)


def _expand(backbone: nn.Module, pattern: str) -> list[str]:
    """`prefix.*.rest` -> one name per index of the module list at `prefix`; a name without `*` as it is."""
    if "*" not in pattern:
        return [pattern]
    prefix, star, rest = pattern.partition(".*.")
    if not star or "*" in prefix or "*" in rest:
        raise ValueError(f"dependency {pattern!r}: `*` must stand alone for the index of one module list, as in "
                         "'layers.*.self_attn.k_norm.weight'")
    return [f"{prefix}.{i}.{rest}" for i in range(len(_layers(backbone, prefix)))]


def _layers(backbone: nn.Module, attr: str) -> Sequence[nn.Module]:
    mod: object = backbone
    for part in attr.split("."):
        mod = getattr(mod, part)
    return cast("Sequence[nn.Module]", mod)  # what the declaration names: a ModuleList (a wrong name fails in use)


def resolve_tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """The live parameter or buffer called `name` (None when absent). Unlike `get_parameter` it finds both."""
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    return own_tensor(owner, leaf)


def current_buffer(backbone: nn.Module, name: str) -> torch.Tensor | None:
    """The derived buffer as registered now; None until its cold build (or while still META)."""
    t = own_buffers(backbone).get(name)
    return None if t is None or t.is_meta else t
