"""Crash consistency of vLLM's reload through the plugin (issue 24): vLLM's own DFlash class in-process (no engine),
cold on draft A and pinned, then a reload toward B interrupted at every write point in turn with RuntimeError,
KeyboardInterrupt and SystemExit, on the three ways a trainer writes a draft: vLLM's layerwise reload
(initialize, load_weights in three calls, finalize), plain load_weights then process_weights_after_loading, and
the plugin's transfer session (start, one update_weights per file, finish). After each interrupt the draft is
usable and bit-equal to a cold build of A or of B at the pinned addresses, or it refuses forward use and the same
call, complete, makes it equal to a cold build of B (tests/support/vllm_crash_scenarios.py).

Measured before the fix (the plugin as it was before this harness, the same sweeps): 2 usable-but-stale runs (an
interrupt while vLLM put a layer back from META left a parameter on META in a GRAPH_CAPTURED draft) and 50 stranded
ones (an interrupted initialize left layers on META, so the complete retry was refused; an interrupt in the
finishing steps left the draft PARTIALLY_LOADED, where no reload begins).

The suite's run: every point of the layerwise reload and every 4th of the others, one interrupt kind per point in
turn (every kind over three consecutive points); `LIFECYCLE_CRASH_FULL=1` runs every point with every kind on both
weight layouts (`python -m support.vllm_crash_scenarios crash WORKDIR` from tests/, with PYTHONPATH set). Measured
with every kind at every point on the CPU layout: 801 points, 2403 interrupted runs; one kind per point on the GPU
layout: 760 points and runs; 0 usable-but-stale, 0 stranded in either.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from support.crash import KINDS, REFUSED, RESULTS, STALE, USABLE, SweepResult
from support.vllm_crash_scenarios import PATHS, run_crash


@pytest.fixture(scope="module")
def crash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = run_crash(tmp_path_factory.mktemp("crash"))
    for s in result["sweeps"]:  # into this session's crash-consistency summary (tests/conftest.py)
        RESULTS.append(SweepResult(s["scenario"], s["points"], s["runs"],
                                   Counter({(k, o): n for k, o, n in s["outcomes"]}), s["violations"]))
    return result


def sweep_of(crash: dict[str, Any], path: str, layout: str = "cpu") -> dict[str, Any]:
    (s,) = [s for s in crash["sweeps"] if s["scenario"] == f"vllm {path} ({layout} layout)"]
    return s


def outcomes(s: dict[str, Any]) -> Counter[str]:
    out: Counter[str] = Counter()
    for _, outcome, n in s["outcomes"]:
        out[outcome.removesuffix(" (vLLM caught it)")] += n
    return out


@pytest.mark.parametrize("path", PATHS)
def test_an_interrupt_at_any_write_point_of_a_vllm_reload_never_leaves_the_draft_usable_but_stale(
        crash: dict[str, Any], path: str) -> None:
    s = sweep_of(crash, path)
    by = outcomes(s)
    print(f"{s['scenario']}: {len(s['points'])} write points, {s['runs']} interrupted runs, "
          f"{by[STALE]} usable-but-stale ({dict(by)})")
    assert s["violations"] == [], "\n".join(s["violations"][:20])
    assert by[STALE] == 0
    assert by[USABLE] + by[REFUSED] == s["runs"] > 0
    assert {k for k, _, _ in s["outcomes"]} == set(KINDS)
    if path == "layerwise":  # every point of it is tried
        assert s["runs"] == len(s["points"])


@pytest.mark.parametrize("path", PATHS)
def test_the_write_points_are_the_ones_a_reload_has(crash: dict[str, Any], path: str) -> None:
    labels = sweep_of(crash, path)["points"]
    steps = {label.split(" ")[0] for label in labels} | {" ".join(label.split(" ")[:2]) for label in labels}
    # vLLM's loaders and copy back (in-place writes), its reload steps, what it registers moving layers to META and
    # back, the lifecycle's reports and triggers, the in-place refresh of the derived buffers
    for step in ("copy_", "materialize", "copy back", "put back", "register_parameter", "report weights_loaded",
                 "fire begin_reload", "fire finalize_loading", "fired finalize_loading", "fire refresh_derived",
                 "fire graphs_verified"):
        assert step in steps, (step, sorted(steps))
    if path != "plain":  # initialize_layerwise_reload moves every layer's buffers to META; plain loads never do
        assert "register_buffer _fused_kv_weight" in steps
    if path == "transfer":
        assert {"transfer receive_weights", "transfer finish_weight_update"} <= set(labels)
    if path != "plain":  # the norms are written in place, the linear layers copied back (vLLM's repack)
        assert {"direct write RMSNorm", "copy back QKVParallelLinear"} <= set(labels), sorted(set(labels))
    assert len(labels) > 150
    # both ends are reached: an interrupt that leaves the draft as it was, one that refuses until the retry
    assert {USABLE, REFUSED} <= set(outcomes(sweep_of(crash, path)))


def test_the_check_names_a_draft_that_disagrees_with_a_cold_build_usable_but_stale(crash: dict[str, Any]) -> None:
    # else a sweep's 0 could mean a check that never looks
    assert crash["canaries"] == {"derived buffer off by one element": STALE, "weight on META": STALE}



def test_on_the_gpu_layout_every_layer_is_written_in_place_and_an_interrupt_anywhere_is_never_usable_but_stale(
        crash: dict[str, Any]) -> None:
    s = sweep_of(crash, "layerwise", "gpu")
    by = outcomes(s)
    print(f"{s['scenario']}: {len(s['points'])} write points, {s['runs']} interrupted runs, {dict(by)}")
    assert s["violations"] == [], "\n".join(s["violations"][:20])
    assert by[STALE] == 0 and by[USABLE] + by[REFUSED] == s["runs"] > 0
    labels = set(s["points"])
    assert {"direct write QKVParallelLinear", "direct write MergedColumnParallelLinear",
            "direct write RowParallelLinear", "direct write RMSNorm"} <= labels, sorted(labels)
    assert not any(label.startswith(("copy back", "materialize")) for label in labels)  # no fresh layer, no copy


def test_an_interrupt_inside_one_layers_in_place_write_leaves_it_torn_and_the_draft_refusing(
        crash: dict[str, Any]) -> None:
    torn = crash["torn"]
    assert torn["labels"] and all(label.startswith("copy_") for label in torn["labels"]), torn["labels"]
    assert torn["violations"] == [], "\n".join(torn["violations"][:20])
    # every kind at every copy of the write: the draft refuses (never usable with a torn layer), and the complete
    # retry (the check's second half) brings it back equal to a cold build
    assert {o for _, o, _ in torn["outcomes"]} == {REFUSED}, torn["outcomes"]
    assert torn["runs"] == 3 * len(torn["labels"])
