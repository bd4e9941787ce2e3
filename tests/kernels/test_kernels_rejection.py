"""Rejection sampler: Triton equals the torch reference, greedy equals argmax, filters, layout, bad input.

The distributional (losslessness) tests live in test_kernels_lossless_stats.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import shared_path
from safetensors.torch import load_file

from kernels.dispatch import rejection_sample, rejection_sample_reference, rejection_sample_triton
from kernels.rejection import filter_thresholds, target_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = {"reference": rejection_sample_reference, "triton": rejection_sample_triton}


@dataclass
class Batch:
    """Arguments of one rejection_sample call (field order = positional order)."""

    target_logits: torch.Tensor
    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None
    cu_draft_lens: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    draft_prob_ids: torch.Tensor | None = None

    def run(self, impl=rejection_sample_reference):
        return impl(
            self.target_logits,
            self.draft_token_ids,
            self.draft_probs,
            self.cu_draft_lens,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seeds,
            self.positions,
            draft_prob_ids=self.draft_prob_ids,
        )


def make_batch(
    lens: list[int],
    vocab: int,
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    sparse_k: int = 0,
    seed: int = 0,
    logit_dtype: torch.dtype = torch.float32,
) -> Batch:
    """A ragged batch whose drafts are really sampled from the draft distribution they come with."""
    gen = torch.Generator().manual_seed(seed)
    num_req, num_draft = len(lens), sum(lens)
    cu = torch.zeros(num_req + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    logits = torch.randn(num_draft + num_req, vocab, generator=gen) * 2.5
    row_of_draft = torch.cat([torch.arange(cu[r], cu[r + 1]) + r for r in range(num_req)]).long()
    draft_logits = logits[row_of_draft] + torch.randn(num_draft, vocab, generator=gen)
    if sparse_k:
        top = draft_logits.topk(sparse_k, dim=-1)
        probs = torch.softmax(top.values, dim=-1)
        pick = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        drafts, ids = top.indices.gather(1, pick[:, None]).squeeze(1), top.indices
    else:
        probs = torch.softmax(draft_logits, dim=-1)
        drafts, ids = torch.multinomial(probs, 1, generator=gen).squeeze(1), None
    n = num_req
    return Batch(
        target_logits=logits.to(logit_dtype).to(DEVICE),
        draft_token_ids=drafts.to(DEVICE),
        draft_probs=probs.to(DEVICE),
        cu_draft_lens=cu.to(DEVICE),
        temperature=torch.tensor(temperature, dtype=torch.float32, device=DEVICE),
        top_k=torch.tensor(top_k if top_k is not None else [0] * n, dtype=torch.int64, device=DEVICE),
        top_p=torch.tensor(top_p if top_p is not None else [1.0] * n, dtype=torch.float32, device=DEVICE),
        seeds=torch.randint(0, 2**62, (n,), generator=gen).to(DEVICE),
        positions=torch.randint(0, 4096, (n,), generator=gen).to(DEVICE),
        draft_prob_ids=ids.to(DEVICE) if ids is not None else None,
    )


def _assert_same(a, b) -> None:
    assert torch.equal(a.num_accepted.cpu(), b.num_accepted.cpu())
    assert torch.equal(a.output_tokens.cpu(), b.output_tokens.cpu())


MIXED = dict(
    lens=[3, 0, 4, 1, 2, 4, 0, 3],
    temperature=[0.0, 1.0, 0.8, 0.0, 1.5, 1.0, 0.6, 1.0],
    top_k=[0, 0, 7, 3, 0, 20, 0, 0],
    top_p=[1.0, 0.9, 1.0, 1.0, 0.75, 0.95, 1.0, 1.0],
)


@pytest.mark.parametrize(
    ("sparse_k", "logit_dtype"), [(0, torch.float32), (6, torch.float32), (0, torch.bfloat16)]
)
def test_triton_equals_reference_on_mixed_ragged_batches(sparse_k: int, logit_dtype: torch.dtype) -> None:
    batch = make_batch(**MIXED, vocab=96, sparse_k=sparse_k, seed=sparse_k, logit_dtype=logit_dtype)
    _assert_same(batch.run(rejection_sample_reference), batch.run(rejection_sample_triton))


def test_triton_equals_reference_when_drafts_follow_the_target() -> None:
    """Drafts drawn from (almost) the target itself get long accepted runs: exercises bonus rows."""
    batch = make_batch(lens=[4, 4, 2, 4], vocab=64, temperature=[1.0, 0.0, 1.0, 1.0], seed=3)
    rows = torch.cat([torch.arange(4), torch.arange(5, 9), torch.arange(10, 12), torch.arange(13, 17)])
    probs = target_probs(
        batch.target_logits[rows].float().cpu(),
        torch.ones(14),
        torch.zeros(14, dtype=torch.int64),
        torch.ones(14),
    )
    batch.draft_probs = probs.to(DEVICE)
    batch.draft_token_ids = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    batch.draft_token_ids = batch.draft_token_ids.to(DEVICE)
    ref = batch.run(rejection_sample_reference)
    assert int(ref.num_accepted.sum()) >= 8
    _assert_same(ref, batch.run(rejection_sample_triton))


def test_greedy_only_batch_needs_no_draft_probs_and_accepts_argmax_prefixes() -> None:
    vocab = 40
    batch = make_batch(lens=[4, 3, 0, 2], vocab=vocab, temperature=[0.0] * 4, seed=5)
    logits = batch.target_logits.clone()
    logits[1, 7] = logits[1].max()  # a tie at the top: argmax takes the smaller id
    logits[1, 3] = logits[1, 7]
    batch.target_logits = logits
    argmax = logits.argmax(dim=-1)
    cu = batch.cu_draft_lens.tolist()
    accept_runs = [2, 3, 0, 0]  # request r: first accept_runs[r] drafts equal the target argmax
    drafts = []
    for r, run in enumerate(accept_runs):
        for k in range(cu[r + 1] - cu[r]):
            best = int(argmax[cu[r] + r + k])
            drafts.append(best if k < run else (best + 1) % vocab)
    batch.draft_token_ids = torch.tensor(drafts, device=DEVICE)
    batch.draft_probs = None
    for impl in IMPLS.values():
        out = batch.run(impl)
        assert out.num_accepted.tolist() == accept_runs
        for r, tokens in enumerate(out.per_request(batch.cu_draft_lens)):
            row = cu[r] + r
            assert tokens == [int(argmax[row + k]) for k in range(accept_runs[r] + 1)]
    assert int(argmax[1]) == 3


def test_output_layout_is_ragged_with_minus_one_padding() -> None:
    batch = make_batch(**MIXED, vocab=50, seed=9)
    out = batch.run(rejection_sample_triton)
    cu = batch.cu_draft_lens.tolist()
    tokens = out.output_tokens.tolist()
    for r, n in enumerate(out.num_accepted.tolist()):
        start, rows = cu[r] + r, cu[r + 1] - cu[r] + 1
        assert all(t >= 0 for t in tokens[start : start + n + 1])
        assert all(t == -1 for t in tokens[start + n + 1 : start + rows])
        drafts = batch.draft_token_ids[cu[r] : cu[r] + n].tolist()
        assert tokens[start : start + n] == drafts


def _sub_batch(batch: Batch, keep: list[int]) -> Batch:
    """The requests ``keep`` of ``batch`` as a batch of their own (same seeds and positions)."""
    cu = batch.cu_draft_lens.tolist()
    rows = torch.cat([torch.arange(cu[r] + r, cu[r + 1] + r + 1) for r in keep]).to(DEVICE)
    drafts = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in keep]).to(DEVICE)
    lens = torch.tensor([cu[r + 1] - cu[r] for r in keep])
    new_cu = torch.zeros(len(keep) + 1, dtype=torch.int64)
    new_cu[1:] = lens.cumsum(0)
    idx = torch.tensor(keep, device=DEVICE)
    return replace(
        batch,
        target_logits=batch.target_logits[rows],
        draft_token_ids=batch.draft_token_ids[drafts],
        draft_probs=batch.draft_probs[drafts],
        cu_draft_lens=new_cu.to(DEVICE),
        temperature=batch.temperature[idx],
        top_k=batch.top_k[idx],
        top_p=batch.top_p[idx],
        seeds=batch.seeds[idx],
        positions=batch.positions[idx],
        draft_prob_ids=batch.draft_prob_ids[drafts] if batch.draft_prob_ids is not None else None,
    )


@pytest.mark.parametrize("impl", IMPLS.keys())
def test_a_requests_output_does_not_depend_on_its_batch(impl: str) -> None:
    batch = make_batch(**MIXED, vocab=80, sparse_k=5, seed=11)
    full = batch.run(IMPLS[impl]).per_request(batch.cu_draft_lens)
    for keep in ([2], [7, 0, 4]):
        alone = _sub_batch(batch, keep)
        assert alone.run(IMPLS[impl]).per_request(alone.cu_draft_lens) == [full[r] for r in keep]


def test_seeds_make_runs_reproducible_and_distinct() -> None:
    batch = make_batch(lens=[2] * 64, vocab=30, temperature=[1.0] * 64, seed=2)
    first, second = batch.run(), batch.run()
    _assert_same(first, second)
    batch.seeds = batch.seeds + 1
    assert not torch.equal(first.output_tokens, batch.run().output_tokens)


def test_top_k_keeps_every_token_tied_with_the_kth_value() -> None:
    row = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0, 0.0, -0.0, -2.0]])
    tau = filter_thresholds(row, torch.tensor([2]), torch.tensor([1.0]))
    assert float(tau[0]) == 4.0
    n = 16
    batch = Batch(
        target_logits=row.repeat(n, 1).to(DEVICE),
        draft_token_ids=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        draft_probs=None,
        cu_draft_lens=torch.zeros(n + 1, dtype=torch.int64, device=DEVICE),
        temperature=torch.full((n,), 2.0, device=DEVICE),
        top_k=torch.full((n,), 2, device=DEVICE),
        top_p=torch.ones(n, device=DEVICE),
        seeds=torch.arange(n, device=DEVICE),
        positions=torch.zeros(n, dtype=torch.int64, device=DEVICE),
    )
    ref, tri = batch.run(rejection_sample_reference), batch.run(rejection_sample_triton)
    _assert_same(ref, tri)
    assert set(ref.output_tokens.tolist()) == {0, 1, 2, 3}


def test_top_p_keeps_the_token_that_crosses_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :].repeat(3, 1)
    top_p = torch.tensor([0.45, 0.55, 0.85])
    kept = target_probs(logits, torch.ones(3), torch.zeros(3, dtype=torch.int64), top_p) > 0
    assert kept.sum(dim=1).tolist() == [1, 2, 3]
    expected = probs[:3] / probs[:3].sum()
    assert torch.allclose(
        target_probs(logits, torch.ones(3), torch.zeros(3, dtype=torch.int64), top_p)[2, :3], expected
    )
    n = 24
    batch = Batch(
        target_logits=logits[:1].repeat(n, 1).to(DEVICE),
        draft_token_ids=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        draft_probs=None,
        cu_draft_lens=torch.zeros(n + 1, dtype=torch.int64, device=DEVICE),
        temperature=torch.ones(n, device=DEVICE),
        top_k=torch.zeros(n, dtype=torch.int64, device=DEVICE),
        top_p=torch.full((n,), 0.55, device=DEVICE),
        seeds=torch.arange(n, device=DEVICE),
        positions=torch.full((n,), 17, device=DEVICE),
    )
    ref, tri = batch.run(rejection_sample_reference), batch.run(rejection_sample_triton)
    _assert_same(ref, tri)
    assert set(ref.output_tokens.tolist()) == {0, 1}


def test_dispatcher_uses_the_reference_on_cpu_and_matches_it() -> None:
    batch = make_batch(**MIXED, vocab=40, seed=4)
    _assert_same(batch.run(rejection_sample), batch.run(rejection_sample_reference))


def test_probabilities_match_deepspec_reference_fixture() -> None:
    """Our p_t, accept probability and residual equal DeepSpec's own numbers on the conformance fixture."""
    ref = load_file(str(shared_path("fixtures/deepspec_tiny_a/reference.safetensors")))
    logits = ref["a.target_verify_logits"][0]
    p_t = target_probs(logits, torch.ones(8), torch.zeros(8, dtype=torch.int64), torch.ones(8))
    assert torch.allclose(p_t, ref["a.t1_target_probs"][0], atol=1e-6)
    p_d = ref["a.t1_draft_probs"][0]
    drafts = ref["a.sampled_tokens_greedy"][0]
    accept = (p_t[:7].gather(1, drafts[:, None]) / p_d.gather(1, drafts[:, None])).clamp(max=1).squeeze(1)
    assert torch.allclose(accept, ref["a.t1_accept_prob"][0], atol=1e-5)
    residual = (p_t[:7] - p_d).clamp(min=0)
    assert torch.allclose(
        residual / residual.sum(dim=1, keepdim=True), ref["a.t1_residual_probs"][0], atol=1e-5
    )


