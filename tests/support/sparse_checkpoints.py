"""Safetensors files whose header claims a huge tensor, its bytes a hole (a sparse file: no disk used).

A real file a trainer, a bad copy or an attacker can produce: every other tensor is real; the big one is declared
in the header (after them in the data) and the file is extended to its full length with `truncate`, so its size
is what the header says and every byte range checks out. Importing this module needs only torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

__all__ = ["TIB", "write_with_sparse_tensor"]

TIB = 2**40
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


def write_with_sparse_tensor(path: Path, tensors: dict[str, torch.Tensor], big: str, shape: tuple[int, ...],
                             dtype: torch.dtype = torch.float32) -> Path:
    """`tensors` as a safetensors file, plus `big` (`shape`, `dtype`) whose bytes are a hole at the end."""
    header: dict[str, object] = {}
    chunks = []
    offset = 0
    for name, t in sorted(tensors.items()):
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    header[big] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
        fh.truncate(8 + len(text) + offset + nbytes)
    return path
