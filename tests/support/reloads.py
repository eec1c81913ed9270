"""Reload steps the derived-buffer tests share (tests/derived/test_plan_reuse.py, tests/loading/test_bulk_reads.py)."""

from __future__ import annotations

import torch

from lifecycle import DraftBackbone

__all__ = ["reload_layers"]


def reload_layers(m: DraftBackbone, layers: list[int], value: float | None = None) -> None:
    """A reload epoch that reports the tensors of `layers` written (filled with `value` when given), the rest
    unchanged."""
    m.begin_reload()
    names = [n for n in m.lifecycle.specs if any(n.startswith(f"layers.{i}.") for i in layers)]
    if value is not None:
        with torch.no_grad():
            for n in names:
                m.live_tensor(n).fill_(value)  # type: ignore[union-attr]
    m.lifecycle.weights_loaded(names)
    m.finalize_loading(keep_untouched=True)
