"""The documented examples run as written: the README's quickstart, and every Python block of docs/guide.md in
order (its worked example, "Your own backbone": separate K and V weights, a layer count from the config). Their own
asserts are the checks, and the names they define are checked here too."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _example() -> str:
    section = GUIDE.read_text(encoding="utf-8").split("## Your own backbone", 1)[1]
    (block,) = _blocks(section.split("\n## ", 1)[0])
    return block


def _run(blocks: list[str], where: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("readme_example")  # a real module: dataclasses look their class's module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for i, block in enumerate(blocks):
        exec(compile(block, f"{where} (block {i + 1})", "exec"), module.__dict__)
    return module


def test_the_readme_backbone_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # it writes its checkpoints to the working directory
    module = _run([_example()], "docs/guide.md (Your own backbone)", monkeypatch)
    draft = module.draft
    assert draft.lifecycle.name == "tiny-5" and len(draft.layers) == 5  # the second config ran
    assert draft._fused_kv_weight.dtype == torch.bfloat16 and draft._fused_kv_weight.shape == (5 * 2 * 48, 96)
    assert draft._fused_v_bias.shape == (5 * 48,)
    assert draft.lifecycle.usable and draft.lifecycle.graphs_pinned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-3.safetensors", "tiny-5.safetensors"]


def test_the_example_is_the_one_the_readme_points_to() -> None:
    block = _example()
    assert "per_layer=lambda layer: (layer.k_proj.weight, layer.v_proj.weight)" in block
    assert '"layers.*.v_proj.bias"' in block and "weights_unchanged" in block


def test_the_readme_quickstart_runs_and_its_log_audits_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.audit.replay import audit_logs

    monkeypatch.chdir(tmp_path)
    (quickstart,) = _blocks((ROOT / "README.md").read_text(encoding="utf-8").split("## Quickstart", 1)[1]
                            .split("\n## ", 1)[0])
    draft = _run([quickstart], "README.md (Quickstart)", monkeypatch).draft
    assert draft.lifecycle.epoch == 1 and draft.lifecycle.graphs_pinned
    states, proof = capsys.readouterr().out.splitlines()  # what a first run shows: the path, and the proof
    cycle = "PARTIALLY_LOADED -> FULLY_LOADED -> FINALIZED -> DERIVED_REFRESHED -> GRAPH_CAPTURED"
    assert states == f"META -> {cycle} -> {cycle}"
    address = f"{draft._fused_kv_weight.data_ptr():#x}"
    assert proof == f"in place: _fused_kv_weight {address} -> {address}, 0 bytes allocated"
    result = audit_logs([tmp_path / "audit.jsonl"])
    assert result.status == 0 and result.events > 10, result


def test_every_python_block_of_the_guide_runs_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = _blocks(GUIDE.read_text(encoding="utf-8"))
    assert len(blocks) >= 4 and _example() in blocks
    module = _run(blocks, "docs/guide.md", monkeypatch)
    assert module.draft.lifecycle.usable
