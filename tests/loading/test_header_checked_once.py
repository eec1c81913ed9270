"""A header is parsed and checked once per its bytes (`lifecycle.header.checked_header`; issue 33): a trainer's
pushes write headers that are the same byte for byte, and each push indexed its files again. What passed is kept
by the header's bytes and the size of the data after it; whatever differs (a byte of the header, the data's size)
is checked afresh, and a refusal is never kept.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lifecycle import header
from lifecycle.checkpoint import checkpoint_index, iter_buckets
from lifecycle.errors import CheckpointError
from lifecycle.loading import write_checkpoint


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths `parse_header` was called for, with an empty memo (other tests' headers do not count)."""
    calls: list[str] = []
    real = header.parse_header

    def counted(text: bytes, path: object) -> list[header.HeaderEntry]:
        calls.append(str(path))
        return real(text, path)  # type: ignore[arg-type]

    monkeypatch.setattr(header, "parse_header", counted)
    monkeypatch.setattr(header, "_CHECKED", type(header._CHECKED)())
    yield calls


def _file(tmp_path: Path, name: str = "a.safetensors", seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    return write_checkpoint({"w": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)},
                            tmp_path / name)


def test_the_same_header_bytes_are_parsed_once_and_each_path_is_its_own(tmp_path: Path, parses: list[str]) -> None:
    a = _file(tmp_path, "a.safetensors", seed=0)
    b = _file(tmp_path, "b.safetensors", seed=1)  # other values, the same header bytes
    first, again, other = checkpoint_index(a), checkpoint_index(a), checkpoint_index(b)
    assert parses == [str(a)]
    assert {e.path for e in again.values()} == {a} and {e.path for e in other.values()} == {b}
    assert [(e.shape, e.dtype, e.start, e.nbytes) for e in first.values()] == \
        [(e.shape, e.dtype, e.start, e.nbytes) for e in other.values()]
    ((_, w),) = next(iter_buckets(other, [["w"]]))
    assert torch.equal(w, torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))


def test_a_file_truncated_under_a_header_that_passed_is_refused(tmp_path: Path, parses: list[str]) -> None:
    a = _file(tmp_path)
    checkpoint_index(a)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(a.read_bytes()[:-4])  # the same header bytes over 4 bytes less data
    with pytest.raises(CheckpointError, match=r"cut\.safetensors.*truncated"):
        checkpoint_index(cut)
    longer = tmp_path / "longer.safetensors"
    longer.write_bytes(a.read_bytes() + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"longer\.safetensors.*belong to no tensor"):
        checkpoint_index(longer)
    assert parses == [str(a), str(cut), str(longer)]


def test_a_changed_byte_is_checked_afresh_and_a_refusal_is_never_kept(tmp_path: Path, parses: list[str]) -> None:
    a = _file(tmp_path)
    checkpoint_index(a)
    raw = a.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:8] + raw[8:8 + n].replace(b'"F32"', b'"F99"', 1) + raw[8 + n:])
    for _ in range(2):
        with pytest.raises(CheckpointError, match=r"bad\.safetensors: tensor \w+ has unsupported dtype F99"):
            checkpoint_index(bad)
    assert parses == [str(a), str(bad), str(bad)]


def test_the_memo_is_bounded(tmp_path: Path, parses: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(header, "_CHECKED_MAX", 2)
    files = [write_checkpoint({f"t{i}": torch.zeros(i + 1)}, tmp_path / f"{i}.safetensors") for i in range(3)]
    for f in files:
        checkpoint_index(f)
    assert len(header._CHECKED) == 2
    checkpoint_index(files[0])  # the oldest went first: parsed again
    assert parses == [*map(str, files), str(files[0])]
    big = tmp_path / "big.safetensors"
    shutil.copy(files[1], big)
    monkeypatch.setattr(header, "_CHECKED_BYTES", 8)  # a header over the size kept is checked every time
    header._CHECKED.clear()
    checkpoint_index(big)
    checkpoint_index(big)
    assert parses[-2:] == [str(big), str(big)] and not header._CHECKED
