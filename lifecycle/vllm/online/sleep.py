"""A level-2 sleep and the draft (vLLM #52479 / #52487: after a level-2 wake the draft is not reloaded, and RL
rollouts' acceptance falls to 0).

What vLLM does (`vllm/v1/worker/gpu_worker.py`, 0.32 and 0.33): `Worker.sleep(level=2)` copies the target's and
the draft's registered buffers to CPU (`_sleep_saved_buffers`, `_sleep_saved_draft_buffers`) and the parameters
named by `sleep_preserve_parameter_names`, then its allocator releases the weights' memory without a copy;
`wake_up` maps memory back at the same addresses (what captured CUDA graphs read), holding no checkpoint's values,
and copies the saved buffers back into it. The weights are the trainer's to refill (`reload_weights`, a weight
sync); nothing rebuilds a draft's derived buffers, which are restored as they were, from the weights before the
sleep. (The CPU worker's `sleep` and `wake_up` do nothing: nothing is discarded there.)

So after vLLM's level-2 sleep returns, each lifecycle draft whose weights it did not preserve is discarded through
the epoch boundary (`reload.epoch.discard`): quarantined (the drafting gate keeps the engine serving without it),
every layer owed a full write, and the trainer's refill is an epoch of its own, built only once every layer is
back and refreshed in place at the addresses the graphs captured.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..drafts.owners import draft_model_of, drafts_of
from ..reload.epoch import discard

__all__ = ["CAUSE", "wrap_sleep"]

CAUSE = "a level-2 sleep freed them without a copy (vLLM restores buffers on wake, never weights)"


def wrap_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def sleep(worker: Any, *args: Any, **kwargs: Any) -> Any:
        level = signature.bind(worker, *args, **kwargs).arguments.get("level", 1)
        result = original(worker, *args, **kwargs)
        if level >= 2:
            model = draft_model_of(getattr(worker, "model_runner", None))
            preserved = set(getattr(worker, "_sleep_saved_parameters", None) or ())
            for backbone in drafts_of(model) if model is not None else []:
                own = {f"draft.{n}" for n, _ in model.named_parameters() if n.startswith(_prefix(model, backbone))}
                if not own <= preserved:  # vLLM keeps only the parameters `sleep_preserve_parameter_names` names
                    discard(backbone, CAUSE)
        return result

    return sleep


def _prefix(model: Any, backbone: Any) -> str:
    """The backbone's parameters' prefix in the draft model's names (`model.`)."""
    for name, module in model.named_modules():
        if module is backbone:
            return f"{name}." if name else ""
    return ""
