"""`custom` derived buffers: refreshed when a dependency was written, in place; an `into=` writer refreshes without
a buffer-size temporary and is dry-run first; a buffer with no dependencies is a constant, built exactly once."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lifecycle import DraftBackbone, LifecycleState, StorageIdentity, StorageReallocationError, custom
from lifecycle.storage import count_allocations
from lifecycle.types import TensorSpec

S = LifecycleState
N = 256  # elements of the head: buffers of 1 KiB, far above any bookkeeping allocation


def _scaled_into(m: nn.Module, out: torch.Tensor) -> torch.Tensor:
    return torch.mul(m.head.weight, 2.0, out=out)


class CustomDraft(DraftBackbone):
    derived_buffers = (
        custom("_copied", build=lambda m: m.head.weight * 2.0, depends_on=("head.weight",)),
        custom("_written", build=lambda m: m.head.weight * 2.0, into=_scaled_into, depends_on=("head.weight",)),
        custom("_const", build=lambda m: torch.full((m.const_size,), 7.0), depends_on=()),
    )

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(N, 1, bias=False)  # weight [1, N]
        self.other = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.const_size = N  # configuration, not a weight: what the constant's layout follows
        self.requires_grad_(False)
        self.init_lifecycle("custom-toy")

    def write(self, values: dict[str, float]) -> None:
        self.lifecycle.ensure_loading_allowed()
        for n, v in values.items():
            self.get_parameter(n).fill_(v)
        self.lifecycle.weights_loaded(list(values))


def loaded() -> CustomDraft:
    m = CustomDraft()
    m.write({"head.weight": 1.0, "other": 0.0})
    m.finalize_loading()
    report = m.refresh_derived_buffers()
    assert [b.mode for b in report.buffers] == ["cold", "cold", "cold"]
    return m


def reload(m: CustomDraft, values: dict[str, float]) -> None:
    m.begin_reload()
    m.write(values)
    m.finalize_loading(keep_untouched=True)


def test_dependency_written_refreshes_in_place_untouched_is_skipped() -> None:
    m = loaded()
    ids = {n: StorageIdentity.of(getattr(m, n)) for n in ("_copied", "_written")}
    reload(m, {"other": 5.0})
    report = m.refresh_derived_buffers()
    assert (report["_copied"].mode, report["_written"].mode) == ("skipped", "skipped")
    assert report.elements_written == 0

    reload(m, {"head.weight": 3.0})
    report = m.refresh_derived_buffers()
    for name in ("_copied", "_written"):
        assert report[name].mode == "in_place" and report[name].elements_written == N
        assert torch.equal(getattr(m, name), torch.full((1, N), 6.0))
        assert StorageIdentity.of(getattr(m, name)) == ids[name]

    reload(m, {"other": 1.0})
    report = m.refresh_derived_buffers(full=True)
    assert report["_copied"].elements_written == report["_written"].elements_written == N


def test_into_writer_refreshes_without_a_buffer_size_temporary() -> None:
    m = loaded()
    nbytes = m._written.numel() * m._written.element_size()
    reload(m, {"head.weight": 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dry run's fake tensors must not reach the counter (data_ptr warning)
        with count_allocations() as log:
            report = m.refresh_derived_buffers()
    assert report["_written"].mode == report["_copied"].mode == "in_place"
    # `_copied` computes its value first: exactly one buffer-size temporary, and the counter sees it
    big = log.at_least(nbytes)
    assert len(big) == 1, log.records
    # without it, the `into` writer alone allocates nothing of buffer size
    m.derived_buffers = tuple(s for s in CustomDraft.derived_buffers if s.name != "_copied")
    reload(m, {"head.weight": 4.0})
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert report["_written"].elements_written == N
    assert log.at_least(nbytes) == [], log.records
    assert torch.equal(m._written, torch.full((1, N), 8.0))


@pytest.mark.parametrize("writer", ["resizes", "returns-new"])
def test_into_writer_that_would_not_fit_is_refused_before_any_write(writer: str) -> None:
    m = loaded()
    if writer == "returns-new":
        bad = custom("_written", build=lambda m: m.head.weight * 2.0, depends_on=("head.weight",),
                     into=lambda m, out: m.head.weight * 2.0)
        m.derived_buffers = (CustomDraft.derived_buffers[0], bad, CustomDraft.derived_buffers[2])
    before = {n: (getattr(m, n), getattr(m, n).clone()) for n in ("_copied", "_written", "_const")}
    m.begin_reload()
    if writer == "resizes":  # the head grows (a declared new layout): the writer's out= op would resize the buffer
        m.head._parameters["weight"] = nn.Parameter(torch.ones(1, 2 * N), requires_grad=False)
        m.lifecycle.specs["head.weight"] = TensorSpec((1, 2 * N), torch.float32)
    m.write({"head.weight": 9.0})
    m.finalize_loading(keep_untouched=True)
    with pytest.raises(StorageReallocationError) as ei:
        m.refresh_derived_buffers()
    problems = "\n".join(ei.value.problems)
    assert f"_written: its in-place writer {writer.replace('-new', ' a new tensor')}" in problems
    if writer == "resizes":
        assert "(1, 512)" in problems and "shape (1, 256)" in problems
        assert "_copied: new value" in problems  # the build-and-copy path is refused for the same reason
    assert m.lifecycle.state is S.FINALIZED
    for n, (obj, values) in before.items():
        assert getattr(m, n) is obj and torch.equal(obj, values), f"{n} was written by a refused refresh"


def test_constant_is_built_once_and_never_rewritten_or_reallocated() -> None:
    m = loaded()
    const = m._const
    ptr = const.data_ptr()
    assert torch.equal(const, torch.full((N,), 7.0))
    const.fill_(-1.0)  # a sentinel: any rewrite would restore 7.0
    for full in (False, True):
        reload(m, {"head.weight": 2.0, "other": 2.0})
        report = m.refresh_derived_buffers(full=full)
        assert report["_const"].mode == "skipped" and report["_const"].elements_written == 0
    m.capture_graphs()
    reload(m, {"head.weight": 3.0})
    m.refresh_derived_buffers(full=True)
    assert m.lifecycle.state is S.GRAPH_CAPTURED
    m.release_graphs()
    reload(m, {"head.weight": 4.0})
    report = m.refresh_derived_buffers(rebuild=True)  # every other buffer gets new storage; the constant does not
    assert report["_copied"].mode == "cold" and report["_const"].mode == "skipped"
    assert m._const is const and const.data_ptr() == ptr
    assert bool((const == -1.0).all())
    # a reconfigured backbone: only an explicit rebuild gives the constant its new layout (and new values)
    m.const_size = 2 * N
    reload(m, {"head.weight": 5.0})
    assert m.refresh_derived_buffers()["_const"].mode == "skipped"
    assert m._const is const
    reload(m, {"head.weight": 6.0})
    report = m.refresh_derived_buffers(rebuild=True)
    assert report["_const"].mode == "cold" and report["_const"].elements_written == 2 * N
    assert m._const is not const and torch.equal(m._const, torch.full((2 * N,), 7.0))


def _raising_into(m: nn.Module, out: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("scale table missing")


def _data_dependent_into(m: nn.Module, out: torch.Tensor) -> torch.Tensor:
    scale = m.head.weight.abs().max().item()  # fine on real tensors, no value in a dry run on fake ones
    return torch.mul(m.head.weight, 2.0 / scale, out=out)


@pytest.mark.parametrize(("writer", "says"), [(_raising_into, "RuntimeError: scale table missing"),
                                              (_data_dependent_into, "data-dependent")],
                         ids=["raises", "item"])
def test_a_failing_into_writer_is_a_derived_build_error_naming_the_buffer(writer, says: str) -> None:
    """Issue 14, defect 4. The old code let the dry run's exception escape: a bare `RuntimeError` from a writer
    that raises, a `DataDependentOutputException` from one that calls `.item()`; neither a `LifecycleError` nor
    naming the buffer. Both are now a `DerivedBuildError` naming the buffer and the dry run (the second saying
    that a dry run has no data), before any buffer is written."""
    from lifecycle.errors import DerivedBuildError

    m = loaded()
    m.derived_buffers = (CustomDraft.derived_buffers[0],
                         custom("_written", build=lambda m: m.head.weight * 2.0, into=writer,
                                depends_on=("head.weight",)),
                         CustomDraft.derived_buffers[2])
    before = {n: (getattr(m, n), getattr(m, n).clone()) for n in ("_copied", "_written", "_const")}
    reload(m, {"head.weight": 3.0})
    with pytest.raises(DerivedBuildError) as ei:
        m.refresh_derived_buffers()
    assert ei.value.buffer == "_written" and "dry run" in ei.value.step
    assert says in str(ei.value)
    assert m.lifecycle.can("refresh_derived") and not m.lifecycle.usable
    for n, (obj, values) in before.items():
        assert getattr(m, n) is obj and torch.equal(obj, values), f"{n} was written by a refused refresh"


# ---- depends_on for a config-dependent layer count; one function for build and into (issue 14, friction 3) ------


class LayeredDraft(DraftBackbone):
    """A class-level declaration whose dependencies follow the config's layer count."""

    derived_buffers = (
        # `*`: every layer's gate, however many; `into` alone builds (out=None) and refreshes (out=buffer)
        custom("_gates", depends_on=("layers.*.weight",),
               into=lambda m, out: torch.cat([layer.weight for layer in m.layers], out=out)),
        # a function of the backbone: the last layer's weight and the head, whatever the count
        custom("_last_plus_head", depends_on=lambda m: [f"layers.{len(m.layers) - 1}.weight", "head"],
               build=lambda m: m.layers[-1].weight + m.head),
    )

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 1, bias=False) for _ in range(num_layers))  # weight [1, 4]
        self.head = nn.Parameter(torch.zeros(1, 4))
        self.requires_grad_(False)
        self.init_lifecycle(f"layered-{num_layers}")

    def write(self, values: dict[str, float]) -> None:
        self.lifecycle.ensure_loading_allowed()
        for n, v in values.items():
            self.get_parameter(n).fill_(v)
        self.lifecycle.weights_loaded(list(values))


