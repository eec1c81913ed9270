"""Which draft owns a module (`lifecycle.vllm.drafts.owners`): every layer a push processes asks, through an index
`claim` fills, and vLLM shares some modules between the engines of one process (`get_rope` caches one rotary
embedding per configuration), so a module may be claimed by several drafts, one of them gone."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn

from lifecycle.vllm.drafts.owners import claim, owner_of
from lifecycle.vllm.drafts.runtime import WORKER


class Draft:
    """What `claim` and `owner_of` read of a draft: its runtime's `owned` (a stand-in for a built draft)."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.lifecycle_runtime = SimpleNamespace(owned={})
        if enabled:
            WORKER.drafts.add(self)


@pytest.fixture
def rotary() -> Iterator[nn.Module]:
    module = nn.Module()
    yield module
    WORKER.owners.pop(module, None)


def _claim(draft: Draft, module: nn.Module, names: list[str]) -> None:
    claim(draft, module, names)  # type: ignore[arg-type]


def test_a_shared_module_belongs_to_the_draft_still_live_when_the_first_claimer_is_gone(rotary: nn.Module) -> None:
    first, second = Draft(), Draft()
    _claim(first, rotary, ["rope"])
    _claim(second, rotary, ["rope"])
    del first
    gc.collect()
    owner: Any = owner_of(rotary)
    assert owner is not None and owner[0] is second and owner[1] == ["rope"]


def test_of_two_live_claimers_the_newest_owns_it_and_a_release_hands_it_back(rotary: nn.Module) -> None:
    first, second = Draft(), Draft()
    _claim(first, rotary, ["a"])
    _claim(second, rotary, ["b"])
    assert owner_of(rotary) == (second, ["b"])
    del second.lifecycle_runtime.owned[rotary]  # `claim_structure` released it
    assert owner_of(rotary) == (first, ["a"])
    _claim(first, rotary, ["a", "c"])  # a claim again moves it last, once
    assert owner_of(rotary) == (first, ["a", "c"]) and len(WORKER.owners[rotary]) == 2


def test_a_draft_whose_enabling_did_not_finish_owns_nothing(rotary: nn.Module) -> None:
    half = Draft(enabled=False)
    _claim(half, rotary, ["rope"])
    assert owner_of(rotary) is None
    assert owner_of(nn.Module()) is None  # never claimed
