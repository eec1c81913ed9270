"""Shared fixtures: a quiet audit configuration, a tiny DFlash config, two checkpoints and a loaded model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lifecycle.events import configure_audit
from lifecycle.loading import load_safetensors, write_checkpoint
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft, random_weights

# Tiny tensors gain nothing from intra-op threads, and on a shared machine OpenMP's barriers cost tens of ms per
# op (a 4x8x32 attention: ~30 ms with 2 threads under load, ~0.03 ms with 1). Results do not depend on it.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def audit_quiet():
    """No console output from audit events; any JSON-lines sink a test opened is closed afterwards."""
    configure_audit(console=False)
    yield
    configure_audit(console=False)


@pytest.fixture
def tiny_cfg() -> DFlashConfig:
    return DFlashConfig(num_hidden_layers=3)


@pytest.fixture
def ckpt_a(tiny_cfg: DFlashConfig, tmp_path: Path) -> Path:
    return write_checkpoint(random_weights(tiny_cfg, 0), tmp_path / "a.safetensors")


@pytest.fixture
def ckpt_b(tiny_cfg: DFlashConfig, tmp_path: Path) -> Path:
    return write_checkpoint(random_weights(tiny_cfg, 1), tmp_path / "b.safetensors")


@pytest.fixture
def loaded(tiny_cfg: DFlashConfig, ckpt_a: Path) -> DFlashQwen3Draft:
    """A DFlash draft cold-loaded from checkpoint A, finalized and refreshed (state DERIVED_REFRESHED)."""
    model = DFlashQwen3Draft(tiny_cfg)
    load_safetensors(model, ckpt_a)
    model.finalize_loading()
    model.refresh_derived_buffers()
    return model


@pytest.fixture(scope="session")
def real_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of audit logs written by real lifecycles (tests/scenarios.py): three ranks of one backbone in
    three files (cold load, capture, two bucketed reloads with a refused early refresh), several backbones in
    one file (refusals, abort and recovery, a quarantined end, release and rebuild, a selective reload) and a
    debug-level log. Tests copy it before editing it."""
    from scenarios import debug_level, mixed_backbones, multi_rank

    root = tmp_path_factory.mktemp("real-logs")
    cfg = DFlashConfig(num_hidden_layers=3)
    a = write_checkpoint(random_weights(cfg, 0), root / "a.safetensors")
    b = write_checkpoint(random_weights(cfg, 1), root / "b.safetensors")
    logs = root / "logs"
    logs.mkdir()
    multi_rank(logs, cfg, a, b)
    mixed_backbones(logs / "mixed.jsonl", cfg, a, b)
    debug_level(logs / "debug.jsonl", cfg, a, b)
    configure_audit(console=False)
    return logs


# ---- real vLLM engines (tests/test_vllm_*.py): each scenario is one engine in its own process -----------------------


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 target and DFlash drafts A (seed 1) and B (seed 2), made here."""
    from lifecycle.vllm.tiny import make_dflash_draft, make_target

    work = tmp_path_factory.mktemp("vllm")
    make_target(work / "target")
    make_dflash_draft(work / "draftA", seed=1)
    make_dflash_draft(work / "draftB", seed=2)
    return work


@pytest.fixture(scope="session")
def cold_b(vllm_workdir: Path) -> dict:
    """A cold engine on draft B: what every reload to B is compared with."""
    from vllm_basic_scenarios import run_scenario

    return run_scenario("cold", vllm_workdir)


# ---- hypothesis profiles ------------------------------------------------------------------------------------------
# "ci" (the default): derandomized, so every run checks the same examples and a failure reproduces; sized to keep
# tests/test_properties.py near 30 s on two shared cores. "nightly": random, far more and longer runs:
#   HYPOTHESIS_PROFILE=nightly make test      (or .venv/bin/python -m pytest tests/test_properties.py)
# "dev": a quick smoke run while editing.

import os  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=300, stateful_step_count=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("nightly", max_examples=2500, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", max_examples=20, stateful_step_count=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


from vllm_runs import vllm_work  # noqa: E402, F401  (session fixture: vLLM checkpoints and in-process runs)
