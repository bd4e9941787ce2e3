"""The verifier -> drafter feature path (issue 8): verifier-side projection, feature dtype, asynchronous push,
drafting ahead.

The verifier may apply the drafter's ``fc`` + ``hidden_norm`` before pushing context features (1/m of the bytes),
ship them in another dtype, answer the scheduler before the push lands, and name the next anchors so the drafter
drafts at once. These tests pin down that none of this changes what a drafter computes (projected and raw rows give
bit-identical drafts, eager and bucketed; drafts made ahead equal fresh ones), that output over the real gRPC
services still equals the target's greedy output (and the in-process engine's seeded sampling), that a Propose
overtaking its context waits for it, and that rows projected by other weights are refused with INVALID_ARGUMENT, at
registration too.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
import torch
from model_factory import PairSpec, write_pair

from cluster.rpc import ServerThread, SyncRpcClient
from draft_service.checkpoint import load_draft_model
from draft_service.engine import ContextItem, DraftEngine, DraftItem
from draft_service.projection import ContextProjection, load_context_projection, model_fingerprint
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.remote import DrafterPool, RemoteVerifier
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SPS = SPSTable([1, 16, 64], [1000, 900, 500])
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    spec = PairSpec(vocab=128, block_size=5, target_layer_ids=(-1, 1, 2), seed=11)
    return write_pair(tmp_path_factory.mktemp("projection"), spec)


def _target(pair: tuple[Path, Path]) -> TargetModel:
    target_dir, draft_dir = pair
    layers = load_draft_model(draft_dir).config.target_layer_ids
    return TargetModel.from_pretrained(target_dir, feature_layer_ids=layers)


def _features(width: int, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Stand-ins for the target's hidden states: any rows of the right width exercise the projection."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(len(p), width, generator=generator) for p in prompts]


def test_loaded_projection_is_the_drafters_own(pair) -> None:
    _, draft_dir = pair
    model = load_draft_model(draft_dir)
    projection = load_context_projection(draft_dir)
    assert projection.fingerprint == model_fingerprint(model)
    rows = torch.randn(37, model.config.context_feature_size)
    assert torch.equal(projection(rows), model.project_context(rows))
    # Another dtype or other weights are another projection.
    assert load_context_projection(draft_dir, dtype=torch.bfloat16).fingerprint != projection.fingerprint
    other = ContextProjection(projection.feature_size, projection.hidden_size, 1e-6)
    assert other.fingerprint != projection.fingerprint
    with pytest.raises(ValueError, match="width"):
        projection(torch.zeros(2, projection.hidden_size))


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_projected_and_raw_rows_give_the_same_drafts(pair, graphs: str) -> None:
    _, draft_dir = pair
    projection = load_context_projection(draft_dir)
    model = load_draft_model(draft_dir)
    prompts = PROMPTS[:4]
    features = _features(model.config.context_feature_size, prompts)
    proposals = []
    for projected in (False, True):
        engine = DraftEngine(model, 4, 64, graphs=graphs, projected_context=projected, graph_buckets=(1, 2, 4))
        for i in range(len(prompts)):
            engine.add_request(f"r{i}", SamplingParams(temperature=0.0))

        def append(rows: list[torch.Tensor], starts: list[int], engine=engine, projected=projected) -> None:
            items = [ContextItem(f"r{i}", s, r) for i, (s, r) in enumerate(zip(starts, rows, strict=True))]
            if projected:  # what the verifier ships: one projection over the batch of rows
                flat = projection(torch.cat(rows)).split([r.shape[0] for r in rows])
                items = [ContextItem(it.req_id, it.start, f) for it, f in zip(items, flat, strict=True)]
            engine.append_context(items, projected=projected)

        # A prefill-sized append (eager), then round-sized ones (bucketed in mode static).
        lengths = [len(p) - 1 for p in prompts]
        append([f[: n] for f, n in zip(features, lengths, strict=True)], [0] * len(prompts))
        append([f[n : n + 1] for f, n in zip(features, lengths, strict=True)], lengths)
        items = [DraftItem(f"r{i}", p[-1], len(p)) for i, p in enumerate(prompts)]
        proposals.append(engine.propose(items))
    raw, projected = proposals
    assert torch.equal(raw.tokens, projected.tokens)
    # The same modules in the same order, but a CPU BLAS may pick another kernel for another row batching (it does
    # on some x86 CPUs below 8 rows), so the last bits can differ; only a draft could ever change, never an output.
    torch.testing.assert_close(raw.topk_probs, projected.topk_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(raw.confidence_logits, projected.confidence_logits, rtol=1e-5, atol=1e-6)


def _deployment(pair, *, projection: bool, feature_dtype: torch.dtype | None = None):
    target_dir, draft_dir = pair
    drafters = [
        DrafterService(DraftEngine(load_draft_model(draft_dir, target_dir=target_dir), max_requests=4, max_seq_len=96))
        for _ in range(2)
    ]
    verifier = VerifierService(
        VerifyEngine(_target(pair), max_requests=8, max_seq_len=96),
        projection=load_context_projection(draft_dir) if projection else None,
        feature_dtype=feature_dtype,
    )
    servers = [ServerThread([d.service()]) for d in drafters] + [ServerThread([verifier.service()])]
    return servers, drafters, verifier


def _generate(servers, params: SamplingParams) -> tuple[list[list[int]], object, int]:
    pool = DrafterPool([s.address for s in servers[:2]])
    remote = RemoteVerifier(servers[2].address, pool.route_of)
    pool.require_projection(remote.context_projection, remote.address)
    engine = SpeculativeEngine(remote, pool, make_policy("dspark", SPS, pool.block_size))
    try:
        tokens = [r.token_ids for r in engine.generate(PROMPTS, params)]
        info = SyncRpcClient(servers[2].address).call("dspark.Verifier", "Info", {})
    finally:
        pool.close()
        remote.close()
    return tokens, engine.snapshot(), info["feature_bytes_sent"]


def test_grpc_projected_features_are_lossless_and_smaller(pair) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    expected = _target(pair).generate(PROMPTS, max_new_tokens=16)
    runs = {}
    for name, projection, dtype in (("raw", False, None), ("projected", True, None), ("bf16", True, torch.bfloat16)):
        servers, drafters, verifier = _deployment(pair, projection=projection, feature_dtype=dtype)
        try:
            runs[name] = _generate(servers, greedy)
            assert all(d.engine.num_free_slots == 4 for d in drafters)
            assert verifier.engine.num_free_slots == 8
        finally:
            for server in servers:
                server.stop()
    for name, (tokens, _, _) in runs.items():
        assert tokens == expected, name
    (_, raw, raw_bytes), (_, projected, projected_bytes), (_, _, bf16_bytes) = runs.values()
    # Same drafts whichever side projects: the same acceptance, round for round.
    assert (raw.rounds, raw.num_accepted_tokens) == (projected.rounds, projected.num_accepted_tokens)
    assert raw.num_accepted_tokens > 0
    # Feature rows shrink from m*H = 3*32 to H = 32 floats, then to half the bytes; the ids, starts and counts of
    # each message stay.
    assert projected_bytes < 0.45 * raw_bytes
    assert bf16_bytes < 0.8 * projected_bytes


def test_rows_projected_by_other_weights_are_refused(pair) -> None:
    servers, drafters, _ = _deployment(pair, projection=False)
    try:
        client = SyncRpcClient(servers[0].address)
        client.call("dspark.Drafter", "AddRequests", {"req_ids": ["a"], "params": [{"temperature": 0.0}]})
        info = client.call("dspark.Drafter", "Info", {})
        assert info["context_projection"] == drafters[0].projection
        hidden, width = info["hidden_size"], info["context_feature_size"]
        message = {"req_ids": ["a"], "starts": [0], "counts": [2], "projection": "0123456789abcdef"}
        with pytest.raises(grpc.RpcError) as err:
            client.call("dspark.Drafter", "AppendContext", {**message, "features": torch.zeros(2, hidden)})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context projection" in err.value.details()
        # Raw rows announced as projected (and the reverse) fail the width check.
        good = {**message, "projection": info["context_projection"]}
        for bad in ({**good, "features": torch.zeros(2, width)}, {**message, "projection": None,
                                                                    "features": torch.zeros(2, hidden)}):
            with pytest.raises(grpc.RpcError) as err:
                client.call("dspark.Drafter", "AppendContext", bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.call("dspark.Drafter", "Info", {})["free_slots"] == 3  # nothing was appended, still serving
        client.call("dspark.Drafter", "AppendContext", {**good, "features": torch.zeros(2, hidden)})
        # A verifier projecting with other weights is refused when it registers with the pool.
        pool = DrafterPool([s.address for s in servers[:2]])
        pool.require_projection(None, "raw verifier")
        with pytest.raises(ValueError, match="projects context features"):
            pool.require_projection("0123456789abcdef", "stranger")
        pool.require_projection(info["context_projection"], "verifier")
        pool.close()
        client.close()
    finally:
        for server in servers:
            server.stop()


def test_mixed_greedy_and_sampled_over_grpc_equal_in_process(pair) -> None:
    """Only sampled requests' draft distributions travel; seeded sampling then gives the in-process tokens."""
    target_dir, draft_dir = pair
    params = [
        SamplingParams(temperature=0.0, max_tokens=12) if i % 2 else SamplingParams(temperature=1.0, max_tokens=12,
                                                                                  seed=40 + i)
        for i in range(len(PROMPTS))
    ]
    local = SpeculativeEngine(
        VerifyEngine(_target(pair), max_requests=8, max_seq_len=96),
        DraftEngine(load_draft_model(draft_dir, target_dir=target_dir), max_requests=8, max_seq_len=96),
        make_policy("dspark", SPS, 5),
    )
    expected = [r.token_ids for r in local.generate(PROMPTS, params)]
    servers, _, _ = _deployment(pair, projection=True)
    try:
        pool = DrafterPool([s.address for s in servers[:2]])
        remote = RemoteVerifier(servers[2].address, pool.route_of)
        engine = SpeculativeEngine(remote, pool, make_policy("dspark", SPS, pool.block_size))
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == expected
        assert engine.snapshot().num_accepted_tokens == local.snapshot().num_accepted_tokens
        pool.close()
        remote.close()
    finally:
        for server in servers:
            server.stop()


