"""What is specific to Qwen3 DFlash2: the grouped local convolution (vLLM's CPU path, checked against a plain
loop), and that its weights and the candidate selector's derive nothing: a reload of only those writes no
derived buffer, yet the block pass reads the new weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lifecycle.loading import load_safetensors
from models.qwen3_dflash2 import grouped_conv, score_edges
from support.family_helpers import Fam


def naive_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
               ) -> torch.Tensor:
    """out[r, c] = sum over taps t with (r mod block) >= t of (base[t, c] + delta[r, t, c // group]) * x[r - t, c]."""
    n, hidden = x.shape
    out = torch.zeros_like(x)
    for r in range(n):
        for t in range(base.shape[0]):
            if r % block_size < t:
                continue
            for c in range(hidden):
                out[r, c] += (base[t, c] + delta[r, t, c // group_size]) * x[r - t, c]
    return out


@pytest.mark.parametrize("taps,block_size", [(3, 4), (2, 3), (4, 4)])
def test_grouped_conv_matches_a_plain_loop(taps: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(taps * 10 + block_size)
    hidden, group = 8, 4
    n = 2 * block_size + 1  # two full blocks and the start of a third
    x, base = torch.randn(n, hidden, generator=g), torch.randn(taps, hidden, generator=g)
    delta = torch.randn(n, taps, hidden // group, generator=g)
    out = grouped_conv(x, delta, base, block_size, hidden // group, group, taps)
    torch.testing.assert_close(out, naive_conv(x, delta, base, block_size, group), atol=1e-5, rtol=0)
    # rows never mix across blocks: changing block 0 leaves the other blocks' outputs as they were
    x2 = x.clone()
    x2[:block_size] += 1.0
    out2 = grouped_conv(x2, delta, base, block_size, hidden // group, group, taps)
    assert torch.equal(out2[block_size:], out[block_size:])
    assert not torch.allclose(out2[:block_size], out[:block_size])


def test_score_edges_chains_each_candidate_to_its_predecessor() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, rank, k, positions = 10, 3, 2, 3
    pred, succ = torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g)
    cand = torch.randint(vocab, (1, positions, k), generator=g)
    unary, hidden = torch.randn(1, positions, k, generator=g), torch.randn(1, positions, rank, generator=g)
    anchor = torch.tensor([7])
    scores = score_edges(pred, succ, cand, unary, hidden, anchor, k)
    assert scores.shape == (1, positions, k, k)
    for pos in range(positions):
        for p in range(k):
            prev = anchor[0] if pos == 0 else cand[0, pos - 1, p]  # position 0 follows the anchor token
            # score(p -> c) = unary logit of candidate c + <pred[prev] * hidden, succ[c]>
            for c in range(k):
                want = unary[0, pos, c] + (pred[prev] * hidden[0, pos] * succ[cand[0, pos, c]]).sum()
                torch.testing.assert_close(scores[0, pos, p, c], want)


PARTS = ("attention_conv", "mlp_conv", "candidate_selector")


def of_part(part: str) -> Callable[[str], bool]:
    return lambda n: f".{part}." in n or n.startswith(f"{part}.")


@pytest.fixture
def fam(tmp_path: Path) -> Fam:
    return Fam.make("dflash2", tmp_path)


@pytest.mark.parametrize("part", PARTS)
def test_conv_and_selector_weights_derive_nothing_but_are_read_live(fam: Fam, part: str) -> None:
    m = fam.cold("a")
    m.capture_graphs()
    before = fam.outputs(m)
    lc = m.lifecycle
    names = [n for n in lc.specs if of_part(part)(n)]
    assert names
    m.begin_reload()
    target = fam.mixed(of_part(part), label=part)
    load_safetensors(m, target, subset=names, bucket_by=1, shuffle=True)
    # a layer that got only its convolution weights: declare the rest of it unchanged
    touched = {lc.readiness.layer_of_name[n] for n in names}
    lc.weights_unchanged([n for n in lc.specs if lc.readiness.layer_of_name[n] in touched and n not in names])
    m.finalize_loading(keep_untouched=True)
    report = m.refresh_derived_buffers()
    assert report.elements_written == 0
    assert {b.mode for b in report.buffers if b.kind != "alias"} == {"skipped"}
    after = fam.outputs(m)
    k, v, hidden, scores = after
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])  # the context path derives from none of it
    assert not torch.equal(scores, before[3])  # but the block pass and the selector read the new weights
    assert torch.equal(hidden, before[2]) is (part == "candidate_selector")
    # and the result is exactly a cold load of the same weights
    for got, want in zip(after, fam.outputs(fam.cold(target)), strict=True):
        assert torch.equal(got, want)
