"""The scheduler restarts under load: in-flight HTTP requests continue on the restarted scheduler (new port) with
nothing sent twice, or past the ingress's bound fail with a retryable 503; nothing hangs.

Real pieces on loopback: drafter and verifier gRPC services over a tiny pair, the scheduler hub's gRPC service,
the OpenAI app on uvicorn with :class:`RemoteBackend` resolving the scheduler's address like the Serve ingress.
A gate holds the verifier's rounds once every request under test was verified, so they are provably in flight
(with tokens emitted) when the scheduler dies. Every wait is on an event or a condition, with a generous bound: the
suite runs on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_harness import demo_tokenizer, serve
from model_factory import PairSpec, write_pair

from cluster.http_app import build_app
from cluster.remote_backend import RemoteBackend
from cluster.rpc import ServerThread, Service
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from scheduler.hub import SchedulerHub
from scheduler.sps import SPSTable
from scheduler.stopping import Decode, tokenizer_decode
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SPS = SPSTable([1, 16, 64], [1000, 900, 500]).to_dict()
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("restart"), PairSpec(vocab=128, block_size=4, seed=11))


class HeldStep:
    """Holds the verifier's rounds once each of ``requests`` requests has been verified in one, until released.

    Until ``admitted()`` (the scheduler's count of requests, set by the test) reaches ``requests``, every round
    waits, so no request runs ahead and finishes before the others arrive. The round after each request was
    verified once is held: the requests are then in flight and have emitted tokens, and the held round carries
    no prefill (nothing a late release could allocate).
    """

    def __init__(self, requests: int) -> None:
        self.requests = requests
        self.admitted: Callable[[], int] = lambda: 0
        self.verified: set[str] = set()
        self.held = threading.Event()
        self.released = threading.Event()

    def wrap(self, service: Service) -> Service:
        handler, schema = service.methods["Step"]

        async def step(request: dict[str, Any]) -> Any:
            while not self.released.is_set():
                if len(self.verified) >= self.requests:
                    self.held.set()
                elif self.admitted() >= self.requests:
                    break
                await asyncio.sleep(0.005)
            self.verified.update(request["verify_req_ids"])
            return await handler(request)

        return Service(service.name, {**service.methods, "Step": (step, schema)})


@pytest.fixture
def replicas(pair: tuple[Path, Path]) -> Iterator[dict[str, Any]]:
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    drafter = DrafterService(DraftEngine(model, max_requests=4, max_seq_len=128))
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    verifier = VerifierService(VerifyEngine(target, max_requests=4, max_seq_len=128))
    gate = HeldStep(requests=2)
    servers = [ServerThread([drafter.service()]), ServerThread([gate.wrap(verifier.service())])]
    yield {"drafter": servers[0].address, "verifier": servers[1].address, "gate": gate, "target": target,
           "verify_engine": verifier.engine}
    gate.released.set()
    for server in servers:
        server.stop()


def _start_scheduler(replicas: dict[str, Any], decode: Decode | None = None) -> tuple[SchedulerHub, ServerThread]:
    # The hub's deadline on replica calls is generous: the held round must not time out on a loaded machine.
    hub = SchedulerHub(model_name="m", policy="dspark", decode=decode, timeout_s=60.0)
    hub.register_drafter("d", replicas["drafter"])  # what the replicas' heartbeats do after a restart
    hub.register_verifier("v", replicas["verifier"], SPS)
    replicas["gate"].admitted = lambda: sum(hub.verifier_loads().values())
    return hub, ServerThread([hub.service()])


def _backend(where: dict[str, str], continue_timeout_s: float = 60.0) -> RemoteBackend:
    """The ingress' backend: it asks ``where`` for the scheduler's address, like the Serve ingress asks Serve."""

    async def resolve() -> str:
        while where.get("lost"):  # as Serve while it restarts the scheduler: the address is not known for a while
            await asyncio.sleep(0.05)
        return where["address"]

    return RemoteBackend(resolve, model_name="m", max_context=127, continue_timeout_s=continue_timeout_s)


def _stream(url: str, max_tokens: int, first_tokens: threading.Event) -> list[dict[str, Any]]:
    """Stream a completion; ``first_tokens`` is set once a chunk with tokens arrived."""
    events = []
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
                if events[-1].get("choices"):
                    first_tokens.set()
    return events


def _wait_refused(address: str, timeout_s: float = 60.0) -> None:
    """Wait until the server at ``address`` takes no new connections (its listener is closed: refused, or reset
    when a connection was caught in the closing backlog)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except ConnectionError:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{address} still accepts connections after {timeout_s}s")


def test_streams_cut_by_a_scheduler_restart_continue_on_the_new_one(replicas: dict[str, Any]) -> None:
    """The scheduler dies while a streamed and a plain completion have emitted tokens: both wait for the new
    scheduler (new port, found only after a while) and continue there, ending with the uncut greedy output: no
    token or text twice, usage as for one request, the uncut run's finish reason."""
    tokenizer = demo_tokenizer()
    decode = tokenizer_decode(tokenizer)
    hub, server = _start_scheduler(replicas, decode)
    where = {"address": server.address}
    app = build_app(_backend(where), tokenizer)
    expected = replicas["target"].generate([PROMPT], max_new_tokens=40)[0]
    want = {"ids": expected, "text": decode(expected), "usage": {"prompt_tokens": 3, "completion_tokens": 40,
                                                                  "total_tokens": 43}}
    with serve(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
        plain = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        first_tokens = threading.Event()
        streamed = pool.submit(_stream, url, 40, first_tokens)
        assert replicas["gate"].held.wait(60), "the requests were never both verified"
        assert first_tokens.wait(60), "the stream never received its first tokens"
        where["lost"] = "yes"
        server.stop(grace_s=None)  # the scheduler process dies with its requests
        replicas["gate"].released.set()
        hub.close()
        # Serve starts a new scheduler (new port); replicas re-register; the old one's requests are released.
        new_hub, new_server = _start_scheduler(replicas, decode)
        where["address"] = new_server.address
        where.pop("lost")
        try:
            response = plain.result(timeout=120)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["token_ids"] == want["ids"] and choice["text"] == want["text"]
            assert choice["finish_reason"] == "length" and response.json()["usage"] == want["usage"]
            events = streamed.result(timeout=120)
            assert not [e for e in events if "error" in e], events
            chunks = [c for e in events for c in e.get("choices", [])]
            assert [t for c in chunks for t in c["token_ids"]] == want["ids"]
            assert "".join(c["text"] for c in chunks) == want["text"]
            assert chunks[-1]["finish_reason"] == "length" and events[-1]["usage"] == want["usage"]
            ok = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 12}, timeout=60)
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == expected[:12]
            _wait_for(lambda: replicas["verify_engine"].num_free_slots == 4, "the verifier's slots to be free")
        finally:
            new_server.stop()
            new_hub.close()


