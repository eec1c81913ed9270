"""Every worker of a Ray engine runs the plugin, or the engine does not start: a check of each node, by name.

Under vLLM's Ray executors the workers run on other machines, each in its own Python environment. A node where
this package is missing (or cannot be imported, or `VLLM_PLUGINS` leaves it out) would load vLLM's stock draft
class and serve it without the lifecycle: the first bucketed reload there rebuilds its fused buffers from META
placeholders. So the plugin, in the process that builds the executor, wraps vLLM's `Executor.__init__`: once a
Ray executor has started its workers, a probe runs in each of them (`collective_rpc`, sent by value: it needs
nothing of this package where it runs) and reports its host, rank and whether the plugin is active there. Any
worker without it fails the engine start with `NodeSetupError` naming the node (host name and address) and its
ranks. If the executor fails to start before that (a worker that cannot import `worker_extension_cls`), the same
probe runs as a Ray task on each node of the engine's placement group and the error says which node lacks the
package, chained to vLLM's own.
"""

from __future__ import annotations

import builtins
import contextlib
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import NodeSetupError

__all__ = ["PLUGIN_NAME", "check_reports", "node_probe", "wrap_executor_init"]

#: The plugin's name in the `vllm.general_plugins` entry-point group (and in `VLLM_PLUGINS`).
PLUGIN_NAME = "reload_lifecycle"
#: The distribution that provides the plugin.
DISTRIBUTION = "reload-lifecycle"
#: Seconds to wait for the probes of a failed start (they only explain the failure; vLLM's error is raised anyway).
PROBE_TIMEOUT_S = 60.0
# The module name the probe claims: not importable anywhere, so cloudpickle sends the function by value.
_PROBE_MODULE = "reload_lifecycle_node_probe"


def _probe(worker: Any = None) -> dict[str, Any]:  # pragma: no cover - runs in Ray workers, sent by value
    """What one worker process says about itself. Standard library only and no module globals: it runs where
    this package may be missing."""
    import contextlib
    import importlib.metadata
    import importlib.util
    import os
    import socket
    import sys

    report: dict[str, Any] = {"node": socket.gethostname(), "pid": os.getpid(), "ip": None, "rank": None,
                              "vllm_plugins": os.environ.get("VLLM_PLUGINS")}
    ray = sys.modules.get("ray")
    if ray is not None:
        with contextlib.suppress(Exception):
            report["ip"] = ray.util.get_node_ip_address()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        report["rank"] = dist.get_rank()
    else:
        report["rank"] = getattr(worker, "rpc_rank", getattr(worker, "rank", None))
    try:
        report["version"] = importlib.metadata.version("reload-lifecycle")
    except Exception:
        report["version"] = None
    try:
        found = importlib.metadata.entry_points(group="vllm.general_plugins")
        report["entry_point"] = any(ep.name == "reload_lifecycle" for ep in found)
    except Exception:
        report["entry_point"] = False
    try:
        report["importable"] = importlib.util.find_spec("lifecycle.vllm.plugin") is not None
    except Exception as e:
        report["importable"] = False
        report["import_error"] = f"{type(e).__name__}: {e}"[:300]
    activation = sys.modules.get("lifecycle.vllm.plugin.activation")  # where `activate()` sets it
    report["active"] = bool(getattr(activation, "_active", False))
    return report


