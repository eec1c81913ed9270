"""The JSON header of a safetensors file, parsed and checked: every problem is a `CheckpointError` naming the
file and the tensor (or `__metadata__`), never an error of the parser or of a conversion.

What is accepted is what safetensors itself writes: a JSON object whose optional `__metadata__` maps strings to
strings (or is null), and whose every other key is a tensor, an object holding `dtype` (a string naming a dtype
of `DTYPES`), `shape` (a list of integers >= 0) and `data_offsets` (two integers, begin <= end, as many bytes apart
as the shape and dtype need). A number that is not a JSON integer (`1.0`, `Infinity`, `NaN`) or a `true` is refused,
not converted (`int(Infinity)` raised `OverflowError`, `int(12.7)` read 12, a shape `"12"` read as (1, 2)); a
dtype that is a list or an object is refused (it raised `TypeError`); nesting deeper than the parser's recursion
limit is refused naming the top-level key it is under (it raised `RecursionError`).

And what safetensors itself refuses (`tests/loading/test_header_differential.py` compares the two on generated
headers): a header that is not UTF-8 (a BOM, UTF-16), a name or field given twice, `NaN`, `Infinity` or `-0`
anywhere, a lone surrogate escape, a number past 64 bits (also a shape whose running product is), a header past
100,000,000 bytes; and the layout (`check_layout`): the tensors' byte ranges, sorted, lie end to end from the start
of the data to its end, so no two tensors share a byte (an entry pointing at another tensor's bytes loaded that
tensor's values), no byte before the first, between two or after the last belongs to no tensor.

A header that passed is remembered by its bytes and the data's size (`checked_header`, which the checkpoint
reader calls): a trainer's pushes repeat both byte for byte, and the same bytes over the same size pass the same
checks. A refusal is never remembered.

>>> try:
...     parse_header(b'{"w": {"dtype": "F32", "shape": [2, Infinity], "data_offsets": [0, 8]}}', "x.safetensors")
... except CheckpointError as e:
...     print(e)
cannot read checkpoint x.safetensors: tensor w: shape [2, Infinity] is not a list of integers >= 0
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from os import PathLike
from typing import Any

import torch

from .errors import CheckpointError
from .types import clipped

__all__ = ["DTYPES", "HEADER_LIMIT", "METADATA", "HeaderEntry", "check_layout", "error", "parse_header"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: safetensors' own limit on the JSON header (its MAX_HEADER_SIZE; it refuses 100,000,001 bytes)
HEADER_LIMIT = 100_000_000
#: a shape, an offset and a tensor's size are Rust `usize`s in safetensors: past 64 bits it refuses them
_U64 = 2**64
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


class _Label:
    """`tensor NAME` (the name cut for a message), formatted only when a message uses it: a header is checked
    entry by entry on every push, and messages are the failure path."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"tensor {clipped(self.name, _SHOWN)}"


class _Repeated(dict[str, Any]):
    """A JSON object that gave a key twice (`repeated`: the first such key); json keeps the last value silently,
    safetensors refuses a repeated field of an entry, and another reader may take the first."""

    repeated = ""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        out = _Repeated(out)
        for k, _ in pairs:
            if k in seen:
                out.repeated = k
                break
            seen.add(k)
    return out


def _integer(text: str) -> int | float:
    # safetensors (serde) reads `-0` as a float, never an unsigned integer: a float is refused where one is needed
    return -0.0 if text == "-0" else int(text)


