"""Engine scenarios for tests/vllm_plugin/reload/test_vllm_engine.py, each run in its own process (vLLM's global state
is per process; several engines run one after the other inside one scenario):

    PYTHONPATH=.:tests python -m support.vllm_scenarios SCENARIO WORKDIR [FAMILY]   -> prints one JSON line

The checkpoints (target, each family's drafts A and B) are made in WORKDIR by the test. vLLM is imported inside
the functions only: importing this module needs nothing but the standard library.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from support.needs import refuse_engines
from support.vllm_trainer_paths import attempt

PROMPTS = ([1, 5, 7, 9, 11], [3, 3, 3, 3], [200, 17, 4, 99, 100, 101], [7] * 10)
MAX_TOKENS = 16
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


@contextmanager
def layout(name: str) -> Iterator[None]:
    """`cpu`: vLLM's CPU build as it is; `gpu`: linear layers keep their weight after loading, as on CUDA."""
    from support.vllm_inprocess import gpu_weight_layout

    with gpu_weight_layout() if name == "gpu" else nullcontext():
        yield


# ---- engines -----------------------------------------------------------------------------------------------------
def _engine(work: Path, draft: str, *, plugin: bool = True, method: str = "dflash", **extra: Any) -> Any:
    from vllm import LLM

    from lifecycle.vllm.demo.tiny import engine_kwargs

    return LLM(**engine_kwargs(work / "target", work / draft, plugin=plugin, method=method),
               disable_log_stats=False, **extra)


def _shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    _release_distributed()


def _release_distributed() -> None:
    """The process's distributed state, after an engine shut down or failed to start: the next engine starts."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def _record_proposals(worker: Any) -> bool:
    """Wrap the (V1) drafter's propose so the draft tokens it proposes are kept; clear the record."""
    d = worker.model_runner.drafter
    if not hasattr(d, "_proposals"):
        d._proposals = []
        propose = d.propose

        def recording(*args: Any, **kwargs: Any) -> Any:
            out = propose(*args, **kwargs)
            d._proposals.append(out.tolist())
            return out

        d.propose = recording
    d._proposals.clear()
    return True


def _proposals(worker: Any) -> list[Any]:
    return list(worker.model_runner.drafter._proposals)


def _spec_counters(llm: Any) -> dict[str, Any]:
    return {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()
            if m.name in SPEC_METRICS}


def _generate(llm: Any) -> dict[str, Any]:
    """Greedy tokens for the fixed prompt set, the draft's proposals, and vLLM's acceptance counters (delta)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()  # as trainers do after a weight update: cached blocks hold the old draft's K/V
    llm.collective_rpc(_record_proposals)
    before = _spec_counters(llm)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    after = _spec_counters(llm)
    delta = {k: ([a - b for a, b in zip(v, before[k], strict=True)] if isinstance(v, list) else v - before[k])
             for k, v in after.items()}
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "proposals": llm.collective_rpc(_proposals)[0],
            "counters": delta}


def _layout_probe(worker: Any) -> list[int]:
    """The shape of the draft's first qkv weight: (0,) after vLLM's CPU repack, 2-D in the GPU layout."""
    from lifecycle.vllm.worker import draft_model_of

    draft = draft_model_of(worker.model_runner)
    return list(next(m for n, m in draft.named_modules() if n.endswith("qkv_proj")).weight.shape)


def _observe(llm: Any) -> dict[str, Any]:
    return {"generate": attempt(lambda: _generate(llm)), **_lifecycle(llm),
            "structure": llm.collective_rpc(_structure_probe)[0], "memory": llm.collective_rpc(_memory_probe)[0]}


def _memory_probe(worker: Any) -> dict[str, Any]:
    """What the draft holds (`vllm_inprocess.memory`): bytes, K/V shadows, those that are views of a buffer."""
    from lifecycle.vllm.worker import draft_model_of
    from support.vllm_inprocess import memory

    draft = draft_model_of(worker.model_runner)
    return {**memory(draft, draft.lifecycle_family), "fused_layers": _fused_layers(draft)}


def _fused_layers(draft: Any) -> list[str]:
    """sha256 of each layer's slice of the fused K/V buffer (an empty list for a family without one)."""
    from lifecycle.vllm.drafts.owners import backbones_in
    from support.vllm_inprocess import digest

    (b,) = backbones_in(draft)
    fused = next((t for n in b.derived_buffer_names() if "kv" in n and (t := b._buffers.get(n)) is not None
                  and t.dim() >= 2 and "norm" not in n), None)
    return [] if fused is None else [digest(part) for part in fused.chunk(len(b.layers))]


