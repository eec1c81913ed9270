"""Engine failure scenarios for tests/vllm_plugin/reload/test_vllm_failures.py, one engine per scenario, every case on
that engine:

    PYTHONPATH=.:tests python -m support.vllm_failure_scenarios SCENARIO WORKDIR   -> prints one JSON line

Each case makes a reload fail at one point (arguments, before the first bucket, mid-bucket, a checkpoint that
changes while read, in finalize, in the refresh, a partial payload), then records the draft's state, a
`generate` (and whether the drafter ran), and the corrected call retried on the same engine. vLLM is imported
inside the functions only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from support.vllm_basic_scenarios import _generate, _try, fingerprint, main

LAYER1 = "layers.1."
NOT_LAYER1 = ["layers.0.", "fc.", "hidden_norm.", "norm."]


# ---- checkpoints made for the scenario ------------------------------------------------------------------------


def _variant(work: Path, name: str, tensors: dict[str, Any], config_from: str = "draftB") -> Path:
    from lifecycle.loading import write_checkpoint

    folder = work / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text((work / config_from / "config.json").read_text())
    write_checkpoint(tensors, folder / "model.safetensors")
    return folder


def make_variants(work: Path) -> None:
    """draftM: draft B with layer 1 of draft A (so a keep-reload of B's layer 1 makes B); bad_shape: B with a
    tensor of another shape in layer 1; short_row / long_row: B with layer 1's k_proj a row short / long;
    bogus_first: B plus a name the draft does not have, sorted first;
    only_k0 / only_k0_b: draft A's / B's layer-0 k_proj alone; dup_q0_no_k0: B without layer 0's k_proj and with
    its q_proj a second time under `midlayer.` (vLLM's DFlash alias of `layers.0.`: the elements vLLM counts add
    up); changing: a copy of B that a case rewrites; an empty folder; a FIFO; sparse_tib: B whose layer-1
    down_proj claims 1 TiB (a hole); deeper_target: the target's checkpoint with two more layers (another model's
    folder)."""
    import torch
    from safetensors.torch import load_file

    from lifecycle.checkpoint import write_checkpoint
    from lifecycle.vllm.demo.tiny import dflash_draft_tensors
    from support.sparse_checkpoints import write_with_sparse_tensor

    a, b = dflash_draft_tensors(1), dflash_draft_tensors(2)
    _variant(work, "draftM", {n: (a[n] if n.startswith(LAYER1) else t) for n, t in b.items()})
    _variant(work, "bad_shape", {**b, "layers.1.mlp.down_proj.weight": torch.zeros(64, 96)})
    k1 = "layers.1.self_attn.k_proj.weight"  # a shard of the fused qkv_proj, within its bound either way
    _variant(work, "short_row", {**b, k1: b[k1][:-1].clone()})
    _variant(work, "long_row", {**b, k1: torch.cat([b[k1], b[k1][:1]])})
    _variant(work, "bogus_first", {**b, "a_bogus.weight": torch.zeros(4)})
    _variant(work, "only_k0", {"layers.0.self_attn.k_proj.weight": a["layers.0.self_attn.k_proj.weight"]})
    _variant(work, "only_k0_b", {"layers.0.self_attn.k_proj.weight": b["layers.0.self_attn.k_proj.weight"]})
    k0, q0 = "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.q_proj.weight"
    _variant(work, "dup_q0_no_k0", {**{n: t for n, t in b.items() if n != k0},
                                    "midlayer.self_attn.q_proj.weight": b[q0].clone()})  # its own bytes on disk
    _variant(work, "changing", b)
    (work / "empty").mkdir(exist_ok=True)
    big = "layers.1.mlp.down_proj.weight"
    write_with_sparse_tensor(work / "sparse_tib" / "model.safetensors", {n: t for n, t in b.items() if n != big},
                             big, (2**38,))
    target = load_file(str(work / "target" / "model.safetensors"))
    for extra in (2, 3):
        target |= {n.replace("layers.1.", f"layers.{extra}."): t.clone() for n, t in target.items()
                   if n.startswith("model.layers.1.")}
    write_checkpoint(target, work / "deeper_target" / "model.safetensors")
    fifo = work / "fifo.safetensors"
    if not fifo.exists():
        os.mkfifo(fifo)


# ---- what each case records -----------------------------------------------------------------------------------


def _engine(work: Path, draft: str, **extra: Any) -> Any:
    from vllm import LLM

    from lifecycle.vllm.demo.tiny import engine_kwargs

    return LLM(**engine_kwargs(work / "target", work / draft), **extra)


def _draft_state(llm: Any) -> dict[str, Any]:
    (rank0,) = llm.collective_rpc("lifecycle_states")
    return next(s for s in rank0 if s["role"] == "draft")


def _events_since(llm: Any, seq: int) -> list[dict[str, Any]]:
    events = llm.collective_rpc("lifecycle_events", kwargs={"last": 256})[0]
    keys = ("event", "trigger", "src", "dst", "reason", "rolled_back", "recoverable", "steps_without_draft", "state")
    return [{k: e.get(k) for k in keys} for e in events if e.get("seq", 0) > seq]


def _last_seq(llm: Any) -> int:
    return max((e.get("seq", 0) for e in llm.collective_rpc("lifecycle_events", kwargs={"last": 1})[0]), default=0)


def _served(llm: Any) -> dict[str, Any]:
    return _try(lambda: _generate(llm))


def _reload(llm: Any, path: Path, **kwargs: Any) -> Any:
    return lambda: llm.collective_rpc("reload_draft_weights", args=(str(path),), kwargs=kwargs)


def _case(llm: Any, call: Any, retry: Any, *, fingerprinted: bool = False, probe: Any = None) -> dict[str, Any]:
    """The failing call, the state it left (and the draft's fingerprint, or what `probe` in the worker says),
    serving, the corrected retry, serving again, and the events."""
    seen = _last_seq(llm)
    out: dict[str, Any] = {"call": _try(call), "state": _draft_state(llm)}
    if fingerprinted:
        out["fingerprint"] = llm.collective_rpc(fingerprint)
    if probe is not None:
        out["probe"] = llm.collective_rpc(probe)
    out["generate"] = _served(llm)
    out["retry"] = _try(retry)
    out["state_after_retry"] = _draft_state(llm)
    out["generate_after_retry"] = _served(llm)
    out["events"] = _events_since(llm, seen)
    return out


# ---- faults injected inside the engine process (collective_rpc runs these in the worker) ----------------------


def _backbone(worker: Any) -> Any:
    from lifecycle.vllm.drafts.owners import backbones_in

    (b,) = backbones_in(worker.model_runner.get_draft_model())
    return b


def _change_file_after_first_bucket(worker: Any, path: str, how: str) -> str:
    """A trainer writing the checkpoint while the engine reads it: after the first bucket, the file is rewritten
    in place (same size, new values) or truncated. The instance attribute shadows load_weights once."""
    draft = worker.model_runner.get_draft_model()
    cls_load = type(draft).load_weights

    def load_weights(weights: Any) -> Any:
        result = cls_load(draft, weights)
        del draft.load_weights  # once
        p = Path(path)
        if how == "truncate":
            os.truncate(p, p.stat().st_size // 2)
        else:
            data = bytearray(p.read_bytes())
            data[-4096:] = bytes(4096)
            with p.open("r+b") as fh:
                fh.write(data)
            st = p.stat()
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        return result

    draft.load_weights = load_weights
    return "armed"


def _raise_in_first_load_weights(worker: Any) -> str:
    """vLLM's load_weights raises on the first bucket, before it wrote anything (once)."""
    draft = worker.model_runner.get_draft_model()

    def load_weights(weights: Any) -> Any:
        del draft.load_weights  # once
        raise ValueError("injected: load_weights failed on the first bucket")

    draft.load_weights = load_weights
    return "armed"


def _raise_in_second_load_weights(worker: Any) -> str:
    """vLLM's load_weights raises on the second bucket, after the first was written (once)."""
    draft = worker.model_runner.get_draft_model()
    cls_load = type(draft).load_weights
    calls = []

    def load_weights(weights: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            return cls_load(draft, weights)
        del draft.load_weights  # once
        raise RuntimeError("injected: load_weights failed on the second bucket")

    draft.load_weights = load_weights
    return "armed"


def _raise_in_reload_hook(worker: Any) -> str:
    from lifecycle.hooks import Phase

    b = _backbone(worker)

    def rescale(_m: Any) -> None:
        b._runtime_hooks[:] = [h for h in b._runtime_hooks if h.name != "rescale"]  # once
        raise RuntimeError("injected: reload hook failed")

    b.register_post_load_hook(rescale, Phase.RELOAD)
    return "armed"


def _raise_in_vllm_finalize(worker: Any) -> str:
    """vLLM's own finalize fails: the first draft attention layer's processing raises, once."""
    attn = worker.model_runner.get_draft_model().model.layers[0].self_attn.attn

    def process_weights_after_loading(*args: Any, **kwargs: Any) -> None:
        del attn.process_weights_after_loading  # once
        raise RuntimeError("injected: attention processing failed")

    attn.process_weights_after_loading = process_weights_after_loading
    return "armed"


def _raise_in_refresh(worker: Any) -> str:
    """A derived builder raises in the refresh plan, once."""
    import dataclasses

    b = _backbone(worker)
    specs = b.derived_buffers
    calls = []

    def per_layer(layer: Any) -> Any:
        calls.append(1)
        b.derived_buffers = specs  # once
        raise RuntimeError("injected: k-norm builder failed")

    b.derived_buffers = tuple(dataclasses.replace(s, per_layer=per_layer) if s.name == "_k_norm_weights" else s
                              for s in specs)
    return "armed"


def _fused_path_while_quarantined(worker: Any) -> dict[str, str]:
    """The fused path of a quarantined draft: a dummy run (no slots) is skipped, a real one refused."""
    import torch

    b = _backbone(worker)
    states, positions = torch.zeros(2, 64), torch.zeros(2, dtype=torch.long)
    out = {"dummy": repr(b.precompute_and_store_context_kv(states, positions))}
    try:
        b.precompute_and_store_context_kv(states, positions, torch.zeros(2, dtype=torch.long))
        out["real"] = "ran"
    except Exception as e:
        out["real"] = type(e).__name__
    return out


def _verl_style(worker: Any, path: str, config: str) -> str:
    """initialize -> load_weights -> finalize called directly (veRL); `config`: 'config' (the draft's model
    config), 'none' (no config: a wrong call), 'initialize_only' (the trainer dies before finalize)."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    draft = worker.model_runner.get_draft_model()
    cfg = worker.vllm_config.speculative_config.draft_model_config
    initialize_layerwise_reload(draft)
    draft.load_weights(list(load_file(path).items()))
    if config == "initialize_only":
        return "left open"
    finalize_layerwise_reload(draft, None if config == "none" else cfg)
    return "finalized"


# ---- the scenarios --------------------------------------------------------------------------------------------


def scenario_failures(work: Path) -> dict[str, Any]:
    """CPU layout (weights repacked, `weight` emptied). RELOAD_LIFECYCLE_PATH_ROOT is the work folder."""
    make_variants(work)
    llm = _engine(work, "draftM")
    out: dict[str, Any] = {"generate_cold": _served(llm), "pinned": llm.collective_rpc("lifecycle_pin")}
    fp_m = llm.collective_rpc(fingerprint)

    # partial='keep': one layer of B into M (= B), then a fused parameter sent in part (cannot be kept on CPU)
    out["keep_one_layer"] = _try(_reload(llm, work / "draftB", exclude_prefixes=NOT_LAYER1, partial="keep",
                                         bucket_size=3))
    out["keep_state"] = _draft_state(llm)
    out["keep_digests"] = llm.collective_rpc("lifecycle_derived_digests")
    out["keep_fingerprint"] = llm.collective_rpc(fingerprint)
    out["keep_events"] = [e for e in llm.collective_rpc("lifecycle_events", kwargs={"last": 60})[0]
                          if e["event"] in ("partial_reload", "layers_unchanged", "refresh", "transition")]
    out["keep_generate"] = _served(llm)
    out["keep_part_of_a_tensor"] = _case(llm, _reload(llm, work / "only_k0", partial="keep"),
                                         _reload(llm, work / "draftB"), fingerprinted=True)
    out["partial_refuse"] = _case(llm, _reload(llm, work / "draftA", exclude_prefixes=[LAYER1]),
                                  _reload(llm, work / "draftB"), fingerprinted=True)
    out["fused_path_while_quarantined"] = _case(llm, _reload(llm, work / "draftA", exclude_prefixes=[LAYER1]),
                                                _reload(llm, work / "draftB"), probe=_fused_path_while_quarantined)

    # arguments and paths: refused before the draft is touched
    outside = Path(tempfile.mkdtemp(prefix="outside-root-"))
    untouched = {
        "empty_folder": _reload(llm, work / "empty"),
        "missing_path": _reload(llm, work / "nope"),
        "fifo": _reload(llm, work / "fifo.safetensors"),
        "outside_root": _reload(llm, outside),
        "bucket_size_str": _reload(llm, work / "draftA", bucket_size="2"),
        "bucket_size_zero": _reload(llm, work / "draftA", bucket_size=0),
        "prefixes_str": _reload(llm, work / "draftA", exclude_prefixes=LAYER1),
        "everything_excluded": _reload(llm, work / "draftA", exclude_prefixes=["layers.", "fc.", "hidden_norm.",
                                                                               "norm."]),
        "partial_unknown": _reload(llm, work / "draftA", partial="maybe"),
        # from the headers alone, before a byte of data is read (lifecycle/vllm/expected.py)
        "sparse_tib": _reload(llm, work / "sparse_tib"),
        "target_folder": _reload(llm, work / "deeper_target"),
        "bogus_name": _reload(llm, work / "bogus_first", bucket_size=1),
        # a tensor of another shape, exactly from the header (issue 32, item 5): vLLM's check ran mid-load
        "bad_shape": _reload(llm, work / "bad_shape"),
        "short_row": _reload(llm, work / "short_row"),
        "long_row": _reload(llm, work / "long_row"),
    }
    out["untouched"] = {}
    for name, call in untouched.items():
        before = _draft_state(llm)
        out["untouched"][name] = {"call": _try(call), "before": before, "after": _draft_state(llm)}
    out["untouched_generate"] = _served(llm)
    out["untouched_retry"] = _try(_reload(llm, work / "draftA", bucket_size=2, exclude_prefixes=[]))
    out["default_plan"] = _try(_reload(llm, work / "draftB"))  # no bucket_size: a layer per bucket

    # before the first bucket (the draft was moved to META, nothing written)
    def session(path: Any, key: str = "path") -> Any:
        def run() -> Any:
            llm.collective_rpc("start_draft_weight_update")
            llm.collective_rpc("update_weights", args=({key: path},))
            return llm.collective_rpc("finish_weight_update")
        return run

    out["session_missing_file"] = _case(llm, session(str(work / "vanished")), session(str(work / "draftB")))
    out["session_short_row"] = _case(llm, session(str(work / "short_row")), session(str(work / "draftB")))
    out["session_bad_update_info"] = _case(llm, session(str(work / "draftA"), key="pathh"),
                                           session(str(work / "draftA")))
    out["first_bucket_raises"] = _case(
        llm, lambda: (llm.collective_rpc(_raise_in_first_load_weights),
                      _reload(llm, work / "draftB", bucket_size=1)())[1],
        _reload(llm, work / "draftB", bucket_size=1))
    out["abandoned_reload"] = _case(
        llm, lambda: llm.collective_rpc(_verl_style, args=(str(work / "draftA" / "model.safetensors"),
                                                           "initialize_only")),
        _reload(llm, work / "draftA"))  # generate runs while the reload is still open

    # mid-bucket, and a checkpoint that changes while it is read
    out["mid_bucket"] = _case(
        llm, lambda: (llm.collective_rpc(_raise_in_second_load_weights), _reload(llm, work / "draftA")())[1],
        _reload(llm, work / "draftB"), fingerprinted=True)
    changing = work / "changing" / "model.safetensors"
    original = changing.read_bytes()
    for how in ("rewrite", "truncate"):

        def arm_and_reload(how: str = how) -> Any:
            llm.collective_rpc(_change_file_after_first_bucket, args=(str(changing), how))
            return _reload(llm, work / "changing", bucket_size=5)()

        def restore_and_retry() -> Any:
            changing.write_bytes(original)
            return _reload(llm, work / "changing", bucket_size=5)()

        out[f"changed_while_read_{how}"] = _case(llm, arm_and_reload, restore_and_retry)

    # in finalize, in the refresh
    out["finalize_without_config"] = _case(
        llm, lambda: llm.collective_rpc(_verl_style, args=(str(work / "draftA" / "model.safetensors"), "none")),
        lambda: llm.collective_rpc(_verl_style, args=(str(work / "draftA" / "model.safetensors"), "config")))
    out["reload_hook_raises"] = _case(
        llm, lambda: (llm.collective_rpc(_raise_in_reload_hook), _reload(llm, work / "draftB")())[1],
        _reload(llm, work / "draftB"))
    out["vllm_finalize_raises"] = _case(
        llm, lambda: (llm.collective_rpc(_raise_in_vllm_finalize), _reload(llm, work / "draftA")())[1],
        _reload(llm, work / "draftA"))
    out["refresh_raises"] = _case(
        llm, lambda: (llm.collective_rpc(_raise_in_refresh), _reload(llm, work / "draftB")())[1],
        _reload(llm, work / "draftB"))
    out["final_state"] = _draft_state(llm)
    out["verify"] = llm.collective_rpc("lifecycle_verify")
    out["fingerprint_m"] = fp_m
    return out


def scenario_gpu_layout(work: Path) -> dict[str, Any]:
    """The GPU layout on CPU: unquantized weights kept after loading (as on CUDA), so a module sent in part can
    be completed with its last values. RELOAD_LIFECYCLE_PARTIAL=keep is the engine-wide setting here."""
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    def keep_weight(self: Any, layer: Any) -> None:
        layer.cpu_linear = lambda x, w, b: F.linear(x, w, b)

    UnquantizedLinearMethod.process_weights_after_loading = keep_weight
    make_variants(work)
    llm = _engine(work, "draftM")
    out: dict[str, Any] = {"generate_cold": _served(llm), "pinned": llm.collective_rpc("lifecycle_pin")}
    out["fingerprint_m"] = llm.collective_rpc(fingerprint)
    out["keep_k0"] = _try(_reload(llm, work / "only_k0"))  # engine-wide keep: draft A's layer-0 k_proj alone
    out["keep_k0_state"] = _draft_state(llm)
    out["keep_k0_fingerprint"] = llm.collective_rpc(fingerprint)
    out["keep_k0_digests"] = llm.collective_rpc("lifecycle_derived_digests")
    out["keep_k0_generate"] = _served(llm)
    out["refuse_k0"] = _case(llm, _reload(llm, work / "only_k0_b", partial="refuse"),
                             _reload(llm, work / "draftB"), fingerprinted=True)
    # a payload that only looks complete: layer 0's q_proj twice, its k_proj never (issue 24, item 13)
    out["fingerprint_b"] = llm.collective_rpc(fingerprint)
    out["duplicate_shard_refuse"] = _case(llm, _reload(llm, work / "dup_q0_no_k0", partial="refuse"),
                                          _reload(llm, work / "draftB"), fingerprinted=True)
    out["duplicate_shard_keep"] = _try(_reload(llm, work / "dup_q0_no_k0"))  # engine-wide keep
    out["duplicate_shard_keep_state"] = _draft_state(llm)
    out["duplicate_shard_keep_fingerprint"] = llm.collective_rpc(fingerprint)
    out["duplicate_shard_keep_generate"] = _served(llm)
    out["verify"] = llm.collective_rpc("lifecycle_verify")
    return out


if __name__ == "__main__":
    main(globals())
