"""The in-process speculative engine: exactness under continuous batching, stop conditions, aborts, bad input."""

from __future__ import annotations

import json
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
from scheduler.engine import FinishReason, RequestRejectedError, SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
POLICIES = ["full", "fixed-1", "dspark", "dspark-async", "autoregressive"]


def _sps() -> SPSTable:
    # A made-up but realistic shape: flat while launch-bound, then falling with the batch.
    sizes = [1, 8, 16, 32, 64, 128, 256]
    return SPSTable(sizes, [1000, 990, 960, 900, 700, 450, 250])


def _engines(target_dir: Path, draft_dir: Path, policy: str, max_requests: int = 8, max_seq_len: int = 160):
    draft_model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=draft_model.config.target_layer_ids)
    verify = VerifyEngine(target, max_requests=max_requests, max_seq_len=max_seq_len)
    draft = DraftEngine(draft_model, max_requests=max_requests, max_seq_len=max_seq_len)
    return SpeculativeEngine(verify, draft, make_policy(policy, _sps(), draft_model.block_size)), target


@pytest.fixture(scope="module")
def fixture_reference() -> dict:
    return json.loads((FIXTURE / "reference.json").read_text())


@pytest.mark.parametrize("policy", POLICIES)
def test_fixture_greedy_equals_target_greedy(policy: str, fixture_reference: dict) -> None:
    engine, _ = _engines(FIXTURE / "target", FIXTURE / "draft", policy)
    prompts = fixture_reference["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=fixture_reference["max_new_tokens"])
    results = engine.generate(prompts, params)
    for i, res in enumerate(results):
        assert res.token_ids == fixture_reference["b"]["target_greedy_new_tokens"][i], (policy, i)
        assert res.finish_reason is FinishReason.LENGTH
    snap = engine.snapshot()
    if policy == "full":
        # The whole block is verified every round except where max_tokens caps it.
        assert snap.num_draft_tokens > 0 and snap.tau > 1.0
    if policy == "autoregressive":
        assert snap.num_draft_tokens == 0


def test_fixture_full_policy_matches_reference_acceptance(fixture_reference: dict) -> None:
    """Same drafts, same verification: per-round acceptance equals DeepSpec's greedy run."""
    engine, _ = _engines(FIXTURE / "target", FIXTURE / "draft", "full")
    prompt = fixture_reference["prompts"][0]
    results = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48))
    expected = fixture_reference["b"]["runs"]["greedy"]["per_prompt"][0]["acceptance_lengths"]
    got = [a + 1 for a in results[0].metrics.accepted]
    # The engine caps the last rounds at max_tokens; every round before that matches exactly.
    assert got[: len(expected) - 1] == expected[: len(expected) - 1]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    spec = PairSpec(vocab=128, hidden=32, block_size=5, markov_rank=8, target_layer_ids=(-1, 1, 2), seed=3)
    return write_pair(root, spec)


def test_continuous_batching_greedy_32_requests(random_pair: tuple[Path, Path]) -> None:
    target_dir, draft_dir = random_pair
    engine, target = _engines(target_dir, draft_dir, "dspark", max_requests=12, max_seq_len=96)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 127, size=int(rng.integers(1, 30))).tolist() for _ in range(32)]
    max_tokens = [int(rng.integers(1, 40)) for _ in range(32)]
    ids: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    pending = list(range(32))
    rounds = 0
    while pending or engine.has_unfinished():
        # Requests join at different rounds: a few per round.
        for _ in range(min(3, len(pending))):
            i = pending.pop(0)
            rid = engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i]))
            ids[rid] = i
            outputs[rid] = []
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
        rounds += 1
        assert engine.num_running <= 12
    expected = target.generate(prompts, max_new_tokens=max(max_tokens))
    for rid, i in ids.items():
        assert outputs[rid] == expected[i][: max_tokens[i]], i
    assert engine.verify.num_free_slots == 12 and engine.draft.num_free_slots == 12
    assert engine.snapshot().num_accepted_tokens > 0


def test_stop_tokens_and_strings_do_not_leak(random_pair: tuple[Path, Path]) -> None:
    target_dir, draft_dir = random_pair
    engine, target = _engines(target_dir, draft_dir, "full")
    prompt = [5, 17, 33, 2, 90]
    reference = target.generate([prompt], max_new_tokens=30)[0]
    stop_token = reference[7]
    first = reference.index(stop_token)
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_token,)))[0]
    assert res.token_ids == reference[: first + 1] and res.finish_reason is FinishReason.STOP

    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("A") + t % 26) for t in ids)

    engine.decode = decode
    full_text = decode(reference)
    stop = full_text[10:13]
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop=(stop,)))[0]
    assert res.finish_reason is FinishReason.STOP
    assert res.text == full_text[: full_text.index(stop)]
    assert stop not in res.text


