"""A dropped draft frees its weights at once, whatever it went through: nothing the backbone owns refers back to it,
and no refusal leaves a reference cycle through the frames that hold it.

A cycle is freed only by Python's cyclic collector, which in a trainer's large heap runs its full collections
rarely: a trainer that rebuilds its draft would hold every earlier draft's weights (gigabytes, on the GPU too) until
then. Each test here runs with the collector off: what it frees, reference counting alone freed.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import DraftBackbone, testing
from lifecycle.loading import load_safetensors, write_checkpoint
from models import FAMILIES
from support.family_helpers import Fam

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def freed_when_dropped(make: Callable[[], DraftBackbone]) -> list[str]:
    """Build a draft with `make`, drop it: what is still alive (the module, its parameters) by reference counting
    alone. `make` runs in its own frame so nothing of it survives in this one."""
    draft = make()
    alive = [("the backbone", weakref.ref(draft))]
    alive += [(name, weakref.ref(t)) for name, t in draft.named_parameters()]
    alive += [(name, weakref.ref(t)) for name, t in draft.named_buffers() if t is not None]
    del draft
    return [name for name, ref in alive if ref() is not None]


def outcome(step: Callable[[], Any]) -> str:
    """The name of the error `step` raised ("ok" if none): the error itself is not kept (a test holding it would
    keep its frames)."""
    try:
        step()
    except Exception as e:  # the name only
        return type(e).__name__
    return "ok"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_frees_its_weights_when_dropped_after_every_step(name: str, tmp_path: Path,
                                                                      no_cyclic_gc: None) -> None:
    fam = Fam.make(name, tmp_path)

    def built() -> DraftBackbone:
        return fam.build()

    def served_after_reload_under_graphs() -> DraftBackbone:
        m = fam.cold("a")
        m.capture_graphs()
        testing.reload(m, fam.ckpt["b"], bucket_by=3, shuffle=True, seed=2)
        fam.outputs(m)
        return m

    assert freed_when_dropped(built) == []
    assert freed_when_dropped(lambda: fam.cold("a")) == []
    assert freed_when_dropped(served_after_reload_under_graphs) == []


def _refusals(fam: Fam, tmp: Path) -> dict[str, tuple[str, Callable[[DraftBackbone], None]]]:
    """Refusal paths of a loaded, refreshed draft: name -> (the error expected, what provokes it)."""
    a = fam.weights["a"]
    first = next(iter(a))
    bad_shape = write_checkpoint({**a, first: torch.zeros(3, 3)}, tmp / "bad_shape.safetensors")
    unknown = write_checkpoint({**a, "nope.weight": torch.zeros(3)}, tmp / "unknown.safetensors")
    nan = write_checkpoint({**a, first: torch.full_like(a[first], float("nan"))}, tmp / "nan.safetensors")

    def reload(path: Path, **kw: Any) -> Callable[[DraftBackbone], None]:
        def step(m: DraftBackbone) -> None:
            m.begin_reload()
            load_safetensors(m, path, **kw)
        return step

    def finish_with_a_layer_missing(m: DraftBackbone) -> None:
        testing.reload(m, fam.ckpt["b"], subset=[first], keep_untouched=False, refresh=False)

    def hook_raises(m: DraftBackbone) -> None:
        def broken(_: DraftBackbone) -> None:
            raise RuntimeError("a post-load hook failed")
        m.register_post_load_hook(broken, "reload")
        testing.reload(m, fam.ckpt["b"], refresh=False)

    def storage_moved_under_graphs(m: DraftBackbone) -> None:
        m.capture_graphs()
        testing.reload(m, fam.ckpt["b"], refresh=False)
        owner, leaf = m._tensor_slots[first]
        owner._parameters[leaf] = nn.Parameter(owner._parameters[leaf].detach().clone(), requires_grad=False)
        m.refresh_derived_buffers()

    def session_rolled_back_then_forward(m: DraftBackbone) -> None:
        try:
            with m.reload_session(rollback=True) as s:
                s.load(fam.ckpt["b"])
                raise ConnectionError("the trainer went away")
        except ConnectionError:
            pass
        m.require_usable()

    def session_verify_finds_nan(m: DraftBackbone) -> None:
        with m.reload_session(rollback=True) as s:
            s.load(nan)
            s.verify(finite=True)

    return {
        "a shape that differs": ("WeightShapeError", reload(bad_shape)),
        "a name it lacks": ("UnknownWeightError", reload(unknown)),
        "subset names absent": ("CheckpointError", reload(fam.ckpt["b"], subset=["absent.weight"])),
        "no such file": ("CheckpointError", reload(tmp / "absent.safetensors")),
        "NaN with the finite check": ("NonFiniteWeightError", reload(nan, finite_check=True)),
        "finish with a layer missing": ("LayersNotReadyError", finish_with_a_layer_missing),
        "a trigger the table refuses": ("IllegalTransitionError", lambda m: m.lifecycle.weights_loaded([first])),
        "a post-load hook that raises": ("RuntimeError", hook_raises),
        "a pinned tensor moved": ("StorageDriftError", storage_moved_under_graphs),
        "forward use while quarantined": ("QuarantinedError", session_rolled_back_then_forward),
        "a session's verify finds NaN": ("NonFiniteWeightError", session_verify_finds_nan),
    }


def test_a_draft_is_freed_when_dropped_after_any_refusal(tmp_path: Path, no_cyclic_gc: None) -> None:
    fam = Fam.make("dflash", tmp_path)
    refusals = _refusals(fam, tmp_path)
    seen: dict[str, tuple[str, list[str]]] = {}
    for what, (_, provoke) in refusals.items():
        raised: list[str] = []

        def refused(provoke: Callable[[DraftBackbone], None] = provoke, raised: list[str] = raised
                    ) -> DraftBackbone:
            m = fam.cold("a")
            raised.append(outcome(lambda: provoke(m)))
            return m

        alive = freed_when_dropped(refused)
        seen[what] = (raised[0], alive[:3])
    assert seen == {what: (expected, []) for what, (expected, _) in refusals.items()}


def test_a_lifecycle_kept_after_its_backbone_was_dropped_says_so(tmp_path: Path, no_cyclic_gc: None) -> None:
    fam = Fam.make("dflash", tmp_path)
    m = fam.cold("a")
    lc = m.lifecycle
    del m
    with pytest.raises(ReferenceError, match="meta_or_absent: the backbone this lifecycle belonged to was dropped"):
        lc.missing()


def test_the_first_dry_run_of_a_process_does_not_keep_the_draft(tmp_path: Path) -> None:
    """The first `FakeTensorMode` of a process imports torch._dynamo, whose `torch.fx.wrap` keeps the importing stack
    in a cycle: the first refresh of a custom `into=` writer must not make it from the refresh's stack. Only a fresh
    process has that first time."""
    fam = next(n for n in sorted(FAMILIES) if any(s.kind == "custom" and s.into is not None
                                                   for s in FAMILIES[n].build(FAMILIES[n].config(), device="meta")
                                                   .derived_buffers))
    script = textwrap.dedent(f"""
        import gc, sys, weakref
        from pathlib import Path
        gc.disable()
        from lifecycle.loading import write_checkpoint
        from lifecycle.testing import cold_load, reload
        from models import FAMILIES
        assert "torch._dynamo" not in sys.modules
        family = FAMILIES[{fam!r}]
        cfg = family.config()
        path = write_checkpoint(family.random_weights(cfg, 0), Path({str(tmp_path)!r}) / "a.safetensors")

        def refreshed_twice():
            m = cold_load(family.build(cfg, device="meta"), path)
            reload(m, path)  # the in-place writer's dry run in the refresh: the first FakeTensorMode
            return weakref.ref(m)

        ref = refreshed_twice()
        print("dynamo imported:", "torch._dynamo" in sys.modules, "draft alive:", ref() is not None)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "dynamo imported: True draft alive: False"
