"""The push book of the front process (lifecycle/vllm/observability/push_book.py; issue 32, items 8 and 9), two API
servers played by two books on one folder (what vLLM's multiprocess metrics folder is to them), every interleaving of
a push's calls between them: each push is counted once, by the server that sees it end, with its kind and from its
start; a chunk or finish with no push open is a stray call; a start ends an open push as abandoned, once. The live
servers' side is test_vllm_online_metrics*.py; the counts here go to a stand-in for the Prometheus families (the
process's registry is the in-process vLLM tests')."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lifecycle.vllm.observability import push_book
from lifecycle.vllm.observability.push_book import PushBook

STEPS = [("start_draft_weight_update", "draft", "start"), ("update_weights", "", "update"),
         ("finish_weight_update", "", "finish")]


class Family:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, ...]] = Counter()
        self.observed: list[tuple[tuple[str, ...], float]] = []

    def labels(self, *labels: str) -> Any:
        family = self

        class Child:
            def inc(self, n: float = 1) -> None:
                family.counts[labels] += n

            def observe(self, v: float) -> None:
                family.observed.append((labels, v))

        return Child()


class Metrics:
    def __init__(self) -> None:
        self.pushes, self.push_seconds, self.stray_calls = Family(), Family(), Family()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Metrics:
    m = Metrics()
    monkeypatch.setattr(push_book, "metrics", lambda: m)
    return m


def _call(book: PushBook, step: tuple[str, str, str], now: float, error: BaseException | None = None) -> str | None:
    method, kind, what = step
    call = book.begin(method, kind, what, now)
    return book.end(call, error, now + 0.5)


@pytest.mark.parametrize("servers", list(itertools.product((0, 1), repeat=3)))
def test_a_push_whose_calls_land_on_either_server_is_counted_once_with_its_kind(tmp_path: Path, counted: Metrics,
                                                                                servers: tuple[int, ...]) -> None:
    books = [PushBook(str(tmp_path)), PushBook(str(tmp_path))]
    outcomes = [_call(books[s], step, 10.0 * i) for i, (s, step) in enumerate(zip(servers, STEPS, strict=True))]
    assert outcomes == [None, None, "ok"]
    assert counted.pushes.counts == {("draft", "ok"): 1}
    assert counted.push_seconds.observed == [(("draft", "ok"), 20.5)]  # from the start, on whichever server
    assert not counted.stray_calls.counts
    assert books[0].open_push() is None and books[1].open_push() is None


def test_a_chunk_or_finish_with_no_push_open_is_a_stray_call_and_a_start_ends_an_open_push_once(
        tmp_path: Path, counted: Metrics) -> None:
    a, b = PushBook(str(tmp_path)), PushBook(str(tmp_path))
    refused = RuntimeError("start_weight_update must be called before update_weights")
    assert _call(a, STEPS[1], 0, refused) == "stray"
    assert _call(b, STEPS[2], 1, refused) == "stray"
    assert _call(a, STEPS[0], 2) is None  # a push begins on a ...
    assert _call(b, STEPS[1], 3, ValueError("refused chunk")) == "refused"  # ... ends refused on b
    assert _call(a, STEPS[2], 4, refused) == "stray"  # the trainer's finish after it: no second push
    assert _call(a, STEPS[0], 5) is None
    assert _call(b, STEPS[0], 6) is None  # a start while a push is open ends it, abandoned
    assert _call(a, STEPS[0], 7) is None  # and the next start ends the one b began: each counted once
    assert counted.pushes.counts == {("draft", "refused"): 1, ("draft", "abandoned"): 2}
    assert counted.stray_calls.counts == {("update_weights",): 1, ("finish_weight_update",): 2}


def test_one_server_keeps_the_book_in_memory(tmp_path: Path, counted: Metrics) -> None:
    book = PushBook()
    for i, step in enumerate(STEPS):
        _call(book, step, i)
    assert counted.pushes.counts == {("draft", "ok"): 1} and list(tmp_path.iterdir()) == []
