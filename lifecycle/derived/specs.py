"""Derived-buffer declarations: `concat`, `stack`, `alias`, `custom`, and how a spec finds its tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from torch import nn

__all__ = ["DerivedSpec", "Kind", "PerLayer", "alias", "concat", "current_buffer", "custom", "resolve_tensor", "stack"]

Kind = Literal["concat", "stack", "alias", "custom"]
T = TypeVar("T")
PerLayer = Callable[[nn.Module], torch.Tensor]
Enabled = Callable[[nn.Module], bool]


@dataclass(frozen=True)
class DerivedSpec:
    """A derived buffer declaration. Build it with `concat`, `stack`, `alias` or `custom`.

    `sources`: for concat/stack, tensor names relative to each layer (`self_attn.k_norm.weight`); for alias,
    the one absolute tensor name it points at; for custom, the absolute names it depends on.
    `fallback`: when set, a source in the wrong layout disables the buffer (its last values stay, the model
    takes the named fallback path) instead of refusing the refresh. Never silent: the report and the audit
    event say so.
    `into`: custom only, an in-place writer `into(backbone, out) -> out` that a refresh uses instead of `build`
    (so no temporary the size of the buffer is created).
    `enabled`: a predicate on the backbone, evaluated once by `init_lifecycle`; a buffer it rejects is not
    registered, built or refreshed on that backbone (a head the config leaves out). None: always enabled.
    """

    name: str
    kind: Kind
    sources: tuple[str, ...]
    per_layer: PerLayer | None = None
    build: Callable[[nn.Module], torch.Tensor] | None = None
    dim: int = 0
    layers_attr: str = "layers"
    fallback: str | None = None
    computed: bool = False

    def __post_init__(self) -> None:
        if self.computed and self.kind != "stack":
            raise ValueError(f"{self.name}: computed=True is only supported for stack specs (got {self.kind})")
    into: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    enabled: Enabled | None = None

    def is_enabled(self, backbone: nn.Module) -> bool:
        """Whether this backbone has the buffer (`enabled`, when given, decides from its config or modules)."""
        return self.enabled is None or bool(self.enabled(backbone))

    def source_names(self, backbone: nn.Module) -> list[str]:
        """Absolute names of every tensor this buffer reads."""
        if self.kind in ("concat", "stack"):
            n = len(_layers(backbone, self.layers_attr))
            return [f"{self.layers_attr}.{i}.{s}" for i in range(n) for s in self.sources]
        return list(self.sources)


def concat(name: str, *, sources: Sequence[str], per_layer: PerLayer, dim: int = 0, layers_attr: str = "layers",
           fallback: str | None = None, enabled: Enabled | None = None) -> DerivedSpec:
    """One slice per layer, concatenated along `dim` (e.g. the fused KV weight)."""
    return DerivedSpec(name, "concat", tuple(sources), per_layer=per_layer, dim=dim, layers_attr=layers_attr,
                       fallback=fallback, enabled=enabled)


def stack(name: str, *, sources: Sequence[str], per_layer: PerLayer, layers_attr: str = "layers",
          fallback: str | None = None, computed: bool = False, enabled: Enabled | None = None) -> DerivedSpec:
    """One slice per layer, stacked along a new leading dim (e.g. the k-norm weights).

    `computed=True`: `per_layer` computes its slice (a new slice-sized tensor, e.g. MLA's absorbed `W_UK_T`
    from `kv_b_proj.weight`) instead of returning a view. Slices are then evaluated one at a time and only
    where written (plan: to validate the layout, result dropped; apply: computed again and copied into the
    buffer's slice), so a refresh never holds more than one slice-sized temporary. `per_layer` must be a
    deterministic function of the layer's declared `sources`: a slice whose sources were not written is not
    re-evaluated (its layout is what the last refresh validated)."""
    return DerivedSpec(name, "stack", tuple(sources), per_layer=per_layer, layers_attr=layers_attr,
                       fallback=fallback, computed=computed, enabled=enabled)


def alias(name: str, *, source: str, enabled: Enabled | None = None) -> DerivedSpec:
    """The buffer IS the live source tensor (e.g. the RoPE cos/sin cache); re-validated at every refresh."""
    return DerivedSpec(name, "alias", (source,), enabled=enabled)


def custom(name: str, *, build: Callable[[nn.Module], torch.Tensor], depends_on: Sequence[str] = (),
           fallback: str | None = None,
           into: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
           enabled: Enabled | None = None) -> DerivedSpec:
    """Any computation from absolute tensor names `depends_on`. `build(backbone)` makes the cold value.

    A refresh (a dependency was written) copies a new `build` result into the buffer, or, when `into` is given,
    calls `into(backbone, out)`, which must write the new value into `out` and return it: no temporary of
    buffer size. The writer is first dry-run on a fake copy of the buffer (`FakeTensorMode`: no data is read or
    written) so that a value that would not fit is refused before any buffer is written.

    With no dependencies the buffer is a constant: built once at the cold build and never rewritten afterwards,
    not even by `full=True`. `rebuild=True` (graphs released) reallocates it only if its layout changed.
    """
    return DerivedSpec(name, "custom", tuple(depends_on), build=build, fallback=fallback, into=into,
                       enabled=enabled)


def _layers(backbone: nn.Module, attr: str) -> Sequence[nn.Module]:
    mod: object = backbone
    for part in attr.split("."):
        mod = getattr(mod, part)
    return mod  # type: ignore[return-value]


def resolve_tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """The live parameter or buffer called `name` (None when absent). Unlike `get_parameter` it finds both."""
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    t = owner._parameters.get(leaf)
    if t is None:
        t = owner._buffers.get(leaf)
    return t


def current_buffer(backbone: nn.Module, name: str) -> torch.Tensor | None:
    """The derived buffer as registered now; None until its cold build (or while still META)."""
    t = backbone._buffers.get(name)
    return None if t is None or t.is_meta else t