def _structure_probe(worker: Any) -> dict[str, Any]:
    """The draft's optional submodules: what its first load froze, what it holds now, the storage and sha256 of
    their tensors (each one the lifecycle tracks)."""
    from lifecycle.vllm.drafts.owners import backbones_in
    from lifecycle.vllm.drafts.structure import observe
    from lifecycle.vllm.worker import draft_model_of
    from support.vllm_inprocess import digest

    draft = draft_model_of(worker.model_runner)
    (b,) = backbones_in(draft)
    structure = b.lifecycle_runtime.structure
    live = observe(draft)
    return {"frozen": b.lifecycle.structure, "holds": {m: v["present"] for m, v in live.items()},
            "storage": {n: p for v in live.values() for n, p in v["tensors"].items()},
            "digests": {n: digest(b.live_tensor(n)) for m in structure.modules for n in structure.names_of(m)
                        if n in b.lifecycle.specs}}


def _lifecycle(llm: Any) -> dict[str, Any]:
    return {name: llm.collective_rpc(f"lifecycle_{rpc}") for name, rpc in
            (("states", "states"), ("digests", "derived_digests"), ("verify", "verify"))}


def _paths(llm: Any, work: Path, drafts: str, start: str = "A") -> list[dict[str, Any]]:
    """Every trainer path in turn, alternating the draft A -> B -> A ..., observed after each."""
    from support.vllm_trainer_paths import DRAFT_PATHS, PATHS, run_in_worker

    runs, cur = [], start
    for path in PATHS:
        dest = {"A": "B", "B": "A"}[cur] if path in DRAFT_PATHS else cur
        result = attempt(lambda p=path, d=dest: llm.collective_rpc(
            run_in_worker, args=(p, str(work / f"{drafts}{d}"), str(work / "target"))))
        runs.append({"path": path, "draft": dest, "result": result, **_observe(llm)})
        cur = dest
    return runs


def scenario_family(work: Path, family: str, layouts: str = "cpu,gpu", drafts: str = "",
                    dummy: str = "") -> dict[str, Any]:
    """For each weight layout: a cold engine on draft B (the reference), then a cold engine on draft A, pinned,
    that runs every trainer path (alternating A <-> B), an incomplete payload, one without the optional
    submodules, and a plain load_weights that is never finished. `drafts`: the checkpoints' folder prefix
    (`{drafts}A`, `{drafts}B`; the family's name by default). With `dummy`, between the two: an engine started
    as veRL starts it, then the trainer's first syncs (`_dummy_start`)."""
    from lifecycle.events import configure_audit
    from support.vllm_inprocess import CASES

    method = CASES[family].method
    drafts = drafts or family
    out: dict[str, Any] = {}
    names = layouts.split(",")
    for name in names:
        with layout(name):
            configure_audit(console=False)
            llm = _engine(work, f"{drafts}B", method=method)
            cold_b = _observe(llm)
            _shutdown(llm)
            if dummy:
                configure_audit(json_path=work / f"audit-{family}-dummy-{name}.jsonl", console=False)
                out[f"dummy_{name}"] = _dummy_start(work, drafts, method)
            # one audit log per pinned engine: the auditor replays one lifecycle per (rank, backbone)
            configure_audit(json_path=work / f"audit-{family}-{name}.jsonl", console=False)
            llm = _engine(work, f"{drafts}A", method=method)
            res: dict[str, Any] = {"cold_B": cold_b, "cold_A": _observe(llm),
                                   "layout": llm.collective_rpc(_layout_probe)[0],
                                   "pinned": llm.collective_rpc("lifecycle_pin")}
            res["runs"] = _paths(llm, work, drafts)
            res["partial"] = _partial(llm, work, drafts)
            # B: the partial payload above wrote draft A's optional tensors, so keeping them is visible
            res["optional_left_out"] = _optional_left_out(llm, work, drafts, "B")
            res["unfinished"] = _unfinished(llm, work, drafts, res["runs"][-1]["draft"], last=name == names[-1])
            if name != names[-1]:
                _shutdown(llm)
        out[name] = res
    return out


