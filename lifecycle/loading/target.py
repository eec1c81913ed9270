"""What the loader needs of the backbone it loads: the module itself and the lifecycle it owns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..machine import BackboneLifecycle

__all__ = ["LoadTarget"]


class LoadTarget(Protocol):
    """An `nn.Module` that owns a lifecycle, such as every `DraftBackbone`: the loader checks and reports through
    `lifecycle`, and hands the module itself to the writer (`Writer`), which writes into its tensors.

    The loader (and the reload session) is written against this rather than against `DraftBackbone`: the backbone
    sits above them, uses their types and builds sessions (`reload_session`), and nothing below it names it."""

    @property
    def lifecycle(self) -> BackboneLifecycle: ...
