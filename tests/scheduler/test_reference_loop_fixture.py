"""The reference speculative decoding loop reproduces DeepSpec's decoding runs on deepspec_tiny_a exactly.

Every run and prompt of reference.json: output tokens, acceptance / proposal / accepted-draft lengths, and
every round's bookkeeping (start, draft cache length, proposal, next token); per-round block hidden states and
confidence logits within the fixture README's tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draft_service.checkpoint import load_draft_model
from scheduler.evaluation.reference_loop import load_target, speculative_generate, target_greedy

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
META = json.loads((FIXTURE / "reference.json").read_text())
CASES = [
    (run, entry["prompt_index"]) for run, spec in META["b"]["runs"].items() for entry in spec["per_prompt"]
]


@pytest.fixture(scope="module")
def models():
    return load_target(FIXTURE / "target"), load_draft_model(FIXTURE / "draft", target_dir=FIXTURE / "target")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference.safetensors"))


@pytest.mark.parametrize(("run", "prompt_index"), CASES, ids=[f"{r}-p{i}" for r, i in CASES])
def test_decoding_run_matches_deepspec(models, ref, run, prompt_index):
    target, draft = models
    spec = META["b"]["runs"][run]
    expected = next(e for e in spec["per_prompt"] if e["prompt_index"] == prompt_index)
    result = speculative_generate(
        target,
        draft,
        META["prompts"][prompt_index],
        max_new_tokens=META["max_new_tokens"],
        confidence_threshold=spec["confidence_threshold"],
        stop_token_ids=spec["stop_token_ids"],
    )
    assert result.new_tokens == expected["output_new_tokens"]
    assert len(result.new_tokens) == expected["num_output_tokens"]
    assert result.acceptance_lengths == expected["acceptance_lengths"]
    assert result.proposal_lengths == expected["proposal_lengths"]
    assert result.accepted_draft_lengths == expected["accepted_draft_lengths"]
    assert result.verify_count == expected["verify_count"]
    greedy = ref[f"b.prompt{prompt_index}_greedy_new_tokens"].tolist()
    assert result.new_tokens == greedy[: len(result.new_tokens)]  # lossless (cut after the stop token)

    for ours, theirs in zip(result.rounds, expected["rounds"], strict=True):
        for key in (
            "start",
            "draft_cache_len_before",
            "new_context_len",
            "anchor_token",
            "proposed_tokens",
            "accepted_draft_tokens",
            "effective_proposal_length",
            "next_token",
            "terminated_by_stop_token",
        ):
            assert getattr(ours, key) == theirs[key], key
        if theirs["confidence_logits"] is None:
            assert ours.confidence_logits is None
        else:
            torch.testing.assert_close(
                torch.tensor(ours.confidence_logits),
                torch.tensor(theirs["confidence_logits"]),
                rtol=1e-4,
                atol=1e-5,
            )
    if run == "greedy":
        hidden = torch.stack([r.block_hidden for r in result.rounds])
        confidence = torch.stack([r.block_confidence_logits for r in result.rounds])
        torch.testing.assert_close(
            hidden, ref[f"b.greedy.prompt{prompt_index}_block_hidden"], rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            confidence, ref[f"b.greedy.prompt{prompt_index}_confidence_logits"], rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("prompt_index", range(len(META["prompts"])))
def test_target_greedy_matches_fixture(models, ref, prompt_index):
    target, _ = models
    tokens = target_greedy(target, META["prompts"][prompt_index], META["max_new_tokens"])
    assert (
        tokens
        == ref[f"b.prompt{prompt_index}_greedy_new_tokens"].tolist()
        == META["b"]["target_greedy_new_tokens"][prompt_index]
    )
