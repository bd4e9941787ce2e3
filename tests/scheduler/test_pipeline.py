"""Pipelined request groups: one group verified while the next drafts, decoding unchanged.

In process (draft and verify engines on two threads) and over real gRPC drafter / verifier servers. Greedy output
must equal the target's own greedy output; with the ``full`` policy (lengths independent of the batch) a sampled
request with a seed must give exactly the tokens it gives in the plain engine.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from model_factory import PairSpec, write_pair

from cluster.rpc import ServerThread
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.pipeline import PipelinedEngine
from scheduler.policy import make_policy
from scheduler.remote import DrafterPool, RemoteVerifier
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SPS = SPSTable([1, 8, 16, 32, 64], [1000, 990, 960, 900, 700])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    spec = PairSpec(vocab=128, hidden=32, block_size=5, markov_rank=8, target_layer_ids=(-1, 1, 2), seed=11)
    return write_pair(tmp_path_factory.mktemp("pipeline"), spec)


def _local(pair: tuple[Path, Path], policy: str, groups: int, max_requests: int = 12, max_seq_len: int = 96):
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    verify = VerifyEngine(target, max_requests=max_requests, max_seq_len=max_seq_len)
    draft = DraftEngine(model, max_requests=max_requests, max_seq_len=max_seq_len)
    policy_ = make_policy(policy, SPS, model.block_size)
    if groups == 1:
        return SpeculativeEngine(verify, draft, policy_), target
    return PipelinedEngine(verify, draft, policy_, groups=groups), target


@pytest.mark.parametrize("groups", [2, 3])
def test_pipelined_greedy_32_requests_joining_at_different_ticks(pair: tuple[Path, Path], groups: int) -> None:
    engine, target = _local(pair, "dspark", groups)
    rng = np.random.default_rng(groups)
    prompts = [rng.integers(0, 127, size=int(rng.integers(1, 30))).tolist() for _ in range(32)]
    max_tokens = [int(rng.integers(1, 40)) for _ in range(32)]
    outputs: dict[str, list[int]] = {}
    index: dict[str, int] = {}
    waiting = list(range(32))
    while waiting or engine.has_unfinished():
        for _ in range(min(3, len(waiting))):
            i = waiting.pop(0)
            rid = engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i]))
            index[rid], outputs[rid] = i, []
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
        assert engine.num_running <= 12
    expected = target.generate(prompts, max_new_tokens=max(max_tokens))
    for rid, i in index.items():
        assert outputs[rid] == expected[i][: max_tokens[i]], i
    assert engine.verify.num_free_slots == 12 and engine.draft.num_free_slots == 12
    assert engine.blocks_ahead > 0  # groups really overlapped
    assert engine.snapshot().num_accepted_tokens > 0
    engine.close()


def test_pipelined_sampling_with_seeds_equals_the_plain_engine(pair: tuple[Path, Path]) -> None:
    prompts = [[3, 4, 5], [9, 9], [1], [7, 8, 9, 10], [2, 2, 2], [5]]
    params = [
        SamplingParams(temperature=1.0, top_k=20, max_tokens=14, seed=7),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, seed=1),
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=1.0, max_tokens=16, seed=3),
        SamplingParams(temperature=1.2, top_k=5, max_tokens=9, seed=11),
        SamplingParams(temperature=1.0, max_tokens=13, seed=5),
    ]
    plain, _ = _local(pair, "full", 1)
    pipelined, _ = _local(pair, "full", 2)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    assert [r.token_ids for r in pipelined.generate(prompts, params)] == expected
    assert pipelined.blocks_ahead > 0
    pipelined.close()


def test_abort_with_a_block_in_flight_frees_the_request(pair: tuple[Path, Path]) -> None:
    engine, target = _local(pair, "full", 2, max_requests=4)
    keep = [engine.add_request([1, 2, 3 + i], SamplingParams(temperature=0.0, max_tokens=20)) for i in range(3)]
    drop = engine.add_request([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=20))
    got: dict[str, list[int]] = {rid: [] for rid in keep}
    for _ in range(3):
        for out in engine.step():
            if out.req_id in got:
                got[out.req_id].extend(out.new_token_ids)
    assert engine._pending  # a block is being drafted for the next group
    assert engine.abort(drop)
    assert not engine.verify.has(drop) and not engine.draft.has(drop)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.req_id].extend(out.new_token_ids)
    expected = target.generate([[1, 2, 3 + i] for i in range(3)], max_new_tokens=20)
    assert [got[rid] for rid in keep] == expected
    assert engine.verify.num_free_slots == 4 and engine.draft.num_free_slots == 4
    engine.close()


def test_pipelined_round_driver_over_grpc_matches_target_greedy(pair: tuple[Path, Path]) -> None:
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    drafter = DrafterService(DraftEngine(model, max_requests=8, max_seq_len=96))
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    verifier = VerifierService(VerifyEngine(target, max_requests=8, max_seq_len=96))
    servers = [ServerThread([drafter.service()]), ServerThread([verifier.service()])]
    pool = DrafterPool([servers[0].address])
    remote = RemoteVerifier(servers[1].address, pool.route_of)
    engine = PipelinedEngine(remote, pool, make_policy("dspark", SPS, pool.block_size), groups=2)
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17], [18], [19, 20, 21]]
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
        assert [r.token_ids for r in results] == target.generate(prompts, max_new_tokens=16)
        assert engine.blocks_ahead > 0
        assert drafter.engine.num_free_slots == 8 and verifier.engine.num_free_slots == 8
    finally:
        engine.close()
        pool.close()
        remote.close()
        for server in servers:
            server.stop()


def test_one_group_is_refused(pair: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        _local(pair, "dspark", 0)


def test_served_scheduler_with_request_groups_is_lossless_and_frees_aborted(pair: tuple[Path, Path]) -> None:
    """``scheduler.request_groups: 2`` as a deployment runs it: the hub's round loop over gRPC replicas."""
    import asyncio

    from scheduler.hub import SchedulerHub

    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    drafter = DrafterService(DraftEngine(model, max_requests=8, max_seq_len=128))
    verifier = VerifierService(VerifyEngine(target, max_requests=8, max_seq_len=128))
    servers = [ServerThread([drafter.service()]), ServerThread([verifier.service()])]
    hub = SchedulerHub(model_name="tiny", policy="dspark", request_groups=2, decode=None)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        hub.register_drafter("d0", servers[0].address)
        hub.register_verifier("v0", servers[1].address, SPS.to_dict())
        engine = hub._groups["v0"].backend.engine
        assert isinstance(engine, PipelinedEngine)
        prompts = [[1 + i, 2 * i + 3, 7, 11 + i] for i in range(6)]

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for delta in hub.generate(f"r{i}", prompts[i], greedy):
                tokens.extend(delta.token_ids)
            return tokens

        async def aborted() -> int:
            """A client that goes away after a few tokens: closing the stream aborts the request."""
            seen = 0
            stream = hub.generate("gone", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=100))
            async for delta in stream:
                seen += len(delta.token_ids)
                if seen >= 3:
                    break
            await stream.aclose()
            return seen

        async def run_all() -> tuple[list[list[int]], int]:
            *got, seen = await asyncio.gather(*(one(i) for i in range(len(prompts))), aborted())
            return list(got), seen

        got, seen = asyncio.run(run_all())
        expected = target.generate(prompts, max_new_tokens=greedy.max_tokens)
        assert got == [e[: greedy.max_tokens] for e in expected]
        assert 3 <= seen < 100
        assert engine.blocks_ahead > 0
        # The abort is queued on the round loop when the stream closes: wait for it to reach both replicas.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (verifier.engine.num_free_slots, drafter.engine.num_free_slots) != (8, 8):
            time.sleep(0.05)
        assert verifier.engine.num_free_slots == 8 and drafter.engine.num_free_slots == 8
    finally:
        hub.close()
        for server in servers:
            server.stop()


