"""Test and benchmark helpers: random checkpoints for any backbone (`random_checkpoint`), and large, valid audit
logs from a recorded one (`repeat_reloads`): the benchmarks' and the tests' way to get a million real events.
And a cold load and a reload in one call each (`cold_load`, `reload`): what a test of one's own backbone does
before what it checks; and the check of what its post-load hooks declare they write (`undeclared_hook_writes`).
Importing this module costs torch and nothing of the loader: those two import it when called.

A real lifecycle is recorded once (cold load in epoch 0, then one reload in epoch 1); `repeat_reloads` writes
the cold load once and the reload again and again, as epochs 1, 2, 3, ..., renumbering `seq` and moving
timestamps forward. Every line has the shape the machine wrote; only epoch, seq, ts and rank change.

>>> recorded = [{"event": "transition", "trigger": "begin_reload", "backbone": "d", "rank": 0, "epoch": 1,
...              "seq": 1, "ts": "x", "src": "GRAPH_CAPTURED", "dst": "PARTIALLY_LOADED"}]
>>> [(e["epoch"], e["seq"], e["ts"]) for e in map(json.loads, repeat_reloads(recorded, 2, start_ts=0.0))]
[(1, 1, '1970-01-01T00:00:00.000010Z'), (2, 2, '1970-01-01T00:00:00.000020Z')]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from .events import TS_FORMAT

if TYPE_CHECKING:
    from .backbone import DraftBackbone

__all__ = ["cold_load", "random_checkpoint", "reload", "repeat_reloads", "undeclared_hook_writes", "write_synthetic"]

BackboneT = TypeVar("BackboneT", bound="DraftBackbone")
#: one checkpoint file or several (what `load_safetensors` reads)
Checkpoint = str | Path | Sequence[str | Path]
#: the tensors a reload writes: names, or a test on each name (what `load_safetensors` takes as `subset`)
Subset = Iterable[str] | Callable[[str], bool] | None

_EPOCH, _SEQ, _TS = -1_234_567_001, -1_234_567_002, "@@ts@@"


def _template(event: Mapping[str, Any], rank: int | None) -> str:
    """The event as a `str.format` template with {epoch}, {seq} and {ts} holes."""
    e = dict(event, epoch=_EPOCH, seq=_SEQ, ts=_TS)
    if rank is not None:
        e["rank"] = rank
    text = json.dumps(e, separators=(",", ":")).replace("{", "{{").replace("}", "}}")
    return text.replace(str(_EPOCH), "{epoch}").replace(str(_SEQ), "{seq}").replace(_TS, "{ts}")


def _ts(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime(TS_FORMAT)


def repeat_reloads(recorded: Sequence[Mapping[str, Any]], reloads: int, *, rank: int | None = None,
                   start_ts: float, step_s: float = 1e-5) -> Iterator[str]:
    """JSON lines (without newline): the recorded epoch-0 events once, then the recorded epoch-1 events
    `reloads` times as epochs 1..reloads. Info-level events only (those are the ones numbered by `seq`)."""
    events = [e for e in recorded if e.get("level", "info") != "debug"]
    cold = [_template(e, rank) for e in events if e["epoch"] == 0]
    reload = [_template(e, rank) for e in events if e["epoch"] == 1]
    if reloads and not reload:
        raise ValueError("the recorded log has no epoch-1 events to repeat")
    seq = 0
    t = start_ts
    for epoch, block in [(0, cold), *((k, reload) for k in range(1, reloads + 1))]:
        for line in block:
            seq += 1
            t += step_s
            yield line.format(epoch=epoch, seq=seq, ts=_ts(t))


def write_synthetic(path: str | Path, recorded: Sequence[Mapping[str, Any]], reloads: int, *,
                    rank: int | None = None, start_ts: float = 1.7e9) -> int:
    """Write `repeat_reloads(...)` to `path`. Returns the number of lines written."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for line in repeat_reloads(recorded, reloads, rank=rank, start_ts=start_ts):
            fh.write(line + "\n")
            n += 1
    return n


