"""Markov-head sampling: Triton equals the reference loop, DeepSpec conformance, batching, bad input.

Distributional tests are in test_kernels_lossless_stats.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import shared_path
from safetensors.torch import load_file

from kernels.dispatch import markov_sample, markov_sample_reference, markov_sample_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = {"reference": markov_sample_reference, "triton": markov_sample_triton}


def make_inputs(
    num_req: int = 6,
    gamma: int = 3,
    vocab: int = 200,
    rank: int = 24,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 1.0, 0.6, 1.7, 0.0, 1.0] * (num_req // 6 + 1))[:num_req]
    return dict(
        base_logits=(torch.randn(num_req, gamma, vocab, generator=gen) * 2).to(dtype).to(DEVICE),
        anchor_ids=torch.randint(0, vocab, (num_req,), generator=gen).to(DEVICE),
        w1=(torch.randn(vocab, rank, generator=gen) * 0.4).to(dtype).to(DEVICE),
        w2=(torch.randn(vocab, rank, generator=gen) * 0.4).to(dtype).to(DEVICE),
        temperature=temps.to(DEVICE),
        seeds=torch.randint(-(2**62), 2**62, (num_req,), generator=gen).to(DEVICE),
        positions=torch.randint(0, 5000, (num_req,), generator=gen).to(DEVICE),
    )


def _assert_close(ref, tri) -> None:
    assert torch.equal(ref.tokens, tri.tokens)
    assert torch.allclose(ref.token_probs, tri.token_probs, rtol=1e-4, atol=1e-7)
    assert torch.equal(ref.confidence_inputs, tri.confidence_inputs)
    for a, b in (
        (ref.sparse_ids, tri.sparse_ids),
        (ref.sparse_probs, tri.sparse_probs),
        (ref.logits, tri.logits),
    ):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b) if a.dtype == torch.int64 else torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("top_k", "dtype"), [(0, torch.float32), (5, torch.float32), (0, torch.bfloat16), (9, torch.bfloat16)]
)
def test_triton_equals_reference(top_k: int, dtype: torch.dtype) -> None:
    inputs = make_inputs(seed=top_k, dtype=dtype, vocab=160)
    ref = markov_sample_reference(**inputs, top_k=top_k, return_logits=True)
    tri = markov_sample_triton(**inputs, top_k=top_k, return_logits=True)
    _assert_close(ref, tri)
    assert ref.confidence_inputs.dtype == dtype


@pytest.mark.parametrize(("top_k", "flat"), [(5, False), (20, False), (5, True)])
def test_truncated_mode_over_many_tiles_equals_reference(top_k: int, flat: bool) -> None:
    """V = 2000 is 16 tiles: top-5 re-reads only the 5 best tiles, top-20 needs every tile, and a flat z
    (all values tied, ids decide) puts more tokens above the tile bound than the candidate buffer holds,
    which takes the exact extraction fallback. Two steps (the second conditioned on the first's tokens) and
    four requests (greedy and three temperatures) cover every path; more only lengthen the interpreted run."""
    inputs = make_inputs(num_req=4, gamma=2, seed=top_k, vocab=2000)
    if flat:
        inputs["base_logits"] = torch.zeros_like(inputs["base_logits"])
        inputs["w2"] = torch.zeros_like(inputs["w2"])
    for return_logits in (False, True):
        ref = markov_sample_reference(**inputs, top_k=top_k, return_logits=return_logits)
        _assert_close(ref, markov_sample_triton(**inputs, top_k=top_k, return_logits=return_logits))


def test_greedy_steps_follow_the_argmax_chain_and_report_probability_one() -> None:
    inputs = make_inputs(num_req=4, gamma=4, vocab=64, seed=3)
    inputs["temperature"] = torch.zeros(4, device=DEVICE)
    for impl in IMPLS.values():
        out = impl(**inputs, top_k=4, return_logits=True)
        previous = inputs["anchor_ids"]
        for k in range(4):
            z = inputs["base_logits"][:, k].float() + inputs["w1"][previous].float() @ inputs["w2"].float().T
            assert torch.equal(out.tokens[:, k], z.argmax(dim=-1))
            previous = out.tokens[:, k]
        assert bool((out.token_probs == 1).all())
        assert out.sparse_probs is not None and bool((out.sparse_probs[..., 0] == 1).all())
        assert out.sparse_ids is not None and torch.equal(out.sparse_ids[..., 0], out.tokens)


def test_sparse_distribution_is_the_renormalised_top_k_and_contains_the_token() -> None:
    inputs = make_inputs(num_req=6, gamma=3, vocab=128, seed=5)
    out = markov_sample_triton(**inputs, top_k=7, return_logits=True)
    assert out.sparse_ids is not None and out.sparse_probs is not None and out.logits is not None
    assert torch.allclose(out.sparse_probs.sum(dim=-1), torch.ones(6, 3, device=DEVICE), atol=1e-5)
    assert bool((out.sparse_ids == out.tokens[..., None]).any(dim=-1).all())
    top_values = out.logits.topk(7, dim=-1).values
    assert torch.allclose(out.logits.gather(2, out.sparse_ids), top_values)
    sampled = inputs["temperature"] > 0
    t = inputs["temperature"][sampled][:, None, None]
    expected = torch.softmax(top_values[sampled] / t, dim=-1)
    assert torch.allclose(out.sparse_probs[sampled], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_request_k_eff_truncates_inside_the_top_k_and_equals_the_reference(dtype: torch.dtype) -> None:
    """k_eff[r] keeps the K sorted ids and renormalises over the first k_eff[r] (probability 0 after); the
    token is one of them (k_eff = 1: the argmax with probability 1); k_eff = K everywhere is no k_eff. The base
    logits are the real-vocabulary view of a wider (padded) row, as the draft engine passes them."""
    top_k = 7
    inputs = make_inputs(num_req=6, gamma=2, vocab=300, seed=11, dtype=dtype)  # rows 0 and 4 are greedy
    padded = torch.full((6, 2, 309), 50.0, dtype=dtype, device=DEVICE)  # padded ids would win every race
    padded[..., :300] = inputs["base_logits"]
    inputs["base_logits"] = padded[..., :300]
    k_eff = torch.tensor([3, 1, 7, 2, 5, 4], device=DEVICE)
    ref = markov_sample_reference(**inputs, top_k=top_k, return_logits=True, k_eff=k_eff)
    _assert_close(ref, markov_sample_triton(**inputs, top_k=top_k, return_logits=True, k_eff=k_eff))
    assert ref.sparse_ids is not None and ref.sparse_probs is not None and ref.logits is not None
    top_values = ref.logits.topk(top_k, dim=-1).values
    assert torch.allclose(ref.logits.gather(2, ref.sparse_ids), top_values)
    live = torch.arange(top_k, device=DEVICE) < k_eff[:, None, None]
    assert bool((ref.sparse_probs[~live.expand_as(ref.sparse_probs)] == 0).all())
    slot = (ref.sparse_ids == ref.tokens[..., None]).int().argmax(dim=-1)
    assert bool((ref.sparse_ids.gather(2, slot[..., None])[..., 0] == ref.tokens).all())
    assert bool((slot < k_eff[:, None]).all())
    sampled = inputs["temperature"] > 0
    t = torch.where(sampled, inputs["temperature"], 1.0)[:, None, None]
    expected = torch.softmax((top_values / t).masked_fill(~live, float("-inf")), dim=-1)
    assert torch.allclose(ref.sparse_probs[sampled], expected[sampled], rtol=1e-4, atol=1e-6)
    assert torch.equal(ref.tokens[1], ref.sparse_ids[1, :, 0]) and bool((ref.token_probs[1] == 1).all())
    greedy = ~sampled
    assert bool((ref.sparse_probs[greedy][..., 0] == 1).all()) and bool((ref.token_probs[greedy] == 1).all())
    for impl in IMPLS.values():
        full_k = impl(**inputs, top_k=top_k, k_eff=torch.full((6,), top_k, device=DEVICE))
        _assert_close(impl(**inputs, top_k=top_k), full_k)


def test_a_requests_draft_does_not_depend_on_its_batch() -> None:
    inputs = make_inputs(num_req=6, gamma=3, vocab=96, seed=8)
    for impl in IMPLS.values():
        full = impl(**inputs, top_k=6)
        keep = torch.tensor([4, 1], device=DEVICE)
        sub = {k: (v[keep] if k not in ("w1", "w2") else v) for k, v in inputs.items()}
        alone = impl(**sub, top_k=6)
        assert torch.equal(alone.tokens, full.tokens[keep])
        assert alone.sparse_ids is not None and full.sparse_ids is not None
        assert torch.equal(alone.sparse_ids, full.sparse_ids[keep])


def test_dispatcher_matches_the_reference() -> None:
    inputs = make_inputs(seed=2)
    assert torch.equal(markov_sample(**inputs).tokens, markov_sample_reference(**inputs).tokens)


@pytest.mark.parametrize("impl", IMPLS.keys())
def test_matches_deepspec_markov_head_on_the_fixture(impl: str) -> None:
    """Greedy Markov sampling of DeepSpec's reference block: same logits, tokens and confidence inputs."""
    root = shared_path("fixtures/deepspec_tiny_a")
    ref = load_file(str(root / "reference.safetensors"))
    draft = load_file(str(root / "draft" / "model.safetensors"))
    w1, w2 = draft["markov_head.markov_w1.weight"], draft["markov_head.markov_w2.weight"]
    out = IMPLS[impl](
        ref["a.base_logits"].to(DEVICE),
        ref["a.draft_input_ids"][:, 0].to(DEVICE),
        w1.to(DEVICE),
        w2.to(DEVICE),
        torch.zeros(1, device=DEVICE),
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
        torch.tensor([19], device=DEVICE),
        return_logits=True,
    )
    assert torch.equal(out.tokens.cpu(), ref["a.sampled_tokens_greedy"])
    assert out.logits is not None
    assert torch.allclose(out.logits.cpu(), ref["a.markov_logits_sampled"], atol=1e-5)
    head_in = torch.cat([ref["a.block_hidden"], out.confidence_inputs.cpu()], dim=-1)
    conf = head_in @ draft["confidence_head.proj.weight"].T + draft["confidence_head.proj.bias"]
    assert torch.allclose(conf.squeeze(-1), ref["a.confidence_logits_sampled"], atol=1e-5)


def _bad_cases() -> dict[str, tuple[dict, dict, str]]:
    """name -> (input overrides, keyword overrides, expected message fragment)."""
    good = make_inputs(num_req=2, gamma=2, vocab=32, rank=8)
    return {
        "base 2-D": (dict(base_logits=good["base_logits"][0]), {}, "3-D"),
        "base int": (dict(base_logits=good["base_logits"].long()), {}, "float32, bfloat16"),
        "w1 vocab": (dict(w1=good["w1"][:-1]), {}, "w1 has 31 rows"),
        "w2 rank": (dict(w2=good["w2"][:, :4]), {}, "must both be [V, r]"),
        "dtype mix": (dict(w2=good["w2"].to(torch.bfloat16)), {}, "share a dtype"),
        "anchor range": (dict(anchor_ids=good["anchor_ids"] + 32), {}, "anchor_ids must be in"),
        "anchor float": (dict(anchor_ids=good["anchor_ids"].float()), {}, "integer"),
        "negative temperature": (dict(temperature=torch.tensor([-0.5, 1.0], device=DEVICE)), {}, ">= 0"),
        "temperature shape": (
            dict(temperature=torch.ones(3, device=DEVICE)),
            {},
            "temperature must have shape [2]",
        ),
        "seed shape": (dict(seeds=good["seeds"][:1]), {}, "seeds"),
        "top_k too large": ({}, dict(top_k=33), "top_k must be in"),
        "top_k negative": ({}, dict(top_k=-1), "top_k must be in"),
        "top_k float": ({}, dict(top_k=2.0), "top_k must be an int"),
        "k_eff without top_k": ({}, dict(k_eff=torch.tensor([1, 1], device=DEVICE)), "needs top_k > 0"),
        "k_eff zero": ({}, dict(top_k=4, k_eff=torch.tensor([0, 2], device=DEVICE)), "k_eff must be in [1, top_k=4]"),
        "k_eff above top_k": ({}, dict(top_k=4, k_eff=torch.tensor([5, 2], device=DEVICE)), "k_eff must be in"),
        "k_eff shape": ({}, dict(top_k=4, k_eff=torch.tensor([2], device=DEVICE)), "k_eff must have shape [2]"),
        "k_eff float": ({}, dict(top_k=4, k_eff=torch.tensor([2.0, 1.0], device=DEVICE)), "k_eff must be an integer"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("impl", IMPLS.keys())
@pytest.mark.parametrize("case", BAD.keys())
def test_bad_input_raises_value_error_with_a_clear_message(impl: str, case: str) -> None:
    overrides, kwargs, fragment = BAD[case]
    inputs = {**make_inputs(num_req=2, gamma=2, vocab=32, rank=8), **overrides}
    with pytest.raises(ValueError, match=re.escape(fragment)):
        IMPLS[impl](**inputs, **kwargs)