def test_a_cut_stream_fails_when_no_scheduler_comes_back_in_time(replicas: dict[str, Any]) -> None:
    """Past ``continue_timeout_s`` without a scheduler, a cut stream ends with an error event and a plain request
    with a retryable 503; ``/health`` answers meanwhile; with no scheduler at all a new request is a clear 503."""
    replicas["gate"].requests = 1
    hub, server = _start_scheduler(replicas)
    where = {"address": server.address}
    app = build_app(_backend(where, continue_timeout_s=2.0), demo_tokenizer())
    with serve(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        first_tokens = threading.Event()
        streamed = pool.submit(_stream, url, 60, first_tokens)
        assert replicas["gate"].held.wait(60), "the request was never verified"
        assert first_tokens.wait(60), "the stream never received its first tokens"
        where["lost"] = "yes"
        killed = time.monotonic()
        server.stop(grace_s=None)
        replicas["gate"].released.set()
        hub.close()
        events = streamed.result(timeout=60)
        assert time.monotonic() - killed < 30, "the stream was not closed after the bound"
        assert events[-1]["error"]["code"] == "service_unavailable"
        assert any(e.get("choices") for e in events[:-1])  # it had streamed tokens before the failure
        probe = time.monotonic()
        down = httpx.get(f"{url}/health", timeout=60)
        assert down.status_code == 503 and "Retry-After" in down.headers
        assert time.monotonic() - probe < 5  # /health answers while the scheduler cannot be found
        new_hub, new_server = _start_scheduler(replicas)  # a scheduler that comes back later serves new requests
        where["address"] = new_server.address
        where.pop("lost")
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        try:
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            _wait_for(lambda: replicas["verify_engine"].num_free_slots == 4, "the verifier's slots to be free")
        finally:
            new_server.stop()
            new_hub.close()
        down = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable"


def test_a_refused_request_does_not_cut_the_requests_still_running(replicas: dict[str, Any]) -> None:
    """A draining scheduler (Serve stopping it gracefully) refuses new calls with UNAVAILABLE but finishes its
    streams. The refused request is a retryable 503; the running one shares the ingress' channel and must still
    complete (closing that channel at once would cancel it: a 499, as if its client had gone)."""
    replicas["gate"].requests = 1
    hub, server = _start_scheduler(replicas)
    app = build_app(_backend({"address": server.address}), demo_tokenizer())
    expected = replicas["target"].generate([PROMPT], max_new_tokens=12)[0]
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    with serve(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            running = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            assert replicas["gate"].held.wait(60), "the request was never verified"
            draining = pool.submit(server.stop, 25.0)  # in-flight calls get 25 s (ServerThread waits 30 s)
            _wait_refused(server.address)

            refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"

            replicas["gate"].released.set()
            response = running.result(timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == expected
            draining.result(timeout=60)
        finally:
            replicas["gate"].released.set()  # a failure above must not leave the pool waiting on a held round
            hub.close()


def _counters(url: str) -> dict[str, float]:
    """The ingress' Prometheus counters (``*_total`` samples, by name)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    out = {}
    for line in text.splitlines():
        if not line.startswith("#") and "_total" in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_stay_monotonic_across_a_scheduler_restart(replicas: dict[str, Any]) -> None:
    """Prometheus counters served by the ingress never go down when the scheduler restarts from zero."""
    replicas["gate"].released.set()  # no round is held here
    hub, server = _start_scheduler(replicas)
    where = {"address": server.address}
    app = build_app(_backend(where), demo_tokenizer())
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with serve(app) as url:
        try:
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            before = _counters(url)
            rounds = 'dspark_rounds_total{model_name="m"}'
            assert before[rounds] > 0
        finally:
            server.stop(grace_s=None)
            hub.close()
        new_hub, new_server = _start_scheduler(replicas)
        where["address"] = new_server.address
        try:
            # The first call after the restart finds the old channel dead (a retryable 503), then resolves again.
            _wait_for(lambda: httpx.get(f"{url}/metrics", timeout=60).status_code == 200, "the new scheduler")
            restarted = _counters(url)
            assert all(restarted[name] >= value for name, value in before.items()), (before, restarted)
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            after = _counters(url)
            assert after[rounds] > restarted[rounds] >= before[rounds]
            assert all(after[name] >= value for name, value in restarted.items())
        finally:
            new_server.stop()
            new_hub.close()


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        threading.Event().wait(0.05)
