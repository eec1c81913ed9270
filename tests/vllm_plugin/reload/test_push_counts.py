"""What a push costs, in counts that do not depend on the machine's load (issue 33 item 4), with vLLM's own DFlash
classes in-process on both weight layouts (`support/vllm_push_counts_runs.py`): a hash or a materialised copy added
to the push path fails here, in `make test`, whatever a benchmark on a busy machine shows.

Per push (the plugin's transfer session with whole-file, one-layer and one-tensor buckets; a plain `load_weights`
then `process_weights_after_loading`), after two warm-up pushes:
- bytes hashed for the weight checker: none on the GPU layout; on the CPU layout exactly the bytes processing
  empties (the K/V rows captured into the shadows are not hashed a second time);
- fresh storages of 1 MiB or more: none on the GPU layout (no layer materialised, reads into the kept staging
  buffer); on the CPU layout vLLM's repack keeps its materialised layers (one per linear layer);
- passes over the payload's bytes: one read (the session), one write into the draft's tensors.
Each push is checked beside its count: weights and derived buffers bit-equal to a cold load of what was pushed, at
the pinned addresses, and `/weight_checker`'s draft entries equal to a cold engine's.

Measured on the code before this change (d032fd9; the same scenario, the hashing counted by wrapping the weight
checker's `digest`): on the GPU layout every push hashed 20,971,520 bytes (the linear weights, which that layout
keeps), allocated 20 fresh storages of 1 MiB or more (38 MiB: every layer materialised, the reads into fresh
tensors) and wrote each byte twice (into the materialised layer, then the copy back); on the CPU layout it hashed
23,068,672 bytes (the K/V rows a second time) and allocated 20 such storages; every test here fails on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.needs import needs
from support.vllm_push_counts_runs import RESULT
from support.vllm_runs import PYTHONPATH, ROOT

SESSIONS = ("session, whole buckets", "session, layer buckets", "session, tensor buckets")


@needs("vllm", "slow")
def _run(layout: str, work: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "support.vllm_push_counts_runs", layout, str(work)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT / "tests",
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line.removeprefix(RESULT)))
    raise AssertionError(f"the scenario printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def counted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = _run(request.param, tmp_path_factory.mktemp(f"counts-{request.param}"))
    assert result["ok"], f"{result['failed']}\n{result.get('trace', '')}"
    return result


def test_a_push_hashes_nothing_on_the_gpu_layout_and_only_what_processing_empties_on_the_cpu_layout(
        counted: dict[str, Any]) -> None:
    for what, c in counted["counts"].items():
        if counted["layout"] == "gpu":
            assert c["bytes_hashed"] == 0, (what, c)
        else:  # each emptied byte once: the weight's digest and the K/V rows' from one pass
            assert c["bytes_hashed"] == counted["emptied_bytes"] > 0, (what, c, counted["emptied_bytes"])


def test_a_push_on_the_gpu_layout_allocates_no_fresh_storage_of_a_mib_or_more(counted: dict[str, Any]) -> None:
    for what, c in counted["counts"].items():
        if counted["layout"] == "gpu":
            assert c["fresh_storages_1mib"] == 0, (what, c)
        else:  # vLLM's repack path: each linear layer materialised once (9: 4 per decoder layer, and fc)
            assert c["fresh_storages_1mib"] <= 9, (what, c)


def test_no_loader_is_dry_run_after_the_first_push(counted: dict[str, Any]) -> None:
    """vLLM counts what each buffered load writes by a dry run of its loader on the META placeholder (0.1 ms per
    tensor, a quarter of a tiny push): the draft's layers are unquantized, so each count is remembered from the
    warm-up pushes (`reload.counting`), on both layouts and both paths."""
    for what, c in counted["counts"].items():
        assert c["loader_dry_runs"] == 0, (what, c)


def test_a_push_reads_the_payload_once_and_writes_it_once(counted: dict[str, Any]) -> None:
    for what, c in counted["counts"].items():
        assert c["bytes_written"] == c["payload_bytes"], (what, c)  # each byte copied once into the draft
        assert c["bytes_read"] == (c["payload_bytes"] if what in SESSIONS else 0), (what, c)  # plain: the trainer's
        # the derived buffers written once: 2 layers' K/V rows (2 x 2 x 256 x 512 fp32) into the fused buffer (or
        # its shadows, which are views of it), and 2 layers' k-norms (128 fp32) into the stacked buffer
        assert c["bytes_derived"] == 2 * 2 * 256 * 512 * 4 + 2 * 128 * 4, (what, c)



def test_vllm_has_nothing_to_warn_about_the_modules_holding_the_plugins_own_buffers(counted: dict[str, Any]) -> None:
    """vLLM counts a module's buffers as loadable; the plugin's own (derived buffers on the draft's model module, K/V
    shadows on its attention modules on the CPU layout) no checkpoint carries, so its finalize warned "Failed to load
    weights" for those modules on every push (three per push of this draft on the CPU layout), and an operator
    learns to skip the warning that one day names a real failure (`reload.counting.leave_out_own_buffers`)."""
    for what, c in counted["counts"].items():
        assert c["own_buffer_warnings"] == [], (what, c["own_buffer_warnings"])
    # the capture works: this build shares no embedding with a target, and vLLM warns about it in a session push
    assert any("VocabParallelEmbedding" in w for c in counted["counts"].values() for w in c["vllm_warnings"])
