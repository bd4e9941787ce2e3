"""The draft engine's block sampling (draft_service.sequential_head.sample_block_keyed).

A vanilla Markov head samples through the fused sampler of kernels.markov (its torch reference on CPU), the gated
and RNN heads and a drafter without a Markov head through the torch loop. Checked for every head type: the eager
and the bucketed (graph layout) steps draft identical blocks, a request's own top-k truncates its sparse
distribution (probability 0 past k_eff, the token among the first k_eff ids), and an inflated pair's padded ids
are never drafted nor listed. For the vanilla head: the engine's drafts are the kernel's, and the confidence
logits computed once per block equal the per-step ones along the drafted path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from model_factory import PairSpec, write_pair

from draft_service.checkpoint import load_draft_model
from draft_service.config import REAL_VOCAB_KEY
from draft_service.engine import ContextItem, DraftEngine, DraftItem, Proposal
from draft_service.model import DSparkDraftModel
from kernels.markov import markov_sample_reference
from kernels.sampling import SamplingParams

BUCKETS = (1, 2, 4, 8)
DRAFT_TOP_K = 6
CASES = [
    (PairSpec(vocab=96, block_size=4, seed=3), None),
    (PairSpec(vocab=96, block_size=4, seed=3), 90),  # an inflated pair: ids 90..95 are padding
    (PairSpec(vocab=96, block_size=3, markov_head_type="gated", seed=4), None),
    (PairSpec(vocab=96, block_size=4, markov_head_type="rnn", confidence_with_markov=False, seed=5), None),
    (PairSpec(vocab=96, block_size=4, markov_rank=0, confidence_with_markov=False, seed=6), None),
]
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, top_k=2, seed=8),  # k_eff = 2
    SamplingParams(temperature=1.3, top_k=9, seed=9),  # wider than the drafter's K: k_eff = K
    SamplingParams(temperature=0.9, top_k=1, seed=10),  # k_eff = 1: the argmax, probability 1
    SamplingParams(temperature=0.0, top_k=3),
]
LENGTHS = [5, 1, 9, 3, 7, 2]


def _drafter(
    root: Path, spec: PairSpec, real_vocab: int | None, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> DSparkDraftModel:
    target_dir, draft_dir = write_pair(root, spec)
    if real_vocab is not None:
        for config_file, extra in (
            (target_dir / "config.json", {REAL_VOCAB_KEY: real_vocab}),
            (draft_dir / "config.json", {REAL_VOCAB_KEY: real_vocab, "mask_token_id": real_vocab - 1}),
        ):
            config_file.write_text(json.dumps(json.loads(config_file.read_text()) | extra))
    return load_draft_model(draft_dir, target_dir=target_dir, dtype=dtype, device=device)


def _propose(drafter: DSparkDraftModel, mode: str) -> tuple[DraftEngine, Proposal]:
    engine = DraftEngine(drafter, 8, 48, draft_top_k=DRAFT_TOP_K, graphs=mode, graph_buckets=BUCKETS)
    gen = torch.Generator().manual_seed(1)
    for i, sp in enumerate(PARAMS):
        engine.add_request(f"r{i}", sp)
    width = drafter.config.context_feature_size
    features = [torch.randn(n, width, generator=gen).to(drafter.device, drafter.dtype) for n in LENGTHS]
    engine.append_context([ContextItem(f"r{i}", 0, f) for i, f in enumerate(features)])
    items = [DraftItem(f"r{i}", 11 + 3 * i, n) for i, n in enumerate(LENGTHS)]
    return engine, engine.propose(items)


def _assert_equal(a: Proposal, b: Proposal) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.topk_ids, b.topk_ids)
    torch.testing.assert_close(a.topk_probs, b.topk_probs, atol=1e-5, rtol=1e-5)
    if a.confidences is not None:
        np.testing.assert_allclose(a.confidences, b.confidences, atol=1e-5)


def _assert_truncated(proposal: Proposal, block_size: int, vocab: int) -> None:
    """Sparse rows of K distinct ids below ``vocab`` holding the token; a greedy request's point mass at the
    token's slot; a sampled request's probabilities renormalised over its first k_eff ids, 0 after."""
    tokens, ids, probs = proposal.tokens, proposal.topk_ids.cpu(), proposal.topk_probs.cpu()
    assert ids.shape == probs.shape == (len(PARAMS), block_size, DRAFT_TOP_K)
    assert bool((ids < vocab).all()) and bool((tokens < vocab).all())
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(PARAMS), block_size))
    slot = (ids == tokens[..., None]).int().argmax(dim=-1)
    assert bool((ids.gather(2, slot[..., None])[..., 0] == tokens).all()), "a token outside its distribution"
    for i, sp in enumerate(PARAMS):
        if sp.greedy:  # the point mass at the token's slot
            assert bool((probs[i].gather(1, slot[i][:, None]) == 1).all())
            continue
        k_eff = min(sp.top_k, DRAFT_TOP_K) if sp.top_k else DRAFT_TOP_K
        assert bool((probs[i, :, k_eff:] == 0).all()) and bool((slot[i] < k_eff).all())
        assert len(set(ids[i, 0].tolist())) == DRAFT_TOP_K


@pytest.mark.parametrize(("spec", "real_vocab"), CASES, ids=[f"{s.name}-{v or 'vocab'}" for s, v in CASES])
def test_eager_and_bucketed_drafts_are_identical_and_truncated(tmp_path: Path, spec: PairSpec, real_vocab) -> None:
    drafter = _drafter(tmp_path, spec, real_vocab)
    (_, off), (_, static) = _propose(drafter, "off"), _propose(drafter, "static")
    _assert_equal(off, static)
    _assert_truncated(off, drafter.block_size, real_vocab or spec.vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_drafts_on_cuda(tmp_path: Path, dtype: torch.dtype) -> None:
    """The Triton Markov sampler on a padded vocabulary: the captured graph drafts what the eager step drafts
    (float32; in bf16 the bucket's padded batch may round the lm_head product differently, so only the form is
    checked there)."""
    spec, real_vocab = CASES[1]
    drafter = _drafter(tmp_path, spec, real_vocab, dtype=dtype, device="cuda")
    (engine, captured), (_, off) = _propose(drafter, "capture"), _propose(drafter, "off")
    assert engine.sampler_backend == "triton"
    if dtype == torch.float32:
        _assert_equal(off, captured)
    _assert_truncated(captured, drafter.block_size, real_vocab)


def test_vanilla_head_drafts_are_the_markov_kernels(tmp_path: Path) -> None:
    """The eager engine's drafts are kernels.markov's on the lm_head output of the real vocabulary, and the
    block's confidence logits equal the per-step confidence head along the drafted path."""
    drafter = _drafter(tmp_path, CASES[1][0], CASES[1][1])
    engine, proposal = _propose(drafter, "off")
    real = drafter.real_vocab_size
    slots = [engine._requests[f"r{i}"].slot for i in range(len(PARAMS))]
    anchors = torch.tensor([11 + 3 * i for i in range(len(PARAMS))])
    positions = torch.tensor(LENGTHS)
    with torch.no_grad():
        hidden = drafter.draft_block(anchors, positions, slots, engine.cache)
        head = drafter.markov_head
        assert head is not None
        k_eff = [min(sp.top_k, DRAFT_TOP_K) if sp.top_k else DRAFT_TOP_K for sp in PARAMS]
        out = markov_sample_reference(
            drafter.lm_head(hidden)[..., :real],
            anchors,
            head.markov_w1.weight[:real],
            head.markov_w2.weight[:real],
            torch.tensor([sp.temperature for sp in PARAMS]),
            torch.tensor([sp.seed or 0 for sp in PARAMS]),
            positions,
            top_k=DRAFT_TOP_K,
            k_eff=torch.tensor(k_eff),
        )
        previous = torch.cat([anchors[:, None], out.tokens[:, :-1]], dim=1)
        per_step = torch.stack(
            [drafter.confidence_logits(hidden[:, k], previous[:, k]) for k in range(drafter.block_size)], dim=1
        )
    assert torch.equal(proposal.tokens, out.tokens)
    assert torch.equal(proposal.topk_ids, out.sparse_ids) and torch.equal(proposal.topk_probs, out.sparse_probs)
    assert proposal.confidence_logits is not None
    np.testing.assert_allclose(proposal.confidence_logits, per_step.double().numpy(), atol=1e-6)
