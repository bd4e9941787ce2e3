"""Sampled output through the disaggregated data plane follows the target's distribution (T = 1).

Real gRPC drafter and verifier services with the shipped demo pair (a trained drafter: most drafts are accepted,
so the second token is usually a draft that rejection sampling kept) and relayed rounds (policy ``full`` plans every
round's lengths): the drafts travel with their sparse distributions from the drafter to the verifier in the
feature push's reply and are verified there; if a field were lost or misaligned on the way, verification would test
drafts against the wrong distribution and the output would drift from the target's.
Chi-square on the text of the first two tokens (the second is the first one verified), as the colocated
placement's Ray test does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from stats import chi_square_p_value
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.rpc import ServerThread
from cluster.serve_local import DEFAULT_DRAFT, DEFAULT_TARGET
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.remote import DrafterPool, RemoteVerifier
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

PROMPT = "    def keys(self):\n        return list(self."
SAMPLES = 400
SLOTS = 16
TOKEN = "sampling-token"


def _pair_distribution(ids: list[int]) -> dict[tuple[int, int], float]:
    """The target's exact probability of each of its likeliest first two tokens at T = 1 (the rest: ``(-1, -1)``)."""
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32).eval()
    probs: dict[tuple[int, int], float] = {}
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        top1 = torch.topk(first, 6)
        for p1, t1 in zip(top1.values.tolist(), top1.indices.tolist(), strict=True):
            second = torch.softmax(model(torch.tensor([[*ids, t1]])).logits[0, -1].float(), -1)
            top2 = torch.topk(second, 6)
            for p2, t2 in zip(top2.values.tolist(), top2.indices.tolist(), strict=True):
                probs[(t1, t2)] = p1 * p2
    probs[(-1, -1)] = max(0.0, 1.0 - sum(probs.values()))
    return probs


@pytest.fixture(scope="module")
def data_plane() -> Iterator[tuple[SpeculativeEngine, DrafterService]]:
    model = load_draft_model(DEFAULT_DRAFT, target_dir=DEFAULT_TARGET)
    drafter = DrafterService(DraftEngine(model, max_requests=SLOTS, max_seq_len=64))
    target = TargetModel.from_pretrained(DEFAULT_TARGET, feature_layer_ids=model.config.target_layer_ids)
    verifier = VerifierService(VerifyEngine(target, max_requests=SLOTS, max_seq_len=64), token=TOKEN)
    servers = [ServerThread([drafter.service()], token=TOKEN), ServerThread([verifier.service()], token=TOKEN)]
    pool = DrafterPool([servers[0].address], token=TOKEN)
    remote = RemoteVerifier(servers[1].address, pool.route_of, token=TOKEN, relay=True)
    pool.require_projection(remote.context_projection, remote.address)
    # Policy "full": every request's second token is a verified draft (or its correction).
    yield SpeculativeEngine(remote, pool, make_policy("full", None, pool.block_size)), drafter
    pool.close()
    remote.close()
    for server in servers:
        server.stop()


def test_sampled_output_through_relayed_drafts_follows_the_target_distribution(data_plane) -> None:
    engine, drafter = data_plane
    ids = AutoTokenizer.from_pretrained(DEFAULT_TARGET).encode(PROMPT)
    expected = _pair_distribution(ids)
    counts: Counter[tuple[int, int]] = Counter()
    for start in range(0, SAMPLES, SLOTS):
        seeds = range(start, start + SLOTS)
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s) for s in seeds]
        for result in engine.generate([ids] * SLOTS, params):
            pair = (result.token_ids[0], result.token_ids[1])
            counts[pair if pair in expected else (-1, -1)] += 1
    assert drafter.proposals_returned > 0  # the drafts did go to the verifier with its pushes' replies
    pool = engine.draft
    assert isinstance(pool, DrafterPool)
    assert sum(s.messages_sent for lane in pool._lanes for s in lane.streams.values()) == 0  # no Propose at all
    snapshot = engine.snapshot()
    assert snapshot.num_draft_tokens >= SAMPLES and snapshot.num_accepted_tokens > 0  # second tokens verified
    bins = list(expected)
    observed = np.array([counts[b] for b in bins], dtype=np.float64)
    p_value = chi_square_p_value(observed, np.array([expected[b] for b in bins]))
    assert p_value > 1e-3, (p_value, {b: int(counts[b]) for b in bins if counts[b]})