def _dummy_start(work: Path, drafts: str, method: str) -> dict[str, Any]:
    """veRL's rollout engine: started with load_format="dummy" (random values, the draft's load_weights never
    called), then the trainer's first syncs of draft B, in buckets, later layers first (path ii): without layer 1;
    the same with partial='keep' (the plugin's RPC); every tensor, the embeddings and lm_head included (the
    proposer gave the draft the target's: vLLM decides that from the dummy state); then the target's sync; then
    every tensor the draft may take."""
    from support.vllm_trainer_paths import run_in_worker, sync_target_in_worker

    started = attempt(lambda: _engine(work, f"{drafts}B", method=method, load_format="dummy"))
    if not started["ok"]:  # what the plugin did before: LayersNotReadyError at the draft's cold processing
        _release_distributed()
        return {"start": {"engine": {k: v for k, v in started.items() if k != "value"}}}
    llm = started["value"]
    weights, shared = str(work / f"{drafts}B"), ("embed_tokens.", "lm_head.")

    def sync(exclude: tuple[str, ...]) -> dict[str, Any]:
        return attempt(lambda: llm.collective_rpc(run_in_worker, args=("buckets_later_layers_first", weights),
                                                  kwargs={"exclude": exclude}))

    out: dict[str, Any] = {"start": {"engine": {"ok": True, "value": "started"}, **_observe(llm)}}
    out["partial"] = {"sync": sync((*shared, "layers.1.")), **_lifecycle(llm)}
    out["keep"] = {"sync": attempt(lambda: llm.collective_rpc("reload_draft_weights", args=(weights,), kwargs={
        "bucket_size": 4, "exclude_prefixes": [*shared, "layers.1."], "partial": "keep"})), **_lifecycle(llm)}
    out["shared"] = {"sync": sync(()), **_lifecycle(llm)}
    out["target"] = attempt(lambda: llm.collective_rpc(sync_target_in_worker, args=(str(work / "target"),)))
    out["full"] = {"sync": sync(shared), **_observe(llm)}
    _shutdown(llm)
    return out


def _partial(llm: Any, work: Path, family: str) -> dict[str, Any]:
    """An incomplete draft payload (layer 1 left out) through the plugin's reload_draft_weights RPC: the draft is
    quarantined and keeps its last good buffers (a backed fused buffer: but for the layers the payload wrote)."""
    before = llm.collective_rpc(_memory_probe)[0]
    out = {"reload": attempt(lambda: llm.collective_rpc("reload_draft_weights", args=(str(work / f"{family}A"),),
                                                      kwargs={"bucket_size": 4, "exclude_prefixes": ["layers.1."]}))}
    out.update(_lifecycle(llm))
    out["memory_before"], out["memory"] = before, llm.collective_rpc(_memory_probe)[0]
    out["structure"] = llm.collective_rpc(_structure_probe)[0]
    out["fused_path"] = attempt(lambda: llm.collective_rpc(_require_usable))
    return out


def _optional_left_out(llm: Any, work: Path, drafts: str, dest: str) -> dict[str, Any]:
    """A draft payload without the optional submodules (embeddings, lm_head, d2t), through the plugin's
    reload_draft_weights RPC: the draft is quarantined naming them, and keeps its structure and their values."""
    out = {"draft": dest, "reload": attempt(lambda: llm.collective_rpc(
        "reload_draft_weights", args=(str(work / f"{drafts}{dest}"),),
        kwargs={"bucket_size": 4, "exclude_prefixes": ["embed_tokens.", "lm_head.", "d2t"]}))}
    out.update(_lifecycle(llm))
    out["structure"] = llm.collective_rpc(_structure_probe)[0]
    out["fused_path"] = attempt(lambda: llm.collective_rpc(_require_usable))
    return out


