"""The core side of a frozen structure (no vLLM): a backbone with an optional submodule tracks its tensors until
the first load says whether it exists (`freeze_structure`, once, in epoch 0 before that load finished); an
absent one's tensors are then neither required, nor pinned, nor writable. The vLLM side is tested in-process and
on live engines (tests/vllm_plugin/reload/test_vllm_inprocess.py, tests/vllm_plugin/reload/test_vllm_engine.py)."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from lifecycle import DraftBackbone, IllegalTransitionError, UnknownWeightError, stack
from lifecycle.readiness import LayerReadiness
from lifecycle.states import LifecycleState


class HeadedDraft(DraftBackbone):
    """Two layers and an optional confidence head."""

    derived_buffers = (stack("_norms", sources=("norm.weight",), per_layer=lambda layer: layer.norm.weight),)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(4)}) for _ in range(2))
        self.head = nn.Linear(4, 1)
        self.requires_grad_(False)
        self.init_lifecycle("headed")


REQUIRED = [f"layers.{i}.norm.{p}" for i in range(2) for p in ("weight", "bias")]
HEAD = ["head.weight", "head.bias"]


def cold_load(draft: HeadedDraft, *, head: bool) -> None:
    lc = draft.lifecycle
    lc.weights_loaded(REQUIRED + (HEAD if head else []))
    draft.freeze_structure({"head": head}, [] if head else HEAD)
    draft.finalize_loading()
    draft.refresh_derived_buffers()


def test_an_absent_optional_module_is_untracked_unpinned_and_unwritable() -> None:
    draft = HeadedDraft()
    lc = draft.lifecycle
    assert set(HEAD) <= set(lc.specs)
    with capture_logs() as logs:
        cold_load(draft, head=False)
    (frozen,) = [e for e in logs if e["event"] == "structure_frozen"]
    assert (frozen["present"], frozen["absent"], frozen["tensors_untracked"], frozen["epoch"]) == ([], ["head"], 2, 0)
    assert frozen["layers_total"] == 2  # the head's layer is gone from the count
    assert lc.structure == {"head": False} and not set(HEAD) & set(lc.specs)
    assert lc.state is LifecycleState.DERIVED_REFRESHED
    draft.capture_graphs()
    assert not set(HEAD) & set(lc.pinned.identities)
    lc.begin_reload()
    with pytest.raises(UnknownWeightError, match=r"head\.weight"):
        lc.weights_loaded(["head.weight"])
    lc.weights_loaded(REQUIRED)  # the reload needs no head
    draft.finalize_loading()
    draft.refresh_derived_buffers()
    assert lc.state is LifecycleState.GRAPH_CAPTURED


def test_a_present_optional_module_is_required_and_pinned_like_any_tensor() -> None:
    draft = HeadedDraft()
    lc = draft.lifecycle
    cold_load(draft, head=True)
    assert lc.structure == {"head": True}
    draft.capture_graphs()
    assert set(HEAD) <= set(lc.pinned.identities)
    lc.begin_reload()
    lc.weights_loaded(REQUIRED)
    assert lc.missing() == {"head": tuple(HEAD)}  # a reload must write or keep it
    draft.weights_unchanged(HEAD)
    draft.finalize_loading()
    draft.refresh_derived_buffers()
    assert lc.state is LifecycleState.GRAPH_CAPTURED


@pytest.mark.parametrize("when", ["finished", "reload", "twice"])
def test_the_structure_is_frozen_once_in_epoch_0_before_the_load_finished(when: str) -> None:
    draft = HeadedDraft()
    lc = draft.lifecycle
    lc.weights_loaded(REQUIRED + HEAD)
    if when == "twice":
        draft.freeze_structure({"head": True}, [])
    else:
        draft.freeze_structure({"head": True}, [])
        draft.finalize_loading()
        draft.refresh_derived_buffers()
        if when == "reload":
            lc.begin_reload()
    specs, state = dict(lc.specs), lc.state
    with pytest.raises(IllegalTransitionError, match="freeze_structure"):
        draft.freeze_structure({"head": False}, HEAD)
    assert (lc.specs, lc.state, lc.structure) == (specs, state, {"head": True})  # nothing changed


def test_forgetting_tensors_rebuilds_the_layer_counts_from_what_is_loaded() -> None:
    r = LayerReadiness(["layers.0.w", "layers.0.b", "head.w", "head.b", "norm.weight"])
    r.mark_loaded(["layers.0.w", "head.w"])
    r.forget(["head.w", "head.b", "not.tracked"])
    assert (r.layers_ready, r.layers_total) == (0, 2)
    assert r.missing() == {"layers.0": ("layers.0.b",), "norm": ("norm.weight",)}
    assert r.mark_loaded(["layers.0.b", "norm.weight"]) == ["layers.0", "norm"] and r.counts_complete()
    assert r.unknown(["head.w"]) == ["head.w"] and "head.w" not in r.dirty_tensors()


def test_a_forgotten_layer_that_completed_no_longer_counts() -> None:
    r = LayerReadiness(["a.w", "b.w"])
    r.mark_loaded(["a.w"])
    assert r.layers_ready == 1
    r.forget(["a.w"])
    assert (r.layers_ready, r.layers_total) == (0, 1)
    r.mark_loaded(["b.w"])
    assert r.counts_complete()


def test_tensors_held_outside_the_backbone_are_tracked_through_slots() -> None:
    outer = nn.Linear(4, 3)  # a vLLM draft's lm_head lives on the ForCausalLM, not on the inner model

    class Inner(HeadedDraft):
        def __init__(self) -> None:
            DraftBackbone.__init__(self)
            self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(4)}) for _ in range(2))
            self.head = nn.Linear(4, 1)
            self.requires_grad_(False)
            tensors = {**dict(self.named_parameters()), "lm_head.weight": outer.weight}
            self.init_lifecycle("slots", tensors=tensors, slots={"lm_head.weight": (outer, "weight")})

    draft = Inner()
    assert draft.live_tensor("lm_head.weight") is outer.weight
    draft.lifecycle.weights_loaded([*REQUIRED, *HEAD, "lm_head.weight"])
    draft.freeze_structure({"head": True, "lm_head": True}, [])
    draft.finalize_loading()
    draft.refresh_derived_buffers()
    draft.capture_graphs()
    assert "lm_head.weight" in draft.lifecycle.pinned.identities
    with torch.no_grad():
        outer.weight = nn.Parameter(torch.zeros(3, 4))  # replaced behind the lifecycle's back
    assert draft.lifecycle.pinned_changes()