def test_propose_waits_for_context_still_in_flight(pair) -> None:
    """The verifier does not wait for its feature push, so a Propose may arrive first: it waits for the rows (up to
    context_wait_s), then fails with the engine's message; a push for a request released meanwhile is skipped."""
    _, draft_dir = pair
    engine = DraftEngine(load_draft_model(draft_dir), max_requests=4, max_seq_len=64)
    service = DrafterService(engine, context_wait_s=0.5)
    server = ServerThread([service.service()])
    client = SyncRpcClient(server.address)
    width = service.engine.model.config.context_feature_size
    try:
        client.call("dspark.Drafter", "AddRequests", {"req_ids": ["a", "b"], "params": [{"temperature": 0.0}] * 2})
        append = {"req_ids": ["a"], "starts": [0], "counts": [3], "features": torch.randn(3, width)}
        propose = {"req_ids": ["a"], "anchors": [1], "positions": [3]}
        replies: list[object] = []
        worker = threading.Thread(target=lambda: replies.append(client.call("dspark.Drafter", "Propose", propose)))
        worker.start()
        threading.Event().wait(0.1)
        client.call("dspark.Drafter", "AppendContext", append)
        worker.join(10)
        assert len(replies) == 1 and replies[0]["tokens"].shape == (1, service.engine.block_size)
        # Rows that never come: refused after the wait, naming the mismatch.
        with pytest.raises(grpc.RpcError) as err:
            client.call("dspark.Drafter", "Propose", {"req_ids": ["b"], "anchors": [1], "positions": [2]})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "anchor positions" in err.value.details()
        # A late push for a request released meanwhile is skipped; an id never held is still NOT_FOUND.
        client.call("dspark.Drafter", "Release", {"req_ids": ["b"]})
        client.call("dspark.Drafter", "AppendContext", {**append, "req_ids": ["b"]})
        with pytest.raises(grpc.RpcError) as err:
            client.call("dspark.Drafter", "AppendContext", {**append, "req_ids": ["never"]})
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        client.close()
        server.stop()