def test_abort_frees_both_engines_and_others_continue(random_pair: tuple[Path, Path]) -> None:
    target_dir, draft_dir = random_pair
    engine, target = _engines(target_dir, draft_dir, "dspark", max_requests=4)
    keep = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
    drop = engine.add_request([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=20))
    got: list[int] = []
    for _ in range(2):
        got += [t for o in engine.step() if o.req_id == keep for t in o.new_token_ids]
    assert engine.abort(drop)
    assert not engine.verify.has(drop) and not engine.draft.has(drop)
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.req_id == keep for t in o.new_token_ids]
    assert got == target.generate([[1, 2, 3]], max_new_tokens=20)[0]
    assert engine.verify.num_free_slots == 4


def test_more_requests_than_kv_slots_wait_and_complete(random_pair: tuple[Path, Path]) -> None:
    target_dir, draft_dir = random_pair
    engine, target = _engines(target_dir, draft_dir, "dspark", max_requests=2)
    prompts = [[i + 1, i + 2] for i in range(5)]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [r.token_ids for r in results] == target.generate(prompts, max_new_tokens=6)


def test_first_token_split_and_joins_are_counted(random_pair: tuple[Path, Path]) -> None:
    """The round driver's split of the time to first token adds up over the requests whose first token came from
    their prefill (arrival to admission, admission to first token), and every target pass is counted once:
    ``rounds`` (they verify) or ``prefill_only_rounds``; a continuation joins but samples no first token. The
    counting changes no token: the outputs are the target's own greedy ones."""
    target_dir, draft_dir = random_pair
    engine, target = _engines(target_dir, draft_dir, "dspark", max_requests=2)
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6 + i)) for i, p in enumerate(prompts)]
    reference = target.generate([*prompts, prompts[0]], max_new_tokens=12)
    ids.append(engine.add_request([*prompts[0], *reference[-1][:2]], SamplingParams(temperature=0.0, max_tokens=4),
                                  emitted=2))
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    finished = {}
    passes = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id] += out.new_token_ids
            if out.finished:
                finished[out.req_id] = out.metrics
        passes += 1
    assert [outputs[rid] for rid in ids[:5]] == [reference[i][: 6 + i] for i in range(5)]
    assert outputs[ids[5]] == reference[-1][2:6]
    snap = engine.snapshot()
    fresh = [finished[rid] for rid in ids[:5]]
    assert snap.first_tokens == 5 and snap.joined_prompts == 6
    assert snap.rounds + snap.prefill_only_rounds == passes and snap.prefill_only_rounds >= 1
    # Rounds of prompts joining running requests, none planned (no chained rounds here), and their wall time
    # within all rounds'.
    wall_s = snap.round_draft_time_s + snap.round_verify_time_s + snap.schedule_time_s + snap.host_time_s
    assert 1 <= snap.joined_rounds <= snap.rounds and snap.planned_rounds == snap.planned_round_time_s == 0
    assert 0 < snap.joined_round_time_s <= wall_s + 1e-9
    assert snap.queue_time_s == pytest.approx(sum(m.admission_time - m.arrival_time for m in fresh))
    assert snap.admission_to_first_token_s == pytest.approx(sum(m.first_token_time - m.admission_time for m in fresh))
    assert all(m.arrival_time <= m.admission_time <= m.first_token_time for m in fresh)
    # Two slots: the later requests waited for earlier ones to finish.
    assert fresh[4].admission_time >= min(m.finish_time for m in fresh[:2])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "empty"), ([1, 2, 10_000], "vocabulary"), (list(range(100)) * 2, "at most")],
)
def test_bad_requests_are_rejected_before_queueing(random_pair: tuple[Path, Path], prompt: list[int],
                                                   message: str) -> None:
    target_dir, draft_dir = random_pair
    engine, _ = _engines(target_dir, draft_dir, "dspark")
    with pytest.raises(RequestRejectedError, match=message):
        engine.add_request(prompt, SamplingParams(temperature=0.0))
    assert not engine.has_unfinished()