def _bad_inputs() -> list[tuple[str, dict, str]]:
    """(case name, field overrides, expected message fragment)."""
    b = make_batch(lens=[2, 1], vocab=20, temperature=[1.0, 0.0], seed=1)
    sparse = make_batch(lens=[2, 1], vocab=20, temperature=[1.0, 0.0], sparse_k=4, seed=1)
    bad_probs = b.draft_probs.clone()
    bad_probs[0] *= 0.9
    negative = b.draft_probs.clone()
    negative[1, 0] = -0.1
    negative[1, 1] += 0.1
    return [
        ("logits 1-D", dict(target_logits=b.target_logits[0]), "2-D"),
        ("logits int", dict(target_logits=b.target_logits.long()), "float32, bfloat16"),
        ("rows", dict(target_logits=b.target_logits[:-1]), "rows"),
        ("draft dtype", dict(draft_token_ids=b.draft_token_ids.float()), "integer"),
        ("draft range", dict(draft_token_ids=b.draft_token_ids + 20), "draft_token_ids must be in"),
        ("negative temperature", dict(temperature=torch.tensor([-1.0, 0.0], device=DEVICE)), ">= 0"),
        ("tiny temperature", dict(temperature=torch.tensor([1e-9, 0.0], device=DEVICE)), "greedy"),
        ("nan temperature", dict(temperature=torch.tensor([float("nan"), 0.0], device=DEVICE)), "finite"),
        ("top_p zero", dict(top_p=torch.tensor([0.0, 1.0], device=DEVICE)), "top_p"),
        ("top_p above one", dict(top_p=torch.tensor([1.5, 1.0], device=DEVICE)), "top_p"),
        ("negative top_k", dict(top_k=torch.tensor([-1, 0], device=DEVICE)), "top_k"),
        ("short seeds", dict(seeds=b.seeds[:1]), "seeds"),
        ("negative position", dict(positions=torch.tensor([-3, 0], device=DEVICE)), "positions"),
        ("cu start", dict(cu_draft_lens=b.cu_draft_lens + 1), "cu_draft_lens[0]"),
        ("cu total", dict(cu_draft_lens=torch.tensor([0, 1, 2], device=DEVICE)), "cu_draft_lens[-1]"),
        ("cu decreasing", dict(cu_draft_lens=torch.tensor([0, 4, 3], device=DEVICE)), "non-decreasing"),
        ("probs sum", dict(draft_probs=bad_probs), "sum to 1"),
        ("probs negative", dict(draft_probs=negative), "non-negative"),
        ("probs dtype", dict(draft_probs=b.draft_probs.double()), "float32"),
        ("probs shape", dict(draft_probs=b.draft_probs[:, :10]), "dense draft_probs"),
        ("probs missing", dict(draft_probs=None), "draft_probs is required"),
        (
            "sparse ids range",
            dict(draft_probs=sparse.draft_probs, draft_prob_ids=sparse.draft_prob_ids + 20),
            "draft_prob_ids must be in",
        ),
        (
            "sparse ids shape",
            dict(draft_probs=sparse.draft_probs, draft_prob_ids=sparse.draft_prob_ids[:, :2]),
            "shape of draft_probs",
        ),
        (
            "sparse too wide",
            dict(
                draft_probs=torch.full((3, 1025), 1 / 1025, device=DEVICE),
                draft_prob_ids=torch.zeros((3, 1025), dtype=torch.int64, device=DEVICE),
            ),
            "1 <= K <= 1024",
        ),
    ]


