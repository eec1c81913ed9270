"""The package, its vLLM subpackage and its core work without vLLM installed (vLLM is imported lazily)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

BLOCK_VLLM = """
import sys
class _NoVLLM:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, _NoVLLM())
"""


def run_without_vllm(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_VLLM + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_core_and_vllm_subpackage_import_and_run_without_vllm() -> None:
    proc = run_without_vllm(
        "import lifecycle, lifecycle.vllm, lifecycle.vllm.reload.mixin, lifecycle.vllm.drafts.families\n"
        "import lifecycle.vllm.compat.registry, lifecycle.vllm.reload.hooks, lifecycle.vllm.worker\n"
        "import lifecycle.vllm.plugin.capabilities\n"
        "import lifecycle.vllm.compat.sources\n"
        "from models.demo import run_demo\n"
        "import io; r = run_demo(layers=2, stream=io.StringIO()); assert r.ok, r.checks\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)\n"
        "print('ok')\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_the_plugin_says_what_is_missing_without_vllm() -> None:
    proc = run_without_vllm("import lifecycle.vllm\nlifecycle.vllm.register()\n")
    assert proc.returncode != 0
    assert "No module named 'vllm'" in proc.stderr
