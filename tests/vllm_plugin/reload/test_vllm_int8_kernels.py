"""vLLM's CPU int8 W8A8 kernel (`CPUInt8ScaledMMLinearKernel`) takes one of two paths per layer when the layer is
processed: `_apply_weights_sgl` where `check_cpu_sgl_kernel` holds (a CPU with AMX and a shape the kernel tiles:
every layer of a Xeon-with-AMX engine), else `_apply_weights_onednn`. The plugin's refusal is decided by the
function the kernel bound (`lifecycle/vllm/quantized.py`); before, the suite assumed the oneDNN path and failed on
a Xeon with AMX (issue 24, item 11). Both paths run here on any CPU that has the sgl kernel compiled (vLLM's `_C`,
loaded on AVX512-BF16 CPUs; it needs no AMX), the branch forced in a process of their own
(tests/support/vllm_int8_scenarios.py): vLLM's own layerwise reload of one real layer, reloaded with other values
and then the cold ones again. Each test first checks that the path it forced is the one vLLM took.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest

from lifecycle.vllm.drafts.quantized import NOT_RELOADABLE, PATH_DECIDED_AT_PROCESSING
from support.vllm_int8_scenarios import run_int8

CPU_INT8 = "vllm.model_executor.kernels.linear.scaled_mm.cpu"


@pytest.fixture(scope="module")
def int8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_int8(tmp_path_factory.mktemp("int8"))


def test_on_the_onednn_path_vllms_reload_computes_from_freed_memory_and_the_plugin_refuses_it(
        int8: dict[str, Any]) -> None:
    """vLLM's reload rebuilds the oneDNN handle from its temporary layer, and the handle reads that layer's weight
    scale, which the reload frees: reloading the cold values leaves the layer computing something else. If a vLLM
    release fixes this, this test fails: take the path off `NOT_RELOADABLE`."""
    res = int8["onednn"]
    assert res["path"] == [CPU_INT8, "CPUInt8ScaledMMLinearKernel._apply_weights_onednn"]  # the path forced
    # what freed memory holds decides the values: far off, or NaN (seen once in a full run); never near the cold ones
    assert res["same_addresses"] and not res["warm_equals_cold"] and not res["max_abs_diff"] <= 1
    assert res["blocker"] is not None
    assert "on CPUInt8ScaledMMLinearKernel (apply_weights_onednn)" in res["blocker"]
    assert "keeps reading that layer's weight scale" in res["blocker"]


def test_on_the_sgl_path_vllms_reload_equals_the_cold_layer_and_the_plugin_allows_it(int8: dict[str, Any]) -> None:
    """The sgl path keeps everything in the layer's parameters (the repacked weight, the per-channel scales),
    which vLLM's reload copies back in place: warm equals cold bit for bit, at the same addresses."""
    if not int8["sgl_compiled"]:  # vLLM's _C_AVX2 / _C_AVX512 (no AVX512-BF16): no sgl kernel, and no AMX
        assert not int8["amx"] and "sgl" not in int8  # vLLM never takes this path on this CPU
        return
    res = int8["sgl"]
    assert res["path"] == [CPU_INT8, "CPUInt8ScaledMMLinearKernel._apply_weights_sgl"]  # the path forced
    assert res["warm_equals_cold"] and res["max_abs_diff"] == 0 and res["same_addresses"]
    assert res["blocker"] is None


def test_every_refused_path_is_a_function_of_the_installed_vllm() -> None:
    """The refusal table names functions by module and qualified name: each must resolve, or the table has gone
    stale against the installed vLLM (a renamed path would silently stop being refused)."""
    assert importlib.util.find_spec("vllm") is not None
    for module, qualname in [*NOT_RELOADABLE, *PATH_DECIDED_AT_PROCESSING]:
        owner: Any = importlib.import_module(module)
        for part in qualname.split("."):
            owner = getattr(owner, part)
        assert callable(owner), (module, qualname)


def test_the_decision_is_the_bound_function_not_the_class_name() -> None:
    """A kernel whose class shares the name but whose bound function is the sgl one is allowed; a subclass that
    inherits the oneDNN path is refused; a kernel of the int8 class with no path bound is refused (path unknown)."""
    import vllm.model_executor.kernels.linear.scaled_mm.cpu as cpu_int8
    from torch import nn

    from lifecycle.vllm.drafts.quantized import reload_blocker

    class Inherits(cpu_int8.CPUInt8ScaledMMLinearKernel):  # type: ignore[misc]
        pass

    def model_with(kernel: object) -> nn.Module:
        holder, layer, scheme = nn.Module(), nn.Module(), type("CompressedTensorsW8A8Int8", (), {})()
        scheme.kernel = kernel
        layer.scheme = scheme
        holder.qkv_proj = layer
        return holder

    def bound(cls: type, name: str) -> object:
        k = object.__new__(cls)
        k.linear_method = getattr(k, name)
        return k

    assert "apply_weights_onednn" in str(reload_blocker(model_with(bound(Inherits, "_apply_weights_onednn"))))
    assert reload_blocker(model_with(bound(Inherits, "_apply_weights_sgl"))) is None
    assert "decided when the layer is processed" in str(reload_blocker(model_with(object.__new__(Inherits))))
    lookalike = type("CPUInt8ScaledMMLinearKernel", (), {"_apply_weights_onednn": lambda self: None})
    assert reload_blocker(model_with(bound(lookalike, "_apply_weights_onednn"))) is None