BAD_INPUTS = {name: (overrides, fragment) for name, overrides, fragment in _bad_inputs()}


@pytest.mark.parametrize("impl", IMPLS.keys())
@pytest.mark.parametrize("case", BAD_INPUTS.keys())
def test_bad_input_raises_value_error_with_a_clear_message(impl: str, case: str) -> None:
    overrides, fragment = BAD_INPUTS[case]
    base = make_batch(lens=[2, 1], vocab=20, temperature=[1.0, 0.0], seed=1)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        replace(base, **overrides).run(IMPLS[impl])


def test_minus_infinity_logits_are_never_emitted() -> None:
    """Masked vocabulary entries (-inf logits, e.g. padding) get probability 0 in every setting."""
    batch = make_batch(**MIXED, vocab=64, sparse_k=5, seed=13)
    masked = torch.zeros(64, dtype=torch.bool)
    masked[1::3] = True  # ids 1 mod 3; a masked id + 1 is in range and unmasked
    logits = batch.target_logits.clone()
    logits[:, masked.to(DEVICE)] = float("-inf")
    batch.target_logits = logits
    drafts = batch.draft_token_ids.clone()
    drafts[masked.to(DEVICE)[drafts]] += 1  # drafts proposing a masked token would be rejected anyway
    batch.draft_token_ids = drafts
    batch.draft_prob_ids = torch.where(masked.to(DEVICE)[batch.draft_prob_ids], batch.draft_prob_ids + 1,
                                       batch.draft_prob_ids)  # fmt: skip
    batch.draft_prob_ids[:, 0] = drafts
    ref, tri = batch.run(rejection_sample_reference), batch.run(rejection_sample_triton)
    _assert_same(ref, tri)
    emitted = ref.output_tokens[ref.output_tokens >= 0].cpu()
    assert not bool(masked[emitted].any())


