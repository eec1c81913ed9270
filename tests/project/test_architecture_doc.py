"""docs/architecture.md holds generated blocks (the transition table, the diagram, the module list, the core's layers,
the vLLM patch points); this test regenerates each from the code and fails if the document differs. The blocks are
made by docs/generate.py, which also writes the other generated pages (tests/project/test_docs.py checks them all).

Regenerate after a change: `python docs/generate.py` (rewrites the blocks in place).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def generated() -> dict[str, str]:
    return {name: make() for name, make in gen.BLOCKS["docs/architecture.md"].items()}


def render(text: str) -> str:
    return gen.fill_blocks(text, gen.BLOCKS["docs/architecture.md"])


def test_every_generated_block_of_the_design_document_matches_the_code() -> None:
    text = DOC.read_text()
    names = {m.group("name") for m in gen.BLOCK.finditer(text)}
    assert names == set(generated()), f"blocks in the document {sorted(names)} vs generated {sorted(generated())}"
    expected = render(text)
    assert text == expected, ("docs/architecture.md is out of date with the code: run "
                              "`python docs/generate.py` and commit the result")


def test_the_documents_opening_example_runs(tmp_path: Path) -> None:
    code = DOC.read_text().split("```python\n", 1)[1].split("```", 1)[0].replace("/tmp/", f"{tmp_path}/")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_check_fails_on_a_stale_table() -> None:
    stale = DOC.read_text().replace("| `capture_graphs` |", "| `capture_graph` |")
    assert render(stale) != stale


if __name__ == "__main__":
    sys.exit(gen.main([]))
