"""Statistical losslessness: emitted tokens follow the target distribution (chi-square, p > 0.001).

Trials are vectorised: one batch of many requests that share made-up target rows p_t,0..p_t,gamma (a target
whose distribution depends on the position only) and draft distributions q_0..q_{gamma-1}, with distinct
seeds. Drafts are drawn from q with torch's own generator, independent of the sampler's counter-based RNG.
Then, for every position j, the j-th emitted token of the requests that got that far must follow p_t,j (the
standard argument conditions on the earlier, independent acceptances), whatever q was, full or sparse.
The expected distributions are computed here from the definitions (float64, sort based), not with the
sampler's own helpers. The torch reference carries the large trial counts; the Triton kernel runs a smaller
batch (the CPU interpreter is slow) and must also match the reference token for token.
"""

from __future__ import annotations

import pytest
import torch
from stats import chi_square_p_value

from kernels import rejection
from kernels.dispatch import (
    markov_sample_reference,
    markov_sample_triton,
    rejection_sample_reference,
    rejection_sample_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P_MIN = 1e-3


def expected_target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """p_t from the definitions: temperature, top-k keeping ties, then top-p keeping the crossing token."""
    z = logits.double() / temperature
    order = z.argsort(descending=True)
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep &= z >= z[order[top_k - 1]]
    probs = torch.where(keep, torch.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        mass = 0.0
        for v in order.tolist():
            mass += float(probs[v])
            if mass >= top_p:
                keep &= z >= z[v]
                break
        probs = torch.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab).double()


def _scenario(n: int, vocab: int, gamma: int, sparse_k: int, seed: int):
    """Target rows, draft distributions (dense [gamma, V] or sparse top-K) and the drafts of n requests."""
    gen = torch.Generator().manual_seed(seed)
    target_rows = torch.randn(gamma + 1, vocab, generator=gen) * 1.5
    draft_logits = target_rows[:gamma] + torch.randn(gamma, vocab, generator=gen)
    if sparse_k:
        top = draft_logits.topk(sparse_k, dim=-1)
        ids, probs = top.indices, torch.softmax(top.values, dim=-1)
        picks = torch.multinomial(probs.repeat(n, 1), 1, generator=gen).squeeze(1)
        drafts = ids.repeat(n, 1).gather(1, picks[:, None]).squeeze(1)
        dense_q = torch.zeros(gamma, vocab).scatter(1, ids, probs)
        return target_rows, dense_q, drafts, probs.repeat(n, 1), ids.repeat(n, 1)
    probs = torch.softmax(draft_logits, dim=-1)
    drafts = torch.multinomial(probs.repeat(n, 1), 1, generator=gen).squeeze(1)
    return target_rows, probs, drafts, probs.repeat(n, 1), None


def _run(impl, target_rows, drafts, probs, ids, temperature, top_k, top_p, seed):
    gamma = target_rows.shape[0] - 1
    n = drafts.numel() // gamma
    t = torch.as_tensor(temperature, dtype=torch.float32)
    out = impl(
        target_rows.repeat(n, 1).to(DEVICE),
        drafts.to(DEVICE),
        probs.to(DEVICE),
        (torch.arange(n + 1) * gamma).to(DEVICE),
        (t.expand(n) if t.dim() == 0 else t).contiguous().to(DEVICE),
        torch.full((n,), top_k, dtype=torch.int64, device=DEVICE),
        torch.full((n,), top_p, dtype=torch.float32, device=DEVICE),
        (torch.arange(n) * 7919 + seed).to(DEVICE),
        torch.randint(0, 10_000, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE),
        draft_prob_ids=ids.to(DEVICE) if ids is not None else None,
    )
    tokens = out.output_tokens.view(n, gamma + 1).cpu()
    return out.num_accepted.cpu(), tokens


SCENARIOS = {
    "dense T=1": dict(sparse_k=0, temperature=1.0, top_k=0, top_p=1.0),
    "dense T=0.7 top-k 6 top-p 0.9": dict(sparse_k=0, temperature=0.7, top_k=6, top_p=0.9),
    "sparse K=5 T=1.3 top-p 0.8": dict(sparse_k=5, temperature=1.3, top_k=0, top_p=0.8),
    "sparse K=3 T=1 top-k 4": dict(sparse_k=3, temperature=1.0, top_k=4, top_p=1.0),
}


@pytest.mark.parametrize("cdf_block", [4, 2048])
@pytest.mark.parametrize("name", SCENARIOS.keys())
def test_reference_output_follows_the_target_distribution(monkeypatch, name: str, cdf_block: int) -> None:
    """Blocks of 4 ids cut the 12-token vocabulary into 3 inverse-CDF blocks; 2048 (the default) into one."""
    monkeypatch.setattr(rejection, "CDF_BLOCK", cdf_block)
    cfg = SCENARIOS[name]
    n, vocab, gamma = 20_000, 12, 3
    target_rows, q, drafts, probs, ids = _scenario(n, vocab, gamma, cfg["sparse_k"], seed=len(name))
    accepted, tokens = _run(
        rejection_sample_reference,
        target_rows,
        drafts,
        probs,
        ids,
        cfg["temperature"],
        cfg["top_k"],
        cfg["top_p"],
        seed=17,
    )
    p_t = [
        expected_target(target_rows[j], cfg["temperature"], cfg["top_k"], cfg["top_p"])
        for j in range(gamma + 1)
    ]
    for j in range(gamma + 1):
        reached = accepted >= j
        assert int(reached.sum()) > 1000, (j, int(reached.sum()))
        p_value = chi_square_p_value(_counts(tokens[reached, j], vocab).numpy(), p_t[j].numpy())
        assert p_value > P_MIN, (name, j, p_value)
    # the first draft is accepted with probability sum_v min(p_t, q) (= 1 - total variation distance)
    expected_rate = float(torch.minimum(p_t[0], q[0].double()).sum())
    observed_rate = float((accepted >= 1).double().mean())
    assert abs(observed_rate - expected_rate) < 5 * (expected_rate * (1 - expected_rate) / n) ** 0.5


def test_mixed_greedy_and_sampled_requests_in_one_batch() -> None:
    n, vocab, gamma = 20_000, 10, 2
    target_rows, _, drafts, probs, ids = _scenario(n, vocab, gamma, 0, seed=99)
    greedy = torch.arange(n) % 2 == 0
    # greedy requests propose the target argmax on their first draft half of the time
    argmax = target_rows.argmax(dim=-1)
    drafts = drafts.view(n, gamma).clone()
    drafts[greedy & (torch.arange(n) % 4 == 0), 0] = argmax[0]
    drafts = drafts.flatten()
    temperature = torch.where(greedy, 0.0, 1.0)
    accepted, tokens = _run(
        rejection_sample_reference, target_rows, drafts, probs, ids, temperature, 0, 1.0, 5
    )
    d = drafts.view(n, gamma)
    expected_greedy_accepts = (d[:, 0] == argmax[0]).long() * (1 + (d[:, 1] == argmax[1]).long())
    assert torch.equal(accepted[greedy], expected_greedy_accepts[greedy])
    for r in torch.nonzero(greedy).squeeze(1)[:500].tolist():
        a = int(accepted[r])
        assert tokens[r, : a + 1].tolist() == [*d[r, :a].tolist(), int(argmax[a])]
    p_value = chi_square_p_value(
        _counts(tokens[~greedy, 0], vocab).numpy(), expected_target(target_rows[0], 1.0, 0, 1.0).numpy()
    )
    assert p_value > P_MIN


@pytest.mark.parametrize("sparse_k", [0, 3])
def test_triton_sampler_output_follows_the_target_and_equals_the_reference(sparse_k: int) -> None:
    n, vocab, gamma = 80, 5, 1
    target_rows, _, drafts, probs, ids = _scenario(n, vocab, gamma, sparse_k, seed=3 + sparse_k)
    ref = _run(rejection_sample_reference, target_rows, drafts, probs, ids, 0.9, 0, 1.0, seed=8)
    tri = _run(rejection_sample_triton, target_rows, drafts, probs, ids, 0.9, 0, 1.0, seed=8)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    p_value = chi_square_p_value(
        _counts(tri[1][:, 0], vocab).numpy(), expected_target(target_rows[0], 0.9, 0, 1.0).numpy()
    )
    assert p_value > P_MIN


def _markov_inputs(n: int, vocab: int, rank: int, gamma: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(gamma, vocab, generator=gen) * 1.5).expand(n, gamma, vocab).contiguous()
    w1 = torch.randn(vocab, rank, generator=gen) * 0.7
    w2 = torch.randn(vocab, rank, generator=gen) * 0.7
    anchors = torch.full((n,), 3, dtype=torch.int64)
    return base, anchors, w1, w2


def _markov_expected(base_row, w1, w2, previous: int, temperature: float, top_k: int) -> torch.Tensor:
    z = (base_row.double() + w1[previous].double() @ w2.double().T) / temperature
    if top_k:
        z = torch.where(z >= z.topk(top_k).values[-1], z, float("-inf"))
    return torch.softmax(z, dim=-1)


@pytest.mark.parametrize("top_k", [0, 4])
def test_markov_reference_samples_its_softmax(top_k: int) -> None:
    n, vocab, rank, gamma, temperature = 20_000, 12, 4, 2, 0.8
    base, anchors, w1, w2 = _markov_inputs(n, vocab, rank, gamma, seed=21 + top_k)
    out = markov_sample_reference(
        base,
        anchors,
        w1,
        w2,
        torch.full((n,), temperature),
        torch.arange(n) * 31 + 1,
        torch.full((n,), 50),
        top_k=top_k,
    )
    first = _markov_expected(base[0, 0], w1, w2, 3, temperature, top_k)
    assert chi_square_p_value(_counts(out.tokens[:, 0], vocab).numpy(), first.numpy()) > P_MIN
    assert torch.allclose(out.token_probs[:, 0].double(), first[out.tokens[:, 0]], rtol=1e-4)
    common = int(out.tokens[:, 0].mode().values)
    given = out.tokens[:, 0] == common
    second = _markov_expected(base[0, 1], w1, w2, common, temperature, top_k)
    assert chi_square_p_value(_counts(out.tokens[given, 1], vocab).numpy(), second.numpy()) > P_MIN
    if top_k:
        assert out.sparse_ids is not None and out.sparse_probs is not None
        assert torch.equal(out.sparse_ids[0, 0], first.topk(top_k).indices)
        assert torch.allclose(out.sparse_probs[0, 0].double(), first.topk(top_k).values, rtol=1e-4)


def test_markov_k_eff_samples_the_softmax_of_its_own_top_k() -> None:
    """A per-request k_eff inside top_k = 5: requests with k_eff = 2 draw from the softmax of their top-2, the
    others (k_eff = 5) from that of their top-5, in one batch."""
    n, vocab, rank, gamma, temperature, top_k = 20_000, 12, 4, 1, 0.8, 5
    base, anchors, w1, w2 = _markov_inputs(n, vocab, rank, gamma, seed=33)
    k_eff = torch.where(torch.arange(n) % 2 == 0, 2, top_k)
    out = markov_sample_reference(
        base,
        anchors,
        w1,
        w2,
        torch.full((n,), temperature),
        torch.arange(n) * 17 + 5,
        torch.full((n,), 90),
        top_k=top_k,
        k_eff=k_eff,
    )
    for k in (2, top_k):
        rows = k_eff == k
        expected = _markov_expected(base[0, 0], w1, w2, 3, temperature, k)
        assert chi_square_p_value(_counts(out.tokens[rows, 0], vocab).numpy(), expected.numpy()) > P_MIN
        assert torch.allclose(out.token_probs[rows, 0].double(), expected[out.tokens[rows, 0]], rtol=1e-4)


def test_markov_triton_samples_its_softmax_and_equals_the_reference() -> None:
    n, vocab, rank, gamma, temperature = 96, 8, 4, 2, 1.2
    base, anchors, w1, w2 = _markov_inputs(n, vocab, rank, gamma, seed=40)
    args = (
        base.to(DEVICE),
        anchors.to(DEVICE),
        w1.to(DEVICE),
        w2.to(DEVICE),
        torch.full((n,), temperature, device=DEVICE),
        (torch.arange(n) * 13).to(DEVICE),
        torch.full((n,), 7, device=DEVICE),
    )
    ref, tri = markov_sample_reference(*args), markov_sample_triton(*args)
    assert torch.equal(ref.tokens, tri.tokens)
    first = _markov_expected(base[0, 0], w1, w2, 3, temperature, 0)
    assert chi_square_p_value(_counts(tri.tokens[:, 0], vocab).numpy(), first.numpy()) > P_MIN
