"""Conformance of the draft model with DeepSpec's own outputs on the vendored fixture deepspec_tiny_a (part
a).

Tolerances are the fixture README's: rtol 1e-4 / atol 1e-5 for logits and hidden states, atol 1e-6 for
probabilities; integer outputs exactly.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from draft_service.checkpoint import load_draft_model
from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import sample_block
from scheduler.evaluation.reference_loop import (
    acceptance_probabilities,
    cache_kwargs,
    context_features,
    load_target,
    residual_distribution,
)

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"


def close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference.safetensors"))


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text())


@pytest.fixture(scope="module")
def draft() -> DSparkDraftModel:
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # the fixture's embedding copies equal the target's: no warning allowed
        return load_draft_model(FIXTURE / "draft", target_dir=FIXTURE / "target")


@pytest.fixture(scope="module")
def target():
    return load_target(FIXTURE / "target")


@pytest.fixture(scope="module")
def block(draft, target, ref):
    """Context features of prompt 0, then the block through the slot cache (the serving path)."""
    with torch.no_grad():
        out = target(input_ids=ref["a.prompt_ids"], output_hidden_states=True)
    features = context_features(out.hidden_states, draft.config.target_layer_ids)
    cache = draft.new_context_cache(num_slots=2, max_seq_len=64)
    slot = cache.allocate()
    draft.append_context(cache, [slot], features[0], [0, features.shape[1]])
    anchor = ref["a.draft_input_ids"][:, 0]
    hidden = draft.draft_block(anchor, torch.tensor([features.shape[1]]), [slot], cache)
    return features, anchor, hidden


def test_config_matches_fixture(draft, meta):
    c = draft.config
    assert (c.block_size, c.mask_token_id, list(c.target_layer_ids)) == (
        meta["block_size"],
        meta["mask_token_id"],
        meta["target_layer_ids"],
    )
    assert (c.num_draft_layers, c.num_target_layers, c.markov_rank, c.markov_head_type) == (
        1,
        4,
        32,
        "vanilla",
    )
    assert c.enable_confidence_head and c.confidence_head_with_markov


def test_context_features_and_projection(draft, block, ref):
    features, _, _ = block
    close(features, ref["a.context_features"])
    close(draft.project_context(features), ref["a.projected_context"])


def test_block_hidden_and_base_logits(draft, block, ref):
    features, anchor, hidden = block
    assert ref["a.draft_input_ids"][0, 1:].eq(draft.config.mask_token_id).all()
    close(hidden, ref["a.block_hidden"])
    close(draft.draft_block_uncached(features[0], int(anchor))[None], ref["a.block_hidden"])
    close(draft.base_logits(hidden), ref["a.base_logits"])


def test_teacher_forced_markov_and_confidence(draft, block, ref):
    _, _, hidden = block
    prev = ref["a.teacher_prev_ids"]
    close(draft.markov_logits(draft.base_logits(hidden), prev, hidden), ref["a.markov_logits_teacher"])
    close(draft.confidence_logits(hidden, prev), ref["a.confidence_logits_teacher"])


def test_greedy_sequential_sampling(draft, block, ref, meta):
    _, anchor, hidden = block
    sample = sample_block(draft, hidden, anchor, temperature=0.0, return_logits=True)
    assert (
        sample.tokens.tolist()
        == ref["a.sampled_tokens_greedy"].tolist()
        == [meta["a"]["sampled_tokens_greedy"]]
    )
    close(sample.logits, ref["a.markov_logits_sampled"])
    close(sample.confidence_logits, ref["a.confidence_logits_sampled"])
    assert torch.equal(sample.token_probs, torch.ones(1, draft.block_size))


def test_target_verify_and_t1_acceptance_math(target, ref):
    """Round-0 verification at T = 1: target probs, acceptance probabilities, residual distributions."""
    cache = DynamicCache()
    prompt = ref["a.prompt_ids"]
    verify_ids = ref["a.verify_input_ids"]
    n = prompt.shape[1]
    with torch.no_grad():
        target(input_ids=prompt, position_ids=torch.arange(n)[None], **cache_kwargs(target, cache))
        logits = target(
            input_ids=verify_ids,
            position_ids=torch.arange(n, n + verify_ids.shape[1])[None],
            **cache_kwargs(target, cache),
        ).logits
    close(logits, ref["a.target_verify_logits"])
    target_probs = torch.softmax(logits, dim=-1)
    draft_probs = torch.softmax(ref["a.markov_logits_sampled"], dim=-1)
    close(target_probs, ref["a.t1_target_probs"], rtol=0, atol=1e-6)
    close(draft_probs, ref["a.t1_draft_probs"], rtol=0, atol=1e-6)
    accept = acceptance_probabilities(target_probs, draft_probs, ref["a.sampled_tokens_greedy"])
    close(accept, ref["a.t1_accept_prob"], rtol=0, atol=1e-6)
    close(
        residual_distribution(target_probs[:, :-1], draft_probs),
        ref["a.t1_residual_probs"],
        rtol=0,
        atol=1e-6,
    )


def test_t1_draft_distribution_from_sampler(draft, block, ref):
    """At T = 1 the sampler's own distribution at position 0 (prev = anchor) is softmax(U_0 + B_0)."""
    _, anchor, hidden = block
    sample = sample_block(draft, hidden, anchor, temperature=1.0, generator=torch.Generator().manual_seed(0))
    close(sample.probs[:, 0], ref["a.t1_draft_probs"][:, 0], rtol=0, atol=1e-6)
    assert sample.token_probs[0, 0] == sample.probs[0, 0, sample.tokens[0, 0]]
