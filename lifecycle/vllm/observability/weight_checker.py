"""The draft in vLLM's own weight checker (`/weight_checker` `checksum` / `compare`), and the same digests computed
on the trainer's side from the state dict it sent, so that "what the trainer sent is what the engine serves" is one
`compare` call.

vLLM's route gathers every worker's `Worker.compute_weight_checksums()`: `{"dp{d}:pp{p}:pcp{c}:tp{t}:" + name:
sha256}` over `compute_tensor_digests(model_runner.get_model())` (sha256 hex of each parameter's bytes,
`vllm/model_executor/model_loader/weight_checksum.py`): the target only. The plugin wraps that method (no new
route) and adds, under the same worker prefix:

  draft.<parameter>           vLLM's digest of each draft parameter that is a checkpoint tensor (what a push
                              writes; the modules the draft shares with the target are the target's entries, and a
                              parameter no checkpoint carries, such as DFlash's `mask_embedding` without its
                              `mask_embedding.pt`, is left out), named as in the draft model
                              (`draft.model.layers.0.self_attn.qkv_proj.weight`)
  draft.derived.<buffer>      per derived buffer, whether it is bit-equal to a cold build from the draft's current
                              weights: `EQUAL` (`equals-cold-build`), `DIFFERS`, `not-built`, or
                              `not-serving:<STATE>` while the draft does not serve (quarantined, mid-reload)

The two layouts. On CUDA (and the CPU build without oneDNN) a linear layer keeps its weight in checkpoint layout
after processing: its digest is read live, when `/weight_checker` asks. vLLM's CPU build repacks every linear layer
into a oneDNN handle and empties its `weight` to shape (0,) (vLLM's own entry then hashes no bytes); the plugin
records the digest of each parameter processing EMPTIES right before the layer is processed
(`record_before_processing`, a processing observer), so `draft.<parameter>` is the same value on both layouts:
what a CUDA engine holds. Which parameters processing empties is learnt from the module's first processing (the
cold load hashes every CPU parameter once and keeps the digests of those it emptied); from then on a push hashes
those alone: nothing on the GPU layout (and never a CUDA tensor), at most the bytes processing empties on the CPU
layout (`DraftRuntime.bytes_hashed` counts them; tests/vllm_plugin/reload/test_push_counts.py). Likewise the K/V
rows the CPU layout keeps only in the fused buffer (`shadows.py`: its per-layer shadows are views of it) are
checked against the rows captured from the weight before it was repacked: where they are the weight's last rows,
by the hash state of the rows before them and the weight's digest (`RowsDigest`: no byte hashed twice), else by
their own digest; on CUDA the cold build reads the live weight rows.

`/weight_checker reset` (vLLM's `zero_weights(get_model())`) zeroes the target only; the draft is left out of it,
so no draft ever holds derived buffers that disagree with zeroed weights.

Trainer side: `expected_checksums(state_dict)` maps checkpoint names to the engine's (the DFlash family's loader:
`model.` prefix; q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`, in that order), casts to the engine's
dtype, hashes with vLLM's formula, and expects `EQUAL` for every derived buffer. Tensor parallelism > 1 shards
the fused weights per rank: not computed here (one prefix, rank 0 of a single-rank engine).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...derived import DerivedSpec, resolve_tensor
from ...torch_private import own_buffers, own_parameters
from ..drafts.owners import VLLMDraftBackbone, backbones_in, draft_model_of, owner_of, shared_modules

__all__ = ["DERIVED_PREFIX", "DIFFERS", "DRAFT_PREFIX", "EQUAL", "NOT_BUILT", "NOT_SERVING",
           "WORKER_PREFIX", "RowsDigest", "derived_verdicts", "digest", "draft_checksums", "expected_checksums",
           "record_before_processing"]

DRAFT_PREFIX = "draft."
DERIVED_PREFIX = "draft.derived."
#: The values of a `draft.derived.<buffer>` entry.
EQUAL, DIFFERS, NOT_BUILT, NOT_SERVING = "equals-cold-build", "differs-from-cold-build", "not-built", "not-serving:"
#: vLLM's key prefix of a single-rank engine's worker (`Worker._weight_checksum_prefix`).
WORKER_PREFIX = "dp0:pp0:pcp0:tp0:"


#: Checkpoint names of the DFlash family's draft -> the engine's: each fused parameter and its parts, in order.
_DFLASH_FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def _byte_view(t: torch.Tensor) -> memoryview:
    """`t`'s bytes, contiguous, on the CPU, as a buffer hashlib reads without a copy (a contiguous CPU tensor is
    not copied at all)."""
    flat = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray is a buffer


def digest(t: torch.Tensor) -> str:
    """vLLM's digest of a tensor: sha256 hex of its bytes, contiguous, on the CPU."""
    return hashlib.sha256(_byte_view(t)).hexdigest()