def _unfinished(llm: Any, work: Path, family: str, cur: str, last: bool) -> dict[str, Any]:
    """A plain load_weights of every bucket, no process_weights_after_loading: the draft refuses to draft; the
    next process_weights_after_loading (imported from model_loader.utils) finishes the epoch. With `last`, a
    second unfinished write is then left open and `generate` must be refused (the engine is not reused after)."""
    from support.vllm_trainer_paths import run_in_worker

    dest = {"A": "B", "B": "A"}[cur]
    out: dict[str, Any] = {"draft": dest}
    out["written"] = attempt(lambda: llm.collective_rpc(run_in_worker, args=(
        "plain_load_weights", str(work / f"{family}{dest}")), kwargs={"finalize": False}))
    out["states_open"] = llm.collective_rpc("lifecycle_states")
    out["fused_path_open"] = attempt(lambda: llm.collective_rpc(_require_usable))
    out["finish"] = attempt(lambda: llm.collective_rpc(_finish_with_process_weights_after_loading))
    out.update(_observe(llm))
    if last:
        from lifecycle.events import configure_audit

        configure_audit(console=False)  # the engine's audit log ends here, every epoch finished
        llm.collective_rpc(run_in_worker, args=("plain_load_weights", str(work / f"{family}{cur}")),
                           kwargs={"finalize": False})
        out["generate_open"] = attempt(lambda: _generate(llm))
    return out


def _require_usable(worker: Any) -> str:
    from lifecycle.vllm.drafts.owners import backbones_in
    from lifecycle.vllm.worker import draft_model_of

    for b in backbones_in(draft_model_of(worker.model_runner)):
        b.require_usable("draft")
    return "usable"


def _finish_with_process_weights_after_loading(worker: Any) -> str:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from lifecycle.vllm.worker import draft_model_of

    process_weights_after_loading(draft_model_of(worker.model_runner),
                                  worker.vllm_config.speculative_config.draft_model_config, "cpu")
    return "finished"


def scenario_noplugin(work: Path) -> dict[str, Any]:
    """Stock vLLM: a bucketed layerwise draft reload breaks (CPU layout); a plain load_weights reload on the GPU
    layout generates, but rebuilds the fused buffer in new storage (what a captured graph would not see)."""
    from support.vllm_trainer_paths import run_in_worker

    def fused_ptr(worker: Any) -> list[Any]:
        inner = worker.model_runner.drafter.model.model
        return [type(worker.model_runner.drafter.model).__name__, inner._fused_kv_weight.data_ptr()]

    llm = _engine(work, "dflashA", plugin=False)
    out: dict[str, Any] = {"generate_before": attempt(lambda: _generate(llm))}
    out["reload"] = attempt(lambda: llm.collective_rpc(run_in_worker, args=("buckets_later_layers_first",
                                                                          str(work / "dflashB"))))
    out["draft_class"] = llm.collective_rpc(fused_ptr)[0][0]
    out["generate_after"] = attempt(lambda: _generate(llm))
    _shutdown(llm)
    with layout("gpu"):
        llm = _engine(work, "dflashA", plugin=False)
        gpu: dict[str, Any] = {"ptr_before": llm.collective_rpc(fused_ptr)[0][1]}
        gpu["reload"] = attempt(lambda: llm.collective_rpc(run_in_worker, args=("plain_load_weights",
                                                                             str(work / "dflashB"))))
        gpu["ptr_after"] = llm.collective_rpc(fused_ptr)[0][1]
        gpu["generate_after"] = attempt(lambda: _generate(llm))
        _shutdown(llm)
    out["gpu_plain"] = gpu
    return out


