"""The per-round messages on long-lived streams: ``Step`` and ``Propose`` as one message each way per replica.

Real grpcio servers and real (tiny) models throughout: standalone server processes give the target's greedy
output over the streams; a refused message fails only itself and the stream serves on; a stream without the token
is refused; a stream that breaks mid-run fails only the round in flight, failover re-prefills its requests and the
next round opens a new stream; a stream that broke while idle is reopened for the next message without failing
it; a message past its deadline fails with DEADLINE_EXCEEDED and the stream is replaced.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hub_client import generate_all
from model_factory import PairSpec, write_pair

from cluster.contract import DRAFTER, VERIFIER
from cluster.messages import Int, Message
from cluster.rpc import (
    RoundStream,
    RpcClient,
    ServerThread,
    Service,
    StreamCallError,
    StreamLane,
    SyncRpcClient,
    stream_method,
)
from cluster.wire import decode, encode
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

REPO = Path(__file__).resolve().parents[2]
SPS = SPSTable([1, 16, 64], [1000, 900, 500])
FLAT_SPS = SPSTable([1, 64], [1000, 1000])
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TOKEN = "stream-token"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("streams"), PairSpec(vocab=128, block_size=5, seed=5))


@pytest.fixture(scope="module")
def expected(pair: tuple[Path, Path]) -> list[list[int]]:
    return TargetModel.from_pretrained(pair[0]).generate(PROMPTS, max_new_tokens=GREEDY.max_tokens)


def _services(pair: tuple[Path, Path]) -> tuple[DrafterService, VerifierService]:
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    drafter = DrafterService(DraftEngine(model, max_requests=4, max_seq_len=96))
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    return drafter, VerifierService(VerifyEngine(target, max_requests=8, max_seq_len=96), token=TOKEN)


@pytest.fixture
def servers(pair: tuple[Path, Path]) -> Iterator[tuple[ServerThread, ServerThread, DrafterService, VerifierService]]:
    drafter, verifier = _services(pair)
    draft_server = ServerThread([drafter.service()], token=TOKEN)
    verify_server = ServerThread([verifier.service()], token=TOKEN)
    yield draft_server, verify_server, drafter, verifier
    draft_server.stop()
    verify_server.stop()


# ------------------------------------------------------------------------------------- standalone processes
def _start(kind: str, pair: tuple[Path, Path]) -> subprocess.Popen:
    target_dir, draft_dir = pair
    cmd = [sys.executable, "-m", "cluster.cli", kind, "--grpc-port", "0", "--target", str(target_dir), "--draft",
           str(draft_dir), "--max-requests", "8", "--max-seq-len", "96", "--device", "cpu", "--dtype", "float32",
           "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DSPARK_GRPC_TOKEN=TOKEN)
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _address(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("listening on "):
            return line.split()[-1]
    raise RuntimeError(f"server exited before listening (code {proc.wait()})")


def test_standalone_servers_on_streams_give_the_target_greedy_output(
    pair: tuple[Path, Path], expected: list[list[int]]
) -> None:
    """`dspark draft-server` and `dspark verify-server` processes with a token: every round is one message each way
    on one stream per replica (each opened once), the output is the target's greedy output, and the round split
    adds up: the replicas' reported time is inside the phases, the transfer is the rest of them, and the part of the
    transfer inside the replicas' processes is within it."""
    procs = [_start("draft-server", pair), _start("verify-server", pair)]
    try:
        drafter, verifier = (_address(p) for p in procs)
        pool = DrafterPool([drafter], token=TOKEN)
        remote = RemoteVerifier(verifier, pool.route_of, token=TOKEN)
        pool.require_projection(remote.context_projection, remote.address)
        engine = SpeculativeEngine(remote, pool, make_policy("dspark", SPS, pool.block_size))
        try:
            started = time.perf_counter()
            tokens = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
            wall = time.perf_counter() - started
            snap = engine.snapshot()
            propose_streams = [s for lane in pool._lanes for s in lane.streams.values()]
            assert tokens == expected
            assert remote._step.streams_opened == 1 and [s.streams_opened for s in propose_streams] == [1]
            assert remote._step.bytes_sent > 0 and remote.bytes_received > remote._step.bytes_received > 0
            # The verifier's engine runs every step; the drafter's last Propose may have been answered from the
            # drafts it made ahead (no engine time on the round's path), so only its residence must be positive.
            assert remote.last_server_s > 0 and pool.last_server_s >= 0
            # The replicas held each message at least as long as their engine call took.
            assert remote.last_held_s >= remote.last_server_s - 1e-6
            assert pool.last_held_s >= pool.last_server_s - 1e-6 and pool.last_held_s > 0
            assert 0 < snap.transfer_in_replica_time_s <= snap.transfer_time_s
            assert snap.transfer_time_s > 0 and snap.round_verify_time_s > 0 and snap.round_draft_time_s > 0
            assert snap.round_draft_time_s + snap.round_verify_time_s + snap.transfer_time_s == pytest.approx(
                snap.draft_time_s + snap.verify_time_s
            )
            parts = snap.round_draft_time_s + snap.round_verify_time_s + snap.schedule_time_s
            assert 0 < parts + snap.transfer_time_s + snap.host_time_s <= wall
        finally:
            pool.close()
            remote.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)


