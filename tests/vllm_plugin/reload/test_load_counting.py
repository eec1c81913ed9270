"""vLLM's dry run of a loader (how many elements a buffered load writes), remembered only where the answer depends on
shapes alone (`lifecycle.vllm.reload.counting`): the same answer as vLLM's every time, and a dry run wherever
remembering could be wrong. With vLLM's own loaders, its own dry-run counter and META placeholders, as vLLM's
layerwise reload hands them over; the counts inside a live engine are in test_push_counts.py (no dry run after the
first push)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn


@pytest.fixture
def counting() -> Any:
    from lifecycle.vllm.reload import counting

    return counting


def _counted(original: Callable[..., tuple[int, Any]]) -> tuple[list[int], Callable[..., tuple[int, Any]]]:
    runs: list[int] = []

    def dry_run(loader: Callable[..., Any], args: inspect.BoundArguments) -> tuple[int, Any]:
        runs.append(1)
        return original(loader, args)

    return runs, dry_run


def _bound(loader: Callable[..., Any], *args: Any) -> inspect.BoundArguments:
    bound = inspect.signature(loader).bind(*args)
    bound.apply_defaults()
    return bound


def test_a_default_loader_is_dry_run_once_per_shape_and_answers_what_vllm_counts(counting: Any) -> None:
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    runs, dry_run = _counted(get_numel_loaded)
    remembered = counting.wrap_numel_loaded(dry_run)
    norm = nn.Parameter(torch.empty(64, device="meta"), requires_grad=False)
    wide = nn.Parameter(torch.empty(128, device="meta"), requires_grad=False)
    for _ in range(3):
        assert remembered(default_weight_loader, _bound(default_weight_loader, norm, torch.ones(64))) == (64, None)
    assert len(runs) == 1
    assert remembered(default_weight_loader, _bound(default_weight_loader, wide, torch.ones(128))) == (128, None)
    assert len(runs) == 2  # another shape: dry-run, then remembered apart
    with pytest.raises(AssertionError):  # vLLM's shape check still runs for arguments never seen
        remembered(default_weight_loader, _bound(default_weight_loader, norm, torch.ones(65)))


def test_an_unquantized_linear_remembers_per_shard_and_a_quantized_one_is_dry_run_every_time(counting: Any) -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded

    class Fused(nn.Module):  # a fused q/k/v linear's loader: each shard writes its own rows
        def __init__(self, method: Any) -> None:
            super().__init__()
            self.quant_method = method

        def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard: str | None = None) -> None:
            rows = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}[shard] if shard else (0, param.shape[0])
            param.data.narrow(0, *rows).copy_(loaded_weight)

    class Scaled(QuantizeMethodBase):  # type: ignore[misc]
        def create_weights(self, *args: Any, **kwargs: Any) -> None: ...

        def apply(self, *args: Any, **kwargs: Any) -> None: ...

    runs, dry_run = _counted(get_numel_loaded)
    remembered = counting.wrap_numel_loaded(dry_run)
    plain, scaled = Fused(UnquantizedLinearMethod()), Fused(Scaled())
    param = nn.Parameter(torch.empty(8, 16, device="meta"), requires_grad=False)
    for _ in range(2):
        for shard, rows in (("q", 4), ("k", 2), ("v", 2)):
            got = remembered(plain.weight_loader, _bound(plain.weight_loader, param, torch.ones(rows, 16), shard))
            assert got == (rows * 16, None)
    assert len(runs) == 3  # once per shard, not again on the second push
    for _ in range(2):
        remembered(scaled.weight_loader, _bound(scaled.weight_loader, param, torch.ones(4, 16), "q"))
    assert len(runs) == 5  # its loader may set attributes on the placeholder: vLLM's dry run every time


def test_a_real_parameter_an_answer_or_an_odd_argument_is_never_remembered(counting: Any) -> None:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    answers: list[Any] = []

    def vllm_count(loader: Callable[..., Any], args: inspect.BoundArguments) -> tuple[int, Any]:
        answers.append(args.arguments)
        return 4, answers[-1].get("tag")

    remembered = counting.wrap_numel_loaded(vllm_count)
    meta = nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)
    live = nn.Parameter(torch.empty(4), requires_grad=False)
    for _ in range(2):
        remembered(default_weight_loader, _bound(default_weight_loader, live, torch.ones(4)))
    assert len(answers) == 2  # a real parameter: the loader would write, never skipped

    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class Answers(nn.Module):  # an unquantized layer whose loader answers its `tag`
        quant_method = UnquantizedLinearMethod()

        def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, tag: object = "kept") -> object:
            return tag

    returns = Answers().weight_loader
    for _ in range(2):
        assert remembered(returns, _bound(returns, meta, torch.ones(4))) == (4, "kept")
    assert len(answers) == 4  # a loader that answers something: its answer is not remembered
    for _ in range(2):
        remembered(returns, _bound(returns, meta, torch.ones(4), None))
    assert len(answers) == 5  # None answered: remembered after the first
    for _ in range(2):
        remembered(returns, _bound(returns, meta, torch.ones(4), [1]))
    assert len(answers) == 7  # an argument that is neither a tensor nor a plain value: dry-run every time
    remembered(len, _bound(returns, meta, torch.ones(4)))  # a builtin cannot be held weakly: dry-run, no error
    assert len(answers) == 8


def test_a_loader_remembers_a_bounded_number_of_argument_sets(counting: Any) -> None:
    """A trainer that sends ever new shapes gets vLLM's dry run for each beyond the cap, with vLLM's answer; the
    table does not grow with every push."""
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from lifecycle.vllm.drafts.runtime import WORKER

    runs, dry_run = _counted(get_numel_loaded)
    remembered = counting.wrap_numel_loaded(dry_run)
    tables = WORKER.load_counts.get(default_weight_loader, {})
    kept_before = len(tables.get(default_weight_loader) or {})  # other tests of this process counted some already
    sizes = range(1000, 1000 + counting.COUNTS_KEPT + 10)
    beyond = len(sizes) - (counting.COUNTS_KEPT - kept_before)
    for _ in range(2):
        for n in sizes:
            param = nn.Parameter(torch.empty(n, device="meta"), requires_grad=False)
            assert remembered(default_weight_loader, _bound(default_weight_loader, param, torch.ones(n))) == (n, None)
    assert len(runs) == len(sizes) + beyond  # those up to the cap remembered, the ones beyond dry-run both times
    assert len(WORKER.load_counts[default_weight_loader][default_weight_loader]) <= counting.COUNTS_KEPT