def _sent_by_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of `fn` whose module is not importable anywhere, so cloudpickle (Ray, vLLM's `collective_rpc`)
    sends its code instead of a reference to this package."""
    copy = types.FunctionType(fn.__code__, {"__builtins__": builtins, "__name__": _PROBE_MODULE}, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__module__ = _PROBE_MODULE
    copy.__qualname__ = fn.__name__
    copy.__doc__ = fn.__doc__
    return copy


#: The probe as workers receive it: `node_probe(worker)` -> a report (node, ip, pid, rank, version, entry_point,
#: importable, active, vllm_plugins).
node_probe = _sent_by_value(_probe)


# ---- judging the reports ----------------------------------------------------------------------------------------


def _cause(report: Mapping[str, Any], driver_version: str | None, *, started: bool) -> str | None:
    """Why the plugin is not (or would not be) active in the worker that sent `report`; None when it is."""
    version = report.get("version")
    if not (started and report.get("active")):
        if not report.get("importable"):
            if version is None:
                return f"{DISTRIBUTION} is not installed there"
            why = report.get("import_error") or "ModuleNotFoundError"
            return f"{DISTRIBUTION} {version} is installed but its package `lifecycle` cannot be imported there ({why})"
        if not report.get("entry_point"):
            return (f"`lifecycle` is importable but not installed as the {DISTRIBUTION} distribution: vLLM finds the "
                    "plugin through its `vllm.general_plugins` entry point (pip install it on that node)")
        plugins = report.get("vllm_plugins")
        if started and plugins is not None and PLUGIN_NAME not in plugins.split(","):
            return f"VLLM_PLUGINS={plugins!r} leaves {PLUGIN_NAME} out there"
        if started:
            return f"the plugin did not load there (see that worker's log: 'Failed to load plugin {PLUGIN_NAME}')"
    if driver_version is not None and version is not None and version != driver_version:
        return f"{DISTRIBUTION} {version} there, {driver_version} in the driver: install the same version"
    return None


def _node_name(report: Mapping[str, Any]) -> str:
    ip = report.get("ip")
    return f"{report.get('node')}" + (f" ({ip})" if ip and ip != report.get("node") else "")


def check_reports(reports: Sequence[Mapping[str, Any]], *, driver_version: str | None, started: bool = True
                  ) -> None:
    """Raise `NodeSetupError` naming every node whose workers do not run the plugin (`started`: the reports come
    from running vLLM workers, so the plugin must be active in them; else from probes of each node, which can
    only say whether the package is there)."""
    failing: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for report in reports:
        cause = _cause(report, driver_version, started=started)
        if cause is not None:
            failing.setdefault((_node_name(report), cause), []).append(report)
    if not failing:
        return
    lines = []
    for (node, cause), group in failing.items():
        ranks = sorted(r["rank"] for r in group if isinstance(r.get("rank"), int))
        where = f"node {node}" + (f", rank(s) {', '.join(map(str, ranks))}" if ranks else "")
        lines.append(f"  {where}: {cause}")
    wanted = f"{DISTRIBUTION}=={driver_version}" if driver_version else DISTRIBUTION
    raise NodeSetupError(
        "reload-lifecycle: the vLLM plugin is not active on every node of this Ray engine, so a draft there would "
        "run without the lifecycle (a bucketed reload would rebuild its fused buffers from META placeholders). "
        f"Install {wanted} (with its vllm extra) on every node, in the Python environment Ray's workers use, "
        "and leave it in VLLM_PLUGINS:\n" + "\n".join(lines),
        nodes=[r for group in failing.values() for r in group])


# ---- the hook in vLLM's executor ----------------------------------------------------------------------------------


def _driver_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_started(executor: Any) -> None:
    reports = executor.collective_rpc(node_probe)
    try:
        check_reports(reports, driver_version=_driver_version())
    except NodeSetupError:
        with contextlib.suppress(Exception):  # the refusal is the news; a failed shutdown of a refused engine is not
            executor.shutdown()
        raise


def _probe_nodes(executor: Any) -> list[dict[str, Any]]:
    """Run the probe as a Ray task on each node of the executor's placement group (its workers' nodes)."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    parallel = executor.parallel_config
    group = parallel.placement_group
    if group is None or not ray.is_initialized():
        return []
    node_ids = sorted(set(placement_group_table(group)["bundles_to_node_id"].values()))
    task = ray.remote(num_cpus=0)(node_probe)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                         runtime_env=parallel.ray_runtime_env or None).remote() for node_id in node_ids]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    reports = []
    for ref in ready:
        try:
            reports.append(ray.get(ref))
        except Exception:  # a node the probe cannot reach: vLLM's own error stands for it
            continue
    return reports


def _explain_failed_start(executor: Any, error: BaseException) -> None:
    try:
        reports = _probe_nodes(executor)
    except Exception:
        return
    try:
        check_reports(reports, driver_version=_driver_version(), started=False)
    except NodeSetupError as refusal:
        raise refusal from error


def wrap_executor_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `Executor.__init__`, then, for a Ray executor, the check of every worker's node (the registry's
    record; `compat.patching.apply` installs it)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, *args, **kwargs)
        except Exception as e:
            if getattr(self, "uses_ray", False):
                _explain_failed_start(self, e)
            raise
        if getattr(self, "uses_ray", False):
            _check_started(self)

    return __init__
