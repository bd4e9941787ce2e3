"""The scheduler restarts under load: in-flight HTTP requests fail with a retryable 503, nothing hangs, and the
ingress reaches the restarted scheduler (new port) for the next request.

Real pieces on loopback: drafter and verifier gRPC services over a tiny pair, the scheduler hub's gRPC service,
the OpenAI app on uvicorn with :class:`RemoteBackend` resolving the scheduler's address like the Serve ingress.
A gate holds the verifier's 4th round so the requests are provably in flight when the scheduler dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Iterator
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
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SPS = SPSTable([1, 16, 64], [1000, 900, 500]).to_dict()
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("restart"), PairSpec(vocab=128, block_size=4, seed=11))


class HeldStep:
    """Lets ``passes`` verifier rounds through, then holds the next ones until released."""

    def __init__(self, passes: int) -> None:
        self.calls = 0
        self.passes = passes
        self.held = threading.Event()
        self.released = threading.Event()

    def wrap(self, service: Service) -> Service:
        handler, schema = service.methods["Step"]

        async def step(request: dict[str, Any]) -> Any:
            self.calls += 1
            if self.calls > self.passes:
                self.held.set()
                while not self.released.is_set():
                    await asyncio.sleep(0.005)
            return await handler(request)

        return Service(service.name, {**service.methods, "Step": (step, schema)})


@pytest.fixture
def replicas(pair: tuple[Path, Path]) -> Iterator[dict[str, Any]]:
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    drafter = DrafterService(DraftEngine(model, max_requests=4, max_seq_len=128))
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    verifier = VerifierService(VerifyEngine(target, max_requests=4, max_seq_len=128))
    gate = HeldStep(passes=3)
    servers = [ServerThread([drafter.service()]), ServerThread([gate.wrap(verifier.service())])]
    yield {"drafter": servers[0].address, "verifier": servers[1].address, "gate": gate, "target": target,
           "verify_engine": verifier.engine}
    gate.released.set()
    for server in servers:
        server.stop()


def _start_scheduler(replicas: dict[str, Any]) -> tuple[SchedulerHub, ServerThread]:
    hub = SchedulerHub(model_name="m", policy="dspark", decode=None, timeout_s=10.0)
    hub.register_drafter("d", replicas["drafter"])  # what the replicas' heartbeats do after a restart
    hub.register_verifier("v", replicas["verifier"], SPS)
    return hub, ServerThread([hub.service()])


def _stream(url: str, max_tokens: int) -> list[dict[str, Any]]:
    events = []
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
    return events


def test_scheduler_restart_fails_in_flight_requests_with_503_then_serves(replicas: dict[str, Any]) -> None:
    hub, server = _start_scheduler(replicas)
    where = {"address": server.address}

    async def resolve() -> str:
        return where["address"]

    backend = RemoteBackend(resolve, model_name="m", max_context=127)
    app = build_app(backend, demo_tokenizer())
    expected = replicas["target"].generate([PROMPT], max_new_tokens=12)[0]
    with serve(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 60, "temperature": 0}
        plain = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
        streamed = pool.submit(_stream, url, 60)
        assert replicas["gate"].held.wait(60), "the requests never reached the verifier's 4th round"
        server.stop(grace_s=None)  # the scheduler process dies with its requests

        response = plain.result(timeout=60)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and "retried" in error["message"]
        events = streamed.result(timeout=60)
        assert events[-1]["error"]["code"] == 503 and events[-1]["error"]["type"] == "service_unavailable"
        assert any(e.get("choices") for e in events[:-1])  # it had streamed tokens before the failure

        # Serve starts a new scheduler (new port); replicas re-register; the old one's requests are released.
        replicas["gate"].released.set()
        hub.close()
        new_hub, new_server = _start_scheduler(replicas)
        where["address"] = new_server.address
        try:
            ok = httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                  "return_token_ids": True})
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["token_ids"] == expected
            assert replicas["verify_engine"].num_free_slots == 4
        finally:
            new_server.stop()
            new_hub.close()
        # No scheduler at all: a clear 503, not a hang.
        down = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable"
