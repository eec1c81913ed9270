"""Shared fixtures: a quiet audit configuration, a tiny DFlash config, two checkpoints and a loaded model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lifecycle.audit import configure_audit
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
