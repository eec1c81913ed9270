"""Every problem of a safetensors header is a `CheckpointError` naming the file and the tensor (or
`__metadata__`), audited as a refusal (lifecycle/checkpoint.py; issue 25, item 8).

Before: deep nesting inside `__metadata__` escaped as `RecursionError`, a dtype given as a list or an object as
`TypeError`, `Infinity` in a shape or an offset as `OverflowError` (and a shape given as a string or as floats
was read as something else): not `LifecycleError`s, never audited as refusals, and a reload session quarantined
the draft with nothing in the trail but the Python error.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from lifecycle.checkpoint import checkpoint_index
from lifecycle.errors import CheckpointError
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.states import LifecycleState
from lifecycle.vllm.reload.payload import plan_payload
from models.qwen3_dflash import DFlashQwen3Draft

S = LifecycleState
DEEP = 100_000


def _with_header(path: Path, edit: object) -> Path:
    """`path`'s safetensors file with its header replaced: `edit(header) -> header` (a dict) or raw JSON text."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    text = edit(header) if callable(edit) else edit
    data = text.encode() if isinstance(text, str) else json.dumps(text).encode()
    path.write_bytes(struct.pack("<Q", len(data)) + data + raw[8 + n:])
    return path


def _set(name: str, field: str, value: str) -> object:
    """Edit one field of one tensor's entry, written as raw JSON (`Infinity` is not something json.dumps writes
    from a dict, but the parser reads it)."""
    def edit(header: dict) -> str:
        header[name][field] = "@@"
        return json.dumps(header).replace('"@@"', value)
    return edit


NAME = "layers.0.self_attn.qkv_proj.weight"
CASES = {
    "deep_metadata": (lambda h: '{"__metadata__": {"k": ' + "[" * DEEP + "]" * DEEP + "}, "
                      + json.dumps(h)[1:], "__metadata__"),
    "nested_metadata": (lambda h: {**h, "__metadata__": {"k": [[["x"]]]}}, "__metadata__"),
    "dtype_list": (_set(NAME, "dtype", '["F32"]'), NAME),
    "dtype_object": (_set(NAME, "dtype", '{"F32": 1}'), NAME),
    "shape_infinity": (_set(NAME, "shape", "[Infinity, 64]"), NAME),
    "shape_nan": (_set(NAME, "shape", "[NaN, 64]"), NAME),
    "offsets_infinity": (_set(NAME, "data_offsets", "[0, Infinity]"), NAME),
    "offsets_minus_infinity": (_set(NAME, "data_offsets", "[-Infinity, 0]"), NAME),
    "shape_string": (_set(NAME, "shape", '"12"'), NAME),
    "shape_floats": (_set(NAME, "shape", "[128.0, 64.0]"), NAME),
    "shape_bools": (_set(NAME, "shape", "[true, true]"), NAME),
    "entry_not_an_object": (_set(NAME, "dtype", '"F32"'), NAME),  # replaced below by a list entry
}


@pytest.fixture
def ckpt_a_copy(ckpt_a: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "hostile.safetensors"
    copy.write_bytes(ckpt_a.read_bytes())
    return copy


def _damaged(path: Path, case: str) -> tuple[Path, str]:
    edit, names = CASES[case]
    if case == "entry_not_an_object":
        def edit(header: dict) -> dict:  # type: ignore[no-redef]
            return {**header, NAME: ["F32", [128, 64], [0, 4]]}
    return _with_header(path, edit), names


@pytest.mark.parametrize("case", list(CASES))
def test_each_header_problem_is_a_checkpoint_error_naming_file_and_tensor(ckpt_a_copy: Path, case: str) -> None:
    path, tensor = _damaged(ckpt_a_copy, case)
    with pytest.raises(CheckpointError) as ei:
        checkpoint_index(path)
    message = str(ei.value)
    assert str(path) in message and tensor in message, message
    assert len(message) < 1000


@pytest.mark.parametrize("case", ["deep_metadata", "dtype_list", "shape_infinity", "offsets_infinity"])
def test_the_loader_audits_the_refusal_and_changes_nothing(loaded: DFlashQwen3Draft, ckpt_a_copy: Path,
                                                           case: str) -> None:
    path, tensor = _damaged(ckpt_a_copy, case)
    loaded.begin_reload()
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        load_safetensors(loaded, path)
    refused = [e for e in loaded.lifecycle.recent_events if e["event"] == "refused"]
    assert refused and refused[-1]["error"] == "CheckpointError" and tensor in refused[-1]["reason"]
    assert loaded.lifecycle.state is S.PARTIALLY_LOADED  # nothing written: the reload can go on


@pytest.mark.parametrize("case", ["deep_metadata", "dtype_object", "offsets_minus_infinity"])
def test_a_session_records_the_refusal_before_it_aborts_and_can_recover(loaded: DFlashQwen3Draft,
                                                                        ckpt_a_copy: Path, case: str) -> None:
    """The README's promise holds (an exception in a session quarantines it): now the trail says why, as a
    refused weights_loaded naming file and tensor, and nothing was written, so the draft recovers at once."""
    path, tensor = _damaged(ckpt_a_copy, case)
    with pytest.raises(CheckpointError), loaded.reload_session(rollback=True) as s:
        s.load(path)
    lc = loaded.lifecycle
    assert lc.state is S.QUARANTINED and lc.quarantine_reason.startswith("CheckpointError")
    refused = [e for e in lc.recent_events if e["event"] == "refused"]
    assert refused and refused[-1]["trigger"] == "weights_loaded" and tensor in refused[-1]["reason"]
    assert loaded.recover() is S.DERIVED_REFRESHED


@pytest.mark.parametrize("case", ["deep_metadata", "dtype_list", "shape_infinity"])
def test_the_vllm_payload_path_refuses_them_too(tmp_path: Path, case: str) -> None:
    path = write_checkpoint({NAME: torch.ones(128, 64), "norm.weight": torch.ones(4)},
                            tmp_path / "d" / "model.safetensors")
    path, tensor = _damaged(path, case)
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        plan_payload(tmp_path / "d")


def test_what_safetensors_itself_accepts_still_reads(ckpt_a_copy: Path) -> None:
    """Guards: string metadata, a null `__metadata__` (safetensors' reader takes it for none) and a 0-d tensor."""
    n = len(checkpoint_index(ckpt_a_copy))
    assert len(checkpoint_index(_with_header(ckpt_a_copy, lambda h: {**h, "__metadata__": {"a": "b"}}))) == n
    assert len(checkpoint_index(_with_header(ckpt_a_copy, lambda h: {**h, "__metadata__": None}))) == n
    scalar = write_checkpoint({"s": torch.tensor(3.0)}, ckpt_a_copy.parent / "scalar.safetensors")
    assert checkpoint_index(scalar)["s"].shape == ()
