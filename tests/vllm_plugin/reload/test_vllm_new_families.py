"""Issue 34's families and guards with vLLM's own classes in-process (no engine; `support/vllm_new_family_runs.py`,
whose checks stand beside the actions they check):

- LiLiCorr: DFlash's layers and a correlator head whose six tensors vLLM rebuilds in new storage at the end of every
  load_weights (from META placeholders mid-reload; on CPU from weights the repack emptied). Owned as the draft's
  buffers: every path a whole-checkpoint draft takes equals a cold load, at the captured addresses; stock vLLM's
  reload leaves the head moved (GPU layout) or wrong (CPU). Its load_weights refuses a bucket (vLLM's coverage
  check), so a bucketed push fails closed.
- DeepSeek-V4 DSpark: why no in-process run is possible on CPU (vLLM's CPU class is a stub; its CUDA class builds
  `torch.cuda.Event()`s in `DeepseekV4Attention.__init__`), and vLLM's loader copy into `context_wkv_proj`.
- Writes outside a weight loader (vLLM #57800): a family's declared hand-written tensor is refused in a reload
  before anything is written, never served stale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.needs import needs
from support.vllm_new_family_runs import RESULT
from support.vllm_runs import PYTHONPATH, ROOT


@needs("vllm", "slow")
def _run(scenario: str, layout: str, work: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "support.vllm_new_family_runs", scenario, layout, str(work)],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line.removeprefix(RESULT)))
    raise AssertionError(f"the scenario printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_lilicorr_reloads_equal_a_cold_load_with_its_head_in_place(layout: str, tmp_path: Path) -> None:
    result = _run("lilicorr", layout, tmp_path)
    assert result["ok"], f"{result['failed']}\n{result.get('trace', '')}"
    assert len(result["done"]) == 4, result["done"]
    assert result["done"][-1].startswith("stock vLLM's"), "stock vLLM's reload was not shown failing"


def test_deepseek_v4_dspark_on_cpu_is_vllms_stub_and_its_cuda_class_does_not_construct(tmp_path: Path) -> None:
    result = _run("deepseek_v4", "cpu", tmp_path)
    assert result["ok"], f"{result['failed']}\n{result.get('trace', '')}"
    assert len(result["done"]) == 3, result["done"]


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_a_tensor_written_outside_the_weight_loader_is_never_served_stale(layout: str, tmp_path: Path) -> None:
    result = _run("hand_write", layout, tmp_path)
    assert result["ok"], f"{result['failed']}\n{result.get('trace', '')}"
    assert len(result["done"]) == 3, result["done"]


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_a_draft_listed_as_deriving_nothing_reloads_equal_to_a_cold_load(layout: str, tmp_path: Path) -> None:
    """EAGLE3 (Qwen3) and EAGLE (Llama), vLLM's own classes (the plugin wraps neither): vLLM's layerwise reload in
    buckets equals a cold load, nothing moved. (On the CPU layout the repacked linears' weights are vLLM's oneDNN
    handles: the GPU layout is the one whose every value is compared.) MTP drafts are not run here: each is its
    target's own multi-token-prediction layers, and none of their targets is among this suite's tiny models."""
    result = _run("listed", layout, tmp_path)
    assert result["ok"], f"{result['failed']}\n{result.get('trace', '')}"
    assert len(result["done"]) == 2, result["done"]


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_a_level_2_sleep_quarantines_the_draft_until_a_refill_writes_every_layer(layout: str, tmp_path: Path) -> None:
    """vLLM #52479: after a level-2 wake the draft's weights hold no checkpoint's values and vLLM restores its
    buffers as they were. Without the plugin's wrapper the draft kept drafting (usable, stale); now it is
    quarantined until a refill, its own epoch, writes every layer; refreshed in place at the captured addresses."""
    result = _run("sleep", layout, tmp_path)
    assert result["ok"], f"{result['failed']}\n{result.get('trace', '')}"
    assert len(result["done"]) == 4, result["done"]
