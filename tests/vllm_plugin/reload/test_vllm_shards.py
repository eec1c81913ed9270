"""A payload that only looks complete, refused naming the missing shard (`lifecycle/vllm/shards.py`; issue 24,
item 13).

vLLM's layerwise reload processes a layer once the elements its loaders copied add up; a fused `qkv_proj` that
receives `q_proj` twice (a trainer's retry in a second call, or one call carrying it under both names vLLM maps
to layer 0) and never `k_proj` adds up with 2 query heads and 1 KV head, and stock vLLM processes it with K rows
that were never sent (uninitialised memory). Measured before the fix, on every path below: the draft usable with
never-sent K rows (both layouts, both policies), and on the CPU layout a late load into the processed layer failing
with "'Parameter' object has no attribute 'weight_loader'", the complete retry included. Readiness is now decided
per tensor and per shard: an incomplete payload is refused naming the shard (partial='refuse'; also 'keep' on the
CPU layout, whose repack leaves no checkpoint rows to complete from), or with partial='keep' on the GPU layout
completed with the last values; a complete retry loads. In-process (tests/support/vllm_shard_scenarios.py), one
process for every case; the engine-level case is in tests/vllm_plugin/reload/test_vllm_failures.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from lifecycle.states import LifecycleState
from support.vllm_shard_scenarios import CASES_RUN, run_shards

INCOMPLETE = [c for c in CASES_RUN if "k" not in c[3].replace("q+alias", "")]
COMPLETE = [c for c in CASES_RUN if c not in INCOMPLETE]


def case_id(case: tuple[str, str, str, str]) -> str:
    return "/".join(case)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_shards(tmp_path_factory.mktemp("shards"))


def names_the_missing_shard(res: dict[str, Any], order: str) -> None:
    assert not res["ok"] and res["error"] == "LayersNotReadyError", res
    message = res["message"]
    assert "layers.0.self_attn.qkv_proj.weight (" in message
    assert "shard 'k' (layers.0.self_attn.k_proj.weight)" in message
    assert "sent 'q' 2 times: vLLM's element count adds up, the rows do not" in message
    if "v" not in order.replace("q+alias", "v"):
        assert "'v' (layers.0.self_attn.v_proj.weight) never sent" in message


@pytest.mark.parametrize("case", [c for c in INCOMPLETE if c[2] == "refuse" or c[1] == "cpu"], ids=case_id)
def test_an_incomplete_payload_is_refused_naming_the_shard_and_the_layer_keeps_its_last_weights(
        shards: dict[str, Any], case: tuple[str, str, str, str]) -> None:
    _, _, policy, order = case
    res = shards[case_id(case)]
    names_the_missing_shard(res, order)
    if policy == "keep":  # the CPU layout: vLLM's repack leaves no checkpoint rows to complete the shard from
        assert "not the checkpoint layout" in res["message"]
    assert res["state"] == LifecycleState.QUARANTINED.value and not res["usable"]
    assert res["rows"] == {"q": "A", "k": "A", "v": "A"}  # the layer got its kernel tensors back, unchanged


@pytest.mark.parametrize("case", [c for c in INCOMPLETE if c[2] == "refuse" or c[1] == "cpu"], ids=case_id)
def test_after_the_refusal_a_complete_reload_reaches_the_checkpoint(shards: dict[str, Any],
                                                                     case: tuple[str, str, str, str]) -> None:
    retry = shards[case_id(case)]["retry"]
    assert retry["ok"], retry
    assert retry["usable"] and retry["rows"] == {"q": "B", "k": "B", "v": "B"}
    if case[1] == "gpu":
        assert retry["fused_is_vllms"]


@pytest.mark.parametrize("case", [c for c in INCOMPLETE if c[2] == "keep" and c[1] == "gpu"], ids=case_id)
def test_keep_completes_the_shard_never_sent_with_its_last_values_on_the_gpu_layout(
        shards: dict[str, Any], case: tuple[str, str, str, str]) -> None:
    res = shards[case_id(case)]
    order = case[3]
    assert res["ok"], res
    assert res["usable"] and res["rows"] == {"q": "B", "k": "A", "v": "B" if "v" in order or "alias" in order
                                             else "A"}
    assert res["fused_is_vllms"]  # the fused K/V buffer is what vLLM's builder makes of those weights


@pytest.mark.parametrize("case", COMPLETE, ids=case_id)
def test_a_retry_that_sends_every_shard_loads(shards: dict[str, Any], case: tuple[str, str, str, str]) -> None:
    res = shards[case_id(case)]
    assert res["ok"], res
    assert res["usable"] and res["rows"] == {"q": "B", "k": "B", "v": "B"}
    if case[1] == "gpu":
        assert res["fused_is_vllms"]


def test_every_path_and_layout_ran(shards: dict[str, Any]) -> None:
    assert {k for k in shards if k != "scenario"} == {case_id(c) for c in CASES_RUN}
    assert {c[0] for c in CASES_RUN} == {"layerwise", "plain", "transfer", "alias"}
    assert {(c[0], c[1]) for c in INCOMPLETE} == {(p, layout) for p in ("layerwise", "plain", "transfer", "alias")
                                                  for layout in ("cpu", "gpu")}
