"""Derived buffers: declared once on the backbone class, built cold once, refreshed in place ever after.

>>> class Toy(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 3, bias=False) for _ in range(2))
>>> spec = concat("fused", sources=("weight",), per_layer=lambda layer: layer.weight[1:])
>>> toy = Toy(); names = [n for n, _ in toy.named_parameters()]
>>> plan = plan_refresh(toy, [spec], tensor_specs={n: TensorSpec.of(p) for n, p in toy.named_parameters()},
...                     dirty=frozenset(names), context={"backbone": "toy", "state": "FULLY_LOADED"})
>>> report = apply_refresh(toy, plan)
>>> toy.fused.shape, report["fused"].mode, "fused" in toy.state_dict()
(torch.Size([4, 2]), 'cold', False)

Every refresh runs in two phases. `plan_refresh` validates EVERY buffer (sources ready and in the expected
layout, the new layout equal to the existing buffer's) and raises before anything is written. `apply_refresh`
then writes: a cold build allocates once; every later refresh copies into the existing storage, only the
slices whose sources were written in this epoch, and checks afterwards that no storage moved.

A `stack(..., computed=True)` slice is a real per-layer computation (it allocates a slice-sized result), so it
is evaluated lazily, one slice at a time and only for the slices that are written: at most one slice-sized
temporary lives at any moment, never a buffer-sized one.

>>> calls = []
>>> def scaled(layer):
...     calls.append(layer)
...     return layer.weight * 2.0   # a new tensor: a computation, not a view
>>> spec2 = stack("doubled", sources=("weight",), per_layer=scaled, computed=True)
>>> plan = plan_refresh(toy, [spec2], tensor_specs={n: TensorSpec.of(p) for n, p in toy.named_parameters()},
...                     dirty=frozenset(names), context={"backbone": "toy", "state": "FULLY_LOADED"})
>>> report = apply_refresh(toy, plan)
>>> toy.doubled.shape, report["doubled"].mode, len(calls)  # plan validated 2 slices, apply computed 2
(torch.Size([2, 3, 2]), 'cold', 4)

All fallible work happens in the plan: every builder runs there (`per_layer` functions, `custom` builds,
`torch.cat` / `torch.stack` of a cold build), and every copy is checked there to have equal shape, dtype and
device at both ends. So a builder that raises leaves every buffer as it was. (Two kinds compute while writing, by
design, to avoid a buffer-sized temporary: `stack(..., computed=True)` slices and `custom(..., into=)` writers; a
failure there is handled like a device fault, below.) The apply phase only registers buffers (cold build, alias)
and runs `copy_`s between those checked tensors. Should one of them raise anyway (a device fault), `apply_refresh`
raises `RefreshInterruptedError` naming every buffer it touched; the backbone records them as torn, keeps its
state (FULLY_LOADED, not usable) and rewrites them fully at the next refresh.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode  # the dry-run engine torch.compile uses

from .errors import (
    DerivedBuildError,
    LayersNotReadyError,
    LifecycleError,
    RefreshInterruptedError,
    SourceLayoutError,
    StorageDriftError,
    StorageReallocationError,
)
from .readiness import layer_of
from .storage import StorageIdentity, describe_changes
from .types import BufferReport, RefreshReport, TensorSpec

Kind = Literal["concat", "stack", "alias", "custom"]
T = TypeVar("T")
PerLayer = Callable[[nn.Module], torch.Tensor]


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

    def source_names(self, backbone: nn.Module) -> list[str]:
        """Absolute names of every tensor this buffer reads."""
        if self.kind in ("concat", "stack"):
            n = len(_layers(backbone, self.layers_attr))
            return [f"{self.layers_attr}.{i}.{s}" for i in range(n) for s in self.sources]
        return list(self.sources)


def concat(name: str, *, sources: Sequence[str], per_layer: PerLayer, dim: int = 0, layers_attr: str = "layers",
           fallback: str | None = None) -> DerivedSpec:
    """One slice per layer, concatenated along `dim` (e.g. the fused KV weight)."""
    return DerivedSpec(name, "concat", tuple(sources), per_layer=per_layer, dim=dim, layers_attr=layers_attr,
                       fallback=fallback)


def stack(name: str, *, sources: Sequence[str], per_layer: PerLayer, layers_attr: str = "layers",
          fallback: str | None = None, computed: bool = False) -> DerivedSpec:
    """One slice per layer, stacked along a new leading dim (e.g. the k-norm weights).

    `computed=True`: `per_layer` computes its slice (a new slice-sized tensor, e.g. MLA's absorbed `W_UK_T`
    from `kv_b_proj.weight`) instead of returning a view. Slices are then evaluated one at a time and only
    where written (plan: to validate the layout, result dropped; apply: computed again and copied into the
    buffer's slice), so a refresh never holds more than one slice-sized temporary. `per_layer` must be a
    deterministic function of the layer's declared `sources`: a slice whose sources were not written is not
    re-evaluated (its layout is what the last refresh validated)."""
    return DerivedSpec(name, "stack", tuple(sources), per_layer=per_layer, layers_attr=layers_attr,
                       fallback=fallback, computed=computed)


def alias(name: str, *, source: str) -> DerivedSpec:
    """The buffer IS the live source tensor (e.g. the RoPE cos/sin cache); re-validated at every refresh."""
    return DerivedSpec(name, "alias", (source,))


def custom(name: str, *, build: Callable[[nn.Module], torch.Tensor], depends_on: Sequence[str] = (),
           fallback: str | None = None,
           into: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> DerivedSpec:
    """Any computation from absolute tensor names `depends_on`. `build(backbone)` makes the cold value.

    A refresh (a dependency was written) copies a new `build` result into the buffer, or, when `into` is given,
    calls `into(backbone, out)`, which must write the new value into `out` and return it: no temporary of
    buffer size. The writer is first dry-run on a fake copy of the buffer (`FakeTensorMode`: no data is read or
    written) so that a value that would not fit is refused before any buffer is written.

    With no dependencies the buffer is a constant: built once at the cold build and never rewritten afterwards,
    not even by `full=True`. `rebuild=True` (graphs released) reallocates it only if its layout changed.
    """
    return DerivedSpec(name, "custom", tuple(depends_on), build=build, fallback=fallback, into=into)


# ---- plan ----------------------------------------------------------------------------------------------------


@dataclass
class _BufferPlan:
    spec: DerivedSpec
    mode: str
    existing: torch.Tensor | None = None
    new_tensor: torch.Tensor | None = None  # cold build result or alias target
    # (start, length, src) along dim; src None: a computed stack slice, evaluated at apply time
    copies: list[tuple[int, int, torch.Tensor | None]] = field(default_factory=list)
    slices_total: int = 0
    # a computed stack's cold build: (slice shape, dtype, device); the buffer is allocated once, filled per slice
    cold_layout: tuple[tuple[int, ...], torch.dtype, torch.device] | None = None
    reason: str = ""


@dataclass
class RefreshPlan:
    buffers: list[_BufferPlan]
    context: dict[str, str]


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


def _fmt_layout(t: torch.Tensor | StorageIdentity) -> str:
    ident = t if isinstance(t, StorageIdentity) else StorageIdentity.of(t)
    return f"shape {ident.shape} stride {ident.stride} {_dtype(ident.dtype)} on {ident.device}"


@dataclass
class _SourceCheck:
    """Sorts what is wrong with sources: not ready (absent or META) vs not in the builder's layout."""

    resolve: Callable[[str], torch.Tensor | None]
    tensor_specs: Mapping[str, TensorSpec]
    not_ready: dict[str, list[str]] = field(default_factory=dict)
    layout: list[str] = field(default_factory=list)

    def check(self, label: str, names: Sequence[str], fallback: str | None) -> tuple[bool, str]:
        """(usable, fallback reason). Unready sources are recorded and never routed to a fallback."""
        wrong = []
        ready = True
        for name in names:
            t = self.resolve(name)
            if t is None or t.is_meta:
                self.not_ready.setdefault(layer_of(name), []).append(f"{name} ({'absent' if t is None else 'META'})")
                ready = False
                continue
            spec = self.tensor_specs.get(name)
            if spec is not None and (tuple(t.shape) != spec.shape or t.dtype != spec.dtype):
                wrong.append(f"{name}: source has layout {tuple(t.shape)} {_dtype(t.dtype)} but the builder "
                             f"expects the checkpoint layout {spec.shape} {_dtype(spec.dtype)} "
                             "(emptied or packed by post-processing?)")
        if not ready:
            return False, ""
        if wrong and not fallback:
            self.layout.extend(f"{label} <- {w}" for w in wrong)
            return False, ""
        return not wrong, "; ".join(wrong)


def _built(spec: DerivedSpec, step: str, context: Mapping[str, str], fn: Callable[[T], torch.Tensor], arg: T
           ) -> torch.Tensor:
    """Run one builder step of the plan; an exception in it becomes a DerivedBuildError naming the buffer and
    the step (nothing was written: builders only run in the plan)."""
    try:
        out = fn(arg)
    except LifecycleError:
        raise
    except Exception as e:
        raise DerivedBuildError(spec.name, step, e, backbone=context.get("backbone", "?"),
                                state=context.get("state", "?")) from e
    if not isinstance(out, torch.Tensor):
        raise DerivedBuildError(spec.name, step, TypeError(f"returned {type(out).__name__}, not a tensor"),
                                backbone=context.get("backbone", "?"), state=context.get("state", "?"))
    return out


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def plan_refresh(
    backbone: nn.Module,
    specs: Sequence[DerivedSpec],
    *,
    tensor_specs: Mapping[str, TensorSpec],
    dirty: frozenset[str],
    context: Mapping[str, str],
    full: bool = False,
    pinned: bool = False,
    allow_realloc: bool = False,
    resolve: Callable[[str], torch.Tensor | None] | None = None,
) -> RefreshPlan:
    """Validate every buffer and decide every write. Raises before anything is written.

    `dirty`: tensors written in this epoch; only slices that read them are rewritten (all when `full`).
    `pinned`: graphs are captured, so an alias may not be re-pointed at a source that moved.
    `allow_realloc`: an explicit cold rebuild (graphs released): existing buffers may be replaced.
    `resolve`: name -> live tensor (default: walk the module tree).
    Raises LayersNotReadyError (a source absent or on META), SourceLayoutError, StorageReallocationError.
    """
    sources = _SourceCheck(resolve or partial(resolve_tensor, backbone), tensor_specs)
    realloc_problems: list[str] = []
    plans: list[_BufferPlan] = []
    for spec in specs:
        existing = None if allow_realloc else current_buffer(backbone, spec.name)
        names = spec.source_names(backbone)
        usable, fallback_reason = sources.check(f"{spec.kind} {spec.name}", names, spec.fallback)
        if fallback_reason:
            plans.append(_BufferPlan(spec, "fallback", existing=existing, reason=fallback_reason))
        if not usable:
            continue

        if spec.kind == "alias":
            target = sources.resolve(names[0])
            assert target is not None
            if pinned and existing is not None and existing is not target:
                old, new = StorageIdentity.of(existing), StorageIdentity.of(target)
                if old != new:
                    realloc_problems.append(
                        f"alias {spec.name}: its source {names[0]} moved, re-pointing would change: "
                        + "; ".join(describe_changes(spec.name, old, new)))
                    continue
            plans.append(_BufferPlan(spec, "alias", existing=existing, new_tensor=target))
            continue

        if spec.kind == "custom":
            live = current_buffer(backbone, spec.name)
            if not names and live is not None:
                # a constant: no refresh rewrites it. An explicit rebuild (graphs released) replaces it only when
                # its layout changed (a reconfigured backbone); otherwise the built value is dropped.
                value = spec.build(backbone) if allow_realloc and spec.build is not None else live
                if _same_layout(value, live):
                    plans.append(_BufferPlan(spec, "skipped", existing=live))
                else:
                    plans.append(_BufferPlan(spec, "cold", new_tensor=value.detach().clone().contiguous()))
                continue
            if existing is not None and not full and not any(n in dirty for n in names):
                plans.append(_BufferPlan(spec, "skipped", existing=existing))
                continue
            assert spec.build is not None
            if existing is not None and spec.into is not None:
                problem = _dry_run_into(spec, backbone, existing)
                if problem:
                    realloc_problems.append(problem)
                else:
                    plans.append(_BufferPlan(spec, "in_place", existing=existing))
                continue
            value = _built(spec, "build", context, spec.build, backbone)
            if existing is None:
                plans.append(_BufferPlan(spec, "cold", new_tensor=value.detach().clone().contiguous()))
            elif not _same_layout(value, existing):
                realloc_problems.append(
                    f"{spec.name}: new value {_fmt_layout(value)} differs from the existing buffer "
                    f"{_fmt_layout(existing)}")
            else:
                plans.append(_BufferPlan(spec, "in_place", existing=existing, copies=[(0, 0, value)]))
            continue

        assert spec.per_layer is not None
        layers = _layers(backbone, spec.layers_attr)
        if spec.computed:
            problem = _plan_computed_stack(spec, layers, existing, dirty, full, plans, context)
            if problem:
                (sources.layout if problem[0] == "layout" else realloc_problems).append(problem[1])
            continue

        # concat / stack: one slice per layer
        slices = [_built(spec, f"per_layer for {spec.layers_attr}.{i}", context, spec.per_layer, layer)
                  for i, layer in enumerate(layers)]
        shapes = {tuple(s.shape) for s in slices}
        dtypes = {s.dtype for s in slices}
        if len(dtypes) > 1 or len({s.device for s in slices}) > 1 or (spec.kind == "stack" and len(shapes) > 1) or (
            spec.kind == "concat" and len({sh[:spec.dim] + sh[spec.dim + 1:] for sh in shapes}) > 1
        ):
            sources.layout.append(f"{spec.kind} {spec.name}: per-layer slices disagree: shapes "
                                   f"{sorted(shapes)}, dtypes {sorted(map(_dtype, dtypes))}, devices "
                                   f"{sorted({str(s.device) for s in slices})}")
            continue
        if spec.kind == "stack":
            lengths = [1] * len(slices)
            new_shape = (len(slices), *slices[0].shape)
            dim = 0
        else:
            dim = spec.dim
            lengths = [s.shape[dim] for s in slices]
            new_shape = tuple(sum(lengths) if d == dim else n for d, n in enumerate(slices[0].shape))
        if existing is None:
            join = torch.stack if spec.kind == "stack" else partial(torch.cat, dim=dim)
            built = _built(spec, spec.kind, context, join, slices)
            plans.append(_BufferPlan(spec, "cold", new_tensor=built.contiguous(), slices_total=len(slices)))
            continue
        if (new_shape != tuple(existing.shape) or slices[0].dtype != existing.dtype
                or slices[0].device != existing.device or not existing.is_contiguous()):
            realloc_problems.append(
                f"{spec.name}: a rebuild would have shape {new_shape} {_dtype(slices[0].dtype)} on "
                f"{slices[0].device}, the existing buffer is {_fmt_layout(existing)}")
            continue
        copies = []
        start = 0
        for i, (src, length) in enumerate(zip(slices, lengths, strict=True)):
            if full or any(f"{spec.layers_attr}.{i}.{s}" in dirty for s in spec.sources):
                copies.append((start, length, src))
            start += length
        plans.append(_BufferPlan(spec, "in_place" if copies else "skipped", existing=existing, copies=copies,
                                 slices_total=len(slices)))

    ctx = dict(context)
    if sources.not_ready:
        raise LayersNotReadyError("derived-buffer build", sources.not_ready, backbone=ctx.get("backbone", "?"),
                                  state=ctx.get("state", "?"))
    if sources.layout:
        raise SourceLayoutError(sources.layout, backbone=ctx.get("backbone", "?"), state=ctx.get("state", "?"))
    if realloc_problems:
        raise StorageReallocationError(realloc_problems, backbone=ctx.get("backbone", "?"),
                                       state=ctx.get("state", "?"))
    return RefreshPlan(plans, ctx)


def _plan_computed_stack(spec: DerivedSpec, layers: Sequence[nn.Module], existing: torch.Tensor | None,
                         dirty: frozenset[str], full: bool, plans: list[_BufferPlan],
                         context: Mapping[str, str]) -> tuple[str, str] | None:
    """Plan a `stack(..., computed=True)`: evaluate only the slices that will be written, one at a time, and keep
    their layout, not their values. Returns ("layout" | "realloc", problem) or None (a plan was appended)."""
    assert spec.per_layer is not None
    n = len(layers)
    written = [i for i in range(n) if existing is None or full
               or any(f"{spec.layers_attr}.{i}.{s}" in dirty for s in spec.sources)]
    layouts: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[int]] = {}
    for i in written:
        value = _built(spec, f"per_layer for {spec.layers_attr}.{i}", context, spec.per_layer, layers[i])
        layouts.setdefault((tuple(value.shape), value.dtype, value.device), []).append(i)
        del value  # a slice-sized temporary; the apply phase computes it again right before its copy
    if len(layouts) > 1:
        return "layout", (f"stack {spec.name}: computed per-layer slices disagree: "
                          + "; ".join(f"layers {ix}: {sh} {_dtype(dt)} on {dev}"
                                      for (sh, dt, dev), ix in layouts.items()))
    if existing is None:
        ((layout, _),) = layouts.items()
        plans.append(_BufferPlan(spec, "cold", cold_layout=layout, slices_total=n))
        return None
    if layouts:
        (((shape, dt, dev), _),) = layouts.items()
        if ((n, *shape) != tuple(existing.shape) or dt != existing.dtype or dev != existing.device
                or not existing.is_contiguous()):
            return "realloc", (f"{spec.name}: a rebuild would have shape {(n, *shape)} {_dtype(dt)} on {dev}, "
                               f"the existing buffer is {_fmt_layout(existing)}")
    copies: list[tuple[int, int, torch.Tensor | None]] = [(i, 1, None) for i in written]
    plans.append(_BufferPlan(spec, "in_place" if copies else "skipped", existing=existing, copies=copies,
                             slices_total=n))
    return None