@pytest.mark.parametrize(
    ("policy", "relay"), [("full", True), ("dspark", True), ("dspark", False)], ids=["full", "dspark", "propose"]
)
def test_relayed_rounds_replace_propose_and_keep_the_greedy_output(
    servers, expected: list[list[int]], policy: str, relay: bool
) -> None:
    """With ``relay`` the drafters return their next blocks (drafted as soon as a step's features arrived) to the
    verifier, and every round whose lengths the policy planned is one relayed ``Step``: most rounds then send no
    ``Propose`` at all, and the output is still the target's greedy output. dspark plans from the last round's
    confidences (here on a flat SPS table: the whole block). Without relaying every drafted round asks the
    drafter with a ``Propose``."""
    draft_server, verify_server, drafter, _verifier = servers
    pool = DrafterPool([draft_server.address], token=TOKEN)
    remote = RemoteVerifier(verify_server.address, pool.route_of, token=TOKEN, relay=relay)
    pool.require_projection(remote.context_projection, remote.address)
    engine = SpeculativeEngine(remote, pool, make_policy(policy, FLAT_SPS, pool.block_size))
    try:
        tokens = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        snap = engine.snapshot()
        proposes = sum(s.messages_sent for lane in pool._lanes for s in lane.streams.values())
    finally:
        pool.close()
        remote.close()
    assert tokens == expected
    drafted = snap.rounds - snap.rounds_without_draft
    if relay:
        assert drafter.proposals_returned > 0
        assert proposes < drafted / 2, (proposes, drafted)  # the rounds right after a join
        assert snap.num_drafts > 0 and drafted - proposes <= snap.planned_rounds <= drafted
    else:
        assert drafter.proposals_returned == 0 and proposes >= drafted > 0 and snap.planned_rounds == 0


# ---------------------------------------------------------------------------------- messages on one stream
def _prefill(req_id: str, tokens: list[int]) -> dict[str, Any]:
    return {
        "prefill_req_ids": [req_id],
        "prefill_params": [SamplingParams(temperature=0.0, max_tokens=4).to_dict()],
        "prefill_counts": [len(tokens)],
        "prefill_tokens": torch.tensor(tokens, dtype=torch.int64),
        "prefill_anchors": [-1],
        "verify_req_ids": [],
        "verify_anchors": [],
        "verify_counts": [],
        "verify_tokens": torch.zeros(0, dtype=torch.int64),
        "inline_features": False,
    }


