"""Where a push's time goes, inside a live engine: each step of the plugin and of vLLM wrapped in a timer where
it is looked up, each timer counting its own time only (a nested step's time is its own, not its caller's).

Plugin steps (`PLUGIN`): header validation (`checkpoint_index` as the payload calls it), the checks that a file did
not change under the reader, the transfer engine's own work per chunk (the payload's planning and admission, the
reader's loop, the staging buffer's upkeep: `receive_weights` less what it calls that is timed), the structure checks
and write hooks around each `load_weights` call (what the plugin's `load_weights` does besides vLLM's), the lifecycle
bookkeeping (epoch begin, layer reports), a completed layer's checks (every shard arrived, which path writes it), the
epoch's open and close (`initialize` / `finalize` wrappers: the push's walk of the modules, partial payloads, shared
modules), the finish (finalize_loading, hooks), the in-place refresh (its plan, checks and events; its copies are the
fused write) and its pin verification, the processing guard (the K/V shadow capture and the weight checker's digests
before vLLM repacks a layer: CPU layout). vLLM steps (`VLLM`): its `initialize_layerwise_reload` (every layer's
tensors to META placeholders, its loaders wrapped), its weight loaders (buffering per layer), its own layerwise
processing of a layer (materialise, load, process, copy back into the kept storage: quantized layers and the CPU
repack), its processing (the CPU repack), its finalize, stock's fused rebuild (`torch.cat` after every call). Shared
with the floor (`SHARED`): the reads, a completed layer written straight into its kept tensors (`reload.direct`: the
loads replayed, the one write of the bytes), and the refresh's copies (the fused buffer written once). The rest of a
push is the session's plumbing (vLLM's worker and transfer-engine session calls, the plugin's session wrappers around
them) and the timers' own cost.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["FUSED_WRITE", "IN_PLACE", "PLUGIN", "PROBE", "READS", "SHARED", "VLLM", "Steps", "timed_steps"]

PLUGIN = ("validation: headers", "file checks", "transfer engine: plan, reader, staging",
          "structure checks, write hooks", "lifecycle bookkeeping", "layer completion checks", "epoch open/close",
          "finish: finalize_loading, hooks", "refresh: plan, checks, events", "pin verification",
          "processing guard (shadow capture, digests)")
VLLM = ("vLLM: layerwise init", "vLLM: weight loaders", "vLLM: layerwise materialize, load, copy back",
        "vLLM: processing", "vLLM: finalize", "vLLM: fused rebuild (torch.cat)")
READS = "reads"
#: A completed layer written straight into its kept tensors: the loads replayed, the one write the floor does too.
IN_PLACE = "in-place write (the copies)"
#: The refresh's copies: the fused buffer written once, which the floor does too (stock: its `torch.cat`).
FUSED_WRITE = "refresh: fused write (copies)"
SHARED = (READS, IN_PLACE, FUSED_WRITE)

_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"


#: A probe timer's step name: the probe around step S times S's timer (`Steps(probe=True)`).
PROBE = "timer probe: "


class Steps:
    """Exclusive wall time and calls per step. A timer's own cost outside the window it measures (the call into
    its wrapper, the bookkeeping after) would land in its caller's exclusive time: it is charged to neither, so it
    stays in the push's rest with the timers' other cost. That cost is calibrated once per process on a no-op
    (`outside_s`), and where the timers run it is more: a timed call that follows a 10 MB read or copy runs the
    timer's code from cold caches (3.6 µs per call around the reads of a one-tensor push, against 0.95 µs hot). So
    a push can be run with a probe timer around every step's timer (`probe=True`): the probe's exclusive time is
    what the step's timer cost its caller beyond `outside_s` (less a probe's own cost, calibrated hot), per call:
    `excess_per_call()`. The pushes whose steps are reported are then timed with each step's in-place cost
    (`excess=`), so that no step's time holds its children's timers."""

    def __init__(self, *, probe: bool = False, excess: Mapping[str, float] | None = None,
                 clock: Callable[[], float] = time.perf_counter, outside_s: float | None = None,
                 probe_inside_s: float | None = None) -> None:
        """`excess`: per step, its timer's in-place cost beyond `outside_s` (`excess_per_call` of a probed push).
        `outside_s`, `probe_inside_s`: the hot calibrations (measured once per process when None)."""
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._stack: list[list[float]] = []
        self._clock = clock
        self.outside_s = _outside_cost() if outside_s is None else outside_s
        self._probe_inside_s = probe_inside_s
        self.probe = probe
        self.excess = dict(excess or {})

    def wrap(self, step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        timed = self._timer(step, fn, self.outside_s + self.excess.get(step, 0.0))
        return self._timer(PROBE + step, timed, self.outside_s) if self.probe else timed

    def _timer(self, step: str, fn: Callable[..., Any], outside: float) -> Callable[..., Any]:
        stack, seconds, calls, clock = self._stack, self.seconds, self.calls, self._clock

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            children = [0.0]
            stack.append(children)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                stack.pop()
                seconds[step] += dt - children[0]
                calls[step] += 1
                if stack:
                    stack[-1][0] += dt + outside

        return timed

    def excess_per_call(self) -> dict[str, float]:
        """After a push with probes: per step, seconds one timed call cost its caller beyond `outside_s` (the
        probe's exclusive time per call, less a probe's own cost measured hot; never below 0)."""
        inside = _probe_inside_cost() if self._probe_inside_s is None else self._probe_inside_s
        return {step: max(0.0, self.seconds[PROBE + step] / n - inside) for step, n in self.calls.items()
                if n and not step.startswith(PROBE) and PROBE + step in self.seconds}

    def step_seconds(self) -> dict[str, float]:
        """Exclusive seconds per step, the probes left out."""
        return {step: v for step, v in self.seconds.items() if not step.startswith(PROBE)}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _least_per_call(steps: Steps, timed: Callable[[], Any], measured: Callable[[Steps, float], float]) -> float:
    """The least over batches of a timed no-op's `measured` seconds per call (the least is the cost itself; other
    tenants only add to it)."""
    best, n = float("inf"), 2000
    for _ in range(7):
        steps.seconds.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            timed()
        best = min(best, measured(steps, time.perf_counter() - t0) / n)
    return max(best, 0.0)


@functools.cache
def _outside_cost() -> float:
    """Seconds a timed call costs its caller beyond the window its timer records, hot: a wrapped no-op's loop
    time less what its timer recorded."""
    steps = Steps(outside_s=0.0, probe_inside_s=0.0)
    return _least_per_call(steps, steps.wrap("probe", lambda: None), lambda s, total: total - s.seconds["probe"])


@functools.cache
def _probe_inside_cost() -> float:
    """A probe's own cost inside its window, hot: its exclusive time around a timed no-op whose timer costs
    exactly the calibrated `outside_s` there."""
    steps = Steps(probe=True, probe_inside_s=0.0)
    return _least_per_call(steps, steps.wrap("probe", lambda: None), lambda s, _total: s.seconds[PROBE + "probe"])


def _patch(stack: ExitStack, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
    """Replace `owner.attr` (a module's, a class's or an instance's own attribute) for the duration of `stack`."""
    own = attr in vars(owner)
    original = vars(owner)[attr] if own else getattr(owner, attr)
    wrapped = make(original.__func__ if isinstance(original, (staticmethod, classmethod)) else original)
    setattr(owner, attr, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)

    def restore() -> None:
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)

    stack.callback(restore)


