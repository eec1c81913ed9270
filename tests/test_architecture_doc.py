"""docs/architecture.md holds generated blocks (the transition table, the diagram, the module list, the vLLM patch
points); this test regenerates each from the code and fails if the document differs.

Regenerate after a change: `.venv/bin/python tests/test_architecture_doc.py` (rewrites the blocks in place).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BLOCK = re.compile(r"(<!-- generated:(?P<name>[a-z-]+):begin -->\n)(?P<body>.*?)(<!-- generated:(?P=name):end -->)",
                   re.S)


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def packages() -> str:
    lines = []
    for package in ("lifecycle", "lifecycle/derived", "lifecycle/loading", "lifecycle/audit", "lifecycle/vllm",
                    "models"):
        folder = ROOT / package
        lines.append(f"- `{package.replace('/', '.')}`")
        for path in sorted(folder.glob("*.py")):
            if path.name == "__init__.py":
                continue
            lines.append(f"  - `{path.name}`: {_first_line(path)}")
    return "\n".join(lines)


def patch_points() -> str:
    from lifecycle.vllm.patches import PATCH_POINTS

    lines = ["| vLLM module | function | wrapper |", "|---|---|---|"]
    lines += [f"| `{module}` | `{attr}` | `{make.__name__}` |" for module, attr, make in PATCH_POINTS]
    return "\n".join(lines)


def generated() -> dict[str, str]:
    from lifecycle.audit.diagram import markdown, mermaid

    return {"transition-table": markdown(), "mermaid": mermaid().strip(), "packages": packages(),
            "patch-points": patch_points()}


def render(text: str) -> str:
    blocks = generated()

    def fill(m: re.Match[str]) -> str:
        return m.group(1) + blocks[m.group("name")] + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def test_every_generated_block_of_the_design_document_matches_the_code() -> None:
    text = DOC.read_text()
    names = {m.group("name") for m in BLOCK.finditer(text)}
    assert names == set(generated()), f"blocks in the document {sorted(names)} vs generated {sorted(generated())}"
    expected = render(text)
    assert text == expected, ("docs/architecture.md is out of date with the code: run "
                              "`.venv/bin/python tests/test_architecture_doc.py` and commit the result")


def test_the_documents_opening_example_runs(tmp_path: Path) -> None:
    import subprocess

    code = DOC.read_text().split("```python\n", 1)[1].split("```", 1)[0].replace("/tmp/", f"{tmp_path}/")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_check_fails_on_a_stale_table() -> None:
    stale = DOC.read_text().replace("| `capture_graphs` |", "| `capture_graph` |")
    assert render(stale) != stale


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    DOC.write_text(render(DOC.read_text()))
    print(f"rewrote {DOC}")