def parse_header(text: bytes, path: str | PathLike[str]) -> list[HeaderEntry]:
    """Every tensor of a header, checked; the first problem is a `CheckpointError` naming `path` and the tensor."""
    try:
        decoded = text.decode("utf-8")  # strictly: json would also take UTF-16/32 and a BOM, safetensors does not
    except UnicodeDecodeError as e:
        raise error(path, f"corrupt header: not UTF-8 (byte {e.start}): not a safetensors file?") from None
    constants: list[str] = []

    def constant(c: str) -> float:
        constants.append(c)
        return float(c)

    try:
        header = json.loads(decoded, object_pairs_hook=_pairs, parse_int=_integer, parse_constant=constant)
    except RecursionError:
        raise error(path, f"corrupt header: {_nested_under(text)} nests deeper than a safetensors header can "
                          "(it nests 3 deep)") from None
    except ValueError as e:
        raise error(path, f"corrupt header ({clipped(str(e), _SHOWN)}): truncated or not a safetensors file?") from e
    if not isinstance(header, dict):
        raise error(path, "corrupt header (not a JSON object): not a safetensors file?")
    if isinstance(header, _Repeated):
        raise error(path, f"tensor {clipped(header.repeated, _SHOWN)} is named twice in the header")
    out = []
    for name, meta in header.items():
        if name == METADATA:
            _check_metadata(path, meta)
        else:
            out.append(_entry(path, name, meta))
    if constants:  # NaN or Infinity in a field nothing reads: still not JSON, and safetensors refuses the file
        raise error(path, f"{_holding(header, lambda v: isinstance(v, float))}: {constants[0]} is not JSON")
    if _ESCAPED_SURROGATE.search(decoded):
        _refuse_lone_surrogates(header, path)
    return out


