"""vLLM's own draft classes in-process, without an engine: for families the CPU build cannot start in an engine
(DSpark and DFlash2 need Model Runner V2, which needs Triton; Kimi K3's MLA target does not run on CPU).

Each draft is built under a CPU `VllmConfig` (a tiny Qwen3 target's engine config with the speculative config
attached afterwards, as `../shared/context/VLLM_ON_CPU.md` describes), loaded by vLLM's own loader (`get_model`:
`initialize_model` -> `load_weights` -> `process_weights_after_loading`) and reloaded through vLLM's own reload
functions (`support/vllm_trainer_paths.py`). The plugin is active, so the classes are the lifecycle-enabled ones;
`stock=True` builds vLLM's class itself, to show what the lifecycle guards against.

Reusable per family: `setup()` once per process, then `make_draft(case, folder, seed)`, `build(case, ...)`.
Importing this module imports no vLLM; every function imports it when called.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lifecycle.loading import write_checkpoint
from lifecycle.vllm.demo.tiny import ENGINE_ENV, HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, VOCAB
from lifecycle.vllm.drafts.families import family

__all__ = ["CASES", "HEAD", "LISTED_CASES", "STRUCTURE", "DraftCase", "build", "build_target", "gpu_weight_layout",
           "make_draft", "memory", "setup", "share_target"]

ENV = {**ENGINE_ENV, "VLLM_KIMI_K3_GEMM_AR": "0"}

_BASE = {
    "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
    "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "float32",
    "hidden_act": "silu", "block_size": 4, "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1]},
}


@dataclass(frozen=True)
class DraftCase:
    """A tiny draft of one family: its config, the speculative method that serves it, how its checkpoint names
    relate to vLLM's parameter names."""

    family: str  # lifecycle.vllm.drafts.families name (or a drafts.underived name: vLLM's own class serves it)
    method: str  # speculative_config["method"]
    config: dict[str, Any]
    split: Callable[[str, torch.Tensor, Any], list[tuple[str, torch.Tensor]]] | None = None  # vLLM name -> ckpt
    drop: tuple[str, ...] = ("embed_tokens.", "lm_head.")  # shared with the target: not in a draft checkpoint
    cpu_fixups: tuple[str, ...] = ()  # module name suffixes whose linear must not be repacked on CPU (K3's MLA)
    engine: bool = False  # the CPU build starts an engine with it
    extra: dict[str, Any] = field(default_factory=dict)  # speculative_config extras

    def with_structure(self) -> DraftCase:
        """The same family with every optional submodule it can have (`STRUCTURE`): a confidence head, its own
        embeddings and lm_head, a reduced output vocabulary with its d2t map."""
        return replace(self, config={**self.config, **STRUCTURE[self.family]}, drop=())


def _split_fused(name: str, t: torch.Tensor, model: Any) -> list[tuple[str, torch.Tensor]]:
    """vLLM's fused parameters back to the separate tensors trainers save (q/k/v, gate/up, K3's q_a/kv_a)."""
    stem, _, leaf = name.rpartition(".")
    owner_name, _, proj = stem.rpartition(".")
    if proj == "qkv_proj":
        attn = model.get_submodule(owner_name)
        q, kv = attn.q_size, attn.kv_size
        return [(f"{owner_name}.q_proj.{leaf}", t[:q]), (f"{owner_name}.k_proj.{leaf}", t[q:q + kv]),
                (f"{owner_name}.v_proj.{leaf}", t[q + kv:])]
    if proj == "gate_up_proj":
        half = t.shape[0] // 2
        return [(f"{owner_name}.gate_proj.{leaf}", t[:half]), (f"{owner_name}.up_proj.{leaf}", t[half:])]
    if proj == "fused_qkv_a_proj":
        q = model.get_submodule(owner_name).q_lora_rank
        return [(f"{owner_name}.q_a_proj.{leaf}", t[:q]), (f"{owner_name}.kv_a_proj_with_mqa.{leaf}", t[q:])]
    if proj == "context_kv_proj":  # K3's loader builds it from every layer's kv_a_proj_with_mqa
        return []
    return [(name, t)]


