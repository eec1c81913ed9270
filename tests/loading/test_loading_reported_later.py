"""The loader reports its buckets after writing them (`loading.load._load_reported_later`) when nothing can act
between buckets: what the lifecycle ends up knowing, and every event it writes, are those of a load that
reports each bucket as it is written (the path a progress callback, a custom writer or a locked lifecycle takes).

Each case loads twice, from the same state, once each way, and compares the readiness bookkeeping, the state,
the load report and the audit trail (event, layers, counts, tensors, transitions; the times aside).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle import LifecycleState, NonFiniteWeightError, WeightWriteError
from lifecycle.events import configure_audit, read_events
from lifecycle.loading import apply_bucket, load_safetensors, write_checkpoint
from lifecycle.loading import write as loading_module
from lifecycle.testing import cold_load
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

S = LifecycleState
CFG = DFlashConfig(num_hidden_layers=4)


def _readiness(m: DFlashQwen3Draft) -> dict[str, Any]:
    lc = m.lifecycle
    r = lc.readiness
    return {"state": lc.state, "epoch": lc.epoch, "ready": r.layers_ready,
            "loaded": {n: r.is_loaded(n) for n in lc.specs}, "dirty": r.dirty_tensors(), "missing": lc.missing(),
            "partly": set(r.partly_written),
            "untouched": r.untouched_layers()}


def _trail(evs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    keep = ("event", "seq", "epoch", "layers", "layers_more", "tensors", "layers_ready", "layers_total", "src", "dst",
            "trigger", "error")
    return [tuple(e.get(k) for k in keep) for e in evs]


def _model(state: str, ckpt: Path) -> DFlashQwen3Draft:
    m = DFlashQwen3Draft(CFG, name="later")
    if state == "reload":
        cold_load(m, ckpt)
        m.begin_reload()
    return m


def _both_ways(tmp_path: Path, state: str, prepare: Any = None, after: Any = None, **load: Any) -> dict[str, Any]:
    """Load into two identical models, reporting later and as written; each model's readiness, report, trail."""
    a = write_checkpoint(random_weights(CFG, 0), tmp_path / "a.safetensors")
    b = write_checkpoint(random_weights(CFG, 1), tmp_path / "b.safetensors")
    out = {}
    for way in ("later", "as written"):
        m = _model(state, a)
        if prepare is not None:
            prepare(m)
        log = tmp_path / f"{way}-{state}.jsonl"
        log.unlink(missing_ok=True)
        configure_audit(json_path=log, console=False)
        extra = {} if way == "later" else {"progress": lambda _p: None}
        error = None
        try:
            report = load_safetensors(m, b, **load, **extra)
        except Exception as e:  # a failing load: compared as such
            report, error = None, type(e)
        configure_audit(console=False)
        if after is not None:
            after()
        out[way] = {"readiness": _readiness(m), "trail": _trail(read_events(log)), "error": error,
                    "report": None if report is None else (report.buckets, report.tensors, report.layers_completed),
                    "ts": [e["ts"] for e in read_events(log)], "model": m}
    return out


PLANS = [
    {},  # by layer, every tensor: whole layers
    {"bucket_by": 5},
    {"bucket_by": "layer", "shuffle": True, "seed": 3},
    {"bucket_by": 4, "duplicates": 3, "seed": 1},
    {"subset": lambda n: not n.startswith("layers.2.")},
]


@pytest.mark.parametrize("state", ["cold", "reload"])
@pytest.mark.parametrize("plan", range(len(PLANS)))
def test_reporting_later_says_what_reporting_each_bucket_says(tmp_path: Path, state: str, plan: int) -> None:
    runs = _both_ways(tmp_path, state, **PLANS[plan])
    later, now = runs["later"], runs["as written"]
    assert later["readiness"] == now["readiness"]
    assert later["report"] == now["report"]
    assert later["trail"] == now["trail"]
    assert later["ts"] == sorted(later["ts"])  # each layer_ready stamped when its bucket was written, in order


@pytest.mark.parametrize("sent", [2, 8], ids=["part of a layer", "a whole layer"])
def test_a_layer_sent_before_the_load_is_counted_the_same(tmp_path: Path, sent: int) -> None:
    """Not a fresh epoch (a trainer sent part of a layer, or all of it, first): the whole-layer count must not
    count that layer again."""
    w = random_weights(CFG, 5)
    first = [(n, w[n]) for n in w if n.startswith("layers.1.")][:sent]
    runs = _both_ways(tmp_path, "reload", prepare=lambda m: apply_bucket(m, first))
    assert runs["later"]["readiness"] == runs["as written"]["readiness"]
    assert runs["later"]["trail"] == runs["as written"]["trail"]


