"""The checkpoint reader refuses every header safetensors itself refuses, from the header alone, naming the file and
the tensor (lifecycle/header.py, lifecycle/checkpoint.py; issue 32, items 4 and 5).

Differential: hypothesis generates files (tensors laid end to end, then broken: an entry over another tensor's bytes,
offsets shifted, swapped, past the end, bytes before, between or after the tensors, a dtype or shape that does not
match, JSON that only Python's parser takes: `NaN`, `-0`, `1e0`, a key given twice, a BOM, a lone surrogate), and
both readers read each one. What `safetensors.safe_open` refuses, `checkpoint_index` refuses with a
`CheckpointError` naming the file and a tensor of the header (or `__metadata__`, or the header as a whole), having
read the header only; what it accepts, the reader accepts too and reads the same bytes (except the dtypes the
lifecycle does not load, and a name given twice, which the reader also refuses).

Before: an entry whose offsets were another tensor's was accepted and that tensor loaded the other's bytes;
padding before the data and trailing bytes were accepted; `NaN`, `-0`, a repeated key and a BOM were taken by
Python's parser (safetensors refused each file: a trainer could not even compute the expected digests).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from lifecycle.checkpoint import checkpoint_index, iter_buckets
from lifecycle.errors import CheckpointError
from lifecycle.header import DTYPES

#: dtypes of the generated entries: the reader's, safetensors' others, and names neither knows
CODES = [*DTYPES, "U16", "U64", "F8_E8M0", "f32", "X"]
SIZE = {**{c: t.itemsize for c, t in DTYPES.items()}, "U16": 2, "U64": 8, "F8_E8M0": 1}
NAMES = ["a", "b", "w.0", "layers.0.q_proj.weight", "é", "", "__metadata__x", "a b"]
#: text edits only Python's json takes (or that break the JSON), each applied to the serialized header
RAW_EDITS = {
    "nan_extra": lambda t: t.replace('"dtype"', '"x": NaN, "dtype"', 1),
    "inf_shape": lambda t: t.replace('"shape": [', '"shape": [Infinity, ', 1),
    "minus_zero": lambda t: t.replace('"data_offsets": [0,', '"data_offsets": [-0,', 1),
    "exponent": lambda t: t.replace('"data_offsets": [0,', '"data_offsets": [0e0,', 1),
    "dup_field": lambda t: t.replace('"dtype"', '"dtype": "F32", "dtype"', 1),
    "dup_key": lambda t: t[:-1] + ", " + t[1:] if len(t) > 2 else t,
    "bom": lambda t: "\ufeff" + t,
    "trailing_nul": lambda t: t + "\x00",
    "surrogate_key": lambda t: t.replace('{"', '{"\\ud800', 1),
    "leading_space": lambda t: " " + t,
    "huge_int": lambda t: t.replace('"shape": [', '"shape": [18446744073709551616, ', 1),
}


@st.composite
def files(draw: Any) -> tuple[bytes, str]:
    """(the file's bytes, what was done to it)."""
    names = draw(st.lists(st.sampled_from(NAMES), max_size=4, unique=True))
    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for name in names:
        code = draw(st.sampled_from(CODES) if draw(st.integers(0, 9)) == 0 else st.sampled_from(list(DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = SIZE.get(code, 4) * int(torch.tensor(shape).prod()) if shape else SIZE.get(code, 4)
        entries[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    order = draw(st.permutations(list(entries)))  # JSON order need not be data order
    done: list[str] = []
    data_size = offset
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["alias", "shift", "swap", "resize", "trailing", "truncated", "padding",
                                     "shape", "negative"]))
        done.append(kind)
        victim = draw(st.sampled_from(names)) if names else None
        if kind == "trailing":
            data_size += draw(st.integers(1, 9))
        elif kind == "truncated" and data_size:
            data_size -= draw(st.integers(1, data_size))
        elif kind == "padding":
            pad = draw(st.integers(1, 8))
            data_size += pad
            for e in entries.values():
                e["data_offsets"] = [o + pad for o in e["data_offsets"]]
        elif victim is None:
            continue
        elif kind == "alias":
            other = entries[draw(st.sampled_from(names))]
            entries[victim] = {**entries[victim], "data_offsets": list(other["data_offsets"]),
                               "shape": list(other["shape"]), "dtype": other["dtype"]}
        elif kind == "shift":
            delta = draw(st.integers(-4, 4))
            entries[victim]["data_offsets"] = [o + delta for o in entries[victim]["data_offsets"]]
        elif kind == "swap":
            entries[victim]["data_offsets"] = entries[victim]["data_offsets"][::-1]
        elif kind == "resize":
            entries[victim]["data_offsets"][1] += draw(st.integers(-4, 4))
        elif kind == "shape":
            entries[victim]["shape"] = draw(st.lists(st.integers(0, 3), max_size=3))
        elif kind == "negative":
            entries[victim]["data_offsets"][0] = -1
    header: dict[str, Any] = {n: entries[n] for n in order}
    metadata = draw(st.sampled_from([None, "absent", {"format": "pt"}, {"n": 1}, "text"]))
    if metadata != "absent":
        header = {"__metadata__": metadata, **header}
    text = json.dumps(header)
    edit = draw(st.sampled_from([None] * 6 + list(RAW_EDITS)))
    if edit is not None:
        text, done = RAW_EDITS[edit](text), [*done, edit]
    raw = text.encode("utf-8", "surrogatepass")
    raw += b" " * draw(st.integers(0, 7))
    data = bytes(i % 251 for i in range(max(data_size, 0)))
    return struct.pack("<Q", len(raw)) + raw + data, "+".join(done) or "valid"


def _safetensors(path: Path) -> dict[str, bytes] | str:
    """Each tensor's bytes as safetensors reads them, or its error."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: _bytes(f.get_tensor(k)) for k in f.keys()}  # noqa: SIM118  (safe_open is not a dict)
    except Exception as e:  # its errors are SafetensorError, and a few of Rust's panics
        return f"{type(e).__name__}: {e}"


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def _keys(raw: bytes) -> list[str]:
    """The header's top-level keys, as a lenient parser finds them (for the 'names a tensor' check)."""
    n = struct.unpack("<Q", raw[:8])[0]
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8", "surrogatepass").lstrip("\ufeff").rstrip("\x00 "))
    except ValueError:
        return []
    return list(header) if isinstance(header, dict) else []


WHOLE_HEADER = ("corrupt header", "not UTF-8", "the header lists no tensor")


def _raw(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


ALIASED = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}


@settings(max_examples=400)
@given(files())
@example((_raw(ALIASED, bytes(4)), "alias"))
@example((_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "padding"))
@example((_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8)), "trailing"))
def test_what_safetensors_refuses_the_reader_refuses_from_the_header_naming_file_and_tensor(
        tmp_path_factory: pytest.TempPathFactory, case: tuple[bytes, str]) -> None:
    raw, what = case
    path = tmp_path_factory.mktemp("diff") / "model.safetensors"
    path.write_bytes(raw)
    theirs = _safetensors(path)
    event(f"safetensors {'refuses' if isinstance(theirs, str) else 'reads'}")  # pytest --hypothesis-show-statistics
    offsets: list[int] = []
    real = os.preadv

    def counted(fd: int, buffers: Any, offset: int) -> int:
        offsets.append(offset)
        return real(fd, buffers, offset)

    os.preadv = counted  # type: ignore[assignment]
    try:
        ours: Any = checkpoint_index(path)
    except CheckpointError as e:
        ours = e
    finally:
        os.preadv = real
    assert set(offsets) <= {0, 8}, (what, offsets)  # the length and the header: never a byte of data
    if isinstance(theirs, str):
        assert isinstance(ours, CheckpointError), (what, theirs, "accepted")
        message = str(ours)
        assert str(path) in message, message
        keys = _keys(raw)
        named = [k for k in keys if f"tensor {k}" in message or (k == "__metadata__" and k in message)]
        assert named or any(w in message for w in WHOLE_HEADER) or "lone surrogate" in message, (what, message)
        return
    if isinstance(ours, CheckpointError):  # stricter than safetensors only where it says so
        assert ("unsupported dtype" in str(ours) or "named twice" in str(ours)
                or "twice" in str(ours)), (what, str(ours))
        return
    assert sorted(ours) == sorted(theirs), what
    for name in ours:
        ((_, t),) = next(iter_buckets(ours, [[name]]))
        assert _bytes(t) == theirs[name], (what, name)


def _file(tmp_path: Path, header: dict[str, Any], data: bytes) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(_raw(header, data))
    return path


def test_an_entry_over_another_tensors_bytes_is_refused_naming_both(tmp_path: Path) -> None:
    """The issue's case: `b` pointed at `a`'s bytes; `checkpoint_index` took it and `b` loaded `a`'s values."""
    a, b = torch.arange(4, dtype=torch.float32), torch.full((4,), 7.0)
    data = a.numpy().tobytes() + b.numpy().tobytes()
    path = _file(tmp_path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                            "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                            "c": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}, data)
    with pytest.raises(CheckpointError, match=r"tensor b: data offsets 0\.\.16 overlap tensor a's bytes"):
        checkpoint_index(path)


@pytest.mark.parametrize(("where", "message"), [
    ("before", r"tensor w: data offsets 8\.\.24 leave 8 byte\(s\) after the start of the data"),
    ("after", r"8 byte\(s\) of data follow the tensors' \(tensor w, the last, ends at 16"),
])
def test_bytes_before_or_after_the_tensors_are_refused(tmp_path: Path, where: str, message: str) -> None:
    begin = 8 if where == "before" else 0
    path = _file(tmp_path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [begin, begin + 16]}},
                 bytes(24))
    with pytest.raises(CheckpointError, match=message):
        checkpoint_index(path)
