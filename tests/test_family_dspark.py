"""What is specific to Qwen3 DSpark: the Markov / confidence heads, and the confidence precompute
`_markov_confidence_logits` (a `custom` buffer with dependencies on two heads, refreshed in place by `into=`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lifecycle import LifecycleState, StorageIdentity, WeightShapeError
from lifecycle.loading import load_safetensors, write_checkpoint
from lifecycle.storage import count_allocations
from models.qwen3_dspark import DSparkConfig, Qwen3DSparkDraft, random_weights

S = LifecycleState
CFG = DSparkConfig(num_hidden_layers=3)
TABLE = "_markov_confidence_logits"
HEADS = ("markov_head.markov_w1.weight", "confidence_head.proj.weight", "confidence_head.proj.bias")


@pytest.fixture
def weights() -> dict[str, dict[str, torch.Tensor]]:
    return {"a": random_weights(CFG, 0), "b": random_weights(CFG, 1)}


@pytest.fixture
def ckpt(weights: dict[str, dict[str, torch.Tensor]], tmp_path: Path) -> dict[str, Path]:
    return {k: write_checkpoint(w, tmp_path / f"{k}.safetensors") for k, w in weights.items()}


def cold(path: Path, cfg: DSparkConfig = CFG) -> Qwen3DSparkDraft:
    m = Qwen3DSparkDraft(cfg)
    load_safetensors(m, path)
    m.finalize_loading()
    m.refresh_derived_buffers()
    return m


def reload(m: Qwen3DSparkDraft, path: Path, subset: object = None) -> None:
    m.begin_reload()
    load_safetensors(m, path, subset=subset, bucket_by=1, shuffle=True)  # type: ignore[arg-type]
    m.finalize_loading(keep_untouched=subset is not None)


def expected_table(w: dict[str, torch.Tensor]) -> torch.Tensor:
    proj = w["confidence_head.proj.weight"]
    return w["markov_head.markov_w1.weight"] @ proj[0, CFG.hidden_size:] + w["confidence_head.proj.bias"]


def test_heads_have_vllm_names_and_dtypes(ckpt: dict[str, Path]) -> None:
    m = cold(ckpt["a"])
    specs = m.lifecycle.specs
    assert specs["markov_head.markov_w1.weight"].shape == (CFG.vocab_size, CFG.markov_rank)
    assert specs["markov_head.markov_w2.weight"].shape == (CFG.vocab_size, CFG.markov_rank)
    assert specs["confidence_head.proj.weight"].shape == (1, CFG.hidden_size + CFG.markov_rank)
    assert specs["confidence_head.proj.weight"].dtype == torch.float32  # float32 whatever the model dtype
    bf16 = Qwen3DSparkDraft(DSparkConfig(num_hidden_layers=1, dtype=torch.bfloat16))
    assert bf16.markov_head.markov_w1.weight.dtype == torch.bfloat16
    assert bf16.confidence_head.proj.weight.dtype == torch.float32  # type: ignore[union-attr]


def test_confidence_table_is_the_markov_half_of_the_confidence_head(ckpt: dict[str, Path], weights) -> None:
    m = cold(ckpt["a"])
    torch.testing.assert_close(getattr(m, TABLE), expected_table(weights["a"]), atol=1e-6, rtol=0)
    h, prev = torch.randn(5, CFG.hidden_size), torch.tensor([0, 7, 7, 42, CFG.vocab_size - 1])
    torch.testing.assert_close(m.compute_confidence(h, prev), m.compute_confidence_reference(h, prev),
                               atol=1e-6, rtol=0)


def test_layer_reload_skips_the_table_head_reload_rewrites_it_in_place(ckpt: dict[str, Path], weights) -> None:
    m = cold(ckpt["a"])
    m.capture_graphs()
    table = getattr(m, TABLE)
    ident = StorageIdentity.of(table)
    with torch.no_grad():
        table.fill_(1234.5)  # where it survives, the table was not written
    reload(m, ckpt["b"], subset=lambda n: n.startswith("layers."))
    report = m.refresh_derived_buffers()
    assert (report[TABLE].mode, report[TABLE].elements_written) == ("skipped", 0)
    assert bool((table == 1234.5).all())
    assert report["_fused_kv_weight"].slices_written == CFG.num_hidden_layers

    for head in ("markov_head.markov_w1.", "confidence_head.proj."):
        # either head rewrites the whole table, in place, with no vocab-sized temporary
        with torch.no_grad():
            table.fill_(1234.5)
        reload(m, ckpt["b"], subset=lambda n, h=head: n.startswith(h))
        with count_allocations() as log:
            report = m.refresh_derived_buffers()
        assert (report[TABLE].mode, report[TABLE].elements_written) == ("in_place", CFG.vocab_size), head
        assert log.at_least(table.numel() * table.element_size()) == [], log.records
        assert getattr(m, TABLE) is table and StorageIdentity.of(table) == ident
        live = {n: m.live_tensor(n) for n in HEADS}
        torch.testing.assert_close(table, expected_table(live), atol=1e-6, rtol=0)  # type: ignore[arg-type]
    assert m.lifecycle.state is S.GRAPH_CAPTURED


@pytest.mark.parametrize("enable,with_markov", [(False, False), (True, False)])
def test_no_markov_fed_confidence_head_declares_no_table(ckpt: dict[str, Path], tmp_path: Path, enable: bool,
                                                         with_markov: bool) -> None:
    cfg = DSparkConfig(num_hidden_layers=2, enable_confidence_head=enable, confidence_head_with_markov=with_markov)
    m = cold(write_checkpoint(random_weights(cfg, 0), tmp_path / "c.safetensors"), cfg)
    assert TABLE not in m.derived_buffer_names() and TABLE not in dict(m.named_buffers())
    assert Qwen3DSparkDraft.derived_buffers[-1].name == TABLE  # the class declares it; this instance does not
    assert ("confidence_head.proj.weight" in m.lifecycle.specs) is enable
    h, prev = torch.randn(3, cfg.hidden_size), torch.tensor([1, 2, 3])
    if enable:
        torch.testing.assert_close(m.compute_confidence(h, prev), m.compute_confidence_reference(h, prev))
    else:
        with pytest.raises(RuntimeError, match="no confidence head"):
            m.compute_confidence(h, prev)


def test_markov_bias_gathered_equals_the_dense_bias(ckpt: dict[str, Path]) -> None:
    m = cold(ckpt["a"])
    prev = torch.tensor([4, 9])
    embed = m.markov_embed(prev)
    dense = m.markov_bias(embed)  # [2, vocab]
    index = torch.tensor([[1, 5, 80], [0, 2, 3]])
    values = torch.randn(2, 3)
    logits = torch.full((2, CFG.vocab_size), float("-inf"))
    out = m.markov_head.apply_bias_gathered(embed, logits, values, index, scale=0.5)
    torch.testing.assert_close(out.gather(1, index), values + 0.5 * dense.gather(1, index))
    assert int(torch.isfinite(out).sum()) == index.numel()


def test_another_vocab_is_refused_at_load(ckpt: dict[str, Path], tmp_path: Path) -> None:
    m = cold(ckpt["a"])
    table = getattr(m, TABLE).clone()
    big = random_weights(DSparkConfig(num_hidden_layers=3, vocab_size=2 * CFG.vocab_size), 3)
    m.begin_reload()
    with pytest.raises(WeightShapeError) as ei:
        load_safetensors(m, write_checkpoint(big, tmp_path / "big-vocab.safetensors"))
    assert {p.split(":")[0] for p in ei.value.problems} == {"markov_head.markov_w1.weight",
                                                            "markov_head.markov_w2.weight"}
    assert torch.equal(getattr(m, TABLE), table)
