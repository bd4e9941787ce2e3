"""The direct feature path (issue 12): context features over torch.distributed links (gloo on the CPU here).

Real gRPC drafter and verifier servers in this process (each ServerThread on its own loop and thread, so the two
ranks of a link run on different threads, as in two processes). Pinned down: output over the links equals the
target's greedy output and the gRPC transport's, with the rows moved over the links and only metadata over gRPC;
a drafter refuses a push naming an unknown link with INVALID_ARGUMENT and keeps serving; a drafter whose link
cannot be built gets its rows as bytes over gRPC, output unchanged. The NCCL backend is not exercised (no GPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
from model_factory import PairSpec, write_pair

from cluster.feature_link import build_group
from cluster.rpc import ServerThread, SyncRpcClient
from draft_service.checkpoint import load_draft_model
from draft_service.engine import ContextItem, DraftEngine, DraftItem
from draft_service.projection import load_context_projection
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.remote import DrafterPool, RemoteVerifier
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

REPO = Path(__file__).resolve().parents[2]
SPS = SPSTable([1, 16, 64], [1000, 900, 500])
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
#: Generous: a loaded 2-core machine may take seconds to build a link; the failing cases wait this long at most.
LINK_TIMEOUT_S = 20.0
Between = Callable[[list[ServerThread], list[DrafterService]], None]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    spec = PairSpec(vocab=128, block_size=5, target_layer_ids=(-1, 1, 2), seed=11)
    return write_pair(tmp_path_factory.mktemp("link"), spec)


def _target(pair: tuple[Path, Path]) -> TargetModel:
    target_dir, draft_dir = pair
    layers = load_draft_model(draft_dir).config.target_layer_ids
    return TargetModel.from_pretrained(target_dir, feature_layer_ids=layers)


def _run(pair, transport: str, link_hosts: tuple[str | None, str | None] = ("127.0.0.1", "127.0.0.1"),
         feature_dtype: torch.dtype | None = None, link_timeout_s: float = LINK_TIMEOUT_S,
         advertise: str | None = None, between: Between | None = None):
    """Greedy generation over two drafter servers and one verifier server; returns tokens and both sides' Info.

    With ``between``, it generates twice and calls ``between`` in the middle (the tokens of both runs are returned).
    """
    target_dir, draft_dir = pair
    drafters = [
        DrafterService(
            DraftEngine(load_draft_model(draft_dir, target_dir=target_dir), max_requests=4, max_seq_len=96),
            link_host=host,
            link_timeout_s=link_timeout_s,
            link_advertise=advertise,
        )
        for host in link_hosts
    ]
    verifier = VerifierService(
        VerifyEngine(_target(pair), max_requests=8, max_seq_len=96),
        projection=load_context_projection(draft_dir),
        feature_dtype=feature_dtype,
        feature_transport=transport,
        link_timeout_s=link_timeout_s,
    )
    servers = [ServerThread([d.service()]) for d in drafters]
    verifier_server = ServerThread([verifier.service()])
    try:
        pool = DrafterPool([s.address for s in servers])
        remote = RemoteVerifier(verifier_server.address, pool.route_of)
        pool.require_projection(remote.context_projection, remote.address)
        engine = SpeculativeEngine(remote, pool, make_policy("dspark", SPS, pool.block_size))
        try:
            tokens = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
            if between is not None:
                verifier_server.run(verifier.drain_pushes())
                between(servers, drafters)
                tokens += [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        finally:
            pool.close()
            remote.close()
        verifier_server.run(verifier.drain_pushes())
        info = SyncRpcClient(verifier_server.address).call("dspark.Verifier", "Info", {})
        drafter_infos = [SyncRpcClient(s.address).call("dspark.Drafter", "Info", {}) for s in servers]
        assert all(d["free_slots"] == 4 for d in drafter_infos)
        verifier_server.run(verifier.close(), timeout_s=LINK_TIMEOUT_S + 30)
        closed = [SyncRpcClient(s.address).call("dspark.Drafter", "Info", {})["feature_links"] for s in servers]
        assert closed == [0, 0]  # the verifier's close closed its links on the drafters too
    finally:
        verifier_server.stop()
        for server, drafter in zip(servers, drafters, strict=True):
            server.stop()
            drafter.close()
    return tokens, info, drafter_infos, engine.snapshot()


def test_collective_transport_is_lossless_and_moves_the_rows_off_grpc(pair) -> None:
    expected = _target(pair).generate(PROMPTS, max_new_tokens=16)
    grpc_tokens, grpc_info, _, grpc_stats = _run(pair, "grpc")
    tokens, info, drafter_infos, stats = _run(pair, "collective")
    assert grpc_tokens == expected
    assert tokens == expected
    # The same drafts (same rows, same dtype): the same acceptance, round for round.
    assert (stats.rounds, stats.num_accepted_tokens) == (grpc_stats.rounds, grpc_stats.num_accepted_tokens)
    assert info["feature_links"] == 2 and all(d["feature_link_port"] for d in drafter_infos)
    assert info["feature_bytes_collective"] > 0
    assert grpc_info["feature_bytes_collective"] == 0
    # The rows left gRPC: its bytes shrank by (nearly) what the links carried; what remains is the metadata (ids,
    # starts, counts, anchors, the link fields, OpenLink/CloseLink), which dominates for this tiny model's rows.
    moved = grpc_info["feature_bytes_sent"] - info["feature_bytes_sent"]
    print(f"grpc {grpc_info['feature_bytes_sent']} B; collective: {info['feature_bytes_sent']} B over gRPC, "
          f"{info['feature_bytes_collective']} B over the links")
    assert 0.8 * info["feature_bytes_collective"] < moved <= info["feature_bytes_collective"]


def test_collective_transport_with_a_narrower_feature_dtype(pair) -> None:
    expected = _target(pair).generate(PROMPTS, max_new_tokens=16)
    grpc_tokens, _, _, grpc_stats = _run(pair, "grpc", feature_dtype=torch.bfloat16)
    tokens, info, _, stats = _run(pair, "collective", feature_dtype=torch.bfloat16)
    assert grpc_tokens == tokens == expected
    assert stats.num_accepted_tokens == grpc_stats.num_accepted_tokens  # bf16 rows on both paths
    assert info["feature_bytes_collective"] > 0


def test_unknown_link_is_invalid_argument_and_the_drafter_keeps_serving(pair) -> None:
    _, draft_dir = pair
    service = DrafterService(DraftEngine(load_draft_model(draft_dir), max_requests=4, max_seq_len=64),
                             link_host="127.0.0.1")
    server = ServerThread([service.service()])
    client = SyncRpcClient(server.address)
    width = service.engine.model.config.context_feature_size
    try:
        client.call("dspark.Drafter", "AddRequests", {"req_ids": ["a"], "params": [{"temperature": 0.0}]})
        metadata = {"req_ids": ["a"], "starts": [0], "counts": [3], "link": "no-such-link", "seq": 0,
                    "shape": [3, width], "dtype": "float32"}
        for bad in (metadata, {**metadata, "seq": None}, {**metadata, "features": torch.zeros(3, width)}):
            with pytest.raises(grpc.RpcError) as err:
                client.call("dspark.Drafter", "AppendContext", bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # a CUDA verifier cannot link to a CPU drafter
            client.call("dspark.Drafter", "OpenLink", {"link_id": "x", "backend": "nccl", "peer_host": "127.0.0.1"})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Still serving: bytes over gRPC append as before.
        client.call("dspark.Drafter", "AppendContext", {**{k: metadata[k] for k in ("req_ids", "starts", "counts")},
                                                        "features": torch.randn(3, width)})
        assert client.call("dspark.Drafter", "Info", {})["free_slots"] == 3
        assert service.engine.context_length("a") == 3
    finally:
        client.close()
        server.stop()
        service.close()


def test_a_drafter_without_a_reachable_store_gets_bytes_over_grpc(pair) -> None:
    """Drafter 0 advertises its store at an address nobody reaches (TEST-NET-1, RFC 5737): its verifier falls back
    to gRPC bytes for it; drafter 1 takes no links at all (transport grpc there)."""
    expected = _target(pair).generate(PROMPTS, max_new_tokens=16)
    tokens, info, _, _ = _run(pair, "collective", link_hosts=("127.0.0.1", None), link_timeout_s=5.0,
                          advertise="192.0.2.1")
    assert tokens == expected
    assert info["feature_links"] == 0 and info["feature_bytes_collective"] == 0
    assert info["feature_bytes_sent"] > 0


def test_a_link_lost_mid_stream_resends_the_push_as_bytes(pair) -> None:
    """Between two generations the drafters drop their ends of the links (as after a failed receive): the next push
    over each link is refused (unknown link), resent as bytes over gRPC, and later pushes stay on gRPC; the output
    never changes and no round fails."""
    expected = _target(pair).generate(PROMPTS, max_new_tokens=16)

    def drop_links(servers: list[ServerThread], drafters: list[DrafterService]) -> None:
        async def drop(drafter: DrafterService) -> None:
            assert drafter.links is not None and drafter.links.num_links == 1
            for link_id in drafter.links.link_ids:
                drafter.links.close_link(link_id)

        for server, drafter in zip(servers, drafters, strict=True):
            server.run(drop(drafter))

    tokens, info, _, _ = _run(pair, "collective", between=drop_links)
    assert tokens == expected + expected
    assert info["feature_links"] == 0 and info["feature_bytes_collective"] > 0


def _start(kind: str, pair, sps: Path, token_file: Path) -> subprocess.Popen:
    target_dir, draft_dir = pair
    cmd = [sys.executable, "-m", "cluster.cli", kind, "--grpc-port", "0", "--target", str(target_dir), "--draft",
           str(draft_dir), "--max-requests", "8", "--max-seq-len", "96", "--device", "cpu",
           "--dtype", "float32", "--log-level", "warning", "--feature-transport", "collective",
           "--grpc-token-file", str(token_file)]
    if kind == "verify-server":
        cmd += ["--sps", str(sps)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _address(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("listening on "):
            return line.split()[-1]
    raise RuntimeError(f"server exited before listening (code {proc.wait()})")


def test_standalone_server_processes_over_collective_links(pair, tmp_path: Path) -> None:
    """`dspark draft-server` and `verify-server --feature-transport collective` as two processes: the link's ranks
    live in different processes, as deployed; output equals the target's greedy output. The two share the token
    file the first of them created (the verifier pushes to the drafter with it)."""
    expected = _target(pair).generate(PROMPTS, max_new_tokens=16)
    sps = SPS.save(tmp_path / "sps.json")
    token_file = tmp_path / "grpc-token"
    procs = [_start("draft-server", pair, sps, token_file), _start("verify-server", pair, sps, token_file)]
    try:
        drafter, verifier = (_address(p) for p in procs)
        token = token_file.read_text().strip()
        pool = DrafterPool([drafter], token=token)
        remote = RemoteVerifier(verifier, pool.route_of, token=token)
        pool.require_projection(remote.context_projection, remote.address)
        engine = SpeculativeEngine(remote, pool, make_policy("dspark", SPS, pool.block_size))
        try:
            tokens = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        finally:
            pool.close()
            remote.close()
        info = SyncRpcClient(verifier, token=token).call("dspark.Verifier", "Info", {})
        assert tokens == expected
        assert info["feature_links"] == 1 and info["feature_bytes_collective"] > 0
        assert SyncRpcClient(drafter, token=token).call("dspark.Drafter", "Info", {})["feature_links"] == 1
        procs[1].send_signal(signal.SIGTERM)  # the verifier closes its link on the drafter as it stops
        assert procs[1].wait(LINK_TIMEOUT_S + 30) == 0
        assert SyncRpcClient(drafter, token=token).call("dspark.Drafter", "Info", {})["feature_links"] == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)


def test_the_drafter_receives_in_sequence_order_and_times_out_on_a_gap(pair) -> None:
    """A verifier end built by hand: the metadata of push 1 sent (from a thread) alongside that of push 0 still gets
    push 1's rows, so the drafts equal those of a drafter given the same rows as bytes (gloo would not notice a
    receive out of order: it fills a buffer of another size without error); a push whose predecessor never comes
    fails after the link timeout, the link is gone, and the drafter keeps serving."""
    _, draft_dir = pair
    service = DrafterService(DraftEngine(load_draft_model(draft_dir), max_requests=4, max_seq_len=64),
                             link_host="127.0.0.1", link_timeout_s=5.0)
    server = ServerThread([service.service()])
    client = SyncRpcClient(server.address, timeout_s=60)
    width = service.engine.model.config.context_feature_size
    try:
        client.call("dspark.Drafter", "AddRequests", {"req_ids": ["a", "b"], "params": [{"temperature": 0.0}] * 2})
        reply = client.call("dspark.Drafter", "OpenLink", {"link_id": "t", "backend": "gloo", "peer_host": "127.0.0.1"})
        store = dist.TCPStore("127.0.0.1", reply["store_port"], None, False, timedelta(seconds=LINK_TIMEOUT_S))
        group = build_group(store, "t", 0, "gloo", "127.0.0.1", torch.device("cpu"), LINK_TIMEOUT_S)
        rows = [torch.randn(3, width), torch.randn(5, width)]
        works = [group.send([r], 1, 0) for r in rows]
        metadata = [{"req_ids": [req], "starts": [0], "counts": [int(r.shape[0])], "link": "t", "seq": seq,
                     "shape": list(r.shape), "dtype": "float32"} for seq, (req, r) in enumerate(zip("ab", rows,
                                                                                                 strict=True))]
        errors: list[BaseException] = []

        def second() -> None:
            try:
                client.call("dspark.Drafter", "AppendContext", metadata[1])
            except BaseException as exc:  # reported below
                errors.append(exc)

        worker = threading.Thread(target=second)
        worker.start()
        client.call("dspark.Drafter", "AppendContext", metadata[0])
        worker.join(60)
        assert not errors and not worker.is_alive()
        for work in works:
            work.wait()
        assert (service.engine.context_length("a"), service.engine.context_length("b")) == (3, 5)
        reference = DraftEngine(load_draft_model(draft_dir), max_requests=4, max_seq_len=64)
        for req, r in zip("ab", rows, strict=True):
            reference.add_request(req, SamplingParams(temperature=0.0))
            reference.append_context([ContextItem(req, 0, r)])
        items = [DraftItem("a", 7, 3), DraftItem("b", 9, 5)]
        mine, theirs = service.engine.propose(items), reference.propose(items)
        assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.topk_probs, theirs.topk_probs)
        # Push 3 without push 2: refused after the link timeout; the link is closed and forgotten.
        with pytest.raises(grpc.RpcError) as err:
            client.call("dspark.Drafter", "AppendContext", {**metadata[0], "seq": 3})
        assert err.value.code() == grpc.StatusCode.INTERNAL and "never came" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.call("dspark.Drafter", "AppendContext", {**metadata[0], "seq": 2})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown feature link" in err.value.details()
        assert client.call("dspark.Drafter", "Info", {})["feature_links"] == 0
        group.shutdown()
    finally:
        client.close()
        server.stop()
        service.close()
