"""Engine scenarios under vLLM's Ray executors, for tests/vllm_plugin/online/test_vllm_ray.py, each in its own process:

    PYTHONPATH=.:tests python -m support.ray_scenarios SCENARIO WORKDIR ARG   -> prints one line: SCENARIO_RESULT {json}

`tp2 WORKDIR v1|v2`: two tensor-parallel ranks under the V1 (`RayDistributedExecutor`) or V2 (`RayExecutorV2`)
Ray executor; a bucketed draft reload on both ranks. `bad_node WORKDIR stock|extension`: the same engine, with
this package hidden in every Ray worker (what a node without it looks like), started without or with the
lifecycle's worker extension.

vLLM's CPU platform declares no Ray device key, so both Ray executors refuse it ("current platform cpu does not
support ray"). HERE ONLY, in this test process and (through a `worker_process_setup_hook` of this process's
`ray.init`) in its Ray workers, the platform is given Ray's "GPU" key, backed by two logical GPUs that Ray only
counts. The plugin never does this: it does not change what vLLM allows.

The Ray cluster is started before RELOAD_LIFECYCLE_AUDIT_DIR is set, so Ray's workers do not inherit it from
this process: they get it only if the executor copies it, as workers on another node would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from support.cpu_shm import buffers_removed
from support.needs import refuse_engines
from support.vllm_basic_scenarios import _try, pinned_reload_on_every_rank


def allow_ray_on_cpu() -> None:
    """Test-only: let vLLM's CPU platform use Ray (see the module doc)."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = "GPU"


def hide_this_package() -> None:
    """Test-only, in Ray workers: make `lifecycle` unimportable, as on a node where it is not installed."""
    import importlib.abc

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            if name == "lifecycle" or name.startswith("lifecycle."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hidden())
    allow_ray_on_cpu()


def _start_ray(hook: Any) -> None:
    import ray

    allow_ray_on_cpu()
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": hook})


def _engine(work: Path, *, plugin: bool = True) -> Any:
    from vllm import LLM

    from lifecycle.vllm.demo.tiny import engine_kwargs

    return LLM(**engine_kwargs(work / "target", work / "draftA", plugin=plugin), tensor_parallel_size=2,
               distributed_executor_backend="ray")


def scenario_tp2(work: Path, executor: str) -> dict[str, Any]:
    from lifecycle.vllm.plugin.activation import AUDIT_DIR_ENV
    from lifecycle.vllm.plugin.nodes import node_probe

    os.environ["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = {"v1": "0", "v2": "1"}[executor]
    _start_ray(allow_ray_on_cpu)
    os.environ[AUDIT_DIR_ENV] = str(work / f"audit-ray-{executor}")  # after ray.init: see the module doc
    started = time.perf_counter()
    llm = _engine(work)
    try:
        return {"start_s": time.perf_counter() - started, "probes": llm.collective_rpc(node_probe),
                "executor": type(llm.llm_engine.model_executor).__name__, **pinned_reload_on_every_rank(llm, work)}
    finally:
        llm.llm_engine.engine_core.shutdown()  # while Ray is up: see main()


def scenario_bad_node(work: Path, variant: str) -> dict[str, Any]:
    os.environ["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = "1"
    _start_ray(hide_this_package)
    started = time.perf_counter()

    def start() -> str:
        _engine(work, plugin={"stock": False, "extension": True}[variant])
        return "started"

    out = {"start": _try(start)}
    out["seconds"] = time.perf_counter() - started
    return out


def main() -> None:
    """Runs one scenario. The engine is shut down before Ray, and Ray may not start a second local cluster: the
    executors' shutdown, run later by the garbage collector, calls `ray.kill`, which after `ray.shutdown()` would
    start a fresh cluster (Ray's auto-connect); its head processes then outlived this process, which hung in its
    exit for 15 minutes in CI."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"  # read when ray is imported
    scenario, work, arg = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    refuse_engines()
    from lifecycle.vllm.demo.tiny import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    with buffers_removed():  # Ray kills its workers without unlinking their buffers: see support.cpu_shm
        try:
            result = {"scenario": scenario, **globals()[f"scenario_{scenario}"](work, arg)}
            print("SCENARIO_RESULT " + json.dumps(result, default=str), flush=True)
        finally:
            if "ray" in sys.modules:
                sys.modules["ray"].shutdown()


if __name__ == "__main__":
    main()
