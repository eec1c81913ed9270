"""The drafts `benchmarks.engine_push` pushes into a live engine, their checkpoints, and the buckets of each push.

A draft checkpoint is a folder of shards: the tensors outside the decoder layers in the first file, then one file
per decoder layer (as a trainer that writes one shard per layer sends them). Every push reads the same files:
  whole   one `load_weights` call with every tensor (`update_weights` of the folder)
  layer   one call per shard, i.e. per decoder layer (one `update_weights` per shard file)
  tensor  one call per tensor (`update_weights` of the folder with `bucket_size=1`)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lifecycle.checkpoint import checkpoint_files, checkpoint_index
from lifecycle.loading import write_checkpoint

__all__ = ["BUCKETS", "SHAPES", "EngineShape", "buckets_of", "kv_rows", "make_checkpoints", "shard_files"]

BUCKETS = ("whole", "layer", "tensor")
VOCAB = 256  # a tiny vocabulary: the embeddings and LM head (the draft shares the target's) stay small


@dataclass(frozen=True)
class EngineShape:
    """A Qwen3 target and a DFlash draft of the same width (fp32, as the suite's engines run)."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_layers: int
    target_layers: int = 2
    note: str = ""

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def fused_kv_bytes(self) -> int:
        """The draft's fused K/V buffer: every layer's K and V rows, fp32."""
        return self.draft_layers * 2 * self.kv_size * self.hidden * 4

    def describe(self) -> str:
        return (f"DFlash draft {self.draft_layers} layers, hidden {self.hidden}, {self.heads} heads x {self.head_dim}, "
                f"{self.kv_heads} KV heads, MLP {self.intermediate}, fp32, on a {self.target_layers}-layer Qwen3 "
                f"target of the same width")


SHAPES = {
    # real width (Qwen3-1.7B's attention: hidden 2048, 16 x 128 heads, 8 KV heads), a narrow MLP to keep the peak
    # of two engines at once modest on a shared 24 GiB machine
    "dflash-2k": EngineShape("dflash-2k", 2048, 2048, 16, 8, 128, 4,
                             note="real width, narrow MLP: hundreds of MB"),
    # lifecycle.vllm.demo.tiny's sizes: the fixed cost of a push, where the copies are negligible
    "tiny": EngineShape("tiny", 64, 128, 2, 1, 32, 2, note="the suite's tiny draft: the fixed cost"),
}


def _config(shape: EngineShape, layers: int) -> dict[str, object]:
    return {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate, "num_hidden_layers": layers,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": False,
            "torch_dtype": "float32"}


def make_target(folder: Path, shape: EngineShape, seed: int = 0) -> Path:
    """The Qwen3 target, saved by transformers."""
    import transformers

    cfg = transformers.Qwen3Config(**{k: v for k, v in _config(shape, shape.target_layers).items()
                                      if k not in ("model_type", "torch_dtype")})
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def draft_tensors(shape: EngineShape, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-format DFlash draft tensors (separate q/k/v and gate/up, as trainers save them)."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter = shape.hidden, shape.heads * shape.head_dim, shape.kv_size, shape.intermediate

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    t: dict[str, torch.Tensor] = {"fc.weight": w(h, h * shape.target_layers), "hidden_norm.weight": norm(h),
                                  "norm.weight": norm(h)}
    for i in range(shape.draft_layers):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                  p + "self_attn.q_norm.weight": norm(shape.head_dim),
                  p + "self_attn.k_norm.weight": norm(shape.head_dim),
                  p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                  p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": norm(h),
                  p + "post_attention_layernorm.weight": norm(h)})
    return t


def make_draft(folder: Path, shape: EngineShape, seed: int) -> Path:
    """config.json and the shards: the non-layer tensors first, then one file per decoder layer."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**_config(shape, shape.draft_layers), "architectures": ["DFlashDraftModel"], "block_size": 4,
              "dflash_config": {"mask_token_id": VOCAB - 1,
                                "target_layer_ids": list(range(shape.target_layers))}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tensors = draft_tensors(shape, seed)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        key = name.split(".")[1] if name.startswith("layers.") else "rest"
        shards.setdefault(key, {})[name] = value
    order = ["rest", *(str(i) for i in range(shape.draft_layers))]
    for n, key in enumerate(order):
        write_checkpoint(shards[key], folder / f"model-{n:05d}-of-{len(order):05d}.safetensors")
    return folder


def make_checkpoints(work: Path, shape: EngineShape) -> dict[str, Path]:
    """The target and two drafts (A, B: different random values), under `work/shape.name`."""
    base = work / shape.name
    return {"target": make_target(base / "target", shape), "A": make_draft(base / "draftA", shape, 1),
            "B": make_draft(base / "draftB", shape, 2)}


def shard_files(draft: Path) -> list[Path]:
    return checkpoint_files(draft)


def buckets_of(draft: Path, bucket: str) -> list[list[str]]:
    """The names of each `load_weights` call of a push (see the module docstring), in the order the plugin's
    reader sends them."""
    if bucket == "layer":
        return [list(checkpoint_index(f)) for f in shard_files(draft)]
    names = list(checkpoint_index(draft))
    return [names] if bucket == "whole" else [[n] for n in names]


def kv_rows(tensors: dict[str, torch.Tensor], layers: int) -> torch.Tensor:
    """What the fused K/V buffer must hold after a push of `tensors`: each layer's K rows, then its V rows."""
    return torch.cat([torch.cat([tensors[f"layers.{i}.self_attn.k_proj.weight"],
                                 tensors[f"layers.{i}.self_attn.v_proj.weight"]]) for i in range(layers)])