CASES: dict[str, DraftCase] = {
    "dflash": DraftCase("dflash", "dflash", {**_BASE, "architectures": ["DFlashDraftModel"]}, _split_fused,
                        engine=True),
    "laguna_dflash": DraftCase("laguna_dflash", "dflash", {
        **_BASE, "model_type": "laguna", "architectures": ["DFlashLagunaForCausalLM"], "draft_vocab_size": VOCAB,
        "layer_types": ["full_attention"] * 2, "gating": False, "num_experts": 0, "attention_bias": False,
        "partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }, engine=True),
    "qwen3_dspark": DraftCase("qwen3_dspark", "dspark", {**_BASE, "architectures": ["Qwen3DSparkModel"],
                                                        "markov_rank": 16}, _split_fused),
    "dflash2": DraftCase("dflash2", "dflash", {
        **_BASE, "architectures": ["DFlash2DraftModel"],
        "dflash_config": {**_BASE["dflash_config"], "conv_kernel_size": 3, "conv_group_size": 16,
                          "selector_rank": 8, "selector_top_k": 4}}, _split_fused),
    "gemma4_dspark": DraftCase("gemma4_dspark", "dspark", {
        "model_type": "gemma4_text", "architectures": ["Gemma4DSparkModel"], "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "global_head_dim": HEAD_DIM,
        "layer_types": ["full_attention"] * 2, "attention_k_eq_v": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "torch_dtype": "float32", "tie_word_embeddings": False,
        "target_layer_ids": [0, 1], "markov_rank": 16, "block_size": 4,
    }, _split_fused),
    # served with method="dflash" (vLLM keeps its architecture name); the correlator head on DFlash's layers
    "lilicorr": DraftCase("lilicorr", "dflash", {
        **_BASE, "architectures": ["LiLiCorrDraftModel"],
        "dflash_config": {**_BASE["dflash_config"], "lilicorr_enabled": True, "lilicorr_hidden_size": 0,
                          "lilicorr_candidate_topk": 2, "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2,
                          "lilicorr_factor_dim": 16, "lilicorr_vector_eps": 1e-6, "lilicorr_logit_scale": 8.0,
                          "lilicorr_num_layers": 1, "block_size": 4}}, _split_fused),
    "kimi_k3_dspark": DraftCase("kimi_k3_dspark", "dspark", {
        "model_type": "k3_dspark", "architectures": ["K3DSparkModel"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32, "v_head_dim": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "torch_dtype": "float32", "hidden_act": "silu", "target_hidden_size": HIDDEN, "num_target_layers": 2,
        "target_layer_ids": [0, 1], "markov_rank": 16, "block_size": 4, "tie_word_embeddings": False,
        "first_k_dense_replace": 2, "n_routed_experts": 0,
    }, _split_fused, cpu_fixups=("kv_b_proj",)),
}


#: Drafts the plugin leaves to vLLM (`lifecycle.vllm.drafts.underived`: they derive nothing), that this CPU build
#: constructs: their reload is vLLM's own layerwise reload.
LISTED_CASES: dict[str, DraftCase] = {
    "eagle3_qwen3": DraftCase("eagle3_qwen3", "eagle3", {
        **_BASE, "architectures": ["Eagle3Qwen3ForCausalLM"], "num_hidden_layers": 1, "draft_vocab_size": VOCAB},
        _split_fused, drop=("embed_tokens.",)),
    "eagle_llama": DraftCase("eagle_llama", "eagle", {
        **_BASE, "model_type": "llama", "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1},
        _split_fused, drop=("embed_tokens.", "lm_head.")),
}


#: Per family, the config that gives a draft every optional submodule the family has (besides its own embeddings
#: and lm_head, which only depend on the checkpoint carrying them): a confidence head, a reduced output vocabulary
#: (half the target's, mapped by d2t).
HEAD = {"enable_confidence_head": True, "confidence_head_with_markov": True}
_REDUCED = {"draft_vocab_size": VOCAB // 2}
STRUCTURE: dict[str, dict[str, Any]] = {
    "dflash": _REDUCED, "dflash2": _REDUCED, "laguna_dflash": {}, "qwen3_dspark": {**HEAD, **_REDUCED},
    "gemma4_dspark": HEAD, "kimi_k3_dspark": HEAD, "lilicorr": {},
}


# ---- process set-up --------------------------------------------------------------------------------------------
_READY = False


def setup() -> None:
    """Once per process: engine-free CPU environment, the plugin, vLLM's CPU no-op accelerator, one gloo rank."""
    global _READY
    if _READY:
        return
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import lifecycle.vllm

    lifecycle.vllm.register()
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # the CPU worker does this; the loader calls torch.accelerator.empty_cache()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with socket.socket() as s:  # other processes run engines on this machine: never a fixed port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(_config(None, None, None)):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
    _READY = True


_TARGET: Path | None = None


def _config(case: DraftCase | None, draft_dir: Path | None, target_dir: Path | None) -> Any:
    """The tiny target's engine config; the speculative config attached afterwards (the V1-runner check that
    refuses DSpark runs only at engine validation)."""
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    from lifecycle.vllm.demo.tiny import make_target

    global _TARGET
    if target_dir is None:
        if _TARGET is None:
            import tempfile

            _TARGET = make_target(Path(tempfile.mkdtemp(prefix="inprocess-target-")))
        target_dir = _TARGET
    cfg = EngineArgs(model=str(target_dir), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                     dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, seed=0,
                     enable_prefix_caching=False).create_engine_config()
    if case is not None:
        cfg.speculative_config = SpeculativeConfig(
            method=case.method, model=str(draft_dir), num_speculative_tokens=3, target_model_config=cfg.model_config,
            target_parallel_config=cfg.parallel_config, **case.extra)
    return cfg


# ---- building ----------------------------------------------------------------------------------------------------
def build(case: DraftCase, draft_dir: Path, target_dir: Path | None = None, *, stock: bool = False,
          load: bool = True, load_format: str = "auto") -> Any:
    """The family's draft, cold-loaded from `draft_dir` by vLLM's loader (`load=False`: constructed only;
    `load_format="dummy"`: vLLM's random values, `draft_dir` gives the config only). `stock=True`: vLLM's own
    class, not the lifecycle-enabled one. The returned model has `.vllm_config`."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    cfg = _config(case, draft_dir, target_dir)
    cfg.load_config.load_format = load_format
    draft_config = cfg.speculative_config.draft_model_config
    model_class = _vllm_class(case.family) if stock else None
    loader = get_model_loader(cfg.load_config)

    def create_model(vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix,
                                 model_class=model_class)
        for name, module in model.named_modules():
            if name.endswith(case.cpu_fixups) and case.cpu_fixups:
                module._cpu_skip_gemm_dispatch = True  # as vLLM's generic MLA does; K3's own MLA does not
        return model

    loader.create_model = create_model  # type: ignore[method-assign]
    with set_current_vllm_config(cfg):
        if load:
            model = loader.load_model(vllm_config=cfg, model_config=draft_config)
        else:
            with torch.device("cpu"):
                model = create_model(cfg, draft_config)
    model.vllm_config = cfg
    return model


def _vllm_class(name: str) -> type:
    """vLLM's own class of a family, or of a draft the plugin lists as deriving nothing (`drafts.underived`)."""
    import importlib

    from lifecycle.vllm.drafts.underived import UNDERIVED

    listed = {u.name: (u.module, u.cls) for u in UNDERIVED}
    module, cls = listed[name] if name in listed else (family(name).module, family(name).causal_lm)
    found: type = getattr(importlib.import_module(module), cls)
    return found


def build_target(target_dir: Path | None = None) -> Any:
    """The tiny Qwen3 target, loaded by vLLM's loader (for a target reload next to a draft)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    cfg = _config(None, None, target_dir)
    with set_current_vllm_config(cfg):
        model = get_model(vllm_config=cfg)
    model.vllm_config = cfg
    return model


def share_target(draft: Any, target: Any) -> None:
    """As vLLM's proposer does: a draft without its own embeddings / lm_head (its first load carried none) uses
    the target's modules."""
    inner = getattr(draft, "model", None)
    structure = inner.lifecycle_runtime.structure if hasattr(inner, "lifecycle_runtime") else None
    own = structure.frozen if structure is not None else {  # stock vLLM: the flags its load_weights set
        "embed_tokens": getattr(draft, "has_own_embed_tokens", False),
        "lm_head": getattr(draft, "has_own_lm_head", False)}
    inner = draft.model
    if hasattr(inner, "embed_tokens") and not own.get("embed_tokens"):
        del inner.embed_tokens
        inner.embed_tokens = target.model.embed_tokens
    if hasattr(draft, "lm_head") and not own.get("lm_head"):
        del draft.lm_head
        draft.lm_head = target.lm_head


# ---- checkpoints -----------------------------------------------------------------------------------------------
def make_draft(case: DraftCase, folder: Path, seed: int, target_dir: Path | None = None) -> Path:
    """A tiny draft checkpoint of the family (config.json + model.safetensors): every parameter of vLLM's class,
    random, under the names trainers save (fused parameters split back, shared modules left out)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(case.config, indent=1))
    setup()
    model = build(case, folder, target_dir, stock=True, load=False)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        rel = name.removeprefix("model.")
        if rel.startswith(case.drop) or name.startswith(case.drop):
            continue
        if rel == "draft_id_to_target_id":  # trainers save it as d2t: target id - draft id, for sorted target ids
            ids = torch.randperm(VOCAB, generator=g)[:p.shape[0]].sort().values
            tensors["d2t"] = ids - torch.arange(p.shape[0])
            continue
        if not p.dtype.is_floating_point:
            continue
        for ck, t in (case.split or (lambda n, x, m: [(n, x)]))(name, _random_like(p, g), model):
            tensors[ck.removeprefix("model.")] = t.contiguous()
    write_checkpoint(tensors, folder / "model.safetensors")
    return folder


def _random_like(p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if p.dim() == 1:  # norm weights and biases: near one
        return 1 + 0.1 * torch.randn(p.shape, generator=g)
    return torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5


# ---- the GPU weight layout, simulated ------------------------------------------------------------------------
@contextmanager
def gpu_weight_layout() -> Iterator[None]:
    """On CUDA an unquantized linear layer keeps its weight after post-processing; on CPU vLLM repacks it into a
    oneDNN handle and empties `weight`. Inside this block (and for models processed inside it) linear layers
    keep their weight and run `torch.nn.functional.linear`, as on a GPU."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    original = UnquantizedLinearMethod.process_weights_after_loading

    def keep_weight(self: Any, layer: torch.nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    UnquantizedLinearMethod.process_weights_after_loading = keep_weight  # type: ignore[method-assign]
    try:
        yield
    finally:
        UnquantizedLinearMethod.process_weights_after_loading = original  # type: ignore[method-assign]


# ---- what the tests compare -------------------------------------------------------------------------------------
def backbone(model: Any) -> Any:
    from lifecycle.vllm.drafts.owners import backbones_in

    (b,) = backbones_in(model)
    return b


def digest(t: torch.Tensor | None) -> str:
    import hashlib

    if t is None:
        return "none"
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def derived_digests(model: Any) -> dict[str, str]:
    b = backbone(model)
    return {n: digest(b._buffers.get(n)) for n in b.derived_buffer_names()}


def weight_digests(model: Any) -> dict[str, str]:
    """Every tensor the lifecycle tracks (parameters and checkpoint-layout shadows), as it is now."""
    b = backbone(model)
    return {n: digest(b.live_tensor(n)) for n in b.lifecycle.specs}


def memory(model: Any, fam: str) -> dict[str, Any]:
    """What a draft (the plugin's or stock vLLM's) holds: `bytes`, of the distinct storages behind its parameters,
    buffers and the tensors the family's builders set (stock vLLM keeps them as plain attributes); its K/V
    shadows: how many, how many are views of a derived buffer's storage, and the bytes of those that are not."""
    from lifecycle.vllm.drafts.families import SHADOW, family
    from lifecycle.vllm.drafts.shadows import shadow_bytes_apart

    inner = model.model
    tensors = [*model.parameters(), *model.buffers(), *(getattr(inner, n, None) for n in family(fam).sets)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor) and not t.is_meta}
    shadows = [t for m in inner.modules() if isinstance(t := m._buffers.get(SHADOW), torch.Tensor)]
    derived = {t.untyped_storage().data_ptr() for n in family(fam).sets
               if isinstance(t := getattr(inner, n, None), torch.Tensor)}
    return {"bytes": sum(storages.values()), "shadows": len(shadows),
            "shadow_views": sum(t.untyped_storage().data_ptr() in derived for t in shadows),
            "shadow_bytes_apart": shadow_bytes_apart(inner) if hasattr(inner, "derived_buffer_names") else 0}


def identities(model: Any) -> dict[str, list[Any]]:
    """(data_ptr, shape) of every derived buffer: what a captured graph reads."""
    b = backbone(model)
    return {n: [t.data_ptr(), list(t.shape)] for n in b.derived_buffer_names()
            if (t := b._buffers.get(n)) is not None}


def transfer_session(draft: Any, weights: Path) -> Callable[[], None]:
    """vLLM's native draft session, as the worker runs it, with the plugin's safetensors_file transfer engine."""

    def run() -> None:
        from vllm.config.weight_transfer import WeightTransferConfig

        from lifecycle.vllm.online.transfer import FileUpdateInfo, engine_class

        cfg = draft.vllm_config
        engine = engine_class()(WeightTransferConfig(backend="safetensors_file"), cfg, torch.device("cpu"), draft)
        engine.set_weight_update_target(draft, cfg.speculative_config.draft_model_config)
        engine.start_weight_update()
        engine.receive_weights(FileUpdateInfo(path=str(weights)))
        engine.finish_weight_update()
        engine.reset_weight_update_target()

    return run


def target_reload(target: Any) -> Callable[[], None]:
    """vLLM's in-place reload of the target from its own checkpoint (what `Worker.reload_weights` runs)."""

    def run() -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        cfg = target.vllm_config
        with set_current_vllm_config(cfg):
            reload_weights(cfg, target, None, cfg.model_config.model, True)

    return run


def vllm_builder_values(model: Any) -> dict[str, Any]:
    """What vLLM's OWN builders would set from the draft's current weights, computed on a shallow copy of the
    backbone whose class is vLLM's (the lifecycle's buffers are untouched). Meaningful where the weights keep
    their checkpoint layout (the GPU layout)."""
    import copy

    from lifecycle.vllm.drafts.families import family

    b = backbone(model)
    fam = family(model.lifecycle_family)
    probe = copy.copy(b)
    probe.__dict__ = dict(b.__dict__)
    probe._buffers = dict(b._buffers)
    probe.__class__ = next(c for c in type(b).__mro__[1:] if c.__module__.startswith("vllm."))
    for builder in fam.builders:
        getattr(probe, builder)()
    return {name: probe.__dict__.get(name, probe._buffers.get(name)) for name in fam.sets}
