"""The tracking benchmarks' drafts and their two loaders: the safetensors loader WITH the lifecycle, and the same
streaming and copying WITHOUT it (`benchmarks.tracking_overhead`, `benchmarks.tracking_breakdown`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import ManyTensorConfig, ManyTensorDraft
from lifecycle import DraftBackbone, Phase
from lifecycle.loading import (
    IndexEntry,
    checkpoint_index,
    iter_buckets,
    load_safetensors,
    plan_buckets,
    write_tensor,
)
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft


@dataclass
class Shape:
    name: str
    build: Callable[[], DraftBackbone]
    note: str
    repeats: float = 1.0  # share of --repeats (the real-size shape reads 1.5 GB a round)


def shapes(quick: bool) -> list[Shape]:
    if quick:
        mt = ManyTensorConfig(hidden_size=32, num_hidden_layers=2, num_experts=4, expert_intermediate_size=8,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        df = DFlashConfig(num_hidden_layers=4)
        real = DFlashConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, dtype=torch.bfloat16)
    else:
        mt = ManyTensorConfig()
        df = DFlashConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=256, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64)
        real = DFlashConfig(hidden_size=4096, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, dtype=torch.bfloat16)
    return [
        Shape("many-tensor", lambda: ManyTensorDraft(mt, name="many-tensor"),
              f"{mt.num_hidden_layers} layers x {7 + 2 * mt.num_experts} tensors (MoE-style), fp32"),
        Shape("dflash-deep", lambda: DFlashQwen3Draft(df, name="dflash-deep"),
              f"DFlash, {df.num_hidden_layers} layers x 8 tensors, hidden {df.hidden_size}, fp32"),
        Shape("dflash-8x4k", lambda: DFlashQwen3Draft(real, name="dflash-8x4k"),
              f"DFlash, {real.num_hidden_layers} layers, hidden {real.hidden_size}, {real.num_attention_heads} heads "
              f"x {real.head_dim}, {real.num_key_value_heads} KV heads, MLP {real.intermediate_size}, bf16", 0.5),
    ]


def baseline_load(model: DraftBackbone, path: Path, layer_map: dict[str, str], phase: Phase, device: str = "cpu"
                  ) -> int:
    """The same streaming and copying as `load_safetensors(bucket_by="layer")`, and the same post-load hooks the
    lifecycle runs in `finalize_loading` (called directly), with no lifecycle call. `layer_map` (name -> layer,
    built once, as the lifecycle's readiness map is) groups the buckets."""
    index = checkpoint_index(path)
    buckets = plan_buckets(list(index), layer_map.__getitem__, bucket_by="layer")
    n = 0
    for bucket in iter_buckets(index, buckets, reuse=True):  # as the loader reads for its own write_tensor
        for name, value in bucket:
            write_tensor(model, name, value, device)
        n += len(bucket)
        del bucket  # as the loader does: one bucket held at a time (holding two changes the allocator's reuse)
    for hook in model.post_load_hooks(phase):
        hook.fn(model)
    return n


def lifecycle_reload(model: DraftBackbone, path: Path, device: str = "cpu") -> None:
    model.begin_reload()
    load_safetensors(model, path, bucket_by="layer", device=device)
    model.finalize_loading()


def lifecycle_cold(model: DraftBackbone, path: Path, device: str = "cpu") -> None:
    load_safetensors(model, path, bucket_by="layer", device=device)
    model.finalize_loading()


@contextmanager
def stubbed_io(tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Disk reads come from memory and writes do nothing, in the loader and the baseline alike: what is left of
    the loader's time is the lifecycle's bookkeeping (validation, readiness, triggers, events)."""

    def from_memory(index: dict[str, IndexEntry], buckets: Sequence[Sequence[str]], reuse: bool = False,
                    into: object = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in buckets:
            yield [(n, tensors[n]) for n in bucket]

    def no_write(module: torch.nn.Module, name: str, value: torch.Tensor, device: object) -> None:
        return None

    with mock.patch("lifecycle.loading.load.iter_buckets", from_memory), \
            mock.patch("lifecycle.loading.write.write_tensor", no_write), \
            mock.patch(f"{__name__}.iter_buckets", from_memory), \
            mock.patch(f"{__name__}.write_tensor", no_write):
        yield
