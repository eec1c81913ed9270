"""The vLLM payload path checks names, shapes and sizes from the headers alone before a byte of data is read, and
streams buckets by default (lifecycle/vllm/payload.py, lifecycle/vllm/expected.py; issue 25, item 7).

Before: `reload_draft_weights` and the `safetensors_file` transfer engine read tensor data before anything checked
the names against the draft. A sparse 1 TiB tensor in the folder gave `RuntimeError: tried to allocate
1099511627776 bytes` (not a `CheckpointError`, and after trying the allocation); a folder of another model (the
target's) reached vLLM's loader; and with the default `bucket_size=None` the whole folder was one bucket, held in
memory at once (a 1.5 GiB payload added 1.5 GiB of resident memory).

The live-engine side (the same refusals through `collective_rpc`, the draft untouched, the engine serving) is in
test_vllm_failures.py (`sparse_tib`, `target_folder`, `bogus_name`, `default_plan`).
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle.checkpoint import write_checkpoint
from lifecycle.errors import CheckpointError
from lifecycle.vllm.reload.payload import feed, plan_payload
from support.sparse_checkpoints import write_with_sparse_tensor
from support.vllm_payload_scenarios import run_payload_families


class Recorder:
    """Stands in for vLLM's `load_weights`: copies what it is given (as vLLM does), and at each call checks that
    no tensor of an earlier call is still alive (the reader holds one bucket at a time)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.alive: list[weakref.ref[torch.Tensor]] = []
        self.held_earlier: list[int] = []

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        gc.collect()
        self.held_earlier.append(sum(t.nbytes for r in self.alive if (t := r()) is not None))
        self.calls.append([n for n, _ in bucket])
        self.alive = [weakref.ref(t) for _, t in bucket]


def test_a_sparse_tib_tensor_is_refused_from_its_header_before_any_read(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "draft"
    write_checkpoint({"layers.0.w": torch.ones(4)}, folder / "a.safetensors")
    write_with_sparse_tensor(folder / "z.safetensors", {"norm.weight": torch.ones(4)}, "layers.1.w", (2**38,))
    assert (folder / "z.safetensors").stat().st_blocks < 64  # really sparse: a hole, no disk
    offsets: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: offsets.append(offset) or real(fd, bufs, offset))
    with pytest.raises(CheckpointError, match=r"z\.safetensors: tensor layers\.1\.w claims 1,099,511,627,776 bytes"):
        feed(Recorder(), plan_payload(folder))
    assert set(offsets) == {0, 8}  # the headers' length and text only: no byte of data read, no allocation tried


def test_the_default_plan_streams_a_layer_at_a_time(tmp_path: Path) -> None:
    tensors = {f"layers.{i}.{leaf}": torch.full((256, 64), float(i)) for i in range(4) for leaf in ("a", "b")}
    tensors |= {"fc.weight": torch.ones(64, 64), "norm.weight": torch.ones(64)}
    write_checkpoint(tensors, tmp_path / "d" / "model.safetensors")
    model = Recorder()
    feed(model, plan_payload(tmp_path / "d"))
    assert model.calls == [["fc.weight"], *[[f"layers.{i}.a", f"layers.{i}.b"] for i in range(4)], ["norm.weight"]]
    assert model.held_earlier == [0] * 6  # one bucket in memory at a time, never the whole folder
    one = Recorder()
    feed(one, plan_payload(tmp_path / "d", whole_calls=True))  # a draft whose load_weights needs every tensor
    assert one.calls == [sorted(tensors)]


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_payload_families(tmp_path_factory.mktemp("payload-families"))


def test_every_familys_own_checkpoint_passes_the_header_check(families: dict[str, Any]) -> None:
    """No false refusal: each in-process family, plain and with every optional submodule, cold-loaded by vLLM."""
    cases = {k: v for k, v in families.items() if "/" in k}
    assert {"dflash", "qwen3_dspark", "lilicorr"} <= set(families["in_process_families"])
    assert set(cases) == {f"{f}/{t}" for f in families["in_process_families"] for t in ("plain", "structure")}
    for name, case in cases.items():
        assert case["own"]["ok"], (name, case["own"])
        assert case["own"]["reads"] == 0
    for tag in ("plain", "structure"):  # names vLLM's own mapper renames (DFlash: `midlayer.` -> `layers.0.`)
        assert families[f"dflash/{tag}"]["midlayer"]["ok"], families[f"dflash/{tag}"]["midlayer"]


def test_another_models_checkpoint_and_an_oversized_tensor_are_refused_naming_them(families: dict[str, Any]
                                                                                   ) -> None:
    for name, case in families.items():
        if "/" not in name:
            continue
        deeper, sparse = case["deeper_target"], case["sparse"]
        assert not deeper["ok"] and deeper["error"] in ("CheckpointError", "FrozenStructureError"), (name, deeper)
        assert "deeper-target/model.safetensors" in deeper["message"] or deeper["error"] == "FrozenStructureError"
        assert not sparse["ok"] and sparse["error"] == "CheckpointError", (name, sparse)
        assert f"{case['largest']} (" in sparse["message"] and "-sparse/model.safetensors" in sparse["message"]
        assert "[274877906944], but the draft's first load took" in sparse["message"]
        assert deeper["reads"] == sparse["reads"] == 0  # from the headers alone
        assert case["state"] == "DERIVED_REFRESHED"  # the draft was not touched


def test_a_tensor_a_row_short_or_long_is_refused_from_its_header_naming_it_and_both_shapes(families: dict[str, Any]
                                                                                          ) -> None:
    """Exact, not a bound (issue 32, item 5): the shape the draft's first load took under each name, in any of the
    name's forms. Before: only a tensor larger than its parameter on all ranks was refused here; one row short (and
    a shard one row long, within its fused parameter's size) reached vLLM, which refused it mid-load, the draft
    quarantined by an `AssertionError` naming nothing."""
    cases = {k: v for k, v in families.items() if "/" in k}
    for name, case in cases.items():
        assert case["unrecorded"] == [], (name, case["unrecorded"])  # every name of the own checkpoint is exact
        for rows in ("rows-1", "rows+1"):
            got = case[rows]
            assert not got["ok"] and got["error"] == "CheckpointError", (name, rows, got)
            assert f"{got['tensor']} (" in got["message"] and got["shown"] in got["message"], (name, rows, got)
            assert got["reads"] == 0
        assert case["state"] == "DERIVED_REFRESHED"  # the draft was not touched
    for tag in ("plain", "structure"):  # vLLM's mapper renames `midlayer.` to `layers.0.`: still exact
        got = families[f"dflash/{tag}"]["midlayer_short"]
        assert not got["ok"] and got["shown"] in got["message"], got
