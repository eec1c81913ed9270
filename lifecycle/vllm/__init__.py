"""vLLM integration. Nothing here imports vLLM at module level: `lifecycle` works without vLLM installed.

Install `reload-lifecycle[vllm]`; vLLM loads the plugin (`register`) in every process through the
`vllm.general_plugins` entry point. It then:
  * refuses a vLLM version it was not built against (set RELOAD_LIFECYCLE_ALLOW_UNKNOWN_VLLM=1 to force),
  * registers lifecycle-enabled versions of vLLM's draft classes for their architectures,
  * wraps `initialize_layerwise_reload`, `finalize_layerwise_reload` and the loader's
    `process_weights_after_loading` where vLLM looks them up, so cold load, `reload_weights`, a draft reload and
    the native weight-transfer sessions drive each draft backbone's state machine.
A worker extension (`lifecycle.vllm.worker.LifecycleWorkerExtension`) adds RPCs for trainers.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """The `vllm.general_plugins` entry point. Idempotent: vLLM may call it several times per process."""
    from .plugin import activate

    activate()
