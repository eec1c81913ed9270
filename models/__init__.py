"""Draft backbones that share the reload lifecycle through inheritance. `FAMILIES` lists them by name.

>>> sorted(FAMILIES)[:1]
['dflash']
"""

from __future__ import annotations

from lifecycle.testing import random_checkpoint

from .registry import FAMILIES, DraftFamily, get_family

__all__ = ["FAMILIES", "DraftFamily", "get_family", "random_checkpoint"]
