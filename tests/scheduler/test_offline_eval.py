"""The offline evaluation harness: exact against the reference loop and the target distribution; metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from model_factory import PairSpec, random_draft, write_target
from transformers import Qwen3ForCausalLM

from scheduler.evaluation.decoder import OfflineSpeculativeDecoder, verify_block
from scheduler.evaluation.reference_loop import speculative_generate
from scheduler.evaluation.report import conditional_acceptance, load_prompts, threshold_sweep
from verify_service.target import TargetModel

CHI2_15DF_P001 = 37.70  # chi-square quantile, 15 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    spec = PairSpec(vocab=16, hidden=32, block_size=4, target_layer_ids=(0, 2), seed=3)
    target_dir = write_target(tmp_path_factory.mktemp("eval") / "target", spec)
    hf = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    return spec, hf, random_draft(target_dir, spec)


def test_greedy_harness_matches_reference_loop_round_by_round(pair) -> None:
    """Temperature 0: every request's tokens AND per-round accepted lengths equal the reference loop's."""
    spec, hf, draft = pair
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab - 1, (n,), generator=gen).tolist() for n in (3, 9, 5, 12)]
    decoder = OfflineSpeculativeDecoder(
        TargetModel(hf, spec.target_layer_ids), draft, temperature=0.0, max_batch=3
    )
    traces = decoder.run(prompts, max_new_tokens=20)
    for i, prompt in enumerate(prompts):
        reference = speculative_generate(hf, draft, prompt, max_new_tokens=20)
        assert traces.outputs[i] == reference.new_tokens[:20]
        # the reference loop may run one more round after reaching 20 tokens (then trims); the harness stops
        rounds = [r for r in reference.rounds if r.start - len(prompt) + 1 < 20]
        assert (traces.accepted[traces.request == i] + 1).tolist() == [
            r.accepted_draft_tokens + 1 for r in rounds
        ]
        logits = np.array([r.block_confidence_logits.tolist() for r in rounds])
        np.testing.assert_allclose(traces.confidence_logits[traces.request == i], logits, atol=1e-4)
    assert traces.accepted.max() > 0, "some drafts should be accepted for a meaningful comparison"


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_verify_block_output_follows_the_target_distribution() -> None:
    """First emitted token ~ p_1; second (given the first draft accepted) ~ p_2, whatever the draft."""
    torch.manual_seed(0)
    V, n = 16, 60000
    p = torch.softmax(torch.randn(3, V) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, V) * 1.5, dim=-1)
    drafts = torch.stack([torch.multinomial(q[k], n, replacement=True) for k in range(2)], dim=1)
    accepted, nxt = verify_block(
        p.log().expand(n, 3, V), q.expand(n, 2, V), drafts, 1.0, torch.Generator().manual_seed(1)
    )
    first = torch.where(accepted >= 1, drafts[:, 0], nxt)
    second = torch.where(accepted >= 2, drafts[:, 1], nxt)[accepted >= 1]
    assert _chi2(np.bincount(first.numpy(), minlength=V), p[0].double().numpy()) < CHI2_15DF_P001
    assert _chi2(np.bincount(second.numpy(), minlength=V), p[1].double().numpy()) < CHI2_15DF_P001
    # acceptance of x_1 happens with probability sum_v min(p, q) = 1 - TV
    rate = float((accepted >= 1).double().mean())
    assert rate == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.01)


def test_sampled_harness_is_lossless(pair) -> None:
    """Temperature 1: the 2nd new token (decided by round 1's draft acceptance) has the target's marginal."""
    spec, hf, draft = pair
    prompt = [1, 5, 2, 9, 4]
    n = 4000
    decoder = OfflineSpeculativeDecoder(
        TargetModel(hf, spec.target_layer_ids), draft, temperature=1.0, seed=7
    )
    traces = decoder.run([prompt] * n, max_new_tokens=2)
    second = np.array([o[1] for o in traces.outputs])
    with torch.no_grad():
        first_p = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        rows = torch.tensor([[*prompt, t] for t in range(spec.vocab)])
        marginal = first_p @ torch.softmax(hf(rows).logits[:, -1].double(), -1)
    assert _chi2(np.bincount(second, minlength=spec.vocab), marginal.numpy()) < CHI2_15DF_P001
    assert traces.accepted.mean() > 0.05, "drafts must be accepted sometimes for the check to involve them"


def test_harness_argument_errors(pair) -> None:
    spec, hf, draft = pair
    with pytest.raises(ValueError, match="layers"):
        OfflineSpeculativeDecoder(TargetModel(hf, (0,)), draft)
    decoder = OfflineSpeculativeDecoder(TargetModel(hf, spec.target_layer_ids), draft, block=2)
    with pytest.raises(ValueError, match="exceed"):
        decoder.run([[1] * 600], max_new_tokens=8)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.run([[]], max_new_tokens=8)
    with pytest.raises(ValueError, match="block"):
        OfflineSpeculativeDecoder(TargetModel(hf, spec.target_layer_ids), draft, block=9)
    traces = decoder.run([[1, 2, 3]], max_new_tokens=6)
    assert traces.confidence_logits.shape[1] == 2 and traces.accepted.max() <= 2


def test_metrics_on_hand_made_traces() -> None:
    accepted = np.array([0, 1, 2, 2, 3])
    assert conditional_acceptance(accepted, 3).tolist() == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    logits = np.log(
        np.array([[0.9, 0.8, 0.2], [0.9, 0.1, 0.9], [0.3, 0.9, 0.9], [0.9, 0.9, 0.9], [0.9, 0.9, 0.9]])
    )
    logits = logits - np.log1p(-np.exp(logits))  # logit of those confidences
    sweep = threshold_sweep(logits, accepted, [0.0, 0.5])
    assert sweep["verified"] == pytest.approx([3.0, (2 + 1 + 0 + 3 + 3) / 5])
    kept = np.minimum(accepted, [2, 1, 0, 3, 3])  # cut at the first confidence < 0.5
    assert sweep["acceptance_rate"][1] == pytest.approx(kept.sum() / 9)
    assert sweep["tau"] == pytest.approx([accepted.mean() + 1, kept.mean() + 1])


def test_load_prompts_uses_the_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("models/demo/tokenizer")
    path = tmp_path / "p.jsonl"
    long_turn = "a = [1, 2, 3]\n" * 20
    path.write_text(
        json.dumps({"turns": ["def f(x):\n", "ignored"]}) + "\n\n" + json.dumps({"turns": [long_turn]}) + "\n"
    )
    prompts, truncated = load_prompts(path, tokenizer, max_prompts=0, max_tokens=12)
    assert tokenizer.decode(prompts[0]) == "def f(x):\n" and truncated == 1 and len(prompts[1]) == 12
    assert tokenizer.decode(prompts[1]) == tokenizer.decode(tokenizer(long_turn)["input_ids"][-12:])
    assert len(load_prompts(path, tokenizer, max_prompts=1, max_tokens=100)[0]) == 1
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1"):
        load_prompts(path, tokenizer, 0, 100)
