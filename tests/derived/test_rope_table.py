"""The RoPE table and the other constant derived buffers: the same bits on every build, and their content pinned
under captured graphs (issue 24, item 12).

`make demo` failed 4 of 39 runs on one machine under load, on "every derived buffer bit-equal to a cold build from
B (_rope_cos_sin_cache)". The table is not the cause by its arithmetic on any machine (first two tests): it is
computed in float64 and rounded to float32, and every entry of every family's table lies further from a float32
rounding boundary than a float64 library can err there (a few ulps of the angle, times the position, plus the
result's own rounding), so no thread count, parallel split, vector width or math library can change a bit of it.
What can make the warm table differ from a cold build is a write into its memory after it was built; a constant
derived buffer (no reload writes it) now has its CONTENT pinned at capture as well as its storage identity, and
`verify_pinned()` (which the demo runs) fails closed naming it (`storage.PinnedContent`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from lifecycle import Phase
from lifecycle.errors import StorageDriftError
from lifecycle.storage import StorageIdentity
from lifecycle.testing import cold_load, reload
from models import FAMILIES
from models.demo import run_demo
from models.layers import RotaryEmbedding, rope_cos_sin_cache
from models.qwen3_dflash import DFlashConfig, DFlashQwen3Draft

TABLES = sorted({(m.rotary_dim, m.max_position, m.base) for fam in FAMILIES.values()
                 for m in fam.build(fam.config(), device="meta").modules() if isinstance(m, RotaryEmbedding)})
EPS = 2.0**-52


def _margin_over_error(rotary_dim: int, max_position: int, base: float) -> float:
    """The smallest ratio, over the table's entries, of the distance from the exact entry to a float32 rounding
    boundary over what a float64 pow/outer/cos/sin can err there: 4 ulps of the angle (amplified by the
    derivative, at most 1) plus 2 ulps of the result."""
    inv = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    angles = np.outer(np.arange(max_position, dtype=np.float64), inv)
    v = np.concatenate([np.cos(angles), np.sin(angles)], -1)
    a = np.concatenate([angles, angles], -1)
    f = v.astype(np.float32)
    up = np.nextafter(f, np.float32(np.inf)).astype(np.float64)
    down = np.nextafter(f, np.float32(-np.inf)).astype(np.float64)
    f64 = f.astype(np.float64)
    boundary = np.where(v >= f64, (f64 + up) / 2, (f64 + down) / 2)
    error = 4 * a * EPS + 2 * np.abs(v) * EPS
    exact = error == 0  # position 0: cos 0 = 1, sin 0 = 0 exactly, on every library
    return float((np.abs(v - boundary)[~exact] / error[~exact]).min())


@pytest.mark.parametrize("table", TABLES, ids=lambda t: f"{t[0]}x{t[1]}@{t[2]:g}")
def test_no_float64_library_can_change_a_familys_rope_table(table: tuple[int, int, float]) -> None:
    assert _margin_over_error(*table) > 4  # measured: >= 24 for every family's table


def test_a_long_context_table_is_not_protected_by_the_margin() -> None:
    """What the margin does NOT give: a real-size table (128 x 32768) has entries within a library's error of a
    rounding boundary, so two machines (or two math libraries) may build it differently. Compare such tables
    built in one process, not across machines."""
    assert _margin_over_error(128, 32768, 1e6) < 1


@pytest.mark.parametrize("table", TABLES, ids=lambda t: f"{t[0]}x{t[1]}@{t[2]:g}")
def test_a_rope_table_is_bit_equal_whatever_the_threads_and_the_allocator(table: tuple[int, int, float]) -> None:
    threads = torch.get_num_threads()
    reference = rope_cos_sin_cache(*table, torch.device("cpu"))
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            garbage = [torch.full((k,), float("nan"), dtype=torch.float64) for k in (16, 4096, 8192, 1 << 16)]
            del garbage  # freed memory full of NaN: a build that read memory it did not write would show it
            assert torch.equal(rope_cos_sin_cache(*table, torch.device("cpu")), reference), n
    finally:
        torch.set_num_threads(threads)


def test_the_demo_passes_every_check_on_every_thread_count(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            result = run_demo(out_dir=tmp_path / str(n), stream=io.StringIO())
            assert result.ok, [c for c in result.checks if not c[1]]
    finally:
        torch.set_num_threads(threads)


# ---- the content of constant derived buffers, pinned ----------------------------------------------------------


def test_the_constant_derived_buffers_are_those_no_reload_writes() -> None:
    for name, fam in FAMILIES.items():
        model = fam.build(fam.config(), device="meta")
        constants = set(model.constant_derived_buffers())
        assert "_rope_cos_sin_cache" in constants, name
        assert not constants & {"_fused_kv_weight", "_k_norm_weights", "_hidden_norm_weight"}, name
    gemma = FAMILIES["gemma-dspark"].build(FAMILIES["gemma-dspark"].config(), device="meta")
    assert "_v_norm_weights" in gemma.constant_derived_buffers()  # custom, depends on nothing


@pytest.fixture
def captured(tiny_cfg: DFlashConfig, ckpt_a: Path) -> DFlashQwen3Draft:
    model = cold_load(DFlashQwen3Draft(tiny_cfg), ckpt_a)
    model.capture_graphs()
    return model


def test_a_write_into_the_rope_table_under_captured_graphs_fails_verify_naming_it(captured: DFlashQwen3Draft
                                                                                   ) -> None:
    """Before: only storage identities were pinned, so a write into the table's memory (what a corrupted or
    racing native kernel does) passed `verify_pinned()` and graphs kept reading the wrong table."""
    lc = captured.lifecycle
    table = captured._rope_cos_sin_cache
    identity = StorageIdentity.of(table)
    assert lc.verify_pinned() > 0
    with torch.no_grad():
        table[7, 3] += 1.0
    assert StorageIdentity.of(captured._rope_cos_sin_cache) == identity  # the identity alone cannot see it
    with pytest.raises(StorageDriftError, match=r"_rope_cos_sin_cache: content changed since capture"):
        lc.verify_pinned()
    assert lc.recent_events[-1]["event"] == "refused"


def test_a_reload_keeps_the_constants_and_passes_verify(captured: DFlashQwen3Draft, ckpt_b: Path) -> None:
    reload(captured, ckpt_b)
    assert captured.lifecycle.verify_pinned() > 0


def test_a_reload_hook_that_rewrites_a_constant_is_pinned_anew(captured: DFlashQwen3Draft, ckpt_b: Path) -> None:
    """A reload's own hooks may write anything: what they leave is what is pinned from then on."""
    def rescale_rope(model: DFlashQwen3Draft) -> None:
        with torch.no_grad():
            model.layers[0].self_attn.rotary_emb.cos_sin_cache.mul_(1.0 + 2.0**-10)

    captured.register_post_load_hook(rescale_rope, Phase.RELOAD)
    reload(captured, ckpt_b)
    assert captured.lifecycle.verify_pinned() > 0


