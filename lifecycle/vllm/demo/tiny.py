"""Tiny real checkpoints for a real engine: a Qwen3 target and a DFlash draft (made on the spot, no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...loading import write_checkpoint

__all__ = ["ENGINE_ENV", "dflash_draft_tensors", "engine_kwargs", "make_dflash_draft", "make_target"]

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 1, 32, 256  # head_dim 32: the CPU backend has it


def make_target(folder: str | Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3 target saved by transformers (safetensors)."""
    import transformers

    folder = Path(folder)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                   num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   head_dim=HEAD_DIM, tie_word_embeddings=False, max_position_embeddings=256)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def dflash_draft_tensors(seed: int, layers: int = 2, target_features: int = 2) -> dict[str, torch.Tensor]:
    """Checkpoint-format DFlash draft tensors (separate q/k/v and gate/up, as trainers save them)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        scaled: torch.Tensor = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
        return scaled

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    t: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        t[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = w(INTER, HIDDEN)
        t[p + "mlp.up_proj.weight"] = w(INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"] = w(HIDDEN, INTER)
        t[p + "input_layernorm.weight"] = norm(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
    t["fc.weight"] = w(HIDDEN, HIDDEN * target_features)
    t["hidden_norm.weight"] = norm(HIDDEN)
    t["norm.weight"] = norm(HIDDEN)
    return t


def make_dflash_draft(folder: str | Path, seed: int, layers: int = 2) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "float32", "block_size": 4,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1]},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_checkpoint(dflash_draft_tensors(seed, layers), folder / "model.safetensors")
    return folder


ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def engine_kwargs(target: str | Path, draft: str | Path, *, plugin: bool = True,
                  method: str = "dflash") -> dict[str, object]:
    """`LLM(**engine_kwargs(...))`: a tiny in-process CPU engine with speculative decoding (`method`, DFlash by
    default); with `plugin`, also the lifecycle RPCs and the plugin's `safetensors_file` weight-transfer engine."""
    kwargs: dict[str, object] = dict(
        model=str(target), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, dtype="float32",
        max_num_seqs=4, max_num_batched_tokens=128, seed=0,
        speculative_config={"method": method, "model": str(draft), "num_speculative_tokens": 3})
    if plugin:
        kwargs["worker_extension_cls"] = "lifecycle.vllm.worker.LifecycleWorkerExtension"
        kwargs["weight_transfer_config"] = {"backend": "safetensors_file"}
    return kwargs