@dataclass(frozen=True)
class RowsDigest:
    """What the K/V rows captured into a shadow hashed to: the rows' own `digest`, or, where they are the last rows
    of a weight hashed anyway, that weight's digest and the hash state of its rows before them (`before`), so the
    rows are not hashed a second time at the push."""

    digest: str
    before: Any = None  # a hashlib sha256 object: the weight's bytes before the shadow's rows

    def holds(self, shadow: torch.Tensor) -> bool:
        """Whether `shadow` still holds the rows captured into it."""
        if self.before is None:
            return digest(shadow) == self.digest
        h = self.before.copy()
        h.update(_byte_view(shadow))
        return bool(h.hexdigest() == self.digest)


def _tail_split(weight: torch.Tensor, rows: slice | None) -> int | None:
    """The byte offset where `weight[rows]` starts when those rows are its last ones (a contiguous weight), else
    None."""
    if rows is None or rows.step not in (None, 1) or rows.stop not in (None, weight.shape[0]) \
            or not weight.is_contiguous() or weight.dim() != 2:
        return None
    start = range(weight.shape[0])[rows].start if weight.shape[0] else 0
    return start * weight.stride(0) * weight.element_size()


def record_before_processing(layer: nn.Module, shadow: tuple[str, torch.Tensor, slice] | None = None
                             ) -> Callable[[], None] | None:
    """Right before `layer` is processed: the digest of each CPU parameter processing empties (all of them the
    first time, when that is not known yet), and what the K/V rows just captured into `shadow` (its name in the
    backbone, the shadow, the rows of `layer.weight` it holds) hash to. Returns what runs right after processing:
    it learns which parameters processing emptied and keeps only their digests."""
    owner = owner_of(layer)
    if owner is None:
        return None
    runtime = owner[0].lifecycle_runtime
    known = runtime.emptied_by_processing.get(layer)  # None: never processed yet
    if known is not None and not known and shadow is None:  # processing keeps every parameter: nothing to do
        return None
    cpu = {name: p for name, p in own_parameters(layer).items()
           if p is not None and not p.is_meta and p.device.type == "cpu" and p.numel() > 0}
    split = _tail_split(cpu["weight"], shadow[2]) if shadow is not None and "weight" in cpu else None
    digests: dict[str, str] = {}
    rows: RowsDigest | None = None
    for name, p in cpu.items():
        if known is not None and name not in known:
            continue  # processing keeps it: read live when asked
        h = hashlib.sha256()
        data = _byte_view(p)
        runtime.bytes_hashed += len(data)
        if name == "weight" and split is not None:
            h.update(data[:split])
            before = h.copy()
            h.update(data[split:])
            digests[name] = h.hexdigest()
            rows = RowsDigest(digests[name], before)
        else:
            h.update(data)
            digests[name] = h.hexdigest()
    if shadow is not None:
        if rows is None:
            rows = RowsDigest(digest(shadow[1]))
            runtime.bytes_hashed += shadow[1].numel() * shadow[1].element_size()
        runtime.captured_digests.setdefault(layer, {})[shadow[0]] = rows
    runtime.digests_before_processing[layer] = digests

    def after_processing() -> None:
        now = own_parameters(layer)
        emptied = {n for n in cpu if (q := now.get(n)) is None or q.numel() == 0}
        runtime.emptied_by_processing[layer] = emptied
        runtime.digests_before_processing[layer] = {n: d for n, d in digests.items() if n in emptied}

    return after_processing