@pytest.mark.parametrize("impl", IMPLS.keys())
def test_an_empty_batch_returns_empty_outputs(impl: str) -> None:
    empty_i = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out = IMPLS[impl](
        torch.zeros(0, 10, device=DEVICE), empty_i, None, torch.zeros(1, dtype=torch.int64, device=DEVICE),
        torch.zeros(0, device=DEVICE), empty_i, torch.zeros(0, device=DEVICE), empty_i, empty_i,
    )  # fmt: skip
    assert out.num_accepted.shape == (0,) and out.output_tokens.shape == (0,)


@pytest.mark.parametrize("peaked", [False, True])
def test_triton_equals_reference_across_splits_and_threshold_paths(monkeypatch, peaked: bool) -> None:
    """Small launch sizes give several vocabulary splits per row and several inverse-CDF blocks per draw; the
    filters cover both threshold paths.

    top-k 5, top-p 0.3 and (on peaked rows) top-p 0.97 are certified by the sketch (sorted candidates); top-k
    300 (beyond the sketch), top-p 0.97 on flat rows and top-k 40 (more tokens above the bound than candidate
    slots) take the exact fallback search over the whole row. The candidates are compacted a few (group, block)
    chunks at a time (several tiles per row)."""
    from kernels import rejection, rejection_triton

    monkeypatch.setitem(rejection_triton.TUNING, "row_block_v", 128)
    monkeypatch.setitem(rejection_triton.TUNING, "row_splits", 4)
    monkeypatch.setattr(rejection, "CDF_BLOCK", 128)  # 8 inverse-CDF blocks (the reference cuts the same)
    monkeypatch.setitem(rejection_triton.TUNING, "cdf_group", 3)
    monkeypatch.setattr(rejection_triton, "SKETCH_GROUPS", 16)
    monkeypatch.setattr(rejection_triton, "CANDIDATES", 32)
    monkeypatch.setitem(rejection_triton.TUNING, "select_tile", 32)  # 4 chunks of 8 ids per compaction tile
    batch = make_batch(
        lens=[2, 1, 3, 0, 2, 1],
        vocab=1000,
        temperature=[1.0, 0.7, 1.0, 1.3, 0.0, 1.0],
        top_k=[5, 40, 300, 0, 3, 0],
        top_p=[1.0, 0.8, 1.0, 0.97, 1.0, 0.3],
        sparse_k=8,
        seed=21,
    )
    if peaked:
        batch.target_logits = batch.target_logits * 3
    logits = batch.target_logits.clone()
    logits[:, 500:520] = float("-inf")
    batch.target_logits = logits
    _assert_same(batch.run(rejection_sample_reference), batch.run(rejection_sample_triton))


