"""`worker_extension_cls="lifecycle.vllm.worker.LifecycleWorkerExtension"`: the class trainers name (by this
string) to give vLLM's workers the lifecycle RPCs: the reload side's (`online.rpcs.ReloadRPCs`: states, events,
pin, verify, digests, `reload_draft_weights`) and the outside view's (`observability.serving_state`: the metrics'
and the acceptance canary's `lifecycle_serving_state`). Call them with `llm.collective_rpc("lifecycle_states")`.
"""

from __future__ import annotations

from .observability.serving_state import ServingStateRPC
from .online.rpcs import ReloadRPCs, draft_model_of

__all__ = ["LifecycleWorkerExtension", "draft_model_of"]


class LifecycleWorkerExtension(ReloadRPCs, ServingStateRPC):
    """Mixed into vLLM's worker class; `self` is the worker."""
