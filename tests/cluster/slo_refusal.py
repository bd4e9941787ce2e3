"""The check that a served deployment refuses an unattainable TPOT target with 429 + ``Retry-After`` (HTTP API
"Service levels"), shared by the real-Ray tests of both placements: over Ray the refusal crosses the scheduler's
or an engine replica's gRPC stream before the ingress answers it."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _refused(base: str, priority: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dspark_tier_refused_total" and sample.labels.get("priority") == priority
    )


def assert_unattainable_target_refused(base: str, model: str) -> None:
    """One request gives the server a round time to predict from; a target of a microsecond per token is then
    refused: 429, ``Retry-After``, OpenAI's error body naming ``tpot_slo_ms``, the tier's refusal counted (the
    counters reach ``/metrics`` with the engine's next snapshot: waited for, generously)."""
    body = {"model": model, "prompt": "def read_config(path):\n", "max_tokens": 8, "temperature": 0}
    served = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert served.status_code == 200, served.text
    before = _refused(base, "7")
    reply = httpx.post(f"{base}/v1/completions", json={**body, "tpot_slo_ms": 0.001, "priority": 7}, timeout=120)
    assert reply.status_code == 429, reply.text
    assert reply.headers["Retry-After"] == "1"
    error = reply.json()["error"]
    assert error["code"] == "slo_unattainable" and error["param"] == "tpot_slo_ms", error
    assert "cannot be met" in error["message"]
    deadline = time.monotonic() + 60
    while _refused(base, "7") < before + 1:
        assert time.monotonic() < deadline, "the refusal never reached /metrics"
        httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 1}, timeout=120)  # one more round
    # A target the server meets is served as usual.
    met = httpx.post(f"{base}/v1/completions", json={**body, "tpot_slo_ms": 60_000.0, "priority": 7}, timeout=120)
    assert met.status_code == 200, met.text
