"""The README's worked example ("Your own backbone": separate K and V weights, a layer count from the config) runs
as written: its own asserts are the checks, and the names it defines are checked here too."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Your own backbone", 1)[1]
    (block,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.S)
    return block


def test_the_readme_backbone_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # it writes its checkpoints to the working directory
    module = types.ModuleType("readme_example")  # a real module: dataclasses look their class's module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(_example(), "README.md (Your own backbone)", "exec"), module.__dict__)
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
