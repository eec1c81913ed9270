"""Real lifecycles that write real audit logs (JSON lines through `configure_audit`), for the auditor's and the
report's tests. Nothing here writes an event by hand: every line comes from a `DFlashQwen3Draft` driven through
the loader and the lifecycle."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lifecycle.errors import IllegalTransitionError, LayersNotReadyError
from lifecycle.events import configure_audit
from lifecycle.loading import apply_bucket, checkpoint_index, iter_buckets, load_safetensors, plan_buckets
from lifecycle.testing import cold_load, reload
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft


@contextmanager
def logging_to(path: Path, level: str = "info") -> Iterator[None]:
    """Audit events go to `path` (appended) while the block runs."""
    configure_audit(json_path=path, console=False, level=level)
    try:
        yield
    finally:
        configure_audit(console=False)


def bucketed_reload(m: DFlashQwen3Draft, ckpt: Path, *, seed: int = 0, early_refresh: bool = True) -> None:
    """begin_reload, shuffled buckets of 3 tensors, an early refresh the guard refuses, finalize, refresh in place."""
    m.begin_reload()
    lc = m.lifecycle
    index = checkpoint_index(ckpt)
    buckets = plan_buckets(list(index), lambda n: lc.readiness.layer_of_name[n], bucket_by=3, shuffle=True,
                           seed=seed)
    for i, bucket in enumerate(iter_buckets(index, buckets)):
        apply_bucket(m, bucket, "cpu")
        if i == 0 and early_refresh:
            with pytest.raises(LayersNotReadyError):
                m.refresh_derived_buffers()
    m.finalize_loading()
    m.refresh_derived_buffers()


def multi_rank(out: Path, cfg: DFlashConfig, a: Path, b: Path, *, ranks: int = 3, reloads: int = 2,
               name: str = "draft") -> dict[int, Path]:
    """`ranks` workers of one backbone, each logging to its own file, stepping in lockstep: cold load and capture
    from A, then `reloads` bucketed reloads alternating B and A."""
    models = {r: DFlashQwen3Draft(cfg, name=name, rank=r) for r in range(ranks)}
    paths = {r: out / f"rank{r}.jsonl" for r in range(ranks)}
    steps: list[Callable[[int, DFlashQwen3Draft], None]] = [lambda r, m: cold_load(m, a, capture_graphs=True)]
    for k in range(reloads):
        ckpt = b if k % 2 == 0 else a
        steps.append(lambda r, m, ckpt=ckpt, k=k: bucketed_reload(m, ckpt, seed=10 * k + r))
    for step in steps:
        for r, m in models.items():
            with logging_to(paths[r]):
                step(r, m)
    return paths


def mixed_backbones(path: Path, cfg: DFlashConfig, a: Path, b: Path) -> Path:
    """Several backbones in one file: refusals, abort and recovery, a quarantined end, release and rebuild,
    a selective reload."""
    with logging_to(path):
        m = DFlashQwen3Draft(cfg, name="refusals")
        with pytest.raises(LayersNotReadyError):
            m.refresh_derived_buffers()  # from META
        load_safetensors(m, a)
        with pytest.raises(IllegalTransitionError):
            m.capture_graphs()  # from FULLY_LOADED
        m.finalize_loading()
        m.refresh_derived_buffers()

        m = cold_load(DFlashQwen3Draft(cfg, name="aborted", rank=1), a, capture_graphs=True)
        m.begin_reload()
        load_safetensors(m, b, subset=lambda n: n.startswith("layers.0."))
        m.abort_reload("weight transfer timed out")
        bucketed_reload(m, b, early_refresh=False)

        m = cold_load(DFlashQwen3Draft(cfg, name="quarantined"), a)
        m.begin_reload()
        load_safetensors(m, b, subset=lambda n: n.startswith("layers.1."))
        m.abort_reload("rank 1 lost")

        m = cold_load(DFlashQwen3Draft(cfg, name="rebuilt"), a, capture_graphs=True)
        m.release_graphs()
        reload(m, b, rebuild=True)
        m.capture_graphs()

        # an aborted session rolled back, then recovered
        m = cold_load(DFlashQwen3Draft(cfg, name="recovered", rank=1), a, capture_graphs=True)
        with m.reload_session(rollback=True) as session:
            session.load(b, subset=lambda n: n.startswith("layers.0."))
            session.abort("trainer cancelled the update")
        m.recover()

        m = cold_load(DFlashQwen3Draft(cfg, name="selective", rank=2), a, capture_graphs=True)
        reload(m, b, subset=lambda n: n.startswith("layers.1."))
    return path


def debug_level(path: Path, cfg: DFlashConfig, a: Path, b: Path) -> Path:
    """A log written at debug level (per-bucket loader events, which carry no `seq`)."""
    with logging_to(path, level="debug"):
        m = cold_load(DFlashQwen3Draft(cfg, name="debugged"), a, capture_graphs=True)
        bucketed_reload(m, b, early_refresh=False)
    return path


# ---- editing a real log -------------------------------------------------------------------------------------


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_lines(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
    return path


def index_of(events: list[dict[str, Any]], start: int = 0, **match: Any) -> int:
    """Index of the first event at or after `start` whose fields equal `match`."""
    for i in range(start, len(events)):
        if all(events[i].get(k) == v for k, v in match.items()):
            return i
    raise LookupError(f"no event with {match} after {start}")
