"""Per-request service levels through the OpenAI API of a real in-process server (docs/HTTP_API.md "Service
levels"): speculation off gives the target's greedy output with no drafted round, waiting requests are admitted
in tier order, a TPOT target that cannot be met is refused with 429 + Retry-After (or queued), invalid values
are 400s, and under contention a request behind its target gets more verification budget than a best-effort one.

The servers price rounds with a steep SPS table (a verifier that slows down fast with the batch: contention),
so Algorithm 1's early stop trims drafts and lateness weighting has budget to move."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
from http_harness import DEMO_TARGET, MODEL, demo_tokenizer, serve, write_demo_drafter
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from cluster.backend import LocalBackend
from cluster.config import AppConfig
from cluster.http_app import build_app
from cluster.loading import build_local_backend
from scheduler.service_levels import ServiceLevels
from scheduler.sps import SPSTable
from verify_service.target import TargetModel

PROMPT = "def read_config(path):\n"


class Served:
    def __init__(self, url: str, backend: LocalBackend) -> None:
        self.url = url
        self.backend = backend
        self.http = httpx.Client(base_url=url, timeout=120)

    def complete(self, **body: object) -> httpx.Response:
        return self.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0, **body})

    def value(self, name: str, **labels: str) -> float:
        """Sum of the /metrics samples called ``name`` whose labels include ``labels``, once the engine loop
        has published the snapshot of its last round (it does after every loop pass: one more pass is run)."""
        self.backend.call(lambda _engine: None).result(timeout=30)
        time.sleep(0.05)
        text = self.http.get("/metrics").text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )


def _start(root: Path, levels: ServiceLevels, max_requests: int) -> LocalBackend:
    sps = SPSTable([1, 2, 4, 8, 16, 32], [100.0, 90.0, 70.0, 45.0, 25.0, 12.0]).save(root / "sps.json")
    config = AppConfig.from_args({
        "model_name": MODEL,
        "models": {"target": str(DEMO_TARGET), "draft": str(write_demo_drafter(root)), "sps": str(sps)},
        "engine": {"max_requests": max_requests, "max_seq_len": 256},
        "scheduler": {"policy": "dspark", "service_levels": asdict(levels)},
    })
    return build_local_backend(config, tokenizer=AutoTokenizer.from_pretrained(DEMO_TARGET))


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    backend = _start(tmp_path_factory.mktemp("slo_refuse"), ServiceLevels(slo_admission="refuse"), 2)
    try:
        with serve(build_app(backend, demo_tokenizer())) as url:
            yield Served(url, backend)
    finally:
        backend.close()


@pytest.fixture(scope="module")
def queueing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    levels = ServiceLevels(slo_admission="queue", on_target_weight=0.05)
    backend = _start(tmp_path_factory.mktemp("slo_queue"), levels, 4)
    try:
        with serve(build_app(backend, demo_tokenizer())) as url:
            yield Served(url, backend)
    finally:
        backend.close()


def test_speculation_off_is_target_greedy_with_no_drafted_round(refusing: Served) -> None:
    target = TargetModel.from_pretrained(DEMO_TARGET)
    ids = demo_tokenizer().encode(PROMPT, add_special_tokens=True)
    expected = target.generate([ids], max_new_tokens=24, stop_token_ids=tuple(target.eos_token_ids))[0][:24]
    rounds = refusing.value("dspark_rounds_total")
    plain = refusing.value("dspark_rounds_without_draft_total")
    drafts = refusing.value("vllm:spec_decode_num_draft_tokens_total")
    reply = refusing.complete(max_tokens=24, speculative="off", return_token_ids=True)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == expected
    ran = refusing.value("dspark_rounds_total") - rounds
    assert ran > 0
    assert refusing.value("dspark_rounds_without_draft_total") - plain == ran  # every round: no drafter call
    assert refusing.value("vllm:spec_decode_num_draft_tokens_total") == drafts
    # ... and the same request with speculation on gives the same tokens, drafting every round.
    rounds = refusing.value("dspark_rounds_total")
    plain = refusing.value("dspark_rounds_without_draft_total")
    reply = refusing.complete(max_tokens=24, speculative="on", return_token_ids=True)
    assert reply.json()["choices"][0]["token_ids"] == expected
    assert refusing.value("dspark_rounds_total") > rounds
    assert refusing.value("dspark_rounds_without_draft_total") == plain


def _engine_counts(served: Served) -> tuple[int, int]:
    """(running, waiting) requests, read on the engine loop between rounds."""
    return served.backend.call(lambda engine: (engine.num_running, engine.num_waiting)).result(timeout=30)


def _wait_for_counts(served: Served, running: int, waiting: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (counts := _engine_counts(served)) != (running, waiting):
        assert time.monotonic() < deadline, f"(running, waiting) = {counts}, expected {(running, waiting)}"
        time.sleep(0.005)


def test_waiting_requests_are_admitted_in_priority_order(refusing: Served) -> None:
    """Both slots are held by long requests of different lengths (so they free one slot at a time); a low tier
    and then a high tier (smaller value) queue behind them. The first slot freed goes to the high tier, whose short
    request ends before the low tier is admitted (to the slot it frees, or the longer holder's). Progress is read
    from the engine, not slept for."""
    finished: list[str] = []

    def run(name: str, **body: object) -> None:
        reply = refusing.complete(**body)
        assert reply.status_code == 200, reply.text
        finished.append(name)

    with ThreadPoolExecutor(4) as pool:
        holders = [
            pool.submit(run, f"hold{i}", max_tokens=n, ignore_eos=True) for i, n in enumerate((160, 230))
        ]
        _wait_for_counts(refusing, running=2, waiting=0)
        low = pool.submit(run, "low", max_tokens=4, priority=5)
        _wait_for_counts(refusing, running=2, waiting=1)
        high = pool.submit(run, "high", max_tokens=4, priority=-5)
        _wait_for_counts(refusing, running=2, waiting=2)
        for future in [*holders, low, high]:
            future.result(timeout=120)
    assert finished[0] == "hold0" and finished.index("high") < finished.index("low"), finished
    assert refusing.value("dspark_tier_requests_total", priority="-5") >= 1


def test_unattainable_target_is_refused_with_429_and_retry_after(refusing: Served) -> None:
    assert refusing.complete(max_tokens=8).status_code == 200  # some rounds: a round time to predict from
    refused = refusing.value("dspark_tier_refused_total", priority="3")
    reply = refusing.complete(max_tokens=8, tpot_slo_ms=0.001, priority=3)
    assert reply.status_code == 429, reply.text
    assert reply.headers["Retry-After"] == "1"
    error = reply.json()["error"]
    assert error["code"] == "slo_unattainable" and error["param"] == "tpot_slo_ms"
    assert refusing.value("dspark_tier_refused_total", priority="3") == refused + 1
    assert refusing.value("dspark_http_errors_total", status="429") >= 1
    # A target the server can meet is served, and its attainment counted.
    reply = refusing.complete(max_tokens=8, tpot_slo_ms=60_000.0, priority=3)
    assert reply.status_code == 200, reply.text
    assert refusing.value("dspark_tier_slo_requests_total", priority="3", attained="true") >= 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("speculative", "sometimes"),
        ("speculative", True),
        ("priority", 1.5),
        ("priority", "1"),
        ("priority", 101),
        ("priority", -101),
        ("tpot_slo_ms", 0),
        ("tpot_slo_ms", -5.0),
        ("tpot_slo_ms", "fast"),
        ("tpot_slo_ms", 1e7),
    ],
)
def test_invalid_service_level_values_are_400(refusing: Served, field: str, value: object) -> None:
    reply = refusing.complete(max_tokens=2, **{field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_value"
    assert field in error["message"]


def test_chat_takes_the_same_fields(refusing: Served) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    assert refusing.http.post("/v1/chat/completions", json={**body, "speculative": "no"}).status_code == 400
    reply = refusing.http.post("/v1/chat/completions", json={**body, "speculative": "off", "priority": 2})
    assert reply.status_code == 200, reply.text


def test_queued_target_gets_more_verification_budget_than_best_effort(queueing: Served) -> None:
    """Two requests at once: one always behind its (unreachable) target, one best-effort. The behind one's
    survivals keep weight 1, the other's are scaled by 0.05, so on the steep SPS curve Algorithm 1 spends the
    round's budget on the late request. Queue mode admits the target request (nothing else runs yet)."""
    with ThreadPoolExecutor(2) as pool:
        late = pool.submit(queueing.complete, max_tokens=64, ignore_eos=True, priority=1, tpot_slo_ms=0.001)
        time.sleep(0.3)
        best = pool.submit(queueing.complete, max_tokens=64, ignore_eos=True, priority=0)
        assert late.result(timeout=120).status_code == 200
        assert best.result(timeout=120).status_code == 200
    late_budget = queueing.value("dspark_tier_verify_budget", priority="1")
    best_budget = queueing.value("dspark_tier_verify_budget", priority="0")
    assert late_budget > best_budget, (late_budget, best_budget)
    assert queueing.value("dspark_tier_slo_requests_total", priority="1", attained="false") == 1