@pytest.mark.parametrize("num_layers", [2, 5])
def test_star_and_callable_dependencies_follow_the_layer_count(num_layers: int) -> None:
    m = LayeredDraft(num_layers)
    gates, last = m.derived_buffers
    assert gates.source_names(m) == [f"layers.{i}.weight" for i in range(num_layers)]
    assert last.source_names(m) == [f"layers.{num_layers - 1}.weight", "head"]
    m.write({n: float(i) for i, n in enumerate(m.lifecycle.specs)})
    m.finalize_loading()
    report = m.refresh_derived_buffers()
    assert report["_gates"].mode == "cold" and m._gates.shape == (num_layers, 4)
    assert torch.equal(m._gates, torch.cat([layer.weight for layer in m.layers]))
    ptr = m._gates.data_ptr()

    # the first layer's weight is a dependency of `_gates` only
    m.begin_reload()
    m.write({"layers.0.weight": 9.0})
    m.finalize_loading(keep_untouched=True)
    with count_allocations() as log:
        report = m.refresh_derived_buffers()
    assert (report["_gates"].mode, report["_last_plus_head"].mode) == ("in_place", "skipped")
    assert m._gates.data_ptr() == ptr and bool((m._gates[0] == 9.0).all())
    assert log.storages_created == 0 and report.temporaries == 0  # torch.cat(out=) wrote into the buffer

    # the last layer's weight: both
    m.begin_reload()
    m.write({f"layers.{num_layers - 1}.weight": 4.0})
    m.finalize_loading(keep_untouched=True)
    report = m.refresh_derived_buffers()
    assert (report["_gates"].mode, report["_last_plus_head"].mode) == ("in_place", "in_place")
    assert torch.equal(m._last_plus_head, m.layers[-1].weight + m.head)
    assert report["_last_plus_head"].temporaries == 1  # the new value, copied into the buffer


def test_declared_dependencies_a_backbone_lacks_are_refused_at_construction() -> None:
    class Typo(LayeredDraft):
        derived_buffers = (custom("_gates", depends_on=("layers.*.wieght",), build=lambda m: m.head * 1.0),)

    with pytest.raises(ValueError, match=r"_gates <- layers\.0\.wieght, layers\.1\.wieght"):
        Typo(2)

    class BadPattern(LayeredDraft):
        derived_buffers = (custom("_gates", depends_on=("layers*.weight",), build=lambda m: m.head * 1.0),)

    with pytest.raises(ValueError, match="must stand alone"):
        BadPattern(2)
    with pytest.raises(TypeError, match="a sequence of names, not the string"):
        custom("_x", depends_on="head", build=lambda m: m.head)
    with pytest.raises(ValueError, match="custom needs build=, into=, or both"):
        custom("_x", depends_on=("head",))
