"""The check of a checkpoint's header before anything is written, and the headers each lifecycle passed already.

A header that passed for a lifecycle (every tensor known, with its shape and dtype) is kept per lifecycle, here:
the next push of the same model (same names, shapes, dtypes, offsets: the same header bytes) skips the check
tensor by tensor. What is kept is held weakly by lifecycle (a dropped backbone takes its entry with it) and
stamped with the lifecycle's `specs_revision`, so a change of what it tracks (`freeze_structure`) voids it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

from ..errors import LifecycleError, UnknownWeightError, WeightShapeError, raise_unheld

if TYPE_CHECKING:
    from ..checkpoint import IndexEntry
    from ..machine import BackboneLifecycle
    from .target import LoadTarget

__all__ = ["VALIDATED_HEADERS_CAP", "file_list", "validate_index", "validated_headers"]

#: The most header bytes kept per lifecycle to skip the check of a checkpoint whose headers it passed before.
VALIDATED_HEADERS_CAP = 16 * 2**20


class _Passed(NamedTuple):
    headers: tuple[bytes, ...]
    specs_revision: int  # of the lifecycle when they passed


#: lifecycle -> the headers whose every tensor matched its specs (the last such checkpoint).
_PASSED: weakref.WeakKeyDictionary[BackboneLifecycle, _Passed] = weakref.WeakKeyDictionary()


def validated_headers(lifecycle: BackboneLifecycle) -> tuple[bytes, ...] | None:
    """The header bytes of the last checkpoint whose every tensor matched `lifecycle`'s specs as they are now
    (None: none, or what it tracks changed since)."""
    passed = _PASSED.get(lifecycle)
    return passed.headers if passed is not None and passed.specs_revision == lifecycle.specs_revision else None


def validate_index(backbone: LoadTarget, index: dict[str, IndexEntry], names: Iterable[str]) -> None:
    """Refuse (before anything is written) unknown names and shape/dtype mismatches, naming every one.

    `names` are names of `index`. An index read by `checkpoint_index` carries its files' header bytes: once every
    tensor of some headers passed, they are kept for the lifecycle (up to `VALIDATED_HEADERS_CAP` bytes), and an
    index with the same bytes is not checked tensor by tensor again (see the module doc)."""
    lc = backbone.lifecycle
    headers = getattr(index, "headers", None)
    if headers and headers == validated_headers(lc):  # bytes compared in C: identical headers, identical check
        return
    names = names if type(names) is list else list(names)
    specs = lc.specs
    # per tensor, the common case inline: known, same shape, same dtype (the messages only for the others)
    suspects = [n for n in names if (spec := specs.get(n)) is None or (entry := index[n]).shape != spec.shape
                or entry.dtype != spec.dtype]
    if not suspects:
        if (headers and sum(map(len, headers)) <= VALIDATED_HEADERS_CAP and len(names) >= len(index)
                and index.keys() == set(names)):  # every tensor of these headers was checked
            _PASSED[lc] = _Passed(headers, lc.specs_revision)
        return
    raise_unheld(_refusal(lc, index, names, suspects))


def _refusal(lc: BackboneLifecycle, index: dict[str, IndexEntry], names: list[str], suspects: list[str]
             ) -> LifecycleError | None:
    """The audited refusal of the suspects' unknown names, else of their shape or dtype mismatches."""
    specs = lc.specs
    unknown = [n for n in suspects if n not in specs]
    if unknown:
        return lc.record_refusal("weights_loaded", UnknownWeightError(
            unknown, backbone=lc.name, state=lc.state.value, source=", ".join(file_list(index, names))))
    problems = [p for n in suspects if (p := specs[n].mismatch(n, index[n].shape, index[n].dtype))]
    if problems:
        return lc.record_refusal("weights_loaded", WeightShapeError(
            problems, backbone=lc.name, state=lc.state.value, source=", ".join(file_list(index, names))))
    return None


_PATH = attrgetter("path")


def file_list(index: dict[str, IndexEntry], names: Iterable[str]) -> list[str]:
    """The files `names` come from, sorted. Entries of one file share one Path object, so they are told apart
    by their hash (a Path caches it) in C: no per-tensor formatting."""
    return sorted({str(p) for p in set(map(_PATH, map(index.__getitem__, names)))})