def test_sampled_output_is_reproducible_with_a_seed(random_pair: tuple[Path, Path]) -> None:
    target_dir, draft_dir = random_pair
    engine, _ = _engines(target_dir, draft_dir, "dspark")
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=7)
    alone = engine.generate([[3, 4, 5]], params)[0].token_ids
    # The same request in a batch with others gives the same tokens (randomness keyed by seed and position).
    batch = engine.generate([[9, 9], [3, 4, 5], [1]], [SamplingParams(temperature=1.0, max_tokens=12, seed=1),
                                                        params, SamplingParams(temperature=0.5, max_tokens=5)])
    assert batch[1].token_ids == alone


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target's sampling distribution (temperature, then top-k, then top-p over the renormalised rest)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    spec = PairSpec(vocab=24, hidden=32, block_size=4, markov_rank=8, target_layer_ids=(0, 2), seed=11)
    return write_pair(tmp_path_factory.mktemp("small"), spec)


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.8, 6, 0.9)])
def test_sampled_tokens_follow_the_target_distribution(
    small_vocab_pair: tuple[Path, Path], temperature: float, top_k: int, top_p: float
) -> None:
    """Marginals of the 2nd and 3rd generated tokens (decided by rejection sampling) match the target's exactly
    computed marginals (chi-square over 4000 seeded requests)."""
    target_dir, draft_dir = small_vocab_pair
    engine, target = _engines(target_dir, draft_dir, "full", max_requests=256, max_seq_len=32)
    prompt = [3, 14, 15, 9, 2]
    n = 4000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, seed=i)
              for i in range(n)]
    results = engine.generate([prompt] * n, params)
    assert engine.snapshot().num_accepted_tokens > 0  # drafts were accepted, not only corrected
    tokens = np.array([r.token_ids for r in results])

    hf = Qwen3ForCausalLM.from_pretrained(target_dir, local_files_only=True)  # the reference, not our loader
    vocab = target.vocab_size
    with torch.no_grad():
        p1 = _filtered_probs(hf(torch.tensor([prompt])).logits[0, -1], temperature, top_k, top_p)
        seq2 = torch.tensor([[*prompt, a] for a in range(vocab)])
        p2 = _filtered_probs(hf(seq2).logits[:, -1], temperature, top_k, top_p)  # [t1, t2]
        seq3 = torch.tensor([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
        p3 = _filtered_probs(hf(seq3).logits[:, -1], temperature, top_k, top_p).view(vocab, vocab, vocab)
    marginal2 = (p1[:, None] * p2).sum(0).numpy()
    marginal3 = (p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1)).numpy()
    assert chi_square_p_value(np.bincount(tokens[:, 0], minlength=vocab), p1.numpy()) > 1e-3
    assert chi_square_p_value(np.bincount(tokens[:, 1], minlength=vocab), marginal2) > 1e-3
    assert chi_square_p_value(np.bincount(tokens[:, 2], minlength=vocab), marginal3) > 1e-3


def test_a_continuation_resumes_a_cut_request_with_no_token_or_text_twice(random_pair: tuple[Path, Path]) -> None:
    """A request cut after some rounds (its scheduler lost) and submitted again as a continuation (prompt + the
    tokens streamed, ``emitted`` = their count, ``emitted_chars`` = the text the client got, ``max_tokens`` less
    them) streams exactly the rest of the uncut output: tokens, text across a stop string that spans the seam,
    and usage as for the original request."""
    target_dir, draft_dir = random_pair
    engine, target = _engines(target_dir, draft_dir, "dspark")
    prompt = [5, 17, 33, 2, 90]
    reference = target.generate([prompt], max_new_tokens=40)[0]

    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("A") + t % 26) for t in ids)

    engine.decode = decode
    full_text = decode(reference)
    stop = full_text[14:18]
    start = full_text.index(stop)
    want_text = full_text[:start]
    seams = set()
    # Cut before the stop string, and inside it (its start held back from the client).
    for at in (1, start + 1, start + 2, start + 3):
        params = SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,))
        cut = engine.add_request(prompt, params, req_id=f"cut-{at}")
        tokens, text = [], ""
        while len(tokens) < at:
            for out in engine.step():
                tokens += out.new_token_ids
                text += out.new_text
                assert not out.finished
        engine.abort(cut)  # the scheduler died with it
        assert tokens == reference[: len(tokens)] and want_text.startswith(text)
        seams.add(len(tokens) - len(text))
        rest = SamplingParams(temperature=0.0, max_tokens=40 - len(tokens), stop=(stop,))
        engine.add_request([*prompt, *tokens], rest, f"continued-{at}", emitted=len(tokens),
                           emitted_chars=len(text))
        new_tokens, new_text, last = [], "", None
        while engine.has_unfinished():
            for out in engine.step():
                new_tokens += out.new_token_ids
                new_text += out.new_text
                last = out
        assert last is not None and last.finished and last.finish_reason is FinishReason.STOP
        assert tokens + new_tokens == reference[: len(tokens) + len(new_tokens)]
        assert text + new_text == want_text
        assert (last.num_prompt_tokens, last.num_output_tokens) == (len(prompt), len(tokens) + len(new_tokens))
    assert seams > {0}, "no cut fell inside the stop string"
    assert engine.verify.num_free_slots == 8 and engine.draft.num_free_slots == 8
    with pytest.raises(RequestRejectedError, match="emitted"):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4), emitted=len(prompt))
