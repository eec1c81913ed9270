"""Worker extensions of another package (a trainer's own, as SkyRL's launcher sets), for
tests/vllm_plugin/online/test_vllm_extensions.py: the lifecycle's RPCs must join them."""

from __future__ import annotations

__all__ = ["ClashingExtension", "OtherExtension"]


class OtherExtension:
    """A trainer's worker extension with an RPC of its own."""

    def other_ping(self) -> str:
        return "pong"


class ClashingExtension:
    """One that defines a name of the lifecycle's RPCs."""

    def lifecycle_states(self) -> str:
        return "mine"
