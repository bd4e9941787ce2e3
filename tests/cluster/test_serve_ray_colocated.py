"""The ``colocated`` placement on a real local Ray cluster, driven over HTTP with the openai client.

One head node plus a ``verify_pool`` node: the engine replica (target, drafter and the in-process round pipeline)
must land on the pool's node, greedy output must equal the target's own greedy output (streamed or not), sampled
output must follow the target's distribution (chi-square on the first two tokens, the second of which goes
through drafting and rejection sampling), and a client that disconnects mid-stream must free its slot.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from ray_start import start_local_cluster
from slo_refusal import assert_unattainable_target_refused
from stats import chi_square_p_value

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
DEMO_DRAFT = ROOT / "models" / "demo" / "draft_dspark"
SLOTS = 8
TOKEN = "test-data-plane-token"


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

    cluster, (verify_node,) = start_local_cluster(
        head={"num_cpus": 2, "object_store_memory": 128 * 2**20},
        workers=[{"num_cpus": 1, "resources": {"verify_pool": 1}, "object_store_memory": 96 * 2**20}],
    )
    ray.init(address=cluster.address)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    from cluster.app import assemble_app

    args = {
        "placement": "colocated",
        "models": {"target": str(DEMO_TARGET), "draft": str(DEMO_DRAFT)},
        "engine": {"max_requests": SLOTS, "max_seq_len": 256},
        "verify_pool": {"resource": "verify_pool", "num_cpus": 0.5},
        "network": {"grpc_token": TOKEN},
    }
    overrides = {"Ingress": {"ray_actor_options": {"num_cpus": 0.2}},
                 "Scheduler": {"ray_actor_options": {"num_cpus": 0.2}}}
    serve.run(assemble_app(args, overrides), name="dspark", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    _wait(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 180, "the app to become healthy")
    yield {"base": base, "verify_node": verify_node.node_id}
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, app_name="dspark")


def _client(served: dict):
    import openai

    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key="unused", timeout=120, max_retries=0)


def test_only_the_engine_deployment_serves_and_lands_on_its_pool(served: dict) -> None:
    from ray import serve

    deployments = set(serve.status().applications["dspark"].deployments)
    assert deployments == {"Ingress", "Scheduler", "Engine"}
    assert _handle("Engine").node_id.remote().result() == served["verify_node"]
    endpoints = _handle("Scheduler").endpoints.remote().result()
    assert len(endpoints["engines"]) == 1 and not endpoints["verifiers"] and not endpoints["drafters"]
    info = httpx.get(f"{served['base']}/v1/models", timeout=30).json()["data"][0]
    sps = info["dspark"]["sps"]
    assert len(sps) == 1 and next(iter(sps.values()))["origin"]["source"] in ("cache", "profiled")


def test_greedy_completions_equal_target_greedy(served: dict) -> None:
    from transformers import AutoTokenizer

    from verify_service.target import TargetModel

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    target = TargetModel.from_pretrained(DEMO_TARGET)
    client = _client(served)
    for prompt in ["    def keys(self):\n        return list(self._data.", "import os\n\ndef main():\n"]:
        expected = tokenizer.decode(target.generate([tokenizer(prompt).input_ids], max_new_tokens=32)[0],
                                    skip_special_tokens=True)
        out = client.completions.create(model="dspark-demo", prompt=prompt, max_tokens=32, temperature=0)
        assert out.choices[0].text == expected
        streamed = client.completions.create(model="dspark-demo", prompt=prompt, max_tokens=32, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected


def _pair_distribution(prompt: str) -> dict[str, float]:
    """The target's exact distribution of the text of its first two sampled tokens at T = 1 (pairs whose
    texts coincide are pooled; the rest of the mass goes to ``""``, the "other" bin)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        probs: dict[str, float] = {}
        top1 = torch.topk(first, 6)
        for p1, t1 in zip(top1.values.tolist(), top1.indices.tolist(), strict=True):
            second = torch.softmax(model(torch.tensor([[*ids, t1]])).logits[0, -1].float(), -1)
            top2 = torch.topk(second, 6)
            for p2, t2 in zip(top2.values.tolist(), top2.indices.tolist(), strict=True):
                text = tokenizer.decode([t1, t2], skip_special_tokens=True)
                probs[text] = probs.get(text, 0.0) + p1 * p2
    probs[""] = max(0.0, 1.0 - sum(probs.values()))
    return probs


def test_sampled_output_follows_the_target_distribution(served: dict) -> None:
    prompt = "    def keys(self):\n        return list(self."
    expected = _pair_distribution(prompt)
    client = _client(served)

    def sample(seed: int) -> str:
        out = client.completions.create(model="dspark-demo", prompt=prompt, max_tokens=2, temperature=1.0,
                                        seed=seed, extra_body={"ignore_eos": True})
        return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        texts = list(pool.map(sample, range(400)))
    bins = list(expected)
    observed = np.zeros(len(bins))
    for text in texts:
        observed[bins.index(text) if text in expected else bins.index("")] += 1
    p_value = chi_square_p_value(observed, np.array([expected[b] for b in bins]))
    assert p_value > 1e-3, (p_value, dict(zip(bins, observed.tolist(), strict=True)))


def _running() -> int:
    from cluster.contract import ENGINE
    from cluster.rpc import SyncRpcClient

    (address,) = _handle("Scheduler").endpoints.remote().result()["engines"].values()
    client = SyncRpcClient(address, token=TOKEN, timeout_s=10)
    try:
        reply = client.call(ENGINE, "Metrics", {})
    finally:
        client.close()
    return reply["running"] + reply["waiting"]


def test_concurrent_requests_and_disconnect_free_the_slots(served: dict) -> None:
    client = _client(served)

    def one(i: int) -> str:
        return client.completions.create(model="dspark-demo", prompt=f"x = {i}\n", max_tokens=16,
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(6)))

    def hang_up(i: int) -> None:
        body = {"model": "dspark-demo", "prompt": f"class A{i}:\n", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{served['base']}/v1/completions", timeout=60, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk received, then hang up

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(hang_up, range(4)))
    _wait(lambda: _running() == 0, 60, "the engine replica to free the aborted requests")
    assert _handle("Scheduler").endpoints.remote().result()["engines"]  # still registered
    text = httpx.get(f"{served['base']}/metrics", timeout=30).text
    assert "dspark_output_tokens_total" in text
    # Every request was routed by the scheduler first, and the ingress timed each Route call.
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    routes = sum(s.value for s in families["dspark_http_routes"] if s.name.endswith("_total"))
    assert routes >= 10 and sum(s.value for s in families["dspark_http_route_seconds"]) > 0
    assert sum(s.value for s in families["dspark_http_first_deltas"] if s.name.endswith("_total")) >= 10


def test_unattainable_target_is_refused_with_429_and_retry_after(served: dict) -> None:
    assert_unattainable_target_refused(served["base"], "dspark-demo")
