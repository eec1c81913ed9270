"""A `models/` folder in the working directory (most ML repositories have one) does not break the package: the CLI,
the documented examples and `lifecycle.bundled` take the bundled draft families from where they are installed, and
the user's own `models` stays what `import models` gives (issue 35, item 1; docs/decisions.md).

Each check runs a real interpreter in a folder that holds a `models` package of its own, with `python -m` / `-c`,
which put the working directory first on `sys.path`, as users run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"


@pytest.fixture
def ml_repo(tmp_path: Path) -> Path:
    """A working directory with a `models` package of its own (no `FAMILIES` in it)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("OURS = 'the user'\n")
    (tmp_path / "models" / "qwen3_dflash.py").write_text("raise ImportError('the user module was imported')\n")
    return tmp_path


def run(cwd: Path, *args: str, path: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """This interpreter in `cwd`, with this checkout (or `path`) on PYTHONPATH after the working directory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def shadow_note(stderr: str, other: Path) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("reload-lifecycle: note: `import models` here gives")
    assert str(other.resolve()) in lines[0] and str(ROOT / "models") in lines[0], lines[0]


def test_the_models_command_lists_the_bundled_families_beside_a_models_folder(ml_repo: Path) -> None:
    from models import FAMILIES

    proc = run(ml_repo, "-m", "lifecycle.cli", "models")
    assert proc.returncode == 0, proc.stderr
    for name in FAMILIES:
        assert re.search(rf"^{re.escape(name)} ", proc.stdout, re.M), name
    shadow_note(proc.stderr, ml_repo / "models")


def test_the_demo_runs_beside_a_models_folder(ml_repo: Path) -> None:
    proc = run(ml_repo, "-m", "lifecycle.cli", "demo", "--layers", "2", "--device", "cpu", "--out", "out")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert "RESULT: all checks passed" in proc.stdout
    shadow_note(proc.stderr, ml_repo / "models")


def test_the_guide_runs_beside_a_models_folder_and_leaves_the_users_models_alone(ml_repo: Path) -> None:
    first = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)[0]
    script = first + (
        "\nimport sys, models\n"
        "from lifecycle.bundled import PRIVATE_NAME, package, shadowing\n"
        "assert models.OURS == 'the user'            # `import models` is still the user's\n"
        "assert package().__name__ == PRIVATE_NAME and qwen3_dflash.__name__ == PRIVATE_NAME + '.qwen3_dflash'\n"
        "assert 'models.qwen3_dflash' not in sys.modules\n"
        "print('guide ran;', draft.lifecycle.state.value, shadowing())\n")
    proc = run(ml_repo, "-c", script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"guide ran; GRAPH_CAPTURED {(ml_repo / 'models').resolve()}" in proc.stdout


def test_without_a_shadow_the_bundled_names_are_the_models_packages_own(tmp_path: Path) -> None:
    proc = run(tmp_path, "-c", "import models, models.registry\nfrom lifecycle.bundled import FAMILIES, registry, "
                               "shadowing\nassert FAMILIES is models.FAMILIES and registry is models.registry\n"
                               "assert shadowing() is None\nprint('same')")
    assert proc.returncode == 0 and proc.stdout.strip() == "same", proc.stderr


def test_version_names_a_shadowing_models_and_a_distribution_that_installs_it_too(tmp_path: Path) -> None:
    """As `pip install models` would leave it: another distribution's `models` package and its metadata."""
    site = tmp_path / "site"
    (site / "models").mkdir(parents=True)
    (site / "models" / "__init__.py").write_text("")
    info = site / "models-0.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: models\nVersion: 0.9\n")
    (info / "top_level.txt").write_text("models\n")
    (info / "RECORD").write_text("models/__init__.py,,\n")
    proc = run(tmp_path, "-m", "lifecycle.cli", "--version", path=site)
    assert proc.returncode == 0, proc.stderr
    import lifecycle

    assert proc.stdout == f"reload-lifecycle {lifecycle.__version__}\n"
    note, warning = proc.stderr.strip().splitlines()
    assert str((site / "models").resolve()) in note
    assert warning == ("reload-lifecycle: warning: the package `models` is also installed by models: one overwrote "
                       "the other's files; give reload-lifecycle an environment of its own")


def test_version_says_only_the_version_where_nothing_clashes(tmp_path: Path) -> None:
    proc = run(tmp_path, "-m", "lifecycle.cli", "--version")
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert re.fullmatch(r"reload-lifecycle \d+\.\d+\.\d+\n", proc.stdout)


def test_no_example_or_doctest_imports_a_bare_models() -> None:
    """The package's own code goes through `lifecycle.bundled` (tests/project/test_layering.py checks its imports); so
    do its doctests and the documentation's examples, which users copy into their own repositories."""
    bare = re.compile(r"^\s*(?:>>> |\.\.\. )?(?:from models\b|import models\b)", re.M)
    texts = {p: p.read_text(encoding="utf-8") for p in [*(ROOT / "lifecycle").rglob("*.py"), ROOT / "README.md",
                                                        *(ROOT / "docs").glob("*.md")]}
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}" for p, text in texts.items()
             for m in bare.finditer(text)]
    assert not found, found