def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (tuple(a.shape), a.dtype, a.device) == (tuple(b.shape), b.dtype, b.device)


def _dry_run_into(spec: DerivedSpec, backbone: nn.Module, existing: torch.Tensor) -> str:
    """Run a custom buffer's `into` writer on a fake copy of the buffer: "" when the value fits in place,
    otherwise the problem (new vs existing layout). Fake tensors carry no data: nothing is read or written."""
    assert spec.into is not None
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # an out= op resizing the fake output warns; the check below reports it
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            out = mode.from_tensor(existing)
            result = spec.into(backbone, out)
            if result is out and tuple(out.shape) == tuple(existing.shape):
                return ""
            layout = f"shape {tuple(result.shape)} {_dtype(result.dtype)} on {result.device}"
    how = "resizes" if result is out else "returns a new tensor instead of writing into"
    return f"{spec.name}: its in-place writer {how} the buffer: new value {layout}, the existing buffer is " \
           f"{_fmt_layout(existing)}"


# ---- apply ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def apply_refresh(backbone: nn.Module, plan: RefreshPlan) -> RefreshReport:
    """Carry out a validated plan. Cold builds register new non-persistent buffers; everything else is a
    `copy_` into existing storage, verified afterwards."""
    t0 = time.perf_counter()
    report = RefreshReport()
    before: dict[str, StorageIdentity] = {}
    touched: list[str] = []
    for bp in plan.buffers:
        if bp.mode in ("cold", "alias", "in_place"):
            touched.append(bp.spec.name)
        try:
            _apply_one(backbone, bp, report, before)
        except Exception as e:
            raise RefreshInterruptedError(bp.spec.name, touched, e, backbone=plan.context.get("backbone", "?"),
                                          state=plan.context.get("state", "?")) from e

    drift = [
        line
        for name, old in before.items()
        for line in describe_changes(name, old, StorageIdentity.of(backbone._buffers[name]))  # type: ignore[arg-type]
    ]
    if drift:
        raise StorageDriftError(drift, backbone=plan.context.get("backbone", "?"),
                                state=plan.context.get("state", "?"))
    report.duration_ms = (time.perf_counter() - t0) * 1e3
    return report