def test_request_groups_setting_is_checked() -> None:
    from pydantic import ValidationError

    from cluster.config import AppConfig

    assert AppConfig.from_args({"scheduler": {"request_groups": 2}}).scheduler.request_groups == 2
    assert AppConfig.from_args({}).scheduler.request_groups == 1
    for bad in (0, 9, "two"):
        with pytest.raises(ValidationError, match="request_groups"):
            AppConfig.from_args({"scheduler": {"request_groups": bad}})


def test_pipelined_over_bucketed_engines_equals_target_greedy(pair: tuple[Path, Path]) -> None:
    """The graph-mode engines on static buffers (the CPU stand-in for captured graphs): the verify step hands
    its committed features out as a view of its output and the drafter's static outputs are overwritten by
    the next propose, so this checks that the pipelined tick consumes both before the buffers are reused."""
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    buckets = (1, 2, 4, 8)
    verify = VerifyEngine(target, 8, 96, graphs="static", max_drafts=model.block_size, graph_buckets=buckets)
    draft = DraftEngine(model, 8, 96, graphs="static", graph_buckets=buckets)
    engine = PipelinedEngine(verify, draft, make_policy("dspark", SPS, model.block_size), groups=2)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 127, size=int(rng.integers(2, 20))).tolist() for _ in range(12)]
    try:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
        assert [r.token_ids for r in results] == target.generate(prompts, max_new_tokens=20)
        assert engine.blocks_ahead > 0
        assert verify.graphs is not None and verify.graphs.replays > 0  # the bucketed path really ran
    finally:
        engine.close()


@pytest.mark.parametrize("policy", ["dspark-async", "fixed-2"])
def test_each_group_has_its_own_policy_state(pair: tuple[Path, Path], policy: str) -> None:
    """dspark-async plans a later round's capacity from this one: with groups, that plan must stay the group's."""
    engine, target = _local(pair, policy, 2)
    assert len(engine.policies) == 2 and engine.policies[0] is not engine.policies[1]
    prompts = [[1 + i, 2 + i, 3] for i in range(8)]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=18))
    assert [r.token_ids for r in results] == target.generate(prompts, max_new_tokens=18)
    engine.close()