@pytest.mark.parametrize(("sparse_k", "cdf_block"), [(0, 64), (8, 64), (8, 16)])
def test_triton_equals_reference_across_inverse_cdf_blocks(monkeypatch, sparse_k: int, cdf_block: int) -> None:
    """Draws over many inverse-CDF blocks, one of them entirely -inf (mass 0, never chosen); filtered requests
    keep a few tokens, so most of their blocks have mass 0 too (and are not read: with 16-id blocks their
    bitmap of listed blocks spans two words)."""
    from kernels import rejection

    monkeypatch.setattr(rejection, "CDF_BLOCK", cdf_block)
    n = 14
    gen = torch.Generator().manual_seed(32)
    batch = make_batch(lens=torch.randint(0, 4, (n,), generator=gen).tolist(), vocab=700,
                       temperature=[0.0 if r % 7 == 3 else 0.7 + 0.1 * (r % 6) for r in range(n)],
                       top_k=[30 if r % 5 == 1 else 0 for r in range(n)],
                       top_p=[0.9 if r % 4 == 2 else 1.0 for r in range(n)], sparse_k=sparse_k, seed=31)  # fmt: skip
    logits = batch.target_logits.clone()
    logits[:, 128:192] = float("-inf")
    logits[:, 300:310] = float("-inf")
    batch.target_logits = logits
    batch.draft_token_ids = torch.where((batch.draft_token_ids >= 128) & (batch.draft_token_ids < 192), 0,
                                        batch.draft_token_ids)  # fmt: skip
    ref = batch.run(rejection_sample_reference)
    _assert_same(ref, batch.run(rejection_sample_triton))
    emitted = ref.output_tokens[ref.output_tokens >= 0]
    assert not bool(((emitted >= 128) & (emitted < 192)).any())


