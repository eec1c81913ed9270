"""The JSON header of a safetensors file, parsed and checked: every problem is a `CheckpointError` naming the
file and the tensor (or `__metadata__`), never an error of the parser or of a conversion.

What is accepted is what safetensors itself writes: a JSON object whose optional `__metadata__` maps strings to
strings (or is null), and whose every other key is a tensor, an object holding `dtype` (a string naming a dtype
of `DTYPES`), `shape` (a list of integers >= 0) and `data_offsets` (two integers, begin <= end, as many bytes apart
as the shape and dtype need). A number that is not a JSON integer (`1.0`, `Infinity`, `NaN`) or a `true` is refused,
not converted (`int(Infinity)` raised `OverflowError`, `int(12.7)` read 12, a shape `"12"` read as (1, 2)); a
dtype that is a list or an object is refused (it raised `TypeError`); nesting deeper than the parser's recursion
limit is refused naming the top-level key it is under (it raised `RecursionError`).

>>> try:
...     parse_header(b'{"w": {"dtype": "F32", "shape": [2, Infinity], "data_offsets": [0, 8]}}', "x.safetensors")
... except CheckpointError as e:
...     print(e)
cannot read checkpoint x.safetensors: tensor w: shape [2, Infinity] is not a list of integers >= 0
"""

from __future__ import annotations

import json
import math
import re
from os import PathLike
from typing import Any

import torch

from .errors import CheckpointError
from .types import clipped

__all__ = ["DTYPES", "HEADER_LIMIT", "METADATA", "HeaderEntry", "error", "parse_header"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: safetensors' own limit on the JSON header.
HEADER_LIMIT = 100 * 2**20
METADATA = "__metadata__"
#: (name, shape, dtype, begin, end): offsets relative to the end of the header
HeaderEntry = tuple[str, tuple[int, ...], torch.dtype, int, int]
_SHOWN = 120  # characters of a header value quoted in a message


def error(path: str | PathLike[str], what: str) -> CheckpointError:
    return CheckpointError(f"cannot read checkpoint {path}: {what}", backbone=None)


def _shown(value: Any) -> str:
    """A header value as JSON writes it (Infinity, NaN), cut for a message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return clipped(text, _SHOWN)


def parse_header(text: bytes, path: str | PathLike[str]) -> list[HeaderEntry]:
    """Every tensor of a header, checked; the first problem is a `CheckpointError` naming `path` and the tensor."""
    try:
        header = json.loads(text)
    except RecursionError:
        raise error(path, f"corrupt header: {_nested_under(text)} nests deeper than a safetensors header can "
                          "(it nests 3 deep)") from None
    except ValueError as e:
        raise error(path, f"corrupt header ({clipped(str(e), _SHOWN)}): truncated or not a safetensors file?") from e
    if type(header) is not dict:
        raise error(path, "corrupt header (not a JSON object): not a safetensors file?")
    out = []
    for name, meta in header.items():
        if name == METADATA:
            _check_metadata(path, meta)
        else:
            out.append(_entry(path, name, meta))
    return out


def _check_metadata(path: str | PathLike[str], meta: object) -> None:
    if meta is None:  # what safetensors' own reader takes for "no metadata"
        return
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        raise error(path, f"{METADATA} must map names to strings (as safetensors writes it), got {_shown(meta)}")


def _entry(path: str | PathLike[str], name: str, meta: object) -> HeaderEntry:
    tensor = f"tensor {clipped(name, _SHOWN)}"
    if type(meta) is not dict:
        raise error(path, f"{tensor}: corrupt header entry {_shown(meta)} (not an object)")
    dtype_code, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if type(dtype_code) is not str:
        raise error(path, f"{tensor}: dtype {_shown(dtype_code)} is not a name (F32, BF16, ...)")
    dtype = DTYPES.get(dtype_code)
    if dtype is None:
        raise error(path, f"{tensor} has unsupported dtype {clipped(dtype_code, _SHOWN)}")
    # `type(d) is int`: a JSON integer; True, 2.0, Infinity and NaN are not (json makes them bool and float)
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise error(path, f"{tensor}: shape {_shown(shape)} is not a list of integers >= 0")
    if (type(offsets) is not list or len(offsets) != 2 or type(begin := offsets[0]) is not int
            or type(end := offsets[1]) is not int):
        raise error(path, f"{tensor}: data_offsets {_shown(offsets)} are not two integers")
    dims = tuple(shape)
    if not 0 <= begin <= end or end - begin != math.prod(dims) * dtype.itemsize:
        raise error(path, f"{tensor}: data offsets {begin}..{end} do not hold {dtype_code} {list(dims)}")
    return name, dims, dtype, begin, end


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]')


def _nested_under(text: bytes) -> str:
    """Which top-level key holds the deepest nesting (a tensor's name, or __metadata__): only on the failure path,
    linear in the header."""
    depth, deepest = 0, 0
    key: bytes | None = None
    where: bytes | None = None
    expect_key = False  # at the top level, the next string is a key (not a value)
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token in (b"[", b"{"):
            depth += 1
            expect_key = depth == 1
            if depth > deepest:
                deepest, where = depth, key
        elif token in (b"]", b"}"):
            depth -= 1
        elif depth == 1 and token == b",":
            expect_key = True
        elif depth == 1 and expect_key:
            key, expect_key = token, False
    if where is None:
        return "the header"
    try:
        name = json.loads(where) if len(where) < 4096 else where[1:4000].decode("utf-8", "replace")
    except ValueError:
        name = where[1:-1].decode("utf-8", "replace")
    return f"tensor {clipped(str(name), _SHOWN)}" if name != METADATA else METADATA
