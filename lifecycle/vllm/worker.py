"""The worker RPCs of the lifecycle, and how they join vLLM's worker: `LifecycleWorkerExtension` is the reload side's
RPCs (`online.rpcs.ReloadRPCs`: states, events, pin, verify, digests, `reload_draft_weights`) and the outside view's
(`observability.serving_state`: the metrics' and the acceptance canary's `lifecycle_serving_state`). Call them with
`llm.collective_rpc("lifecycle_states")`.

An engine gets them whatever its `worker_extension_cls`: once vLLM built the worker (and added the extension it was
given, a trainer's own such as SkyRL's, to the worker class's bases), the plugin adds `LifecycleWorkerExtension`
there too unless the class has it already (`wrap_init_worker`, a record of the patch registry). Naming it as
`worker_extension_cls="lifecycle.vllm.worker.LifecycleWorkerExtension"` still works. A name of the other extension
that is one of the lifecycle's refuses the engine start, naming both classes and the names (as vLLM refuses a clash
between the worker and its extension). Without the plugin in the worker processes none of this happens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .observability.serving_state import ServingStateRPC
from .online.rpcs import ReloadRPCs, draft_model_of

__all__ = ["RPC_NAMES", "LifecycleWorkerExtension", "compose", "draft_model_of", "wrap_init_worker"]


class LifecycleWorkerExtension(ReloadRPCs, ServingStateRPC):
    """Mixed into vLLM's worker class; `self` is the worker."""


#: Every name the lifecycle adds to vLLM's worker class (its RPCs and their helpers).
RPC_NAMES = tuple(sorted(a for a in dir(LifecycleWorkerExtension) if not a.startswith("__")))


def compose(worker_class: type) -> bool:
    """Give `worker_class` the lifecycle's RPCs (append `LifecycleWorkerExtension` to its bases) unless it has them;
    True when it changed. A name the class has already (another extension's) refuses, naming both."""
    if issubclass(worker_class, LifecycleWorkerExtension):
        return False
    clash = [name for name in RPC_NAMES if hasattr(worker_class, name)]
    if clash:
        owners = sorted({c.__qualname__ for c in worker_class.__mro__ for name in clash if name in vars(c)})
        raise TypeError(f"reload-lifecycle: vLLM's worker class {worker_class.__qualname__} already has "
                        f"{', '.join(clash)} (from {', '.join(owners)}), which the lifecycle's worker RPCs "
                        f"(lifecycle.vllm.worker.LifecycleWorkerExtension) define: rename them in that extension")
    worker_class.__bases__ = (*worker_class.__bases__, LifecycleWorkerExtension)
    return True


def wrap_init_worker(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `WorkerWrapperBase.init_worker`, then the lifecycle's RPCs joined to the worker built."""

    def init_worker(wrapper: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(wrapper, *args, **kwargs)
        worker = getattr(wrapper, "worker", None)
        if worker is not None:
            compose(type(worker))
        return result

    return init_worker
