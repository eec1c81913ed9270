"""What is specific to the DSpark heads (`models/dspark_heads.py`, here on Qwen3 DSpark; Gemma4 DSpark shares them):
the Markov / confidence heads, and the confidence precompute `_markov_confidence_logits` (a `custom` buffer with
dependencies on two heads, refreshed in place by `into=`, and declared with `enabled=`: only a config with a
Markov-fed confidence head has it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lifecycle import LifecycleState, StorageIdentity, WeightShapeError
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.storage import count_allocations
from models import FAMILIES
from models.qwen3_dspark import DSparkConfig, Qwen3DSparkDraft, random_weights
from support.family_helpers import Fam, reload

S = LifecycleState
TABLE = "_markov_confidence_logits"
HEADS = ("markov_head.markov_w1.weight", "confidence_head.proj.weight", "confidence_head.proj.bias")
DSPARK_FAMILIES = ["dspark", "gemma-dspark"]


@pytest.fixture
def fam(tmp_path: Path) -> Fam:
    return Fam.make("dspark", tmp_path)


def expected_table(w: dict[str, torch.Tensor], hidden_size: int) -> torch.Tensor:
    proj = w["confidence_head.proj.weight"]
    return w["markov_head.markov_w1.weight"] @ proj[0, hidden_size:] + w["confidence_head.proj.bias"]


def test_heads_have_vllm_names_and_dtypes(fam: Fam) -> None:
    cfg = fam.cfg
    specs = fam.cold("a").lifecycle.specs
    assert specs["markov_head.markov_w1.weight"].shape == (cfg.vocab_size, cfg.markov_rank)
    assert specs["markov_head.markov_w2.weight"].shape == (cfg.vocab_size, cfg.markov_rank)
    assert specs["confidence_head.proj.weight"].shape == (1, cfg.hidden_size + cfg.markov_rank)
    assert specs["confidence_head.proj.weight"].dtype == torch.float32  # float32 whatever the model dtype
    bf16 = Qwen3DSparkDraft(DSparkConfig(num_hidden_layers=1, dtype=torch.bfloat16))
    assert bf16.markov_head.markov_w1.weight.dtype == torch.bfloat16
    assert bf16.confidence_head.proj.weight.dtype == torch.float32  # type: ignore[union-attr]


def test_confidence_table_is_the_markov_half_of_the_confidence_head(fam: Fam) -> None:
    m, cfg = fam.cold("a"), fam.cfg
    torch.testing.assert_close(getattr(m, TABLE), expected_table(fam.weights["a"], cfg.hidden_size), atol=1e-6, rtol=0)
    h, prev = torch.randn(5, cfg.hidden_size), torch.tensor([0, 7, 7, 42, cfg.vocab_size - 1])
    torch.testing.assert_close(m.compute_confidence(h, prev), m.compute_confidence_reference(h, prev),
                               atol=1e-6, rtol=0)


def test_layer_reload_skips_the_table_head_reload_rewrites_it_in_place(fam: Fam) -> None:
    m, cfg = fam.cold("a"), fam.cfg
    m.capture_graphs()
    table = getattr(m, TABLE)
    ident = StorageIdentity.of(table)
    with torch.no_grad():
        table.fill_(1234.5)  # where it survives, the table was not written
    reload(m, fam.ckpt["b"], subset=lambda n: n.startswith("layers."), bucket_by=1, shuffle=True)
    report = m.refresh_derived_buffers()
    assert (report[TABLE].mode, report[TABLE].elements_written) == ("skipped", 0)
    assert bool((table == 1234.5).all())
    assert report["_fused_kv_weight"].slices_written == cfg.num_hidden_layers

    for head in ("markov_head.markov_w1.", "confidence_head.proj."):
        # either head rewrites the whole table, in place, with no vocab-sized temporary
        with torch.no_grad():
            table.fill_(1234.5)
        reload(m, fam.ckpt["b"], subset=lambda n, h=head: n.startswith(h), bucket_by=1, shuffle=True)
        with count_allocations() as log:
            report = m.refresh_derived_buffers()
        assert (report[TABLE].mode, report[TABLE].elements_written) == ("in_place", cfg.vocab_size), head
        assert log.at_least(table.numel() * table.element_size()) == [], log.records
        assert getattr(m, TABLE) is table and StorageIdentity.of(table) == ident
        live = {n: m.live_tensor(n) for n in HEADS}
        torch.testing.assert_close(table, expected_table(live, cfg.hidden_size), atol=1e-6, rtol=0)  # type: ignore[arg-type]
    assert m.lifecycle.state is S.GRAPH_CAPTURED


@pytest.mark.parametrize("family", DSPARK_FAMILIES)
@pytest.mark.parametrize("enable,with_markov", [(False, False), (True, False)])
def test_no_markov_fed_confidence_head_has_no_table(tmp_path: Path, family: str, enable: bool,
                                                    with_markov: bool) -> None:
    """The class declares the table with `enabled=`; a backbone whose config has no Markov-fed confidence head
    neither registers nor builds it, and its fused path works without it."""
    fam = Fam.make(family, tmp_path, num_hidden_layers=2, enable_confidence_head=enable,
                   confidence_head_with_markov=with_markov)
    m = fam.cold("a")
    cls = type(m)
    assert [s.name for s in cls.derived_buffers if s.enabled is not None] == [TABLE]  # the class declares it
    assert TABLE not in m.derived_buffer_names() and TABLE not in dict(m.named_buffers())
    assert TABLE in fam.build(FAMILIES[family].config(num_hidden_layers=2)).derived_buffer_names()
    assert ("confidence_head.proj.weight" in m.lifecycle.specs) is enable
    h, prev = torch.randn(3, fam.cfg.hidden_size), torch.tensor([1, 2, 3])
    if enable:
        torch.testing.assert_close(m.compute_confidence(h, prev), m.compute_confidence_reference(h, prev))
    else:
        for confidence in (m.compute_confidence, m.compute_confidence_reference):
            with pytest.raises(RuntimeError, match="no confidence head"):
                confidence(h, prev)


def test_markov_bias_gathered_equals_the_dense_bias(fam: Fam) -> None:
    m = fam.cold("a")
    prev = torch.tensor([4, 9])
    embed = m.markov_embed(prev)
    dense = m.markov_bias(embed)  # [2, vocab]
    index = torch.tensor([[1, 5, 80], [0, 2, 3]])
    values = torch.randn(2, 3)
    logits = torch.full((2, fam.cfg.vocab_size), float("-inf"))
    out = m.markov_head.apply_bias_gathered(embed, logits, values, index, scale=0.5)
    torch.testing.assert_close(out.gather(1, index), values + 0.5 * dense.gather(1, index))
    assert int(torch.isfinite(out).sum()) == index.numel()


def test_another_vocab_is_refused_at_load(fam: Fam, tmp_path: Path) -> None:
    m = fam.cold("a")
    table = getattr(m, TABLE).clone()
    big = random_weights(DSparkConfig(num_hidden_layers=3, vocab_size=2 * fam.cfg.vocab_size), 3)
    m.begin_reload()
    with pytest.raises(WeightShapeError) as ei:
        load_safetensors(m, write_checkpoint(big, tmp_path / "big-vocab.safetensors"))
    assert {p.split(":")[0] for p in ei.value.problems} == {"markov_head.markov_w1.weight",
                                                            "markov_head.markov_w2.weight"}
    assert torch.equal(getattr(m, TABLE), table)
