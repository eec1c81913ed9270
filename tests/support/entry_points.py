"""This checkout's entry points, for a `vllm serve` subprocess. Standard library only.

vLLM finds its plugins through the installed distributions' entry points (`importlib.metadata`), not through
`PYTHONPATH`: a server started from a checkout whose `pyproject.toml` declares an entry point the installed
metadata does not have yet (the shared venv holds another checkout's editable install) would run without it.
`dist_info(folder)` writes a `reload_lifecycle-<version>.dist-info` with this checkout's `[project.entry-points]`
and scripts into `folder`; first on the server's `PYTHONPATH`, it is the distribution `importlib.metadata` finds
first for the name (it keeps the first of each name), so the server sees what an install of this checkout has.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

__all__ = ["dist_info"]

ROOT = Path(__file__).resolve().parents[2]


def _package_version() -> str:
    """`lifecycle.__version__` as the source says it (the version is dynamic: pyproject.toml reads it there)."""
    found = re.search(r'^__version__ = "([^"]+)"', (ROOT / "lifecycle" / "__init__.py").read_text(), flags=re.M)
    if found is None:
        raise LookupError("lifecycle/__init__.py declares no __version__")
    return found.group(1)


def dist_info(folder: Path) -> Path:
    """Write this checkout's distribution metadata (name, version, entry points) into `folder`; returns `folder`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project.get("version") or _package_version()
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    meta = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (meta / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
        for group, entries in groups.items()))
    return folder