def random_checkpoint(model: nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights for every checkpoint tensor of `model` (META is fine): norm weights near 1, others
    scaled by 1/sqrt(fan_in). Deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        else:
            value = torch.randn(t.shape, generator=gen) / max(t.shape[-1], 1) ** 0.5 if t.dim() else torch.randn(())
        out[name] = value.to(t.dtype if t.dtype.is_floating_point else dtype).contiguous()
    return out


def cold_load(backbone: BackboneT | Callable[[], BackboneT], checkpoint: Checkpoint, *, refresh: bool = True,
              capture_graphs: bool = False, **load: Any) -> BackboneT:
    """The first load of a backbone: `load_safetensors(backbone, checkpoint, **load)`, `finalize_loading()`,
    then (`refresh`) `refresh_derived_buffers()`, which leaves it DERIVED_REFRESHED, and (`capture_graphs`)
    `capture_graphs()`: GRAPH_CAPTURED. `backbone` is a backbone (on META or not) or what builds one (a class that
    needs no argument, a `functools.partial`, a family's `build`). `load` takes any option of `load_safetensors`
    (`bucket_by`, `shuffle`, `subset`, `device`, ...). Returns the backbone.

    >>> import tempfile
    >>> from lifecycle import write_checkpoint
    >>> from lifecycle.events import configure_audit; _ = configure_audit(console=False)
    >>> from lifecycle.bundled import qwen3_dflash as q
    >>> cfg = q.DFlashConfig(num_hidden_layers=2)
    >>> a = write_checkpoint(q.random_weights(cfg, seed=0), tempfile.mkdtemp() + "/a.safetensors")
    >>> draft = cold_load(q.DFlashQwen3Draft(cfg, device="meta"), a)
    >>> draft.lifecycle.state.value, draft.lifecycle.epoch
    ('DERIVED_REFRESHED', 0)
    >>> cold_load(lambda: q.DFlashQwen3Draft(cfg), a, capture_graphs=True).lifecycle.state.value
    'GRAPH_CAPTURED'
    """
    from .backbone import DraftBackbone
    from .loading import load_safetensors

    # a backbone is callable too (an nn.Module): tell the two apart by type; the cast keeps the caller's class
    model = cast("BackboneT", backbone) if isinstance(backbone, DraftBackbone) else backbone()
    load_safetensors(model, checkpoint, **load)
    model.finalize_loading()
    if refresh:
        model.refresh_derived_buffers()
    if capture_graphs:
        model.capture_graphs()
    return model


def reload(backbone: DraftBackbone, checkpoint: Checkpoint, *, subset: Subset = None,
           keep_untouched: bool | None = None, refresh: bool = True, full: bool = False, rebuild: bool = False,
           **load: Any) -> list[str]:
    """A reload in one call: `begin_reload()`, `load_safetensors(backbone, checkpoint, subset=subset, **load)`,
    `finalize_loading(keep_untouched=...)` and (`refresh`) `refresh_derived_buffers(full=full, rebuild=rebuild)`.
    `keep_untouched` defaults to whether a `subset` was given: a selective reload keeps the layers it did not
    write. Without `refresh` the backbone stays FINALIZED (what a test checks between the two). `load` takes any
    other option of `load_safetensors` (`bucket_by`, `shuffle`, `seed`, `device`, `writer`, ...). Returns the
    names of the post-load hooks `finalize_loading` ran.

    >>> import tempfile
    >>> from lifecycle import write_checkpoint
    >>> from lifecycle.events import configure_audit; _ = configure_audit(console=False)
    >>> from lifecycle.bundled import qwen3_dflash as q
    >>> cfg, folder = q.DFlashConfig(num_hidden_layers=2), tempfile.mkdtemp()
    >>> a = write_checkpoint(q.random_weights(cfg, seed=0), folder + "/a.safetensors")
    >>> b = write_checkpoint(q.random_weights(cfg, seed=1), folder + "/b.safetensors")
    >>> draft = cold_load(q.DFlashQwen3Draft(cfg), a, capture_graphs=True)
    >>> reload(draft, b, bucket_by=3, shuffle=True)
    []
    >>> draft.lifecycle.state.value, draft.lifecycle.epoch  # refreshed in place under the captured graphs
    ('GRAPH_CAPTURED', 1)
    >>> _ = reload(draft, a, subset=lambda name: name.startswith("layers.1."), refresh=False)
    >>> draft.lifecycle.state.value
    'FINALIZED'
    """
    from .loading import load_safetensors

    backbone.begin_reload()
    load_safetensors(backbone, checkpoint, subset=subset, **load)
    hooks = backbone.finalize_loading(keep_untouched=subset is not None if keep_untouched is None else keep_untouched)
    if refresh:
        backbone.refresh_derived_buffers(full=full, rebuild=rebuild)
    return hooks


def undeclared_hook_writes(backbone: DraftBackbone, phase: str) -> dict[str, list[str]]:
    """Hook name -> the tracked tensors it wrote that its `writes=` does not cover, for each hook of `phase` that
    declares what it writes (`post_load_hook(..., writes=...)`): each is run on `backbone` once, every tracked tensor
    read before and after it. Empty: every declaration holds for this backbone. The hooks' writes are not reported
    to its lifecycle: check a backbone loaded for the check (`cold_load`), not one that serves."""
    from .hooks import Phase, _signatures, may_write

    lc = backbone.lifecycle
    out: dict[str, list[str]] = {}
    for hook in backbone.post_load_hooks(Phase(phase)):
        if hook.writes is None:
            continue
        names = list(lc.specs)
        before = _signatures([backbone.live_tensor(n) for n in names])
        hook.fn(backbone)
        after = _signatures([backbone.live_tensor(n) for n in names])
        allowed = set(may_write([hook], names))
        wrote = [n for n, was, now in zip(names, before, after, strict=True) if was != now and n not in allowed]
        if wrote:
            out[hook.name] = wrote
    return out
