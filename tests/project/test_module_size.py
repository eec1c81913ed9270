"""No module over 400 lines anywhere in `lifecycle/` (the vLLM layer included) and `models/` (issue 31): a module
that grows past it is split by concern, as the audit package's report (`panels`) and replay (`findings`) were."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400


def too_long(files: list[Path], limit: int = MAX_LINES) -> dict[str, int]:
    """The files of more than `limit` lines (as `wc -l` counts them, a last line without a newline included)."""
    counts = {p.as_posix(): len(p.read_text(encoding="utf-8").splitlines()) for p in files}
    return {name: n for name, n in counts.items() if n > limit}


def modules() -> list[Path]:
    return [p for pkg in ("lifecycle", "models") for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_module_is_over_400_lines() -> None:
    files = modules()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    assert {"lifecycle/machine.py", "lifecycle/audit/replay.py", "models/registry.py"} <= names
    assert any(name.startswith("lifecycle/vllm/") and name.count("/") >= 3 for name in names)  # its subpackages too
    found = {Path(name).relative_to(ROOT).as_posix(): n for name, n in too_long(files).items()}
    assert not found, f"modules over {MAX_LINES} lines (split each by concern): {found}"


def test_the_check_finds_a_long_module(tmp_path: Path) -> None:
    at, over, unterminated = tmp_path / "at.py", tmp_path / "over.py", tmp_path / "unterminated.py"
    at.write_text("x = 1\n" * MAX_LINES)
    over.write_text("x = 1\n" * (MAX_LINES + 1))
    unterminated.write_text("x = 1\n" * MAX_LINES + "y = 2")
    assert too_long([at, over, unterminated]) == {over.as_posix(): MAX_LINES + 1,
                                                  unterminated.as_posix(): MAX_LINES + 1}