# ---- engine side ---------------------------------------------------------------------------------------------


def _parameter_digest(module: nn.Module, name: str, p: torch.Tensor) -> str:
    if p.numel() == 0:  # emptied by processing (the CPU repack): what it held right before
        owner = owner_of(module)
        recorded = owner[0].lifecycle_runtime.digests_before_processing.get(module, {}).get(name) if owner else None
        if recorded is not None:
            return recorded
    return digest(p)


def draft_checksums(draft: nn.Module) -> dict[str, str]:
    """`{draft.<parameter>: sha256, draft.derived.<buffer>: verdict}` of one draft model (no worker prefix)."""
    backbones = backbones_in(draft)
    shared = tuple(name + "." for name, _ in shared_modules(draft))
    tracked: set[str] = set()
    for path, module in draft.named_modules():
        if isinstance(module, VLLMDraftBackbone):
            tracked.update(f"{path}.{n}" if path else n for n in module.lifecycle.specs)
    out: dict[str, str] = {}
    for path, module in draft.named_modules():
        for name, p in own_parameters(module).items():
            full = f"{path}.{name}" if path else name
            if p is None or full not in tracked or full.startswith(shared) or DRAFT_PREFIX + full in out:
                continue
            out[DRAFT_PREFIX + full] = _parameter_digest(module, name, p)
    for backbone in backbones:
        out.update({DERIVED_PREFIX + n: v for n, v in derived_verdicts(backbone).items()})
    return out


def derived_verdicts(backbone: VLLMDraftBackbone) -> dict[str, str]:
    """Per derived buffer: `EQUAL` when bit-equal to a cold build from the backbone's current weights, else
    `DIFFERS` or `NOT_BUILT`; every buffer `not-serving:<STATE>` while the backbone does not serve."""
    lc = backbone.lifecycle
    names = backbone.derived_buffer_names()
    if not lc.usable:
        return dict.fromkeys(names, NOT_SERVING + lc.state.value)
    specs = {s.name: s for s in backbone.derived_buffers}
    out = {}
    for name in names:
        live = own_buffers(backbone).get(name)
        if live is None or live.is_meta:
            out[name] = NOT_BUILT
            continue
        out[name] = EQUAL if _equals_cold_build(backbone, specs[name], live) else DIFFERS
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself), same shape, dtype and device."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(_bytes(a), _bytes(b))


def _equals_cold_build(backbone: VLLMDraftBackbone, spec: DerivedSpec, live: torch.Tensor) -> bool:
    if spec.kind == "alias":  # the buffer IS its source
        source = resolve_tensor(backbone, spec.sources[0])
        return source is not None and source.data_ptr() == live.data_ptr() and _same_bits(live, source)
    if spec.kind == "custom":
        return _same_bits(live, spec.build_value(backbone))
    assert spec.per_layer is not None
    slices = []
    for layer in getattr(backbone, spec.layers_attr):
        out = spec.per_layer(layer)
        parts = [out] if isinstance(out, torch.Tensor) else list(out)
        if not _captures_hold(backbone, layer, parts):
            return False
        if spec.kind == "concat":
            slices += parts
        else:
            slices.append(parts[0] if len(parts) == 1 else torch.cat(parts, 0))
    cold = torch.cat(slices, spec.dim) if spec.kind == "concat" else torch.stack(slices)
    return _same_bits(live, cold)


def _captures_hold(backbone: VLLMDraftBackbone, layer: nn.Module, parts: list[torch.Tensor]) -> bool:
    """A part that is a K/V shadow (the CPU layout: the buffer keeps the only copy of the rows) still holds the
    rows captured into it from the weight before processing emptied the weight."""
    for module in layer.modules():
        for name, recorded in backbone.lifecycle_runtime.captured_digests.get(module, {}).items():
            shadow = resolve_tensor(backbone, name)
            if shadow is not None and any(p is shadow for p in parts) and not recorded.holds(shadow):
                return False
    return True