@contextmanager
def timed_steps(steps: Steps, draft: Any, *, plugin: bool, engine: Any = None) -> Iterator[Steps]:
    """Every step's timer installed on `draft` (vLLM's ForCausalLM) and on the functions its pushes call, and on
    `engine` (the worker's weight-transfer engine, the plugin's `safetensors_file` one) when given."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from lifecycle import checkpoint

    layerwise = importlib.import_module(_LAYERWISE)
    inner = draft.model
    with ExitStack() as stack:
        def patch(owner: Any, attr: str, step: str) -> None:
            _patch(stack, owner, attr, lambda fn: steps.wrap(step, fn))

        patch(checkpoint, "_read_tensor", READS)
        patch(UnquantizedLinearMethod, "process_weights_after_loading", "vLLM: processing")
        patch(layerwise, "finalize_layerwise_processing", "vLLM: finalize")
        patch(importlib.import_module("vllm.model_executor.model_loader.utils"), "process_weights_after_loading",
              "vLLM: finalize")
        if plugin:
            from lifecycle.vllm.reload import direct, hooks, payload
            from lifecycle.vllm.reload import epoch as patches
            from lifecycle.vllm.reload import mixin as drafts

            patch(layerwise, "_layerwise_process", "layer completion checks")  # the plugin's wrapper
            patch(hooks, "vllm_process", "vLLM: layerwise materialize, load, copy back")
            patch(direct, "write_layer", IN_PLACE)
            base = type(draft).__mro__[1]  # vLLM's class, which the plugin's calls for the loading itself
            patch(type(draft), "load_weights", "structure checks, write hooks")
            patch(base, "load_weights", "vLLM: weight loaders")
            patch(payload, "checkpoint_index", "validation: headers")
            patch(checkpoint._OpenFile, "check", "file checks")
            lc_class = type(inner.lifecycle)
            for method in ("weights_loaded", "weights_unchanged"):
                patch(lc_class, method, "lifecycle bookkeeping")
            patch(drafts.LifecycleDraftModel, "begin_reload", "lifecycle bookkeeping")
            for name in ("reload_blocker", "reload_in_progress", "keep_shared_modules_live", "settle_partial",
                         "fail"):
                patch(patches, name, "epoch open/close")

            def begin_timed(begin: Callable[..., Any]) -> Callable[..., Any]:
                # the epoch's opening, around vLLM's initialize_layerwise_reload (handed to it as `original`)
                timed = steps.wrap("epoch open/close", begin)

                def opening(model: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
                    return timed(model, steps.wrap("vLLM: layerwise init", original), *args, **kwargs)

                return opening

            _patch(stack, hooks, "begin", begin_timed)
            if engine is not None:  # the payload's planning, the reader's loop and the staging buffer's upkeep
                patch(type(engine), "receive_weights", "transfer engine: plan, reader, staging")
            patch(patches, "finish_epoch", "finish: finalize_loading, hooks")
            patch(type(inner), "refresh_derived_buffers", "refresh: plan, checks, events")
            patch(importlib.import_module("lifecycle.backbone"), "apply_refresh", FUSED_WRITE)
            patch(lc_class, "pinned_changes", "pin verification")
            for module in inner.modules():
                quant_method = getattr(module, "quant_method", None)
                if quant_method is not None and "process_weights_after_loading" in vars(quant_method):
                    patch(quant_method, "process_weights_after_loading",
                          "processing guard (shadow capture, digests)")
        else:
            patch(layerwise, "_layerwise_process", "vLLM: layerwise materialize, load, copy back")
            patch(type(draft), "load_weights", "vLLM: weight loaders")
            patch(type(inner), "_build_fused_kv_buffers", "vLLM: fused rebuild (torch.cat)")
        yield steps
