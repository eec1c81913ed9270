"""The draft families bundled with reload-lifecycle, found where they are installed, never by a bare `import models`.

The families are the top-level package `models`, installed beside `lifecycle` (the repository's layout). Most ML
repositories have a `models/` folder of their own, and `python -m ...` or `python -c ...` puts the working directory
first on `sys.path`: there a bare `import models` finds the user's folder, not the families. So this package's own
code (the CLI, the documentation's examples, its doctests) takes them from here:

    from lifecycle.bundled import qwen3_dflash           # a family's module
    from lifecycle.bundled import FAMILIES, get_family   # the registry (what `models` exports)

Where `import models` gives the bundled package, these are its very modules (`models.qwen3_dflash`). Where another
`models` comes first, that one is left alone (a user's code keeps importing it) and the bundled package is loaded
from its folder under a private name (`PRIVATE_NAME`); `shadowing()` says which `models` shadows which.

>>> from lifecycle.bundled import get_family, package, qwen3_dflash, shadowing
>>> shadowing() is None and qwen3_dflash is sys.modules["models.qwen3_dflash"]  # nothing shadows it here
True
>>> package().__name__, get_family("dflash").name
('models', 'dflash')
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["DISTRIBUTION", "PACKAGE", "PRIVATE_NAME", "BundledModelsError", "home", "located", "name_clashes",
           "package", "shadowing"]

#: The import name of the bundled families, and the distribution that installs them.
PACKAGE = "models"
DISTRIBUTION = "reload-lifecycle"
#: The name the bundled package is loaded under when another `models` shadows it.
PRIVATE_NAME = "_reload_lifecycle_models"


class BundledModelsError(ImportError):
    """The bundled draft families are not installed beside `lifecycle` (a partial copy of the package)."""


def home() -> Path:
    """The folder of the bundled `models` package: beside the `lifecycle` folder this module is in."""
    return Path(__file__).resolve().parent.parent / PACKAGE


def _location(module: ModuleType) -> Path | None:
    where = getattr(module, "__path__", None) or [getattr(module, "__file__", None)]
    first = next(iter(where), None)
    return Path(first).resolve() if first else None


def located() -> Path | None:
    """Where `import models` finds a package or module now (its folder, or its file), None where it finds none."""
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None:
        return _location(loaded)
    try:
        spec = importlib.util.find_spec(PACKAGE)  # a top-level name: finds, imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve() if spec.origin else None


def shadowing() -> Path | None:
    """The other `models` that a bare `import models` gives instead of the bundled one, None where it gives ours."""
    where = located()
    return None if where is None or where == home() else where


def package() -> ModuleType:
    """The bundled `models` package: `models` itself where that is ours, else ours loaded from its folder under
    `PRIVATE_NAME` (the first call loads it; the other `models` is not touched)."""
    private = sys.modules.get(PRIVATE_NAME)
    if private is not None:
        return private
    folder = home()
    if located() == folder:
        return importlib.import_module(PACKAGE)
    init = folder / "__init__.py"
    spec = importlib.util.spec_from_file_location(PRIVATE_NAME, init, submodule_search_locations=[str(folder)])
    if not init.is_file() or spec is None or spec.loader is None:
        raise BundledModelsError(f"reload-lifecycle's draft families are not installed beside lifecycle: {folder} "
                                 f"holds no package; reinstall {DISTRIBUTION}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_NAME] = module  # before it runs: its relative imports find their parent here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == PRIVATE_NAME or n.startswith(PRIVATE_NAME + ".")]:
            del sys.modules[name]
        raise
    return module


def name_clashes() -> dict[str, list[str]]:
    """Top-level import names of this distribution (`lifecycle`, `models`) that other installed distributions
    declare too (name -> those distributions): installing both overwrote one's files with the other's."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    clashes = {name: sorted({d for d in owners.get(name, []) if d.lower() != DISTRIBUTION}) for name in
               ("lifecycle", PACKAGE)}
    return {name: others for name, others in clashes.items() if others}


def __getattr__(name: str) -> Any:
    """`from lifecycle.bundled import X`: a name `models` exports (`FAMILIES`), or one of its modules."""
    if name.startswith("_"):  # the import system's own look-ups (`__path__`, ...): never load anything for them
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    pkg = package()
    if name in getattr(pkg, "__all__", ()):
        return getattr(pkg, name)
    if (home() / f"{name}.py").is_file():
        return importlib.import_module(f"{pkg.__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: the bundled draft families "
                         f"({home()}) have no module or name of that name")
