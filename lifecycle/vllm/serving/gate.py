"""Whether the engine may run the draft model in this step: only while every lifecycle draft in it is usable.

A quarantined draft (or one mid-reload, its modules on META) must not run. Raising from the draft step is not a
way to refuse: the exception leaves the scheduler's requests half-processed, and the next `generate` on the
same engine hangs (measured on vLLM 0.32). So the plugin answers vLLM's own question "does this step's input fit
in the drafter?" with no while the draft is not usable: the runner then skips the drafter and zeroes the step's
draft tokens (what vLLM does when a sequence outgrows the drafter), the target verifies them, and the output is
exactly what it would be without speculation. Speculation resumes on the first step after a successful reload
or `recover()`. (The draft's own KV cache misses the context of the steps it skipped: requests that span the
pause may draft worse afterwards, never wrongly.)

Each pause and resume is one audit event per draft (`drafting_paused` with the state and the quarantine reason;
`drafting_resumed` with the number of steps served without the draft), never one per step; the steps served without
the draft since the process started are counted too (`steps_without_draft_total`, for the metrics). Model Runner V1
asks through `drafting_allowed(runner)`, V2's speculator through `drafting_allowed_for(model)` (`runner_v2.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..drafts.owners import VLLMDraftBackbone, drafts_of

__all__ = ["drafting_allowed", "drafting_allowed_for", "steps_without_draft_total", "wrap_fits"]

def steps_without_draft_total(backbone: VLLMDraftBackbone) -> int:
    """Engine steps served without this draft since the process started."""
    return backbone.lifecycle_runtime.steps_without_draft_total


def _draft_model(runner: Any) -> nn.Module | None:
    get = getattr(runner, "get_draft_model", None)
    if callable(get):
        model: nn.Module | None = get()
        return model
    drafter = getattr(runner, "drafter", None)
    return getattr(drafter, "model", None)


def drafting_allowed(runner: Any) -> bool:
    """False while any lifecycle draft of the runner's draft model is not usable (audited on each change)."""
    return drafting_allowed_for(_draft_model(runner))


def drafting_allowed_for(model: nn.Module | None) -> bool:
    """As `drafting_allowed`, for the draft model itself."""
    if model is None:
        return True
    allowed = True
    for backbone in drafts_of(model):  # cached per model: asked every engine step
        lc, runtime = backbone.lifecycle, backbone.lifecycle_runtime
        paused = runtime.drafting_paused_steps
        if lc.usable:
            if paused is not None:
                runtime.drafting_paused_steps = None
                lc.audit_event("drafting_resumed", steps_without_draft=paused)
            continue
        allowed = False
        if paused is None:
            lc.audit_event("drafting_paused", state=lc.state.value, reason=lc.quarantine_reason)
        runtime.drafting_paused_steps = (paused or 0) + 1
        runtime.steps_without_draft_total += 1
    return allowed


def wrap_fits(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's own way to run a step without the drafter: when this says False the runner zeroes the step's draft
    # tokens (the target verifies them, so the output is unchanged) and never calls into the draft model
    def _input_fits_in_drafter(runner: Any, *args: Any, **kwargs: Any) -> bool:
        return drafting_allowed(runner) and bool(original(runner, *args, **kwargs))

    return _input_fits_in_drafter