def test_a_refused_message_fails_only_itself_and_the_stream_serves_on(servers) -> None:
    """INVALID_ARGUMENT (undecodable, schema-invalid, refused by the engine) and NOT_FOUND reach the caller as
    errors of that message; the same stream then carries the next one."""
    draft_server, verify_server, _, verifier = servers
    lane = StreamLane()
    step = lane.stream(verify_server.address, VERIFIER, "Step", token=TOKEN, timeout_s=30)
    propose = lane.stream(draft_server.address, DRAFTER, "Propose", token=TOKEN, timeout_s=30)
    try:
        with pytest.raises(StreamCallError) as error:
            step.call({"prefill_req_ids": 5})
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefill_req_ids" in error.value.details()
        reply = step.call(_prefill("a", [1, 2, 3]))
        assert reply["req_ids"] == ["a"] and len(reply["tokens"]) == 1 and reply["engine_ms"] > 0
        with pytest.raises(StreamCallError) as error:  # already running: refused, not loaded twice
            step.call(_prefill("a", [1, 2, 3]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(StreamCallError) as error:
            propose.call({"req_ids": ["nobody"], "anchors": [1], "positions": [3]})
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(StreamCallError) as error:
            propose.call({"req_ids": ["a", "b"], "anchors": [1], "positions": [3]})
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert step.streams_opened == 1 and propose.streams_opened == 1
        assert verifier.engine.num_free_slots == 7  # only the one good prefill was applied
    finally:
        lane.close()
    # Bytes that are no msgpack at all, on a raw stream: an INVALID_ARGUMENT envelope, then the next message.
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(verify_server.address) as channel:
        twin = channel.stream_stream(f"/{VERIFIER}/{stream_method('Step')}")
        replies = [decode(r) for r in twin(iter([b"\xc1", encode(_prefill("b", [4, 5]))]), timeout=30,
                                           metadata=metadata)]
    assert replies[0]["code"] == "INVALID_ARGUMENT" and replies[1]["ok"]["req_ids"] == ["b"]


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
def test_a_stream_without_the_token_is_refused(servers, token: str | None) -> None:
    draft_server, verify_server, _, verifier = servers
    lane = StreamLane()
    try:
        for address, service, method, message in (
            (verify_server.address, VERIFIER, "Step", _prefill("x", [1, 2])),
            (draft_server.address, DRAFTER, "Propose", {"req_ids": [], "anchors": [], "positions": []}),
        ):
            stream = lane.stream(address, service, method, token=token, timeout_s=30)
            with pytest.raises(grpc.RpcError) as error:
                stream.call(message)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert verifier.engine.num_free_slots == 8
    finally:
        lane.close()


# ------------------------------------------------------------------------------------ broken and slow streams
ECHO = Message("Echo", {"x": Int(min=0)})


class _Echo:
    """A service whose handler fails the stream (a CancelledError) or stalls on request."""

    def __init__(self) -> None:
        self.calls = 0

    async def echo(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        if request["x"] == 1:
            raise asyncio.CancelledError
        if request["x"] == 2:
            await asyncio.sleep(30)
        return {"x": request["x"]}

    def service(self) -> Service:
        return Service("t.Echo", {"Echo": (self.echo, ECHO)})


def test_broken_and_timed_out_streams_fail_their_message_and_reopen_for_the_next() -> None:
    echo = _Echo()
    server = ServerThread([echo.service()])
    port = server.port
    lane = StreamLane()
    stream: RoundStream = lane.stream(server.address, "t.Echo", "Echo", timeout_s=1.0)
    try:
        assert stream.call({"x": 5}) == {"x": 5}
        with pytest.raises(grpc.RpcError) as error:  # the stream breaks while the message is in flight
            stream.call({"x": 1})
        assert error.value.code() == grpc.StatusCode.CANCELLED
        assert stream.call({"x": 6}) == {"x": 6} and stream.streams_opened == 2
        with pytest.raises(StreamCallError) as error:
            stream.call({"x": 2})
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stream.call({"x": 7}) == {"x": 7} and stream.streams_opened == 3
        # The server goes away and comes back on the same port while the stream is idle: the next message
        # goes on a new stream (it never left this process on the old one) and is answered once.
        server.stop()
        server = ServerThread([echo.service()], port=port)
        before = echo.calls
        assert stream.call({"x": 8}) == {"x": 8} and stream.streams_opened == 4 and echo.calls == before + 1
        server.stop()
        with pytest.raises(grpc.RpcError) as error:  # gone for good: the message fails
            stream.call({"x": 9})
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        lane.close()
        server.stop()
    assert stream_method("Step") == "StepStream"
    with pytest.raises(ValueError, match="taken by the stream"):
        Service("t.Bad", {"Echo": (echo.echo, ECHO), "EchoStream": (echo.echo, ECHO)})


def test_a_client_round_stream_serves_overlapping_callers_in_order_on_one_stream() -> None:
    """``RpcClient.round_stream`` (a replica's per-round push): callers that overlap on one loop get their own
    replies, their messages go one at a time on one stream in the order the callers came, each reply reports
    how long the server held it, a stalled message fails alone at its deadline and the next opens a new stream."""
    echo = _Echo()
    server = ServerThread([echo.service()])

    async def run() -> None:
        client = RpcClient(server.address, timeout_s=1.0)
        stream = client.round_stream("t.Echo", "Echo")
        try:
            replies = await asyncio.gather(*(stream.exchange({"x": x}) for x in (3, 4, 5, 6)))
            assert replies == [{"x": x} for x in (3, 4, 5, 6)] and stream.streams_opened == 1
            assert 0 < stream.last_held_s < 1.0
            with pytest.raises(StreamCallError) as error:
                await stream.exchange({"x": 2}, timeout_s=0.5)
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await stream.exchange({"x": 7}) == {"x": 7} and stream.streams_opened == 2
        finally:
            await client.close()

    try:
        server.run(run())
    finally:
        server.stop()


def test_a_stream_broken_mid_run_fails_its_round_and_failover_recovers(
    pair: tuple[Path, Path], expected: list[list[int]]
) -> None:
    """The verifier's Step stream breaks in the middle of a generation (the server ends it; the replica lives):
    that round fails with CANCELLED and commits nothing, failover keeps the requests on the live verifier
    (re-prefilled), the next round opens a new stream, and every request gets exactly the target's tokens."""
    drafter, verifier = _services(pair)
    handler, schema = verifier.service().methods["Step"]
    steps = 0

    async def breaking(request: dict[str, Any]) -> Any:
        nonlocal steps
        steps += 1
        if steps == 4:  # a prefill round and two verify rounds went through
            raise asyncio.CancelledError
        return await handler(request)

    methods = {**verifier.service().methods, "Step": (breaking, schema)}
    draft_server = ServerThread([drafter.service()], token=TOKEN, health=drafter.health)
    verify_server = ServerThread([Service(VERIFIER, methods)], token=TOKEN, health=verifier.health)
    hub = SchedulerHub(model_name="t", policy="dspark", decode=None, token=TOKEN, timeout_s=30.0)
    try:
        hub.register_drafter("d", draft_server.address)
        hub.register_verifier("v", verify_server.address, SPS.to_dict())
        assert generate_all(hub, PROMPTS, GREEDY) == expected
        assert steps > 4 and hub._groups["v"].verifier._step.streams_opened == 2
        assert verifier.engine.num_free_slots == 8 and drafter.engine.num_free_slots == 4
        with SyncRpcClient(verify_server.address, token=TOKEN) as client:  # the unary methods are still there
            assert client.call(VERIFIER, "Info", {})["free_slots"] == 8
    finally:
        hub.close()
        draft_server.stop()
        verify_server.stop()
