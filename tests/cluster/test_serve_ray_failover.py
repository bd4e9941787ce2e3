"""A Verifier replica process is killed while requests stream over HTTP: every client still completes with the
target's greedy output, with no error and no duplicated or missing text (real multi-node local Ray cluster). The
deployment uses the collective feature links and two request groups per verifier (both off by default).

Two verifier replicas share the verify pool's node; ``ray.kill`` ends one replica actor (its process, its gRPC
server and its KV caches) once every client has received text. The scheduler re-prefills the dead replica's
requests on the other one from prompt + emitted tokens; Serve then starts a replacement, which re-registers.
Then the scheduler is killed: Serve replaces it, every pool replica registers with the new one, and it serves.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from ray_start import start_local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
DEMO_DRAFT = ROOT / "models" / "demo" / "draft_dspark"
PROMPTS = ["def add(a, b):\n    return", "import os\n\ndef main():\n", "class Stack:\n", "for i in range(10):\n",
           "x = [1, 2, 3]\n", "# compute the mean\n"]
MAX_TOKENS = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:  # the app may still be starting
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _topology() -> dict[str, int]:
    from ray import serve

    return serve.get_deployment_handle("Scheduler", app_name="dspark").topology.remote().result(timeout_s=10)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    import ray
    from ray import serve

    cluster, _ = start_local_cluster(
        head={"num_cpus": 2, "object_store_memory": 128 * 2**20},
        workers=[{"num_cpus": 1, "resources": {"draft_pool": 1}, "object_store_memory": 96 * 2**20},
                 {"num_cpus": 2, "resources": {"verify_pool": 1}, "object_store_memory": 96 * 2**20}],
    )
    ray.init(address=cluster.address)
    try:
        yield from _deploy()
    finally:  # also when the deployment fails: the next module starts its own cluster
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _deploy() -> Iterator[str]:
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    from cluster.app import assemble_app

    args = {
        "models": {"target": str(DEMO_TARGET), "draft": str(DEMO_DRAFT)},
        # The non-default data plane options run here too, under Serve and through a replica's death: the
        # context features over torch.distributed links (gloo), and pipelined request groups.
        "engine": {"max_requests": 8, "max_seq_len": 256, "feature_transport": "collective"},
        "scheduler": {"request_groups": 2},
        "draft_pool": {"resource": "draft_pool", "num_cpus": 0.5},
        "verify_pool": {"resource": "verify_pool", "num_cpus": 0.5},
        # A stream cut by the scheduler's death waits this long for its replacement (slow starts on 2 loaded cores).
        "network": {"grpc_timeout_s": 20, "grpc_token": "test-data-plane-token", "readiness_timeout_s": 120},
    }
    overrides = {"Ingress": {"ray_actor_options": {"num_cpus": 0.2}},
                 "Scheduler": {"ray_actor_options": {"num_cpus": 0.2}},
                 "Verifier": {"num_replicas": 2}}
    serve.run(assemble_app(args, overrides), name="dspark", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    _wait(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 180, "the app to become healthy")
    _wait(lambda: _topology()["verifiers"] == 2, 120, "both verifiers to register")
    yield base


def _stream_events(url: str, body: dict, timeout_s: float, on_event: Callable[[], None]) -> list[dict]:
    """The data events of a streamed completion (a 200 expected), calling ``on_event`` as each arrives."""
    events = []
    with httpx.stream("POST", url, json=body, timeout=timeout_s) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
                on_event()
    return events


def _verifier_actors() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and "#Verifier#" in a["name"])


def test_killing_a_verifier_replica_mid_stream_loses_nothing(served: str) -> None:
    import ray
    from transformers import AutoTokenizer

    from verify_service.target import TargetModel

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    target = TargetModel.from_pretrained(DEMO_TARGET)
    expected = [
        tokenizer.decode(ids, skip_special_tokens=True)
        for ids in target.generate([tokenizer(p).input_ids for p in PROMPTS], max_new_tokens=MAX_TOKENS)
    ]
    received = [0] * len(PROMPTS)
    lock = threading.Lock()

    def client(i: int) -> tuple[str, list[dict]]:
        body = {"model": "dspark-demo", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "ignore_eos": True}
        def count() -> None:
            with lock:
                received[i] += 1

        events = _stream_events(f"{served}/v1/completions", body, 150, count)
        return "".join(c["text"] for e in events for c in e.get("choices", [])), events

    victims = _verifier_actors()
    assert len(victims) == 2
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(client, i) for i in range(len(PROMPTS))]
        _wait(lambda: all(received), 120, "every client to receive text")
        ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
        results = [f.result(timeout=150) for f in futures]
    for (text, events), want in zip(results, expected, strict=True):
        assert not [e for e in events if "error" in e]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert text == want
    # Serve replaces the dead replica and the replacement registers with the scheduler by heartbeat.
    _wait(lambda: _topology()["verifiers"] == 2 and victims[0] not in _verifier_actors(), 120,
          "a replacement verifier to register")
    # The features really went over links (the gRPC pushes carried metadata only).
    from ray import serve

    from cluster.rpc import SyncRpcClient

    address = serve.get_deployment_handle("Drafter", app_name="dspark").address.remote().result(timeout_s=30)
    with SyncRpcClient(address, token="test-data-plane-token", timeout_s=30) as drafter:
        assert drafter.call("dspark.Drafter", "Info", {})["feature_links"] >= 1  # the surviving verifier's


def test_a_killed_scheduler_is_replaced_and_relearns_every_replica(served: str) -> None:
    """Serve notices the scheduler's death at its next health check (``HEALTH_CHECK_PERIOD_S``) and starts
    another; the pool replicas' heartbeats register with it in whatever order they arrive (a verifier heard before
    the drafter is told "not yet" and retries), and it then serves the target's greedy output."""
    import ray
    from transformers import AutoTokenizer

    from verify_service.target import TargetModel

    def schedulers() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "serve" and "#Scheduler#" in a["name"]]

    (victim,) = schedulers()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    _wait(lambda: len(schedulers()) == 1 and victim not in schedulers(), 120, "Serve to replace the scheduler")
    _wait(lambda: httpx.get(f"{served}/health", timeout=5).status_code == 200, 180, "the new scheduler to be ready")
    _wait(lambda: _topology() == {"drafters": 1, "verifiers": 2}, 120, "every replica to register again")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    want = tokenizer.decode(TargetModel.from_pretrained(DEMO_TARGET).generate(
        [tokenizer(PROMPTS[0]).input_ids], max_new_tokens=32)[0], skip_special_tokens=True)
    body = {"model": "dspark-demo", "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{served}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == want


def _scheduler_process() -> int:
    """The PID of the Scheduler replica's process: the descendant of this test process (it started the local
    cluster) titled as Serve titles its replicas, as ``bench/fault_inject.py`` finds the one to kill."""
    import psutil  # Ray's vendored copy: importing ray put it on the path

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::ServeReplica:dspark:Scheduler"):
                found.append(child.pid)
        except psutil.Error:
            continue
    assert len(found) == 1, found
    return found[0]


def test_streams_continue_when_the_scheduler_process_is_killed_mid_stream(served: str) -> None:
    """SIGKILL of the scheduler replica's process while greedy completions stream: every stream waits for the
    replacement and continues there, ending with the target's greedy text (nothing sent twice, nothing lost), the
    finish reason of an uncut run and usage counting the original prompt and every completion token."""
    import os
    import signal

    from transformers import AutoTokenizer

    from verify_service.target import TargetModel

    prompts, max_tokens = PROMPTS[:4], 200
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    expected = [tokenizer.decode(ids, skip_special_tokens=True)
                for ids in TargetModel.from_pretrained(DEMO_TARGET).generate(prompt_ids, max_new_tokens=max_tokens)]
    received = [0] * len(prompts)
    after_kill = [0] * len(prompts)
    killed = threading.Event()
    lock = threading.Lock()

    def client(i: int) -> list[dict]:
        body = {"model": "dspark-demo", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        def count() -> None:
            with lock:
                received[i] += 1
                after_kill[i] += killed.is_set()

        return _stream_events(f"{served}/v1/completions", body, 300, count)

    victim = _scheduler_process()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client, i) for i in range(len(prompts))]
        _wait(lambda: all(n >= 2 for n in received), 120, "every client to receive text")
        killed.set()
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
    assert all(after_kill), f"a stream was not in flight at the kill: {after_kill}"
    for events, want, ids in zip(results, expected, prompt_ids, strict=True):
        assert not [e for e in events if "error" in e], [e for e in events if "error" in e]
        chunks = [c for e in events for c in e.get("choices", [])]
        assert "".join(c["text"] for c in chunks) == want
        assert chunks[-1]["finish_reason"] == "length"
        assert events[-1]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": max_tokens,
                                       "total_tokens": len(ids) + max_tokens}
    _wait(lambda: _topology() == {"drafters": 1, "verifiers": 2}, 120, "every replica to register again")
