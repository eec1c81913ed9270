"""vLLM integration. Nothing here imports vLLM at module level: `lifecycle` works without vLLM installed.

Install `reload-lifecycle[vllm]`; vLLM loads the plugin (`register`) in every process through the
`vllm.general_plugins` entry point. It then:
  * checks that vLLM has every name it relies on (`capabilities.py`) and refuses, naming each missing one,
    otherwise (an untested release series with everything present runs after one warning),
  * registers lifecycle-enabled versions of vLLM's draft classes for their architectures,
  * wraps `initialize_layerwise_reload`, `finalize_layerwise_reload` and `process_weights_after_loading` where
    vLLM looks them up, so cold load, `reload_weights`, a draft reload, a plain `load_weights` after the cold load
    and the native weight-transfer sessions drive each draft backbone's state machine.
A worker extension (`lifecycle.vllm.worker.LifecycleWorkerExtension`) adds RPCs for trainers.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """The `vllm.general_plugins` entry point. Idempotent: vLLM may call it several times per process."""
    from .plugin.activation import activate

    activate()