def _build_computed_stack(backbone: nn.Module, spec: DerivedSpec,
                          layout: tuple[tuple[int, ...], torch.dtype, torch.device]) -> torch.Tensor:
    """The cold build of a computed stack: the buffer is allocated once and filled slice by slice (never a
    `torch.stack` of L computed temporaries)."""
    assert spec.per_layer is not None
    layers = _layers(backbone, spec.layers_attr)
    shape, dtype, device = layout
    buf = torch.empty((len(layers), *shape), dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        buf[i].copy_(spec.per_layer(layer))
    return buf


def _apply_one(backbone: nn.Module, bp: _BufferPlan, report: RefreshReport,
               before: dict[str, StorageIdentity]) -> None:
    spec = bp.spec
    rep = BufferReport(spec.name, spec.kind, bp.mode, slices_total=bp.slices_total, reason=bp.reason)
    if bp.mode == "cold" and bp.cold_layout is not None:
        bp.new_tensor = _build_computed_stack(backbone, spec, bp.cold_layout)
    if bp.mode in ("cold", "alias"):
        assert bp.new_tensor is not None
        if bp.mode == "cold":
            rep.elements_written = bp.new_tensor.numel()
            rep.slices_written = bp.slices_total
        backbone.register_buffer(spec.name, bp.new_tensor, persistent=False)
    elif bp.mode == "in_place":
        buf = bp.existing
        assert buf is not None
        before[spec.name] = StorageIdentity.of(buf)
        layers = _layers(backbone, spec.layers_attr) if spec.computed else ()
        if spec.kind == "custom" and spec.into is not None:
            spec.into(backbone, buf)
            rep.elements_written = buf.numel()
        for start, length, src in bp.copies:
            if src is None:  # a computed slice: evaluated now, copied, dropped
                assert spec.per_layer is not None
                src = spec.per_layer(layers[start])
            if spec.kind == "custom":
                dst = buf
            elif spec.kind == "stack":
                dst = buf[start]
            else:
                dst = buf.narrow(spec.dim, start, length)
            dst.copy_(src)
            rep.elements_written += dst.numel()
        rep.slices_written = len(bp.copies) if spec.kind != "custom" else 0
    live = current_buffer(backbone, spec.name)
    if live is not None:
        rep.nbytes = live.numel() * live.element_size()
        rep.data_ptr = live.data_ptr()
    report.buffers.append(rep)