def wrap_compute(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_weight_checksums(worker: Any, *args: Any, **kwargs: Any) -> dict[str, str]:
        result: dict[str, str] = original(worker, *args, **kwargs)
        draft = draft_model_of(worker.model_runner)
        if draft is not None:
            prefix = worker._weight_checksum_prefix()
            result.update({prefix + k: v for k, v in draft_checksums(draft).items()})
        return result

    return compute_weight_checksums


# ---- trainer side --------------------------------------------------------------------------------------------


def expected_checksums(state_dict: Mapping[str, torch.Tensor], *, family: str = "dflash",
                       dtype: torch.dtype | None = torch.float32, prefix: str = WORKER_PREFIX,
                       derived: Iterable[str] | None = None) -> dict[str, str]:
    """What `/weight_checker checksum` answers for the draft once the engine serves `state_dict` (checkpoint names
    and layout, as the trainer sends them): `draft.<parameter>` digests and `EQUAL` for every derived buffer,
    under `prefix` (vLLM's worker prefix; a single-rank engine's by default). `dtype`: the engine's (`--dtype`;
    None keeps each tensor's). `derived`: the buffer names (default: the family's). Merge it into the engine's
    own target entries, or compare only the `draft.` keys:

        sent = expected_checksums(state_dict)
        engine = requests.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
        baseline = {k: v for k, v in engine.items() if ":draft." not in k} | sent
        requests.post(url + "/weight_checker", json={"action": "compare", "baseline": baseline})  # match: true

    Families: `dflash` (vLLM's Qwen3 DFlash loader naming); another raises ValueError."""
    if family != "dflash":
        raise ValueError(f"expected_checksums: family {family!r} is not supported (supported: 'dflash'); its "
                         "loader's naming and fusion would have to be declared here")
    given: Mapping[str, object] = state_dict  # checked: a trainer's dict may hold anything
    for key, value in given.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"expected_checksums: state_dict[{key!r}] is {type(value).__name__}, not a tensor")
    engine: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state_dict.items():
        mapped = _dflash_name(name)
        t = t.detach().cpu() if dtype is None else t.detach().cpu().to(dtype)
        fused = _fused_into(mapped)
        if fused is None:
            engine[mapped] = t
        else:
            pending.setdefault(fused[0], {})[fused[1]] = t
    for target, parts in pending.items():
        order = next(p for f, p in _DFLASH_FUSED if target.rsplit(".", 2)[-2] == f)
        missing = [p for p in order if p not in parts]
        if missing:
            raise ValueError(f"expected_checksums: {target} needs {', '.join(order)}; the state dict lacks "
                             f"{', '.join(missing)} (the engine fuses them: send every part)")
        engine[target] = torch.cat([parts[p] for p in order], 0)
    from ..drafts.families import family as family_of

    names = list(derived) if derived is not None else [s.name for s in family_of(family).derived()
                                                       if s.enabled is None]
    out = {prefix + DRAFT_PREFIX + n: digest(t) for n, t in engine.items()}
    out.update({prefix + DERIVED_PREFIX + n: EQUAL for n in names})
    return out


def _dflash_name(name: str) -> str:
    """vLLM's DFlash `load_weights`: `d2t` becomes `draft_id_to_target_id`, everything but the LM head gets the
    inner model's `model.` prefix."""
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    return name if "lm_head" in name else "model." + name


def _fused_into(name: str) -> tuple[str, str] | None:
    """(the fused parameter, the part) a checkpoint name is loaded into, or None."""
    head, _, leaf = name.rpartition(".")
    module_path, _, proj = head.rpartition(".")
    for fused, parts in _DFLASH_FUSED:
        if proj in parts:
            return f"{module_path}.{fused}.{leaf}", proj
    return None