def scenario_extensions(work: Path) -> dict[str, Any]:
    """The lifecycle's RPCs beside a trainer's own worker extension, and with none; a clashing one refused.
    Checks run beside their actions (a failure names its line)."""
    from support.vllm_writes_runs import expect

    def kwargs(extension: str | None) -> dict[str, Any]:
        from lifecycle.vllm.demo.tiny import engine_kwargs

        args = engine_kwargs(work / "target", work / "draftA")
        if extension is None:
            del args["worker_extension_cls"]
        else:
            args["worker_extension_cls"] = extension
        return args

    from vllm import LLM

    done = []
    for extension in ("support.other_extension.OtherExtension", None):
        llm = LLM(**kwargs(extension), disable_log_stats=False)
        if extension is not None:
            expect(llm.collective_rpc("other_ping") == ["pong"], "the trainer's own RPC stopped answering")
        (states,) = llm.collective_rpc("lifecycle_states")
        draft = next(s for s in states if s["role"] == "draft")
        expect(draft["state"] in ("DERIVED_REFRESHED", "GRAPH_CAPTURED"), f"draft {draft['state']}")
        (answer,) = llm.collective_rpc("reload_draft_weights", args=(str(work / "draftB"),))
        expect(answer["tensors"] == 25, f"the reload through the RPC answered {answer}")
        tokens = _generate(llm)["tokens"]
        expect(len(tokens) == len(PROMPTS) and all(tokens), f"generation after the reload gave {tokens}")
        done.append(f"with {extension or 'no extension'}: the lifecycle's RPCs answer beside it; a reload works")
        _shutdown(llm)
    try:
        LLM(**kwargs("support.other_extension.ClashingExtension"))
    except Exception as e:
        expect("lifecycle_states" in str(e) and "ClashingExtension" in str(e), f"the clash was refused as {e!r}")
        done.append("a clashing extension: the start refused naming both")
    else:
        raise AssertionError("an extension redefining lifecycle_states was accepted")
    _release_distributed()
    return {"done": done}


def scenario_tp2(work: Path) -> dict[str, Any]:
    """Two tensor-parallel ranks (worker processes) run every trainer path; events carry the rank."""
    from vllm import LLM

    from lifecycle.vllm.demo.tiny import engine_kwargs

    llm = LLM(**engine_kwargs(work / "target", work / "dflashA"), tensor_parallel_size=2,
              distributed_executor_backend="mp", disable_log_stats=False)
    out: dict[str, Any] = {"cold_A": _observe_ranks(llm), "pinned": llm.collective_rpc("lifecycle_pin")}
    out["runs"] = _tp_paths(llm, work)
    return out


def _observe_ranks(llm: Any) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False)
    tokens = attempt(lambda: [list(o.outputs[0].token_ids) for o in llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)])
    return {"tokens": tokens, **_lifecycle(llm)}


def _tp_paths(llm: Any, work: Path) -> list[dict[str, Any]]:
    from support.vllm_trainer_paths import DRAFT_PATHS, PATHS, run_in_worker

    runs, cur = [], "A"
    for path in PATHS:
        dest = {"A": "B", "B": "A"}[cur] if path in DRAFT_PATHS else cur
        runs.append({"path": path, "draft": dest, "result": attempt(lambda p=path, d=dest: llm.collective_rpc(
            run_in_worker, args=(p, str(work / f"dflash{d}"), str(work / "target")))), **_observe_ranks(llm)})
        cur = dest
    return runs


def main() -> None:
    scenario, work, *rest = sys.argv[1:]
    refuse_engines()  # started by a test not marked `engine` (the in-process scenario): no engine may start here
    from support.vllm_inprocess import ENV

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if scenario.startswith("inprocess"):
        from support.vllm_inprocess_runs import run_inprocess

        result = run_inprocess(Path(work), *rest)
    else:
        result = globals()[f"scenario_{scenario}"](Path(work), *rest)
    print("SCENARIO_RESULT " + json.dumps({"scenario": scenario, **result}, default=str), flush=True)


if __name__ == "__main__":
    main()
