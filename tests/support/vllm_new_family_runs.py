"""Issue 34's families with vLLM's own classes in-process (`python -m support.vllm_new_family_runs SCENARIO LAYOUT
WORKDIR`), for tests/vllm_plugin/reload/test_vllm_new_families.py:

- `lilicorr`: LiLiCorr (DFlash's layers and a correlator head whose six tensors vLLM builds in
  `materialize_inference_buffers` at the end of every load_weights): every path a whole-checkpoint draft takes equals
  a cold load, the head's tensors included, at the addresses captured; a bucketed push fails closed with vLLM's own
  message; stock vLLM's reload leaves the head wrong (CPU) or moved (GPU layout).
- `deepseek_v4`: what of DeepSeek-V4 DSpark runs on CPU: the registry's CPU class (a stub), why vLLM's CUDA class
  does not construct here, and vLLM's own generator that fills `context_wkv_proj` from every layer.
- `hand_write`: the guard against writes outside a weight loader (vLLM #57800), on vLLM's Qwen3 DSpark classes.
- `listed`: drafts the plugin lists as deriving nothing (EAGLE3, EAGLE): vLLM's own reload equals a cold load.
- `sleep`: a level-2 sleep and wake (vLLM #52479): the draft quarantined until a refill writes every layer.

Every check stands beside the action it checks (`expect`); the first failure ends the run and is the result.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from support.vllm_inprocess import (
    CASES,
    ENV,
    backbone,
    build,
    build_target,
    derived_digests,
    gpu_weight_layout,
    identities,
    make_draft,
    setup,
    target_reload,
    transfer_session,
    weight_digests,
)
from support.vllm_trainer_paths import read, write_draft

__all__ = ["run_deepseek_v4", "run_hand_write", "run_lilicorr", "run_listed", "run_sleep"]

RESULT = "NEW_FAMILY_RESULT "
HEAD_ATTRS = ("_fused_edge_weight", "_fused_edge_bias", "_attn_bias", "_rank_frac_col", "_is_top1_col")


def expect(condition: bool, message: str | Callable[[], str]) -> None:
    if not condition:
        raise AssertionError(message() if callable(message) else message)


def _head_values(model: Any) -> dict[str, list[torch.Tensor]]:
    head = model.model.lilicorr
    out = {a: [getattr(head, a)] for a in HEAD_ATTRS}
    out["_factor_input_splits"] = list(head._factor_input_splits)
    return out


def _head_identity(model: Any) -> dict[str, list[int]]:
    return {a: [id(t) for t in ts] for a, ts in _head_values(model).items()}


def _same_values(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> list[str]:
    return sorted(n for n in a if len(a[n]) != len(b[n]) or not all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a[n], b[n], strict=True)))


def _current(model: Any, cold: dict[str, Any], pinned: dict[str, Any], head_ids: dict[str, Any], what: str) -> None:
    """The draft serves what was sent: usable, every tracked tensor and derived buffer (the head's included) equal
    to a cold load of it, nothing moved, the head still pointing at the same tensors."""
    from lifecycle.vllm.serving.gate import drafting_allowed_for

    b = backbone(model)
    expect(b.lifecycle.usable, f"{what}: state {b.lifecycle.state.value}, expected usable")
    expect(drafting_allowed_for(model), f"{what}: the drafting gate is closed on a usable draft")
    weights, derived = weight_digests(model), derived_digests(model)
    wrong = sorted(n for n in cold["derived"] if derived.get(n) != cold["derived"][n])
    wrong += sorted(n for n in cold["weights"] if weights.get(n) != cold["weights"][n])
    expect(not wrong, f"{what}: differ from a cold load of what was sent: {wrong}")
    wrong_head = _same_values(_head_values(model), cold["head"])
    expect(not wrong_head, f"{what}: the head's tensors differ from a cold load's: {wrong_head}")
    moved = sorted(n for n, ident in identities(model).items() if pinned.get(n) != ident)
    expect(not moved, f"{what}: pinned storage moved: {moved}")
    expect(_head_identity(model) == head_ids, f"{what}: the head points at other tensors than at capture")


def run_lilicorr(work: Path, layout: str) -> dict[str, Any]:
    setup()
    from lifecycle.vllm.demo.tiny import make_target
    from lifecycle.vllm.serving.gate import drafting_allowed_for

    case = CASES["lilicorr"].with_structure()
    make_target(work / "target")
    folders = {w: make_draft(case, work / f"lilicorr{w}", seed, work / "target") for w, seed in (("A", 1), ("B", 2))}
    done: list[str] = []
    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        cold: dict[str, Any] = {}
        for w, folder in folders.items():
            m = build(case, folder, work / "target")
            cold[w] = {"derived": derived_digests(m), "weights": weight_digests(m), "head": _head_values(m)}
        expect(cold["A"]["derived"] != cold["B"]["derived"], "drafts A and B build the same buffers")
        stock = {w: _head_values(build(case, f, work / "target", stock=True)) for w, f in folders.items()}
        for w in "AB":  # the lifecycle's build of the head's tensors is vLLM's own computation
            expect(not _same_values(cold[w]["head"], stock[w]), f"draft {w}: the head's tensors differ from vLLM's")
        done.append("cold: the head's six tensors are the draft's buffers, equal to stock vLLM's")

        draft = build(case, folders["A"], work / "target")
        b = backbone(draft)
        head = draft.model.lilicorr
        expect(head._fused_edge_weight is b._buffers["_lilicorr_fused_edge_weight"],
               "the head's fused edge weight is not the draft's buffer")
        if layout == "cpu":  # vLLM's CPU repack would empty the weights the buffers read
            expect(head.out_head.weight.shape == (head.factor_dim, head.hidden_size),
                   lambda: f"out_head.weight {tuple(head.out_head.weight.shape)}: emptied by the CPU repack")
        b.capture_graphs()
        pinned, head_ids = identities(draft), _head_identity(draft)
        cfg = draft.vllm_config.speculative_config.draft_model_config
        target = build_target(work / "target")
        for path, dest in (("one_call", "B"), ("transfer_session", "A"), ("target_reload", "A")):
            write_draft(draft, cfg, read(folders[dest]), path, session=transfer_session(draft, folders[dest]),
                        target_reload=target_reload(target))
            _current(draft, cold[dest], pinned, head_ids, path)
        draft.load_weights(read(folders["B"]))  # a plain load_weights of the whole draft, then vLLM's processing
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(draft, cfg, torch.device("cpu"))
        _current(draft, cold["B"], pinned, head_ids, "plain load_weights")
        done.append("one call, the transfer session, a plain load_weights, a target reload: equal to a cold load")

        before = derived_digests(draft)
        try:
            write_draft(draft, cfg, read(folders["A"]), "buckets_later_layers_first")
        except ValueError as e:
            expect("LiLiCorr checkpoint coverage mismatch" in str(e), f"a bucketed push raised {e!r}")
        else:
            raise AssertionError("a bucketed push of a whole-checkpoint draft went through")
        expect(b.lifecycle.quarantined and not drafting_allowed_for(draft), "a failed bucketed push left it drafting")
        changed = {n for n, d in derived_digests(draft).items() if before[n] != d}
        # on CPU the fused K/V buffer backs the shadows: the quarantined draft holds the rows vLLM processed
        # (documented: the fused path refuses until a good reload); every other buffer, the head's, is unchanged
        expect(changed <= ({"_fused_kv_weight"} if layout == "cpu" else set()),
               lambda: f"a failed bucketed push changed the derived buffers {sorted(changed)}")
        write_draft(draft, cfg, read(folders["A"]), "one_call")
        _current(draft, cold["A"], pinned, head_ids, "a whole push after the bucketed one")
        done.append("a bucketed push fails closed with vLLM's message; the next whole push serves")

        plain = build(case, folders["A"], work / "target", stock=True)
        moved_from = [t.data_ptr() for ts in _head_values(plain).values() for t in ts]
        try:
            write_draft(plain, plain.vllm_config.speculative_config.draft_model_config, read(folders["B"]), "one_call")
        except Exception as e:  # vLLM's reload may itself fail on the CPU layout
            stale = f"stock vLLM's reload raised {type(e).__name__}"
        else:
            wrong = _same_values(_head_values(plain), stock["B"])
            moved = moved_from != [t.data_ptr() for ts in _head_values(plain).values() for t in ts]
            stale = f"stock vLLM's head after a reload: differs {wrong}, moved {moved}" if wrong or moved else ""
        expect(bool(stale), "stock vLLM's reload kept the head current and in place: the premise changed")
        done.append(stale)
    return {"layout": layout, "done": done}


def run_deepseek_v4(work: Path, layout: str) -> dict[str, Any]:
    setup()
    import lifecycle.vllm.registered as registered
    from lifecycle.vllm.drafts.families import family

    done: list[str] = []
    served = registered.deepseek_v4_dspark
    expect(served.__module__ == "vllm.models.deepseek_v4.cpu.dspark",
           f"on CPU the plugin serves {served.__module__}, not vLLM's own CPU class")
    try:
        served(vllm_config=None)
    except NotImplementedError as e:
        expect("not implemented on CPU" in str(e), f"vLLM's CPU class raised {e!r}")
    else:
        raise AssertionError("vLLM's CPU DSpark class constructed: the CPU build has one now")
    done.append("on CPU vLLM's registry serves its own DSpark stub, which raises: not implemented on CPU")

    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM, _duplicate_context_wkv_weights
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config

    from support.vllm_inprocess import _config

    cfg = _config(None, None, None)
    cfg.model_config.hf_config = DeepseekV4Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=32, hc_mult=2,
        hc_eps=1e-6, hc_sinkhorn_iters=2, rms_norm_eps=1e-6, dspark_target_layer_ids=[0, 1], index_topk=4,
        n_mtp_layers=2, dspark_markov_rank=8, num_hash_layers=0, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, q_lora_rank=32, o_lora_rank=32, o_groups=2,
        sliding_window=8, compress_ratios=[0, 0, 0, 0], qk_rope_head_dim=16, torch_dtype="float32")
    cfg.speculative_config = type("Spec", (), {"draft_model_config": cfg.model_config})()
    try:
        with set_current_vllm_config(cfg), torch.device("cpu"):
            DSparkDeepseekV4ForCausalLM(vllm_config=cfg, prefix="")
    except RuntimeError as e:
        frame = traceback.extract_tb(e.__traceback__)[-3]
        expect("Tried to instantiate dummy base class Event" in str(e), f"vLLM's CUDA class raised {e!r}")
        expect(frame.filename.endswith("vllm/models/deepseek_v4/attention.py") and "torch.cuda.Event" in (
            frame.line or ""), f"raised at {frame.filename}:{frame.lineno} {frame.line}")
        done.append(f"vLLM's CUDA DSpark does not construct on CPU: {frame.filename.split('site-packages/')[-1]}:"
                    f"{frame.lineno} `{frame.line}` (a CPU build of torch has no CUDA events)")
    else:
        raise AssertionError("vLLM's CUDA DSpark constructed on CPU: an in-process test can run now")

    copy = family("deepseek_v4_dspark").duplicated[0]
    wkv = [torch.full((4, 8), float(i)) for i in range(3)]
    sent = [(f"{copy.checkpoint.format(i=i)}.weight", t) for i, t in enumerate(wkv)] + [("mtp.0.attn.wq_a.weight",
                                                                                        torch.zeros(2, 8))]
    out = list(_duplicate_context_wkv_weights(sent, 2))
    copies = [(n, t) for n, t in out if n.startswith(f"{copy.module}.")]
    expect([n for n, _ in out if not n.startswith(f"{copy.module}.")] == [n for n, _ in sent],
           "vLLM's generator dropped or renamed a checkpoint tensor")
    expect([(n, t.shard_id) for n, t in copies] == [(f"{copy.module}.weight", 0), (f"{copy.module}.weight", 1)],
           lambda: f"the context projection received {[(n, getattr(t, 'shard_id', None)) for n, t in copies]}")
    expect(all(t.untyped_storage().data_ptr() == wkv[i].untyped_storage().data_ptr()
               for i, (_, t) in enumerate(copies)), "a shard is not layer i's own WKV tensor")
    done.append("vLLM fills context_wkv_proj's shard i with layer i's WKV (layers past the draft's skipped)")
    return {"layout": layout, "done": done}


def run_hand_write(work: Path, layout: str) -> dict[str, Any]:
    """The #57800 guard on vLLM's Qwen3 DSpark classes, its family declaring the Markov head written by hand (as
    vLLM 0.32's DeepSeek-V4 DSpark writes its attention sink, and 0.33's XPress its mixer): the cold load takes it;
    a reload carrying it is refused before anything is written (a layerwise reload would drop that write and serve
    the old value as current); a reload without it, with partial='keep', serves the new weights and keeps its
    value."""
    from dataclasses import replace

    import lifecycle.vllm.drafts.families as families
    from lifecycle.vllm.drafts.declarations import HandWrite

    marked = HandWrite("markov_head", "markov_head.*")
    families.FAMILIES = tuple(replace(f, written_by_hand=(marked,)) if f.name == "qwen3_dspark" else f
                              for f in families.FAMILIES)
    setup()
    from lifecycle.errors import CheckpointError
    from lifecycle.vllm.demo.tiny import make_target
    from lifecycle.vllm.serving.gate import drafting_allowed_for

    case = CASES["qwen3_dspark"].with_structure()
    make_target(work / "target")
    folders = {w: make_draft(case, work / f"dspark{w}", seed, work / "target") for w, seed in (("A", 1), ("B", 2))}
    done: list[str] = []
    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        draft = build(case, folders["A"], work / "target")
        b = backbone(draft)
        cold_a = weight_digests(draft)
        expect(b.lifecycle.usable and any("markov_head" in n for n in cold_a), "the cold load did not take it")
        done.append("the cold load writes the hand-written tensor")
        cfg = draft.vllm_config.speculative_config.draft_model_config
        tensors_b = read(folders["B"])
        try:
            write_draft(draft, cfg, tensors_b, "one_call")
        except CheckpointError as e:
            expect("markov_head" in str(e) and "#57800" in str(e) and "nothing of it was written" in str(e),
                   f"refused with {e}")
        else:
            raise AssertionError("a reload carrying a hand-written tensor went through")
        expect(b.lifecycle.usable and drafting_allowed_for(draft), "the refused reload left the draft unusable")
        expect(weight_digests(draft) == cold_a, "the refused reload changed a tensor")
        done.append("a reload carrying it is refused, naming it; nothing written, still serving A")
        b.lifecycle_runtime.reload_partial = "keep"
        write_draft(draft, cfg, [(n, t) for n, t in tensors_b if "markov_head" not in n], "one_call")
        cold_b = weight_digests(build(case, folders["B"], work / "target"))
        now = weight_digests(draft)
        wrong = sorted(n for n in now if now[n] != (cold_a[n] if "markov_head" in n else cold_b[n]))
        expect(b.lifecycle.usable and not wrong, lambda: f"after a keep reload without it: {wrong}")
        done.append("a reload without it (partial='keep'): B's weights, its value kept, usable")
    return {"layout": layout, "done": done}


def run_listed(work: Path, layout: str) -> dict[str, Any]:
    """Drafts the plugin leaves to vLLM because they derive nothing (EAGLE3 on the Qwen3 target, EAGLE for Llama),
    built by vLLM's loader: vLLM's own layerwise reload, in buckets (later layers first), equals a cold load of what
    was sent, every tensor in its storage of the start; the plugin wraps none of them."""
    setup()
    from lifecycle.vllm.demo.tiny import make_target
    from lifecycle.vllm.drafts.owners import backbones_in
    from support.vllm_inprocess import LISTED_CASES

    make_target(work / "target")
    done: list[str] = []
    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        for name, case in LISTED_CASES.items():
            folders = {w: make_draft(case, work / f"{name}{w}", seed, work / "target")
                       for w, seed in (("A", 1), ("B", 2))}
            cold_b = build(case, folders["B"], work / "target")
            draft = build(case, folders["A"], work / "target")
            expect(not backbones_in(draft), f"{name}: the plugin wrapped a draft it lists as deriving nothing")
            expect(type(draft).__module__.startswith("vllm."), f"{name}: served by {type(draft).__module__}")
            before = {n: t.untyped_storage().data_ptr() for n, t in draft.state_dict(keep_vars=True).items()}
            expect(any(not torch.equal(t, cold_b.state_dict()[n]) for n, t in draft.state_dict().items()
                       if t.numel()), f"{name}: drafts A and B are the same")
            cfg = draft.vllm_config.speculative_config.draft_model_config
            calls = write_draft(draft, cfg, read(folders["B"]), "buckets_later_layers_first")
            now, ref = draft.state_dict(keep_vars=True), cold_b.state_dict()
            shared = [n for n in now if n.removeprefix("model.").startswith(case.drop)]  # the target's, once served
            for n in shared:
                del now[n]
            wrong = sorted(n for n, t in now.items() if t.shape != ref[n].shape or not torch.equal(t, ref[n]))
            moved = sorted(n for n, t in now.items() if t.untyped_storage().data_ptr() != before[n])
            expect(not wrong and not moved, f"{name}: after vLLM's reload differ {wrong}, moved {moved}")
            done.append(f"{name} ({type(draft).__name__}): {calls} buckets, equal to a cold load, nothing moved")
    return {"layout": layout, "done": done}


class _Runner:
    def __init__(self, draft: Any) -> None:
        self.draft = draft

    def get_draft_model(self) -> Any:
        return self.draft


def run_sleep(work: Path, layout: str) -> dict[str, Any]:
    """A level-2 sleep and wake (vLLM #52479) on a Qwen3 DSpark draft: vLLM's GPU worker's sleep is the plugin's
    wrapper and the CPU worker's is vLLM's own (it returns at once: nothing is discarded on CPU). The CUDA allocator's
    half (the weights' memory released, mapped back at the same addresses holding no checkpoint's values, the
    buffers copied back) is done here by hand, around the plugin's wrapper of the CPU worker's sleep; on a GPU
    `benchmarks/gpu_check.py` runs it with captured graphs."""
    setup()
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from lifecycle.errors import LayersNotReadyError, QuarantinedError
    from lifecycle.vllm.compat import patching
    from lifecycle.vllm.demo.tiny import make_target
    from lifecycle.vllm.online.sleep import wrap_sleep
    from lifecycle.vllm.serving.gate import drafting_allowed_for

    done: list[str] = []
    expect(patching.is_wrapped(Worker.sleep) and not patching.is_wrapped(CPUWorker.sleep),
           "the GPU worker's sleep is not the plugin's, or the CPU worker's is")
    case = CASES["qwen3_dspark"]
    make_target(work / "target")
    folders = {w: make_draft(case, work / f"dspark{w}", seed, work / "target") for w, seed in (("A", 1), ("B", 2))}
    with gpu_weight_layout() if layout == "gpu" else nullcontext():
        cold_b = build(case, folders["B"], work / "target")
        ref = {"derived": derived_digests(cold_b), "weights": weight_digests(cold_b)}
        draft = build(case, folders["A"], work / "target")
        b, lc = backbone(draft), backbone(draft).lifecycle
        b.capture_graphs()
        pinned = identities(draft)
        worker = object.__new__(CPUWorker)
        worker.model_runner = _Runner(draft)
        CPUWorker.sleep(worker, level=2)  # vLLM's CPU worker: nothing discarded, the draft keeps serving
        expect(lc.usable, f"the CPU worker's level-2 sleep changed the draft: {lc.state.value}")
        worker._sleep_saved_parameters = {f"draft.{n}": p for n, p in draft.named_parameters()}
        wrap_sleep(CPUWorker.sleep)(worker, level=2)  # every parameter preserved (`sleep_preserve_parameter_names`)
        expect(lc.usable, "a level-2 sleep that preserved every draft parameter quarantined the draft")
        done.append("the CPU worker's sleep, and a level-2 sleep preserving the draft's parameters: still serving")

        saved = {n: t.detach().clone() for n, t in draft.named_buffers()}  # vLLM saves every buffer to CPU
        worker._sleep_saved_parameters = {}
        wrap_sleep(CPUWorker.sleep)(worker, 2)  # the wrapper, after vLLM's sleep returned
        with torch.no_grad():
            for p in draft.parameters():  # the allocator frees them; on wake the same addresses hold other bytes
                if p.numel() and p.dtype.is_floating_point:
                    p.normal_()
            for n, t in draft.named_buffers():  # vLLM's wake copies every saved buffer back in place
                t.copy_(saved[n])
        expect(lc.quarantined and lc.recovery_blocker is not None, f"after a level-2 sleep: {lc.state.value}")
        expect(not drafting_allowed_for(draft), "the drafting gate is open on discarded weights")
        try:
            b.require_usable("draft")
        except QuarantinedError as e:
            expect("level-2 sleep" in str(e), f"refused without the cause: {e}")
        else:
            raise AssertionError("the fused path ran on discarded weights")
        expect(any(e["event"] == "weights_discarded" for e in lc.recent_events), "no weights_discarded event")
        done.append("a level-2 sleep: quarantined, not recoverable, not drafting, audited weights_discarded")

        cfg = draft.vllm_config.speculative_config.draft_model_config
        tensors = read(folders["B"])
        b.lifecycle_runtime.reload_partial = "keep"
        try:
            write_draft(draft, cfg, [(n, t) for n, t in tensors if not n.startswith("layers.1.")],
                        "buckets_later_layers_first")
        except LayersNotReadyError as e:
            expect("level-2 sleep" in str(e) and "layers.1" in str(e), f"refused with {e}")
        else:
            raise AssertionError("a refill that left a layer out kept what the sleep left there")
        expect(lc.quarantined, "a refused refill left the draft serving")
        done.append("a refill that leaves a layer out (partial='keep') is refused, naming the sleep")

        epoch = lc.epoch
        write_draft(draft, cfg, tensors, "buckets_later_layers_first")
        weights, derived = weight_digests(draft), derived_digests(draft)
        wrong = sorted(n for n in ref["weights"] if weights.get(n) != ref["weights"][n])
        wrong += sorted(n for n in ref["derived"] if derived.get(n) != ref["derived"][n])
        moved = sorted(n for n, ident in identities(draft).items() if pinned.get(n) != ident)
        expect(lc.usable and drafting_allowed_for(draft), f"after the refill: {lc.state.value}")
        expect(not wrong and not moved, f"after the refill: differ {wrong}, moved {moved}")
        expect(lc.epoch == epoch + 1, "the refill was not an epoch of its own")
        done.append("the refill: its own epoch, equal to a cold load, in place at the captured addresses")
    return {"layout": layout, "done": done}


def main() -> None:
    scenario, layout, work = sys.argv[1:]
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    run = {"lilicorr": run_lilicorr, "deepseek_v4": run_deepseek_v4, "hand_write": run_hand_write,
           "listed": run_listed, "sleep": run_sleep}[scenario]
    try:
        result: dict[str, Any] = {"ok": True, **run(Path(work), layout)}
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if f.filename.endswith("vllm_new_family_runs.py") and f.name not in ("expect", "main")]
        where = " <- ".join(f"vllm_new_family_runs.py:{f.lineno} {f.line}" for f in reversed(frames)) or "?"
        result = {"ok": False, "failed": f"{where}: {type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    print(RESULT + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
