"""The Serve application on a real multi-node local Ray cluster, driven over HTTP with the openai client.

One head node plus one node per pool (``draft_pool``, ``verify_pool``): the drafter and verifier replicas must land
on their pool's node, greedy output must equal the target's own greedy output, and a client that disconnects
mid-stream must free the request's caches on both replicas.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ray_start import start_local_cluster
from slo_refusal import assert_unattainable_target_refused

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
DEMO_DRAFT = ROOT / "models" / "demo" / "draft_dspark"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def served() -> Iterator[dict]:
    import ray
    from ray import serve

    cluster, (draft_node, verify_node) = start_local_cluster(
        head={"num_cpus": 2, "object_store_memory": 128 * 2**20},
        workers=[{"num_cpus": 1, "resources": {"draft_pool": 1}, "object_store_memory": 96 * 2**20},
                 {"num_cpus": 1, "resources": {"verify_pool": 1}, "object_store_memory": 96 * 2**20}],
    )
    ray.init(address=cluster.address)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    from cluster.app import assemble_app

    args = {
        "models": {"target": str(DEMO_TARGET), "draft": str(DEMO_DRAFT)},
        "engine": {"max_requests": 8, "max_seq_len": 256},
        "draft_pool": {"resource": "draft_pool", "num_cpus": 0.5},
        "verify_pool": {"resource": "verify_pool", "num_cpus": 0.5},
        "network": {"grpc_token": "test-data-plane-token"},
    }
    overrides = {"Ingress": {"ray_actor_options": {"num_cpus": 0.2}},
                 "Scheduler": {"ray_actor_options": {"num_cpus": 0.2}}}
    serve.run(assemble_app(args, overrides), name="dspark", route_prefix="/")
    # A RUNNING application has its pool replicas warm and registered (their constructors end with that).
    topology = serve.get_deployment_handle("Scheduler", app_name="dspark").topology.remote().result()
    assert topology == {"drafters": 1, "verifiers": 1}
    base = f"http://127.0.0.1:{port}"
    _wait(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 180, "the app to become healthy")
    yield {
        "base": base,
        "draft_node": draft_node.node_id,
        "verify_node": verify_node.node_id,
    }
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, app_name="dspark")


def _free_slots() -> tuple[int, int]:
    from cluster.rpc import SyncRpcClient

    out = []
    for name, service in (("Drafter", "dspark.Drafter"), ("Verifier", "dspark.Verifier")):
        client = SyncRpcClient(_handle(name).address.remote().result(), token="test-data-plane-token", timeout_s=10)
        out.append(client.call(service, "Info", {})["free_slots"])
        client.close()
    return out[0], out[1]


def test_pools_are_placed_on_their_nodes(served: dict) -> None:
    assert _handle("Drafter").node_id.remote().result() == served["draft_node"]
    assert _handle("Verifier").node_id.remote().result() == served["verify_node"]


def test_greedy_completions_equal_target_greedy(served: dict) -> None:
    import openai
    from transformers import AutoTokenizer

    from verify_service.target import TargetModel

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    target = TargetModel.from_pretrained(DEMO_TARGET)
    client = openai.OpenAI(base_url=f"{served['base']}/v1", api_key="unused", timeout=120)
    prompts = ["def add(a, b):\n    return", "import os\n\ndef main():\n"]
    for prompt in prompts:
        expected = tokenizer.decode(target.generate([tokenizer(prompt).input_ids], max_new_tokens=24)[0],
                                    skip_special_tokens=True)
        out = client.completions.create(model="dspark-demo", prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == expected
        assert out.usage.completion_tokens == 24
        streamed = client.completions.create(model="dspark-demo", prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected


def test_the_whole_slot_is_served_as_in_one_process(served: dict) -> None:
    """The ingress admits what a slot holds (max_seq_len prompt + completion tokens), as ``--no-ray`` does."""
    url = f"{served['base']}/v1"
    assert httpx.get(f"{url}/models", timeout=30).json()["data"][0]["max_model_len"] == 256
    body = {"model": "dspark-demo", "prompt": [100 + i % 50 for i in range(240)], "temperature": 0,
            "ignore_eos": True}
    full = httpx.post(f"{url}/completions", json={**body, "max_tokens": 16}, timeout=120)
    assert full.status_code == 200, full.text
    assert full.json()["usage"] == {"prompt_tokens": 240, "completion_tokens": 16, "total_tokens": 256}
    over = httpx.post(f"{url}/completions", json={**body, "max_tokens": 17}, timeout=120)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded", over.text


def test_concurrent_requests_and_disconnect_frees_caches(served: dict) -> None:
    import concurrent.futures

    import openai

    client = openai.OpenAI(base_url=f"{served['base']}/v1", api_key="unused", timeout=120)

    def one(i: int) -> str:
        out = client.completions.create(model="dspark-demo", prompt=f"x = {i}\n", max_tokens=16, temperature=0)
        return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, range(6)))
    assert all(texts)

    def hang_up(i: int) -> None:
        body = {"model": "dspark-demo", "prompt": f"class A{i}:\n", "max_tokens": 200, "stream": i % 2 == 0}
        if body["stream"]:
            with httpx.stream("POST", f"{served['base']}/v1/completions", timeout=60, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break  # one chunk received, then hang up
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{served['base']}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))

    aborted_before = _counter(served["base"], "dspark_requests_aborted")
    errors_before = _counter(served["base"], "dspark_http_errors")  # start-up probes may have seen a 503
    # Several hang-ups at once: under Serve a hang-up can surface as a failing ASGI receive (the proxy dropped the
    # request), which must still be an abort, not a 500 with a traceback.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(hang_up, range(8)))
    _wait(lambda: _free_slots() == (8, 8), 60, "both replicas to free the aborted requests' caches")
    assert _counter(served["base"], "dspark_http_errors") == errors_before
    aborted = _counter(served["base"], "dspark_requests_aborted")[""] - aborted_before.get("", 0.0)
    assert 4 <= aborted <= 8  # every hang-up that reached the app (a request the proxy dropped first never did)


def _counter(base: str, family: str) -> dict[str, float]:
    """A counter's totals by its ``status`` label ("" when it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {
        sample.labels.get("status", ""): sample.value
        for metric in text_string_to_metric_families(text)
        if metric.name == family
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def test_unattainable_target_is_refused_with_429_and_retry_after(served: dict) -> None:
    assert_unattainable_target_refused(served["base"], "dspark-demo")
