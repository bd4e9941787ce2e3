"""Readiness of the served product before and after its replicas are there, over HTTP.

Real pieces on loopback, as the Ray deployment wires them (without Ray): the scheduler hub's gRPC service, the
OpenAI app on uvicorn over :class:`RemoteBackend` (the Serve ingress), and drafter / verifier gRPC services built
by :mod:`cluster.loading` exactly as the pool replicas build them (warm-up, SPS lookup) over a tiny random pair.
Replicas register with the hub as their heartbeats would. Every wait is on a condition with a generous bound.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from http_harness import demo_tokenizer, serve
from model_factory import PairSpec, write_pair

from cluster.config import AppConfig
from cluster.http_app import build_app
from cluster.loading import build_drafter_service, build_verifier_service
from cluster.probe import main as probe
from cluster.readiness import RETRY_AFTER_S
from cluster.remote_backend import RemoteBackend
from cluster.rpc import ServerThread
from scheduler.hub import SchedulerHub
from verify_service.target import TargetModel

PROMPT = [5, 6, 7]


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        threading.Event().wait(0.01)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("readiness")
    target_dir, draft_dir = write_pair(root, PairSpec(vocab=128, block_size=4, seed=5))
    config = AppConfig.from_args({
        "models": {"target": str(target_dir), "draft": str(draft_dir)},
        "engine": {"max_requests": 4, "max_seq_len": 128},
        "cache_dir": str(root / "cache"),
    })
    drafter = build_drafter_service(config, "127.0.0.1")
    verifier = build_verifier_service(config)
    servers = [ServerThread([drafter.service()]), ServerThread([verifier.service()])]
    yield {"drafter": servers[0].address, "verifier": servers[1].address, "sps": verifier.sps,
           "target": TargetModel.from_pretrained(target_dir), "verify_engine": verifier.engine}
    for server in servers:
        server.stop()
    drafter.close()


@pytest.fixture
def ingress() -> Iterator[dict[str, Any]]:
    hub = SchedulerHub(model_name="m", policy="dspark", decode=None, timeout_s=60.0, readiness_timeout_s=60.0)
    server = ServerThread([hub.service()])

    async def resolve() -> str:
        return server.address

    app = build_app(RemoteBackend(resolve, model_name="m", max_context=127), demo_tokenizer())
    with serve(app) as url:
        yield {"hub": hub, "url": url}
    server.stop()
    hub.close()


def _unavailable(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == str(RETRY_AFTER_S)
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and reason in error["message"], error


def test_health_follows_the_replicas_and_a_request_sent_before_readiness_waits(
    deployment: dict[str, Any], ingress: dict[str, Any]
) -> None:
    hub, url = ingress["hub"], ingress["url"]
    _unavailable(httpx.get(f"{url}/health", timeout=30), "no verifier replica is registered yet")
    assert probe(["--url", f"{url}/health"]) == 1  # the pod's readiness probe (deploy/rayservice.yaml)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        early = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        _wait(lambda: hub.num_waiting_for_readiness == 1, "the early request to wait for readiness")
        hub.register_drafter("d0", deployment["drafter"])
        _unavailable(httpx.get(f"{url}/health", timeout=30), "no verifier replica is registered yet")
        assert not early.done()
        hub.register_verifier("v0", deployment["verifier"], deployment["sps"])
        response = early.result(timeout=120)
    assert response.status_code == 200, response.text
    expected = deployment["target"].generate([PROMPT], max_new_tokens=10)[0]
    assert response.json()["choices"][0]["token_ids"] == expected  # served like any later request: lossless
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert probe(["--url", f"{url}/health"]) == 0
    # The model card says which SPS table the verifier prices rounds with, and where it came from.
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert card["dspark"]["sps"]["v0"]["origin"]["source"] in ("profiled", "cache")
    # A drafting policy without an accepting drafter is not ready; neither is a deployment whose verifiers left.
    hub.drain_drafter("d0")
    _unavailable(httpx.get(f"{url}/health", timeout=30), "every drafter replica is draining")
    hub.unregister_drafter("d0")
    _unavailable(httpx.get(f"{url}/health", timeout=30), "no drafter replica is registered")
    hub.drain_verifier("v0")
    hub.unregister_verifier("v0")
    _unavailable(httpx.get(f"{url}/health", timeout=30), "no verifier replica is registered yet")
    assert deployment["verify_engine"].num_free_slots == 4


def test_requests_past_the_readiness_bound_get_503_retry_after_logged_once(
    ingress: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    hub, url = ingress["hub"], ingress["url"]
    hub.readiness_timeout_s = 0.2
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
    with caplog.at_level(logging.INFO):
        for stream in (False, True, False, False, True):
            _unavailable(httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=30),
                         "no verifier replica is registered yet (waited 0.2 s)")
    refusals = [r for r in caplog.records if "refused since the last report" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # once per interval, not per request
    assert not [r for r in caplog.records if r.exc_info], "a refused request logged a traceback"
    assert hub.num_waiting_for_readiness == 0


def test_readiness_probe_passes_before_the_application_is_deployed(ingress: dict[str, Any]) -> None:
    """KubeRay deploys the application only once the head pod is Ready: no listener, or a proxy that routes no
    application (404), must not hold the pod back."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert probe(["--url", f"http://127.0.0.1:{free}/health"]) == 0
    assert probe(["--url", f"{ingress['url']}/no-application-here"]) == 0


def test_heartbeats_the_hub_refuses_are_retried_and_logged_once_per_interval(
    deployment: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A pool replica registers by heartbeat every few seconds: a verifier heard before any drafter is not
    registered yet (quietly), and a replica the hub cannot use (here: nothing listens at its address) is refused
    with one log line per interval and no traceback, instead of one traceback per heartbeat."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    hub = SchedulerHub(model_name="m", policy="dspark", decode=None, timeout_s=10.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="scheduler.hub"):
            assert hub.heartbeat("verifier", "v0", deployment["verifier"], deployment["sps"]) is False
            assert [hub.heartbeat("drafter", "gone", dead) for _ in range(3)] == [False, False, False]
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "3 registration(s) refused" not in warnings[0].getMessage()  # the first refusal is reported at once
        assert "drafter gone at " + dead in warnings[0].getMessage() and warnings[0].exc_info is None
        assert not hub.readiness().ready
        assert hub.heartbeat("drafter", "d0", deployment["drafter"]) is True
        assert hub.heartbeat("verifier", "v0", deployment["verifier"], deployment["sps"]) is True
        assert hub.heartbeat("verifier", "v0", deployment["verifier"], deployment["sps"]) is True  # idempotent
        assert hub.readiness().ready
        with pytest.raises(ValueError, match="unknown replica kind"):
            hub.heartbeat("router", "r0", dead)
    finally:
        hub.drain_verifier("v0")
        hub.unregister_verifier("v0")
        hub.unregister_drafter("d0")
        hub.close()
    assert deployment["verify_engine"].num_free_slots == 4
