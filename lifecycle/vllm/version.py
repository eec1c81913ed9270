"""Which vLLM versions the integration was built and tested against; anything else is refused."""

from __future__ import annotations

from .. import env
from ..errors import UnsupportedVLLMError

__all__ = ["FORCE_ENV", "SUPPORTED_SERIES", "UnsupportedVLLMError", "check_vllm_version"]

#: Release series whose reload internals (`model_loader.reload`, the DFlash-family builders) the patches match.
SUPPORTED_SERIES = ("0.32",)
FORCE_ENV = "RELOAD_LIFECYCLE_ALLOW_UNKNOWN_VLLM"


def check_vllm_version(version: str | None = None) -> str:
    """Return the running vLLM version, or raise UnsupportedVLLMError for one we do not know."""
    if version is None:
        import vllm

        version = vllm.__version__
    series = ".".join(version.split("+")[0].split(".")[:2])
    if series in SUPPORTED_SERIES or env.flag(FORCE_ENV):
        return version
    raise UnsupportedVLLMError(
        f"reload-lifecycle's vLLM plugin supports vLLM {', '.join(s + '.x' for s in SUPPORTED_SERIES)}; this is "
        f"vLLM {version}. Its reload internals may differ, so the plugin refuses to patch them blindly. Set "
        f"{FORCE_ENV}=1 to try anyway, or disable the plugin with VLLM_PLUGINS (a list that leaves it out)."
    )