def test_drafts_made_ahead_are_the_drafts_propose_would_make(pair) -> None:
    _, draft_dir = pair
    service = DrafterService(DraftEngine(load_draft_model(draft_dir), max_requests=4, max_seq_len=64))
    server = ServerThread([service.service()])
    client = SyncRpcClient(server.address)
    width = service.engine.model.config.context_feature_size
    try:
        params = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}]
        client.call("dspark.Drafter", "AddRequests", {"req_ids": ["a", "b"], "params": params})
        client.call(
            "dspark.Drafter",
            "AppendContext",
            {"req_ids": ["a", "b"], "starts": [0, 0], "counts": [3, 4], "features": torch.randn(7, width),
             "draft_anchors": [5, 6]},
        )
        propose = {"req_ids": ["a", "b"], "anchors": [5, 6], "positions": [3, 4]}
        reply = client.call("dspark.Drafter", "Propose", propose)
        assert service.proposals_ahead == 1
        fresh = service.engine.propose([DraftItem("a", 5, 3), DraftItem("b", 6, 4)])
        assert torch.equal(reply["tokens"], fresh.tokens)
        assert torch.equal(reply["confidences"], torch.from_numpy(fresh.confidences))
        assert reply["distribution_rows"] == [1]  # the greedy request's distribution stays here
        assert torch.equal(reply["topk_probs"], fresh.topk_probs[1:])
        # Used once; another anchor (or a second Propose) drafts afresh.
        client.call("dspark.Drafter", "Propose", {"req_ids": ["a"], "anchors": [5], "positions": [3]})
        assert service.proposals_ahead == 1
    finally:
        client.close()
        server.stop()