def test_releasing_graphs_unpins_the_content(captured: DFlashQwen3Draft) -> None:
    lc = captured.lifecycle
    assert lc.pinned_content is not None and len(lc.pinned_content) == 1
    lc.release_graphs()
    assert lc.pinned_content is None


def test_the_demo_names_a_rope_table_written_during_the_reload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """What the failing runs would have said: a write into the warm table's memory while B is applied fails
    `verify_pinned()` naming the content change, and the bit-equality check says the warm side changed."""
    import models.demo

    real_apply = models.demo.apply_bucket

    def apply_and_write_into_the_table(model, bucket, device):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            model._rope_cos_sin_cache[100:].zero_()
        return real_apply(model, bucket, device)

    monkeypatch.setattr(models.demo, "apply_bucket", apply_and_write_into_the_table)
    checks = {name: (ok, detail) for name, ok, detail in run_demo(out_dir=tmp_path, stream=io.StringIO()).checks}
    ok, detail = checks["lifecycle verify_pinned()"]
    assert not ok and "_rope_cos_sin_cache: content changed since capture" in detail
    ok, detail = checks["every derived buffer bit-equal to a cold build from B"]
    assert not ok and "_rope_cos_sin_cache: the warm buffer changed since capture" in detail
    assert checks["every derived buffer's storage identity unchanged"][0]  # the identity alone could not see it
