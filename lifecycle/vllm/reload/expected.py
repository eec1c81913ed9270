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
code: left to vLLM). And the shapes, exactly where the draft's first load saw the name: vLLM hands every rank the
whole checkpoint tensor and each rank's weight loader takes its part (a TP shard, a replicated KV head), so the
shape the first load's `load_weights` calls carried under a name (`DraftStructure.cold_shapes`, in any of the
name's forms above) is the one shape a reload may send under it, on every rank and any tensor-parallel size; one
row short or one row long is refused naming the tensor and both shapes (vLLM's own check of a short one ran
mid-load, quarantining the draft with an `AssertionError` that named nothing). Where the first load never saw the
name (a dummy-format start, which calls no `load_weights`; a name in a form the first load did not use), a bound:
a tensor may not hold more elements than the tracked tensor it loads into holds on all tensor-parallel ranks
together (per tensor, not summed over a fused tensor's shards: a quantized checkpoint's per-shard metadata, such
as compressed-tensors' `weight_shape`, loads each shard into the one small fused parameter); a smaller wrong shape
then reaches vLLM, which refuses it mid-load.

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


def _stems(name: str, mappers: list[Callable[[str], str | None]]) -> set[str] | None:
    """The forms of `name` vLLM's loaders may give it (prefix added or removed, `d2t`, each mapper's rename), or
    None when a mapper drops it."""
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
                return None
            stems |= {mapped, mapped.removeprefix("model.")}
    return stems


def _candidates(stems: set[str] | None, packed: dict[str, str]) -> Iterator[str]:
    """The parameter names (relative to the draft's inner model, and as the outer model has them) a name of these
    `stems` may load into, or `_DROPPED` when a mapper drops it."""
    if stems is None:
        yield _DROPPED
        return
    for stem in stems:
        yield stem
        parts = stem.split(".")
        for i, part in enumerate(parts):
            if part in packed:
                yield ".".join([*parts[:i], packed[part], *parts[i + 1:]])


def _cold_lookup(structure: Any, mappers: list[Callable[[str], str | None]]) -> dict[str, tuple[int, ...]]:
    """Every form of each name the first load carried -> the shape it carried (kept once the structure is frozen:
    the first load is over, nothing adds to it). A form two names share (a mapper that renames shards onto their
    fused parameter) says nothing about either: left out, each name's own form still counts."""
    if structure is None:
        return {}
    if structure.cold_lookup is not None:
        return cast("dict[str, tuple[int, ...]]", structure.cold_lookup)
    owner: dict[str, str] = {}
    lookup: dict[str, tuple[int, ...]] = {}
    shared: set[str] = set()
    for name, shape in structure.cold_shapes.items():
        for stem in _stems(name, mappers) or ():
            if owner.setdefault(stem, name) != name:
                shared.add(stem)
            lookup.setdefault(stem, shape)
    for stem in shared - set(structure.cold_shapes):
        del lookup[stem]
    if structure.frozen is not None:
        structure.cold_lookup = lookup
    return lookup


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
    cold = _cold_lookup(structure, mappers)
    for name in names:
        entry = index[name]
        if any(s in name for s in SKIPPED) or name.endswith(KV_SCALES):
            continue
        stems = _stems(name, mappers)
        candidates = list(_candidates(stems, packed))
        if _DROPPED in candidates:
            continue
        took = cold[name] if name in cold else next((cold[s] for s in sorted(stems or ()) if s in cold), None)
        if took is not None:  # exact: what the first load carried under this name, as every rank was handed it
            if tuple(entry.shape) != took:
                problems.append(f"{name} ({entry.path}): {list(entry.shape)}, but the draft's first load took "
                                f"{list(took)} for it (a tensor of another shape)")
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
