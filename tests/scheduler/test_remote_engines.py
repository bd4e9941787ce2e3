"""The round driver over real gRPC servers: drafter and verifier services on loopback, features pushed directly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hub_client import generate_all
from model_factory import PairSpec, write_pair

from cluster.rpc import ServerThread, SyncRpcClient
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.hub import SchedulerHub
from scheduler.policy import make_policy
from scheduler.remote import DrafterPool, RemoteVerifier
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("rpc"), PairSpec(vocab=128, block_size=5, seed=5))


@pytest.fixture
def services(pair: tuple[Path, Path]):
    target_dir, draft_dir = pair
    drafters = []
    for _ in range(2):
        model = load_draft_model(draft_dir, target_dir=target_dir)
        drafters.append(DrafterService(DraftEngine(model, max_requests=4, max_seq_len=96)))
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    verifier = VerifierService(VerifyEngine(target, max_requests=8, max_seq_len=96))
    servers = [ServerThread([d.service()]) for d in drafters] + [ServerThread([verifier.service()])]
    yield servers, drafters, verifier, target
    for server in servers:
        server.stop()


def test_remote_round_driver_matches_target_greedy(services) -> None:
    servers, drafters, verifier, target = services
    pool = DrafterPool([s.address for s in servers[:2]])
    remote = RemoteVerifier(servers[2].address, pool.route_of)
    sps = SPSTable([1, 16, 64], [1000, 900, 500])
    engine = SpeculativeEngine(remote, pool, make_policy("dspark", sps, pool.block_size))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17]]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert [r.token_ids for r in results] == target.generate(prompts, max_new_tokens=16)
    # Both drafters got work, and everything was freed on every replica.
    assert all(d.engine.num_free_slots == 4 for d in drafters)
    assert verifier.engine.num_free_slots == 8
    assert engine.snapshot().num_accepted_tokens > 0
    pool.close()
    remote.close()


def test_bad_messages_get_invalid_argument_and_not_found(services) -> None:
    servers, _, _, _ = services
    drafter = SyncRpcClient(servers[0].address)
    with pytest.raises(grpc.RpcError) as err:
        drafter.call("dspark.Drafter", "Propose", {"req_ids": ["nope"], "anchors": [1], "positions": [3]})
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        drafter.call("dspark.Drafter", "AddRequests", {"req_ids": ["a"], "params": [{"temperature": -1}]})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    ver = SyncRpcClient(servers[2].address)
    with pytest.raises(grpc.RpcError) as err:
        ver.call("dspark.Verifier", "Step", {"prefill_req_ids": 5})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Still serving, no state was touched.
    assert ver.call("dspark.Verifier", "Info", {})["free_slots"] == 8
    assert drafter.call("dspark.Drafter", "Info", {})["free_slots"] == 4


def test_plain_decoding_over_grpc_leaves_the_features_on_the_verifier(services) -> None:
    """A round driver without a drafter asks for no inline features: exact, and the reply carries only tokens."""
    servers, _, verifier, target = services
    sps = SPSTable([1, 16, 64], [1000, 900, 500])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    received = {}
    for inline in (True, False):
        remote = RemoteVerifier(servers[2].address, lambda _req_id: None, inline_features=inline)
        engine = SpeculativeEngine(remote, None, make_policy("autoregressive", sps, 1))
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
        assert [r.token_ids for r in results] == target.generate(prompts, max_new_tokens=12)
        received[inline] = remote.bytes_received
        remote.close()
    assert received[False] * 4 < received[True]
    before = verifier._thread.busy_total_s
    SyncRpcClient(servers[2].address).call("dspark.Verifier", "Info", {})
    assert verifier.info()["engine_busy_s"] == pytest.approx(before) and before > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_decoding_of_several_tokens_per_step_is_the_one_step_output(services, temperature: float) -> None:
    """``decode_steps``: a round driver without a drafter has the verifier decode up to 4 tokens per ``Step``;
    the tokens are the ones one step per round gives (greedy: the target's; sampled: the same keyed draws), a
    stop token ends a request mid-step with the rest dropped, max_tokens caps the last step, and the steps go in
    about a quarter of the rounds."""
    servers, _, verifier, target = services
    sps = SPSTable([1, 16, 64], [1000, 900, 500])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = [SamplingParams(temperature=temperature, max_tokens=n, seed=7 + n, ignore_eos=True) for n in (13, 9, 16)]
    outputs, rounds = {}, {}
    for steps in (1, 4):
        remote = RemoteVerifier(servers[2].address, lambda _req_id: None, inline_features=False)
        engine = SpeculativeEngine(remote, None, make_policy("autoregressive", sps, 1), decode_steps=steps)
        outputs[steps] = [r.token_ids for r in engine.generate(prompts, params)]
        rounds[steps] = engine.snapshot().rounds
        remote.close()
    assert outputs[4] == outputs[1] and [len(t) for t in outputs[4]] == [13, 9, 16]
    if temperature == 0.0:
        greedy = target.generate(prompts, max_new_tokens=16)
        assert outputs[4] == [t[:n] for t, n in zip(greedy, (13, 9, 16), strict=True)]
    assert rounds[4] <= rounds[1] // 4 + 2, rounds  # 15 tokens after the first: 4 rounds, not 15
    stop = outputs[1][0][5]  # a stop token in the middle of a 4-token step of request 0
    stopped = SamplingParams(
        temperature=temperature, max_tokens=13, seed=params[0].seed, stop_token_ids=[stop], ignore_eos=True
    )
    remote = RemoteVerifier(servers[2].address, lambda _req_id: None, inline_features=False)
    engine = SpeculativeEngine(remote, None, make_policy("autoregressive", sps, 1), decode_steps=4)
    (result,) = engine.generate([prompts[0]], [stopped])
    remote.close()
    first = outputs[1][0].index(stop)
    assert result.token_ids == outputs[1][0][: first + 1] and result.finish_reason == "stop"
    assert verifier.engine.num_free_slots == 8


def test_the_hub_decodes_several_tokens_per_step_for_plain_decoding(services) -> None:
    """The scheduler hub's round loop for the autoregressive policy (no drafter pool) sends ``decode_steps``
    tokens' worth of decoding in each ``Step``: the target's greedy output in about a quarter of the rounds."""
    servers, _, verifier, target = services
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    hub = SchedulerHub(model_name="t", policy="autoregressive", decode=None, decode_steps=4)
    try:
        hub.register_verifier("v", servers[2].address, None)
        tokens = generate_all(hub, prompts, SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True))
        snap = asyncio.run(hub.metrics())
    finally:
        hub.close()
    assert tokens == target.generate(prompts, max_new_tokens=17)
    assert snap.rounds <= 6, snap.rounds  # 16 tokens after each prompt's first: 4 rounds (5 with a late join)
    assert verifier.engine.num_free_slots == 8


def test_a_verifier_without_feature_layers_serves_plain_decoding_through_the_hub(pair) -> None:
    """A verifier replica of a plain-decoding deployment loads its target with no feature layers (no drafter to
    feed): its ``Info`` says ``feature_dim`` 0, and the hub registers it and decodes through it."""
    target = TargetModel.from_pretrained(pair[0])
    verifier = VerifierService(VerifyEngine(target, max_requests=2, max_seq_len=64))
    server = ServerThread([verifier.service()])
    hub = SchedulerHub(model_name="t", policy="autoregressive", decode=None)
    try:
        assert verifier.info()["feature_dim"] == 0
        hub.register_verifier("v", server.address, None)
        tokens = generate_all(hub, [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    finally:
        hub.close()
        server.stop()
    assert tokens == target.generate([[1, 2, 3]], max_new_tokens=9)


def test_a_decoding_step_with_drafts_or_bad_counts_is_refused(services) -> None:
    servers = services[0]
    client = SyncRpcClient(servers[2].address)
    prefill = {
        "prefill_req_ids": ["d"], "prefill_params": [SamplingParams(temperature=0.0, max_tokens=8).to_dict()],
        "prefill_counts": [2], "prefill_tokens": torch.tensor([1, 2]), "prefill_anchors": [-1],
        "verify_req_ids": [], "verify_anchors": [], "verify_counts": [],
        "verify_tokens": torch.zeros(0, dtype=torch.int64),
        "inline_features": False,
    }
    for bad in ({"verify_steps": [0]}, {"verify_steps": [2, 2]}):
        message = {**prefill, "verify_req_ids": ["x"], "verify_anchors": [3], "verify_counts": [0], **bad}
        with pytest.raises(grpc.RpcError) as err:
            client.call("dspark.Verifier", "Step", message)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "decoding step" in err.value.details()
    assert client.call("dspark.Verifier", "Info", {})["free_slots"] == 8


def _count_calls(client: SyncRpcClient, counts: dict[str, int]) -> None:
    """Count the methods a real client calls (each call still goes to its server)."""
    call = client.call

    def counted(service: str, method: str, message: dict, **options: Any) -> Any:
        counts[method] = counts.get(method, 0) + 1
        return call(service, method, message, **options)

    client.call = counted  # type: ignore[method-assign]


def test_joining_and_finishing_requests_cost_one_call_per_replica_per_round(services) -> None:
    """A round's joiners are placed with one AddRequests per drafter and its finishers freed with one Release
    per replica (over gRPC each call is a round trip: per request they dominated the host time at 128 requests),
    and the output is still the target's greedy output."""
    servers, drafters, verifier, target = services
    pool = DrafterPool([s.address for s in servers[:2]])
    remote = RemoteVerifier(servers[2].address, pool.route_of)
    drafter_calls: dict[str, int] = {}
    verifier_calls: dict[str, int] = {}
    for client in pool._clients.values():
        _count_calls(client, drafter_calls)
    _count_calls(remote._client, verifier_calls)
    engine = SpeculativeEngine(remote, pool, make_policy("full", None, pool.block_size))
    prompts = [[1 + i, 2 + i, 3] for i in range(8)]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [r.token_ids for r in results] == target.generate(prompts, max_new_tokens=4)
    assert drafter_calls["AddRequests"] == 2  # 8 joiners in the first round, 4 on each drafter
    rounds = engine.snapshot().rounds + 1  # + the prefill round
    assert verifier_calls["Release"] <= rounds < len(prompts)
    assert drafter_calls["Release"] <= 2 * rounds
    assert all(d.engine.num_free_slots == 4 for d in drafters) and verifier.engine.num_free_slots == 8
    pool.close()
    remote.close()


def test_drafter_pool_places_a_prefix_when_slots_run_out(services) -> None:
    servers, drafters, _, _ = services
    pool = DrafterPool([s.address for s in servers[:2]])
    params = SamplingParams(temperature=0.0, max_tokens=4).with_seed()
    requests = [(f"r{i}", params) for i in range(10)]
    assert pool.add_requests(requests) == 8  # 4 + 4 slots
    assert [pool.has(r) for r, _ in requests] == [True] * 8 + [False] * 2
    assert sorted(d.engine.num_free_slots for d in drafters) == [0, 0]
    pool.release_many(["r0", "r1", "r2", "nobody"])
    assert sum(d.engine.num_free_slots for d in drafters) == 3 and not pool.has("r0")
    pool.release_many([r for r, _ in requests])
    assert all(d.engine.num_free_slots == 4 for d in drafters)
    pool.close()
