"""Test and benchmark helpers: random checkpoints for any backbone (`random_checkpoint`), and large, valid audit
logs from a recorded one (`repeat_reloads`): the benchmarks' and the tests' way to get a million real events.

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
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .events import TS_FORMAT

__all__ = ["random_checkpoint", "repeat_reloads", "write_synthetic"]

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
