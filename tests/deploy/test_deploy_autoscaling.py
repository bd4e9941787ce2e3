"""The verifier pool scales out under load and back in after it, on a real local Ray cluster, losing no request.

deploy/serve_config.yaml, shrunk for a 2-core machine (4 KV slots per replica, fast autoscaling), goes to Serve's
controller the way ``serve deploy`` and KubeRay send it: a config naming ``cluster.app:build_app`` with per-deployment
options. Concurrent streaming completions over HTTP fill the single verifier replica; it reports its KV-slot use
through ``record_autoscaling_stats``, the custom policy asks for a second replica, and the scheduler routes new
requests to it once it registers. When the load drops, Serve stops one verifier replica, which drains (the scheduler
stops giving it requests, its running ones finish) before it leaves. Every request must complete.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ray_start import init_local_ray

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
DEMO_DRAFT = ROOT / "models" / "demo" / "draft_dspark"
APP = "dspark"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _test_config(port: int) -> dict[str, Any]:
    """The shipped CPU config with test-sized engines and autoscaling that reacts in seconds."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"]["models"].update(target=str(DEMO_TARGET), draft=str(DEMO_DRAFT))
    app["args"]["engine"].update(max_requests=4, max_seq_len=256)
    app["args"]["scheduler"]["drain_timeout_s"] = 60
    del app["args"]["network"]["grpc_token_env"]  # this test's cluster does not have the variable
    app["args"]["network"]["grpc_token"] = "test-data-plane-token"
    deployments = {d["name"]: d for d in app["deployments"]}
    deployments["Verifier"]["autoscaling_config"].update(
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=2,  # of 4 KV slots: one full replica asks for a second
        metrics_interval_s=0.5,  # how often replicas push their load (default 10 s)
        look_back_period_s=1.5,
        upscale_delay_s=1,
        downscale_delay_s=4,
    )
    deployments["Drafter"].pop("autoscaling_config")
    deployments["Drafter"]["num_replicas"] = 1
    return config


@dataclass
class Load:
    """Client threads streaming completions in a loop until told to stop; every outcome is recorded."""

    base: str
    max_tokens: int
    ok: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int) -> Load:
        for i in range(clients):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _client(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = f"def f{index}_{n}(x):\n    return"
            try:
                self.ok.append(self._one(prompt))
            except Exception as error:  # recorded, asserted on by the test
                self.failed.append(f"{prompt!r}: {error!r}")

    def _one(self, prompt: str) -> str:
        body = {"model": "dspark-demo", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True}
        text, finish = "", None
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(f"error in stream: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
        if finish not in ("length", "stop"):
            raise RuntimeError(f"stream ended without a finish reason (text {text!r})")
        return text

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(180)
        assert not any(t.is_alive() for t in self.threads), "a client is stuck"


@pytest.fixture(scope="module")
def deployed() -> Iterator[str]:
    import ray
    from ray import serve
    from ray.serve._private import api as serve_private_api
    from ray.serve.schema import ServeDeploySchema

    init_local_ray(
        num_cpus=4,  # logical: 2 verifiers + drafter + scheduler + ingress at 0.5 each
        resources={"draft_pool": 1, "verify_pool": 1},
        object_store_memory=128 * 2**20,
        include_dashboard=False,
    )
    port = _free_port()
    config = ServeDeploySchema.model_validate(_test_config(port))
    # What `serve deploy` (through the dashboard) and `serve run CONFIG` do: start Serve with the file's HTTP
    # options, then hand the whole config to the controller, which imports cluster.app:build_app itself.
    client = serve_private_api.serve_start(http_options=config.http_options.model_dump())
    client.deploy_apps(config)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(healthy, 240, "the application to become healthy")
    yield base
    serve.shutdown()
    ray.shutdown()


def _running_verifiers() -> tuple[int, int]:
    """(RUNNING, total) Verifier replicas as Serve reports them."""
    from ray import serve

    states = serve.status().applications[APP].deployments["Verifier"].replica_states
    return states.get("RUNNING", 0), sum(states.values())


def _registered_verifiers() -> int:
    from ray import serve

    return serve.get_deployment_handle("Scheduler", app_name=APP).topology.remote().result()["verifiers"]


def test_verifier_pool_scales_out_under_load_and_in_after_it(deployed: str) -> None:
    # /health turns 200 once the verifier has registered with the scheduler, which it does from its constructor:
    # Serve may still list that replica as STARTING for a moment.
    _wait(lambda: _running_verifiers() == (1, 1), 60, "Serve to report the first Verifier replica RUNNING")
    heavy = Load(deployed, max_tokens=48).start(8)  # twice one replica's KV slots
    try:
        _wait(lambda: _running_verifiers() == (2, 2), 150, "a second Verifier replica under load")
        _wait(lambda: _registered_verifiers() == 2, 60, "the scheduler to route to the new verifier")
        served = len(heavy.ok)
        _wait(lambda: len(heavy.ok) >= served + 8, 120, "requests completing on two verifiers")
    finally:
        heavy.finish()
    # Light load: fewer running requests than one replica's target, so the pool shrinks back, while long
    # requests keep running on both replicas (the one Serve stops has to drain them).
    light = Load(deployed, max_tokens=160).start(2)
    try:
        _wait(lambda: _running_verifiers() == (1, 1), 150, "the Verifier pool to scale back to one replica")
        _wait(lambda: _registered_verifiers() == 1, 60, "the scheduler to forget the stopped verifier")
        done = len(light.ok)
        _wait(lambda: len(light.ok) >= done + 2, 120, "requests completing after the scale-in")
    finally:
        light.finish()
    assert heavy.failed == [] and light.failed == []
    assert len(heavy.ok) >= 16 and len(light.ok) >= 2
    assert all(heavy.ok) and all(light.ok)
