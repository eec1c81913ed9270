"""What a lifecycle draft can take, checked from the checkpoint's headers alone, before a byte of tensor data is
read (`reload_draft_weights`, the `safetensors_file` transfer engine; `payload.plan_payload(model=)` runs it).

First the frozen structure (`structure.py`): a tensor for an optional module the draft's first load decided it
lacks, or shares with the target, is refused as each `load_weights` call would refuse it (`FrozenStructureError`),
but before anything is read or touched. Then the names: vLLM's draft loaders map a checkpoint name onto a
parameter, so each name of the payload must map, by one of the ways vLLM's loaders do, onto a tensor the draft's
lifecycle tracks (recorded in checkpoint layout at construction, before any repacking), onto one it leaves to vLLM
(its attention layers' own parameters, shared embeddings and lm_head, optional modules), or be one vLLM drops or
skips. The ways tried, any of which admits a name: the `model.` prefix added or removed, `d2t` ->
`draft_id_to_target_id`, the class's own `hf_to_vllm_mapper` (the outer model's and the inner one's: renames such
as `midlayer.` -> `layers.0.`, stacked shards, names it drops), the usual shard -> fused parameter names (q/k/v
-> `qkv_proj`, gate/up -> `gate_up_proj`, K3's q_a/kv_a -> `fused_qkv_a_proj`, and the class's
`packed_modules_mapping`), and a family's `renamed_in_code` prefixes (names its `load_weights` renames in its own
code: left to vLLM). And the sizes: a tensor may not hold more elements than the tracked tensor it loads into
holds on all tensor-parallel ranks together. (Per tensor, not summed over a fused tensor's shards: a quantized
checkpoint's per-shard metadata, such as compressed-tensors' `weight_shape`, loads each shard into the one small
fused parameter.) This is a bound, not an exact shape check, so that a TP shard or a replicated KV head is never
refused; a smaller wrong shape reaches vLLM, which refuses it.

Anything else is refused with a `CheckpointError` naming each tensor and its file, audited as a refused
`weights_loaded`, and the draft is not touched: a folder of another model (the target's) or a sparse 1 TiB
tensor no longer reaches `torch.empty` (which raised `RuntimeError: tried to allocate ...` after trying) or the
engine's memory. The check errs towards admitting: a name it cannot place is one vLLM would refuse too, after
reading; a name it admits wrongly still meets vLLM's own refusal, with the draft rolled back.

A model without a lifecycle backbone (the target, through the transfer engine) is not checked here: vLLM's
loader does, and `payload.plan_payload` refuses any tensor larger than the machine's memory for every payload.

A payload that passed is remembered by its headers and names (`DraftRuntime.payloads_checked`, once the draft's
structure is frozen): headers equal byte for byte list the same names, shapes and dtypes, so a trainer's every push
of one model is checked once, not once per push (the loader's `validate_index` does the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from ...errors import MESSAGE_ITEMS_CAP, CheckpointError
from ...types import capped
from ..drafts.owners import VLLMDraftBackbone, drafts_of

__all__ = ["PACKED", "SKIPPED", "check_payload", "needs_whole_calls"]

#: A checkpoint's shard name -> the fused parameter vLLM loads it into (a class's `packed_modules_mapping` adds
#: to it).
PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj", "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}
#: Names vLLM's draft loaders skip whatever they hold, and the KV-cache scales vLLM's loaders move onto the
#: attention layer (`maybe_remap_kv_scale_name`).
SKIPPED = ("t2d", "rotary_emb.inv_freq")
KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")
_DROPPED = "dropped"  # a mapper maps the name to None: vLLM ignores it
PAYLOADS_KEPT = 64  # payloads remembered as checked, per draft (a trainer's chunks: one per shard file)


def needs_whole_calls(model: Any) -> bool:
    """Whether the draft's `load_weights` needs every tensor in every call (0.33's Muse Spark: lm_head and d2t;
    XPress: `xpress_head.mix.L`): a payload without `bucket_size` is then one bucket."""
    return any(b._family.whole_calls for b in drafts_of(model))


def _mappers(*owners: Any) -> list[Callable[[str], str | None]]:
    """The name mapping of each owner's class `hf_to_vllm_mapper` (vLLM's `WeightsMapper`; `map_name`, older
    releases `_map_name`)."""
    out = []
    for owner in owners:
        mapper = getattr(type(owner), "hf_to_vllm_mapper", None)
        fn = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)
        if callable(fn):
            out.append(fn)
    return out


def _candidates(name: str, packed: dict[str, str], mappers: list[Callable[[str], str | None]]
                ) -> Iterator[str]:
    """The parameter names (relative to the draft's inner model, and as the outer model has them) `name` may load
    into, or `_DROPPED` when a mapper drops it."""
    stems = {name, name.removeprefix("model."), f"model.{name}"}
    if name.rpartition(".")[2] == "d2t":
        stems |= {s.replace("d2t", "draft_id_to_target_id") for s in stems}
    for fn in mappers:
        for stem in list(stems):
            try:
                mapped = fn(stem)
            except Exception:  # a mapper that cannot take this form of the name: the other forms still count
                continue
            if mapped is None:
                yield _DROPPED
                return
            stems |= {mapped, mapped.removeprefix("model.")}
    for stem in stems:
        yield stem
        parts = stem.split(".")
        for i, part in enumerate(parts):
            if part in packed:
                yield ".".join([*parts[:i], packed[part], *parts[i + 1:]])


def _left_to_vllm(backbone: VLLMDraftBackbone) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefixes, markers) of names the lifecycle does not track and vLLM loads: the family's untracked prefixes
    (shared embeddings, lm_head, mask embedding), the attention layers' own parameters (by module: vLLM deletes
    some once processed) and the names its code renames; the optional modules' markers (the frozen structure
    decides on those, per call)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    family = backbone._family
    attention = tuple(f"{name}." for name, m in backbone.named_modules() if name and is_deferred_attention_layer(m))
    return (family.untracked_prefixes + family.renamed_in_code + attention,
            tuple(m.marker for m in family.optional))


def _tp_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:  # not inside an initialized vLLM worker (a unit test): one rank
        return 1


def check_payload(index: dict[str, Any], names: Iterable[str], model: Any, *, tp_size: int | None = None) -> None:
    """Refuse, before any data is read, payload names `model`'s lifecycle draft cannot take, and tensors larger
    than what they load into (see the module doc). A model without a lifecycle backbone passes."""
    backbones = drafts_of(model)
    if not backbones:
        return
    names = list(names)
    lc = backbones[0].lifecycle
    runtime = backbones[0].lifecycle_runtime
    structure = runtime.structure
    headers = getattr(index, "headers", ())
    key = (headers, frozenset(names), tp_size or _tp_size()) if headers and structure.frozen is not None else None
    if key is not None and key in runtime.payloads_checked:
        return
    if structure is not None:
        names_only = cast("list[tuple[str, Any]]", [(n, None) for n in names])  # admit reads the names alone
        _, refusal = structure.admit(names_only, lc)
        if refusal is not None:
            try:
                raise lc.record_refusal("weights_loaded", refusal)
            finally:
                del refusal  # see `lifecycle.errors`: a local holding the raised error keeps its frames alive
    packed = {**PACKED, **{shard: fused for fused, shards in getattr(type(model), "packed_modules_mapping", {}).items()
                           for shard in shards}}
    mappers = _mappers(model, *backbones)
    tp = tp_size or _tp_size()
    specs = {n: s for b in backbones for n, s in b.lifecycle.specs.items()}
    params = {n.removeprefix("model."): None for n, _ in model.named_parameters()}
    left = [_left_to_vllm(b) for b in backbones]
    prefixes = tuple(p for ps, _ in left for p in ps)
    markers = tuple(m for _, ms in left for m in ms)
    problems: list[str] = []
    for name in names:
        entry = index[name]
        if any(s in name for s in SKIPPED) or name.endswith(KV_SCALES):
            continue
        candidates = list(_candidates(name, packed, mappers))
        if _DROPPED in candidates:
            continue
        target = next((c for c in candidates if c in specs), None)
        if target is None:
            if not any(c in params or c.startswith(prefixes) or any(m in c for m in markers) for c in candidates):
                problems.append(f"{name} ({entry.path}): no tensor of the draft loads from it (a checkpoint of "
                                "another model, such as the target's?)")
            continue
        spec = specs[target]
        if math.prod(entry.shape) > math.prod(spec.shape) * tp:
            problems.append(f"{name} ({entry.path}): {list(entry.shape)} ({entry.nbytes:,} bytes) is more than the "
                            f"draft's {target} holds ({list(spec.shape)} per rank, {tp} tensor-parallel rank(s))")
    if problems:
        shown, more = capped(problems, MESSAGE_ITEMS_CAP)
        raise lc.record_refusal("weights_loaded", CheckpointError(
            "the payload does not fit the draft, checked from its headers before any data was read; nothing was "
            "touched:\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else ""),
            backbone=lc.name, state=lc.state.value))
    if key is not None:
        while len(runtime.payloads_checked) >= PAYLOADS_KEPT:  # the oldest first (a dict keeps its order)
            del runtime.payloads_checked[next(iter(runtime.payloads_checked))]
        runtime.payloads_checked[key] = None
