"""The sequential heads and the batched torch sampling path of the drafter.

Head equations are checked against the paper's formulas (reference/dspark.md) written out independently here;
sampling is checked for self-consistency (the returned distribution is the one the token came from), for the
greedy / top-k / sparse forms, statistically against its own distribution, and for clear errors on bad input.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.checkpoint import load_draft_model
from draft_service.heads import GatedMarkovHead, MarkovHead, RNNHead
from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import inverse_cdf, sample_block

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
V, R_RANK, H = 40, 6, 10


@pytest.fixture(scope="module")
def draft() -> DSparkDraftModel:
    return load_draft_model(FIXTURE / "draft")


@pytest.fixture(scope="module")
def block(draft):
    features = torch.randn(12, draft.config.context_feature_size, generator=torch.Generator().manual_seed(3))
    return draft.draft_block_uncached(features, 235)[None], torch.tensor([235])


def randomized(head: MarkovHead) -> MarkovHead:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
    return head


def test_vanilla_and_gated_heads_follow_the_equations():
    h = torch.randn(3, H)
    prev = torch.tensor([1, 7, 39])
    vanilla = randomized(MarkovHead(V, R_RANK))
    _, bias = vanilla.step(None, prev, h)
    e = vanilla.markov_w1.weight[prev]
    torch.testing.assert_close(bias, e @ vanilla.markov_w2.weight.T)
    gated = randomized(GatedMarkovHead(V, R_RANK, H))
    _, bias = gated.step(None, prev, h)
    e = gated.markov_w1.weight[prev]
    gate = torch.sigmoid(torch.cat([h, e], -1) @ gated.gate_proj.weight.T + gated.gate_proj.bias)
    torch.testing.assert_close(bias, (gate * e) @ gated.markov_w2.weight.T)


def test_rnn_head_follows_the_equations_and_carries_state():
    head = randomized(RNNHead(V, R_RANK, H))
    hidden = torch.randn(2, 4, H)
    prev = torch.tensor([[3, 5, 8, 13], [21, 34, 2, 1]])
    W, b = head.joint_proj.weight, head.joint_proj.bias
    s = torch.zeros(2, R_RANK)
    expected = []
    for k in range(4):
        z = torch.cat([s, head.markov_w1.weight[prev[:, k]], hidden[:, k]], -1)
        g, c, o = (z @ W.T + b).split(R_RANK, dim=-1)
        g = torch.sigmoid(g)
        s = g * s + (1 - g) * torch.tanh(c)
        expected.append(torch.tanh(o) @ head.markov_w2.weight.T)
    torch.testing.assert_close(head.block_bias(prev, hidden), torch.stack(expected, 1))
    # the state carries x_0 into position 2; the memoryless head does not
    changed = prev.clone()
    changed[:, 0] = 0
    assert not torch.allclose(head.block_bias(changed, hidden)[:, 2], head.block_bias(prev, hidden)[:, 2])
    vanilla = randomized(MarkovHead(V, R_RANK))
    torch.testing.assert_close(
        vanilla.block_bias(changed, hidden)[:, 2], vanilla.block_bias(prev, hidden)[:, 2]
    )


def test_inverse_cdf_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.2, 0.0, 0.0, 0.0, 0.8]])
    top = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    assert inverse_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 0]
    assert inverse_cdf(probs, torch.stack([top, top])).tolist() == [3, 4]
    assert inverse_cdf(probs, torch.tensor([0.49, 0.21])).tolist() == [1, 4]


def test_greedy_rows_are_one_hot_argmax(draft, block):
    hidden, anchor = block
    for draft_top_k in (0, 6):
        sample = sample_block(draft, hidden, anchor, draft_top_k=draft_top_k, return_logits=True)
        assert torch.equal(sample.tokens, sample.logits.argmax(-1))
        assert torch.equal(sample.token_probs, torch.ones_like(sample.token_probs))
        if draft_top_k:
            assert torch.equal(
                sample.topk_ids.gather(-1, sample.topk_probs.argmax(-1, keepdim=True))[..., 0], sample.tokens
            )
            assert torch.equal(sample.topk_probs.sum(-1), torch.ones(1, draft.block_size))
        else:
            assert torch.equal(
                sample.probs, torch.nn.functional.one_hot(sample.tokens, draft.config.vocab_size).float()
            )


def test_sparse_distribution_is_the_truncated_softmax(draft, block):
    hidden, anchor = block
    R = 3
    hidden, anchor = hidden.expand(R, -1, -1), anchor.expand(R)
    top_k = torch.tensor([0, 3, 9])
    sample = sample_block(
        draft,
        hidden,
        anchor,
        temperature=torch.tensor([0.7, 1.0, 2.0]),
        top_k=top_k,
        draft_top_k=6,
        generator=torch.Generator().manual_seed(1),
        return_logits=True,
    )
    ids, probs = sample.topk_ids, sample.topk_probs
    assert ids.shape == probs.shape == (R, draft.block_size, 6)
    assert all(len(set(row.tolist())) == 6 for row in ids.reshape(-1, 6))
    torch.testing.assert_close(probs.sum(-1), torch.ones(R, draft.block_size))
    assert torch.all(probs[1, :, 3:] == 0) and torch.all(probs[1, :, :3] > 0)  # request top_k 3 < K
    assert torch.all(probs[2] > 0)  # request top_k 9 is capped at K = 6
    # position 0 (prev = anchor for every row): exactly softmax(top-k logits / T), renormalised
    for r, (t, k) in enumerate(((0.7, 6), (1.0, 3), (2.0, 6))):
        vals, top_ids = sample.logits[r, 0].topk(k)
        assert torch.equal(ids[r, 0, :k], top_ids)
        torch.testing.assert_close(probs[r, 0, :k], torch.softmax(vals / t, -1))
    chosen = (ids == sample.tokens[..., None]).float().argmax(-1, keepdim=True)
    torch.testing.assert_close(probs.gather(-1, chosen)[..., 0], sample.token_probs)
    # dense with the same per-request truncation gives the same distribution at position 0
    dense = sample_block(
        draft,
        hidden,
        anchor,
        temperature=torch.tensor([0.7, 1.0, 2.0]),
        top_k=torch.tensor([6, 3, 6]),
        generator=torch.Generator().manual_seed(1),
    )
    scattered = torch.zeros(R, draft.config.vocab_size).scatter(-1, ids[:, 0], probs[:, 0])
    torch.testing.assert_close(dense.probs[:, 0], scattered)


def test_sampling_follows_its_distribution(draft, block):
    """N copies of one block: the empirical law of x_1 matches the returned distribution (TV < 0.04)."""
    hidden, anchor = block
    N = 4000
    sample = sample_block(
        draft,
        hidden.expand(N, -1, -1),
        anchor.expand(N),
        temperature=0.8,
        top_k=12,
        uniforms=torch.rand(N, draft.block_size, generator=torch.Generator().manual_seed(5)),
    )
    p0 = sample.probs[0, 0]
    assert torch.allclose(sample.probs[:, 0], p0.expand(N, -1))
    empirical = torch.bincount(sample.tokens[:, 0], minlength=draft.config.vocab_size).float() / N
    assert 0.5 * (empirical - p0).abs().sum() < 0.04
    # every drawn token has positive probability and its reported probability is its distribution's entry
    chosen = sample.probs.gather(-1, sample.tokens[..., None])[..., 0]
    assert torch.all(chosen > 0)
    torch.testing.assert_close(chosen, sample.token_probs)


def test_same_uniforms_same_draft(draft, block):
    hidden, anchor = block
    u = torch.rand(1, draft.block_size, generator=torch.Generator().manual_seed(9))
    a = sample_block(draft, hidden, anchor, temperature=1.0, uniforms=u)
    b = sample_block(draft, hidden, anchor, temperature=1.0, uniforms=u.clone())
    assert torch.equal(a.tokens, b.tokens)


def test_bad_sampling_input(draft, block):
    hidden, anchor = block
    bs = draft.block_size
    with pytest.raises(ValueError, match="temperature"):
        sample_block(draft, hidden, anchor, temperature=-1.0)
    with pytest.raises(ValueError, match="uniforms"):
        sample_block(draft, hidden, anchor, temperature=1.0, uniforms=torch.rand(2, bs))
    with pytest.raises(ValueError, match="uniforms"):
        sample_block(draft, hidden, anchor, temperature=1.0, uniforms=torch.ones(1, bs))
    with pytest.raises(ValueError, match="top_k"):
        sample_block(draft, hidden, anchor, temperature=1.0, top_k=-2)
    with pytest.raises(ValueError, match="anchor_ids"):
        sample_block(draft, hidden, torch.tensor([1, 2]))


def test_bad_backbone_input(draft):
    cache = draft.new_context_cache(num_slots=2, max_seq_len=8)
    slot = cache.allocate()
    width = draft.config.context_feature_size
    with pytest.raises(ValueError, match="width"):
        draft.append_context(cache, [slot], torch.zeros(3, width + 1), [0, 3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        draft.append_context(cache, [slot], torch.zeros(3, width), [0, 2, 3])
    with pytest.raises(ValueError, match="N=2"):
        draft.append_context(cache, [slot], torch.zeros(3, width), [0, 2])
    with pytest.raises(ValueError, match="overflow"):
        draft.append_context(cache, [slot], torch.zeros(9, width), [0, 9])
    with pytest.raises(ValueError, match="not allocated"):
        draft.append_context(cache, [1], torch.zeros(1, width), [0, 1])
    with pytest.raises(ValueError, match="duplicate"):
        draft.draft_block(torch.tensor([1, 1]), torch.tensor([0, 0]), [slot, slot], cache)
    draft.append_context(cache, [slot], torch.zeros(3, width), [0, 3])
    with pytest.raises(ValueError, match="anchor positions"):
        draft.draft_block(torch.tensor([1]), torch.tensor([4]), [slot], cache)
    with pytest.raises(ValueError, match="vocabulary"):
        draft.draft_block(torch.tensor([draft.config.vocab_size]), torch.tensor([3]), [slot], cache)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(slot, 5)
    cache.release(slot)
    assert cache.allocate() == slot and cache.length(slot) == 0


def test_bf16_model_and_cache_run(draft, block):
    """The GPU configuration (bf16 weights and cache) runs the same path; numbers agree to bf16 precision."""
    bf16 = load_draft_model(FIXTURE / "draft", dtype=torch.bfloat16)
    features = torch.randn(12, draft.config.context_feature_size, generator=torch.Generator().manual_seed(3))
    cache = bf16.new_context_cache(num_slots=1, max_seq_len=16)
    slot = cache.allocate()
    bf16.append_context(cache, [slot], features, [0, 12])
    hidden = bf16.draft_block(torch.tensor([235]), torch.tensor([12]), [slot], cache)
    assert hidden.dtype == cache.k.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.float(), block[0], rtol=0.05, atol=0.05)
    sample = sample_block(
        bf16,
        hidden,
        torch.tensor([235]),
        temperature=1.0,
        draft_top_k=8,
        generator=torch.Generator().manual_seed(0),
    )
    assert sample.topk_probs.dtype == torch.float32 and sample.confidence_logits.dtype == torch.float32
    torch.testing.assert_close(sample.topk_probs.sum(-1), torch.ones(1, draft.block_size))
