"""The round driver with skip-the-draft: exact output while the gate flips between drafted and plain rounds."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from model_factory import PairSpec, write_pair
from stats import chi_square_p_value
from transformers import Qwen3ForCausalLM

from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from kernels.sampling import SamplingParams
from scheduler.algorithm import DraftCost
from scheduler.draft_gate import DraftGate
from scheduler.engine import SpeculativeEngine
from scheduler.policy import DSparkAsync, DSparkScheduled, make_policy
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel


def _sps() -> SPSTable:
    sizes = [1, 8, 16, 32, 64, 128, 256]
    return SPSTable(sizes, [1000, 990, 960, 900, 700, 450, 250])


class _RecordingGate(DraftGate):
    """A DraftGate that records (running requests, decision) per round for the assertions."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.log: list[tuple[int, bool]] = []

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        decision = super().should_draft(max_lengths)
        self.log.append((len(max_lengths), decision))
        return decision


def _engine(pair: tuple[Path, Path], policy: str, gate: DraftGate, max_requests: int, max_seq_len: int):
    target_dir, draft_dir = pair
    draft_model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=draft_model.config.target_layer_ids)
    verify = VerifyEngine(target, max_requests=max_requests, max_seq_len=max_seq_len)
    draft = DraftEngine(draft_model, max_requests=max_requests, max_seq_len=max_seq_len)
    cost = gate.draft_cost
    scheduled = DSparkScheduled(_sps(), cost, gate) if policy == "dspark" else DSparkAsync(_sps(), 2, cost, gate)
    return SpeculativeEngine(verify, draft, scheduled), target


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    spec = PairSpec(vocab=128, hidden=32, block_size=5, markov_rank=8, target_layer_ids=(-1, 1, 2), seed=3)
    return write_pair(tmp_path_factory.mktemp("pair"), spec)


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_greedy_equals_target_while_the_gate_flips_with_load(random_pair: tuple[Path, Path], policy: str) -> None:
    """Requests join 3 a round and finish at different rounds, so the load rises and falls; with a draft cost
    growing per request the gate drafts at low load and skips at high load (and probes while skipping)."""
    gate = _RecordingGate(_sps(), DraftCost(per_request_s=0.4e-3), DraftCost(), probe_interval=4)
    engine, target = _engine(random_pair, policy, gate, max_requests=12, max_seq_len=96)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 127, size=int(rng.integers(1, 30))).tolist() for _ in range(32)]
    max_tokens = [int(rng.integers(1, 40)) for _ in range(32)]
    ids: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    pending = list(range(32))
    while pending or engine.has_unfinished():
        for _ in range(min(3, len(pending))):
            i = pending.pop(0)
            rid = engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i]))
            ids[rid] = i
            outputs[rid] = []
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
    expected = target.generate(prompts, max_new_tokens=max(max_tokens))
    for rid, i in ids.items():
        assert outputs[rid] == expected[i][: max_tokens[i]], i
    assert engine.verify.num_free_slots == 12 and engine.draft.num_free_slots == 12
    # Both kinds of round happened, and the decision flipped more than once in each direction.
    decisions = [d for _, d in gate.log]
    flips = sum(a != b for a, b in itertools.pairwise(decisions))
    assert gate.skipped > 0 and gate.skipped < gate.decisions and flips >= 4, gate.log
    # Low load drafted, high load skipped (outside probes).
    assert any(d for r, d in gate.log if r <= 3) and any(not d for r, d in gate.log if r >= 10), gate.log
    snapshot = engine.snapshot()
    assert snapshot.num_accepted_tokens > 0
    # Every skip is a round without draft (/metrics: dspark_rounds_without_draft); prefill-only steps aren't rounds.
    assert snapshot.rounds_without_draft == gate.skipped


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    spec = PairSpec(vocab=24, hidden=32, block_size=4, markov_rank=8, target_layer_ids=(0, 2), seed=11)
    return write_pair(tmp_path_factory.mktemp("small"), spec)


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution_with_skipped_rounds(
    small_vocab_pair: tuple[Path, Path],
) -> None:
    """Marginals of the 2nd and 3rd generated tokens match the target's exactly computed marginals (chi-square
    over 4000 seeded requests) when every other round skips the drafter (an expensive draft, probe every 2nd
    round), so tokens come from both kinds of round."""
    gate = _RecordingGate(_sps(), DraftCost(fixed_s=1.0), DraftCost(), probe_interval=2)
    engine, target = _engine(small_vocab_pair, "dspark", gate, max_requests=256, max_seq_len=32)
    prompt = [3, 14, 15, 9, 2]
    n = 4000
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i) for i in range(n)]
    results = engine.generate([prompt] * n, params)
    assert 0 < gate.skipped < gate.decisions
    assert engine.snapshot().num_accepted_tokens > 0
    tokens = np.array([r.token_ids for r in results])
    hf = Qwen3ForCausalLM.from_pretrained(small_vocab_pair[0], local_files_only=True)  # the reference
    vocab = target.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.softmax(hf(torch.tensor([[*prompt, a] for a in range(vocab)])).logits[:, -1].double(), -1)
        seq3 = torch.tensor([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
        p3 = torch.softmax(hf(seq3).logits[:, -1].double(), -1).view(vocab, vocab, vocab)
    marginal2 = (p1[:, None] * p2).sum(0).numpy()
    marginal3 = (p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1)).numpy()
    assert chi_square_p_value(np.bincount(tokens[:, 0], minlength=vocab), p1.numpy()) > 1e-3
    assert chi_square_p_value(np.bincount(tokens[:, 1], minlength=vocab), marginal2) > 1e-3
    assert chi_square_p_value(np.bincount(tokens[:, 2], minlength=vocab), marginal3) > 1e-3


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_greedy_equals_target_with_the_measured_draft_cost(random_pair: tuple[Path, Path], policy: str) -> None:
    """``draft_cost="measured"``: the engine feeds every round's real timings to the policy's estimator, whose
    cost then steers Algorithm 1 and the gate (a fast SPS table makes the CPU draft relatively expensive, so
    rounds may skip); whatever it decides, greedy output is the target's."""
    target_dir, draft_dir = random_pair
    draft_model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=draft_model.config.target_layer_ids)
    verify = VerifyEngine(target, max_requests=12, max_seq_len=96)
    draft = DraftEngine(draft_model, max_requests=12, max_seq_len=96)
    fast = SPSTable([1, 8, 16, 32, 64, 128, 256], [1e5, 9.9e4, 9.6e4, 9e4, 7e4, 4.5e4, 2.5e4])
    scheduled = make_policy(policy, fast, draft.block_size, draft_cost="measured")
    engine = SpeculativeEngine(verify, draft, scheduled)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 127, size=int(rng.integers(1, 30))).tolist() for _ in range(24)]
    max_tokens = [int(rng.integers(1, 40)) for _ in range(24)]
    results = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens])
    expected = target.generate(prompts, max_new_tokens=max(max_tokens))
    for i, result in enumerate(results):
        assert result.token_ids == expected[i][: max_tokens[i]], i
    assert scheduled.gate.decisions > 0
    assert scheduled._cost.estimator.draft_cost is not None  # the engine's timings warmed it up
