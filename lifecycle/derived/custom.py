"""Planning `custom` buffers: built by `build` (or `into(backbone, None)`), refreshed only when a dependency was
written, in place by an `into=` writer after a dry run on fake tensors, else by copying a new `build` value; a
custom buffer without dependencies is a constant.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from ..errors import DerivedBuildError, LifecycleError
from ..torch_private import DATA_DEPENDENT_ERRORS, fake_mode  # fake tensors: the dry-run engine torch.compile uses
from ..types import dtype_name
from .buffer_plan import (
    BufferPlan,
    Problem,
    Request,
    SliceCopy,
    built,
    fmt_layout,
    owned_storages,
    same_layout,
    temporaries,
)
from .specs import DerivedSpec, current_buffer

__all__ = ["DRY_RUN_STEP", "plan_custom"]

Planned = BufferPlan | Problem
#: The step a `DerivedBuildError` names when an `into=` writer fails its dry run.
DRY_RUN_STEP = "into, dry run on fake tensors"

_fake_mode_imported = threading.Event()


def _import_fake_mode_once() -> None:
    """Make the first `FakeTensorMode` in a thread of its own. The first one imports `torch._dynamo`, and
    `torch.fx.wrap`, run by that import, keeps its own frame in a reference cycle, and with it every caller's
    frame up the stack: made from a refresh, those frames hold the backbone, so the first draft refreshed with a
    custom writer would keep all its weights until the cyclic collector ran. A thread's stack holds nothing of
    ours."""
    if not _fake_mode_imported.is_set():
        thread = threading.Thread(target=_make_fake_mode, name="reload-lifecycle: import FakeTensorMode")
        thread.start()
        thread.join()
        _fake_mode_imported.set()


def _make_fake_mode() -> None:
    with contextlib.suppress(Exception):  # a failure recurs in the dry run, where it is reported
        fake_mode()


def plan_custom(r: Request) -> Planned:
    """Built by `build`; refreshed only when a dependency was written, in place by `into` when given (dry-run
    first), else by copying a new `build` result of the same layout."""
    spec, existing = r.spec, r.existing
    live = current_buffer(r.backbone, spec.name)
    if not r.names and live is not None:
        return _plan_constant(r, live)
    if existing is not None and not r.full and not any(n in r.dirty for n in r.names):
        return BufferPlan(spec, "skipped", existing=existing)
    if existing is not None and spec.into is not None:
        problem = _dry_run_into(spec, r, existing)
        return Problem("realloc", problem) if problem else BufferPlan(spec, "in_place", existing=existing)
    bp = BufferPlan(spec, "cold")
    value = _value(bp, r)
    if existing is None:
        bp.new_tensor = value.detach().clone().contiguous()
        return bp
    if not same_layout(value, existing):
        return Problem("realloc", f"{spec.name}: new value {fmt_layout(value)} differs from the existing buffer "
                                  f"{fmt_layout(existing)}")
    bp.mode, bp.existing, bp.copies = "in_place", existing, [SliceCopy(0, 0, None, value)]
    return bp


def _plan_constant(r: Request, live: torch.Tensor) -> Planned:
    """A custom buffer without dependencies: no refresh rewrites it. An explicit rebuild (graphs released)
    replaces it only when its layout changed (a reconfigured backbone); otherwise the built value is dropped."""
    spec = r.spec
    bp = BufferPlan(spec, "skipped", existing=live)
    value = _value(bp, r) if r.allow_realloc else live
    if same_layout(value, live):
        return bp
    bp.mode, bp.existing, bp.new_tensor = "cold", None, value.detach().clone().contiguous()
    return bp


def _value(bp: BufferPlan, r: Request) -> torch.Tensor:
    """A new value from `build` (or `into(backbone, None)`); unless it is a view of the backbone's tensors, it is
    a temporary (copied into the buffer, or cloned into a new one)."""
    spec = r.spec
    value = built(spec, "build" if spec.build is not None else "into(backbone, None)", r.context, spec.build_value,
                  r.backbone)
    bp.count(temporaries([value], lambda: owned_storages(r.backbone)))
    return value


def _dry_run_into(spec: DerivedSpec, r: Request, existing: torch.Tensor) -> str:
    """Run a custom buffer's `into` writer on a fake copy of the buffer: "" when the value fits in place,
    otherwise the problem (new vs existing layout). Fake tensors carry no data: nothing is read or written. A
    writer that raises is a `DerivedBuildError` naming the buffer; one that needs values (`.item()`, a boolean
    mask) says so."""
    assert spec.into is not None
    _import_fake_mode_once()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # an out= op resizing the fake output warns; the check below reports it
        with fake_mode(allow_non_fake_inputs=True) as mode:
            out = mode.from_tensor(existing)
            result = _run_writer(spec, r, out)
            if result is out and tuple(out.shape) == tuple(existing.shape):
                return ""
            layout = f"shape {tuple(result.shape)} {dtype_name(result.dtype)} on {result.device}"
    how = "resizes" if result is out else "returns a new tensor instead of writing into"
    return f"{spec.name}: its in-place writer {how} the buffer: new value {layout}, the existing buffer is " \
           f"{fmt_layout(existing)}"


def _run_writer(spec: DerivedSpec, r: Request, out: torch.Tensor) -> torch.Tensor:
    assert spec.into is not None
    where = {"backbone": r.context.get("backbone", "?"), "state": r.context.get("state", "?")}
    try:
        result = spec.into(r.backbone, out)
    except LifecycleError:
        raise
    except DATA_DEPENDENT_ERRORS as e:
        cause = RuntimeError(
            f"the writer uses a data-dependent operation ({e}), and a dry run on fake tensors has no values: an "
            "`into=` writer may not branch on data (`.item()`, `.tolist()`, `nonzero()`, boolean masks); compute with "
            "tensor ops (`torch.where`, `torch.clamp`, ...) or declare the buffer without `into=`")
        raise DerivedBuildError(spec.name, DRY_RUN_STEP, cause, **where) from e
    except Exception as e:
        raise DerivedBuildError(spec.name, DRY_RUN_STEP, e, **where) from e
    if not isinstance(result, torch.Tensor):
        raise DerivedBuildError(spec.name, DRY_RUN_STEP, TypeError(f"returned {type(result).__name__}, not a "
                                                                   "tensor"), **where)
    return result