@pytest.mark.parametrize("sparse", [False, True])
def test_an_all_zero_residual_draws_from_the_target(sparse: bool) -> None:
    """p_d = 1.0009 * p_t (within the sum tolerance) leaves no residual: the rare rejections (u >= 1 / 1.0009)
    draw from p_t instead, in both implementations alike, and never a token of probability 0."""
    n, vocab = 3000, 16
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5)) * 2
    logits[:, 8:] = float("-inf")
    p_t = target_probs(logits[:1], torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))[0]
    p_d = p_t * 1.0009
    drafts = torch.multinomial(p_t, n, replacement=True, generator=torch.Generator().manual_seed(6))
    ids = torch.arange(8).repeat(n, 1) if sparse else None
    batch = Batch(
        target_logits=logits.repeat(n, 1).to(DEVICE),
        draft_token_ids=drafts.to(DEVICE),
        draft_probs=(p_d[:8].repeat(n, 1) if sparse else p_d.repeat(n, 1)).to(DEVICE),
        cu_draft_lens=torch.arange(n + 1).to(DEVICE),
        temperature=torch.ones(n, device=DEVICE),
        top_k=torch.zeros(n, dtype=torch.int64, device=DEVICE),
        top_p=torch.ones(n, device=DEVICE),
        seeds=torch.arange(n, device=DEVICE) * 3 + 1,
        positions=torch.full((n,), 40, device=DEVICE),
        draft_prob_ids=ids.to(DEVICE) if ids is not None else None,
    )
    rejected = torch.nonzero(batch.run().num_accepted.cpu() == 0).squeeze(1).tolist()
    assert 0 < len(rejected) < 20
    alone = _sub_batch(batch, rejected[:6])
    ref = alone.run(rejection_sample_reference)
    _assert_same(ref, alone.run(rejection_sample_triton))
    tokens = ref.output_tokens.view(-1, 2)[:, 0].cpu()
    assert bool((p_t[tokens] > 0).all())