def test_a_write_failing_half_way_reports_the_buckets_before_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    real = loading_module.write_tensor
    armed = {"on": False}

    def failing(module: torch.nn.Module, name: str, value: torch.Tensor, device: object) -> None:
        if armed["on"] and name == "layers.2.mlp.down_proj.weight":
            raise RuntimeError("disk gone")
        real(module, name, value, device)

    monkeypatch.setattr(loading_module, "write_tensor", failing)
    runs = _both_ways(tmp_path, "reload", prepare=lambda m: armed.update(on=True),
                      after=lambda: armed.update(on=False))
    later, now = runs["later"], runs["as written"]
    assert later["error"] is now["error"] is WeightWriteError
    assert later["readiness"] == now["readiness"]
    assert later["trail"] == now["trail"]
    loaded = later["readiness"]["loaded"]
    assert loaded["layers.1.mlp.down_proj.weight"] and not loaded["layers.3.mlp.down_proj.weight"]
    assert not loaded["layers.2.mlp.down_proj.weight"] and later["readiness"]["state"] is S.PARTIALLY_LOADED


def test_the_whole_layer_count_leaves_every_name_written(tmp_path: Path) -> None:
    runs = _both_ways(tmp_path, "reload")
    m = runs["later"]["model"]
    assert m.lifecycle.readiness.dirty_tensors() == frozenset(m.lifecycle.specs)
    assert m.lifecycle.state is S.FULLY_LOADED
    m.finalize_loading()
    m.refresh_derived_buffers()
    assert m.lifecycle.usable


def test_capture_logs_sees_the_same_events(tmp_path: Path) -> None:
    """A `capture_logs` block (no holding, each event at once) gets the same events either way."""
    a = write_checkpoint(random_weights(CFG, 0), tmp_path / "a.safetensors")
    seen = {}
    for way, extra in (("later", {}), ("as written", {"progress": lambda _p: None})):
        m = DFlashQwen3Draft(CFG, name="later")
        with capture_logs() as logs:
            load_safetensors(m, a, **extra)
        seen[way] = [(e["event"], e.get("layers"), e.get("layers_ready"), e.get("dst")) for e in logs]
    assert seen["later"] == seen["as written"] and seen["later"]


def test_a_load_sent_again_after_a_failed_write_completes_the_same(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry a trainer makes after a failed write: the second load of the same epoch is no fresh epoch (the
    per-layer count must not apply to what the first wrote) and ends FULLY_LOADED, then finalizes, either way."""
    real = loading_module.write_tensor
    armed = {"on": False}

    def failing(module: torch.nn.Module, name: str, value: torch.Tensor, device: object) -> None:
        if armed["on"] and name == "layers.2.mlp.down_proj.weight":
            armed["on"] = False  # fails once
            raise RuntimeError("disk gone")
        real(module, name, value, device)

    monkeypatch.setattr(loading_module, "write_tensor", failing)
    b = write_checkpoint(random_weights(CFG, 1), tmp_path / "retry.safetensors")

    def fail_then_retry(m: DFlashQwen3Draft) -> None:
        armed["on"] = True
        with pytest.raises(WeightWriteError):
            load_safetensors(m, b, progress=None)

    runs = _both_ways(tmp_path, "reload", prepare=fail_then_retry)
    later, now = runs["later"], runs["as written"]
    assert later["readiness"] == now["readiness"] and later["trail"] == now["trail"]
    assert later["readiness"]["state"] is S.FULLY_LOADED and later["readiness"]["missing"] == {}
    for run in (later, now):
        run["model"].finalize_loading()
        run["model"].refresh_derived_buffers()
        assert run["model"].lifecycle.usable


def test_a_non_finite_bucket_is_refused_the_same_after_the_buckets_before_it(tmp_path: Path) -> None:
    weights = random_weights(CFG, 1)
    weights["layers.2.mlp.down_proj.weight"][0, 0] = float("nan")
    path = write_checkpoint(weights, tmp_path / "nan.safetensors")
    seen = {}
    for way, extra in (("later", {}), ("as written", {"progress": lambda _p: None})):
        m = _model("reload", write_checkpoint(random_weights(CFG, 0), tmp_path / "a.safetensors"))
        log = tmp_path / f"nan-{way}.jsonl"
        configure_audit(json_path=log, console=False)
        with pytest.raises(NonFiniteWeightError):
            load_safetensors(m, path, finite_check=True, **extra)
        configure_audit(console=False)
        seen[way] = (_readiness(m), _trail(read_events(log)))
    assert seen["later"] == seen["as written"]
    assert seen["later"][1][-1][0] == "refused" and seen["later"][0]["loaded"]["layers.1.mlp.down_proj.weight"]