#: a JSON escape of a UTF-16 surrogate: only those can make a string that is not Unicode (a lone one)
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(header: dict[str, Any], path: str | PathLike[str]) -> None:
    """A lone surrogate escape (`"\\ud800"`) makes a str that is no Unicode text: json takes it, safetensors does
    not, and a name holding one cannot be written anywhere (only on the failure path: the text holds such an
    escape)."""
    for key, value in header.items():
        try:
            json.dumps([key, value], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            shown = key.encode("utf-8", "backslashreplace").decode()
            where = METADATA if key == METADATA else f"tensor {clipped(shown, _SHOWN)}"
            raise error(path, f"{where}: a lone surrogate escape (\\ud800-\\udfff) is not Unicode text") from None


def _holding(header: dict[str, Any], found: Any) -> str:
    """`tensor NAME` (or `__metadata__`) of the first top-level entry holding a value `found` accepts (an iterative
    walk: the failure path only)."""
    for key, value in header.items():
        stack = [value]
        while stack:
            v = stack.pop()
            if found(v):
                return METADATA if key == METADATA else f"tensor {clipped(key, _SHOWN)}"
            stack.extend(v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
    return "the header"


def _check_metadata(path: str | PathLike[str], meta: object) -> None:
    if meta is None:  # what safetensors' own reader takes for "no metadata"
        return
    if isinstance(meta, _Repeated):
        raise error(path, f"{METADATA} gives {clipped(meta.repeated, _SHOWN)} twice")
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        raise error(path, f"{METADATA} must map names to strings (as safetensors writes it), got {_shown(meta)}")


def _entry(path: str | PathLike[str], name: str, meta: object) -> HeaderEntry:
    tensor = _Label(name)  # "tensor NAME", made only for a message
    if isinstance(meta, _Repeated):
        raise error(path, f"{tensor}: its entry gives {clipped(meta.repeated, _SHOWN)} twice")
    if type(meta) is not dict:
        raise error(path, f"{tensor}: corrupt header entry {_shown(meta)} (not an object)")
    dtype_code, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if type(dtype_code) is not str:
        raise error(path, f"{tensor}: dtype {_shown(dtype_code)} is not a name (F32, BF16, ...)")
    dtype = DTYPES.get(dtype_code)
    if dtype is None:
        raise error(path, f"{tensor} has unsupported dtype {clipped(dtype_code, _SHOWN)}")
    # `type(d) is int`: a JSON integer; True, 2.0, Infinity and NaN are not (json makes them bool and float)
    if type(shape) is not list or not all(type(d) is int and 0 <= d < _U64 for d in shape):
        raise error(path, f"{tensor}: shape {_shown(shape)} is not a list of integers >= 0")
    if (type(offsets) is not list or len(offsets) != 2 or type(begin := offsets[0]) is not int
            or type(end := offsets[1]) is not int or not 0 <= begin < _U64 or not 0 <= end < _U64):
        raise error(path, f"{tensor}: data_offsets {_shown(offsets)} are not two integers")
    dims = tuple(shape)
    elements = 1
    for d in dims:  # as safetensors counts: a running product past 64 bits is refused, even if a later 0 follows
        elements *= d
        if elements >= _U64:
            raise error(path, f"{tensor}: shape {_shown(shape)} holds more elements than 64 bits count")
    if not begin <= end or end - begin != elements * dtype.itemsize:
        raise error(path, f"{tensor}: data offsets {begin}..{end} do not hold {dtype_code} {list(dims)}")
    return name, dims, dtype, begin, end


def check_layout(entries: Sequence[HeaderEntry], data_size: int, path: str | PathLike[str], data_start: int = 0
                 ) -> None:
    """The tensors' byte ranges, sorted, lie end to end over the data exactly (`data_size` bytes), as safetensors
    checks: the first begins at 0, each begins where the one before it ends (zero-size tensors may share a point),
    the last ends at the end of the file. Any other layout is refused naming the tensor (and the one it meets):
    two entries over one range loaded one tensor with the other's values; bytes before, between or after the
    tensors are something a writer put there that no tensor accounts for. `data_start`: where the data begins in
    the file (for messages)."""
    at, before = 0, None
    for name, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        tensor = _Label(name)
        if end > data_size:
            raise error(path, f"{tensor} needs bytes {data_start + begin}..{data_start + end} but the file has "
                              f"{data_start + data_size}: truncated")
        if begin < at:
            raise error(path, f"{tensor}: data offsets {begin}..{end} overlap tensor {clipped(before or '', _SHOWN)}'s "
                              f"bytes (to {at}): two tensors would read the same bytes")
        if begin > at:
            after = f"tensor {clipped(before, _SHOWN)}'s end ({at})" if before is not None else "the start of the data"
            raise error(path, f"{tensor}: data offsets {begin}..{end} leave {begin - at} byte(s) after {after} that "
                              "belong to no tensor (safetensors lays tensors end to end)")
        at, before = end, name
    if at != data_size:
        last = (f"tensor {clipped(before, _SHOWN)}, the last, ends at {at}" if before is not None
                else "the header lists no tensor")
        raise error(path, f"{data_size - at} byte(s) of data follow the tensors' ({last}; the data holds {data_size}): "
                          "they belong to no tensor (appended to the file?)")


#: Headers checked before, by their bytes and the data's size: a trainer's pushes write headers that are the same
#: byte for byte (the same names, shapes, dtypes and offsets), and the checks are a pure function of the two. Only
#: what passed is kept, at most `_CHECKED_MAX` headers of at most `_CHECKED_BYTES` each.
_CHECKED: OrderedDict[tuple[bytes, int], tuple[HeaderEntry, ...]] = OrderedDict()
_CHECKED_MAX = 16
_CHECKED_BYTES = 256 << 10
_CHECKED_LOCK = threading.Lock()


def checked_header(text: bytes, data_size: int, path: str | PathLike[str], data_start: int = 0
                   ) -> tuple[HeaderEntry, ...]:
    """`parse_header` then `check_layout` (`data_size` bytes of data after it), each header's bytes checked once:
    the same bytes over the same data size answer what passed before (a failure is never kept: it is raised again,
    naming `path`)."""
    key = (text, data_size)
    with _CHECKED_LOCK:
        hit = _CHECKED.get(key)
        if hit is not None:
            _CHECKED.move_to_end(key)
            return hit
    entries = parse_header(text, path)
    check_layout(entries, data_size, path, data_start)
    checked = tuple(entries)
    if len(text) <= _CHECKED_BYTES:
        with _CHECKED_LOCK:
            _CHECKED[key] = checked
            while len(_CHECKED) > _CHECKED_MAX:
                _CHECKED.popitem(last=False)
    return checked


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
