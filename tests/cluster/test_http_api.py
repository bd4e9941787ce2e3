"""The OpenAI-compatible API over the in-process engine, through a real uvicorn server and the `openai` client:
greedy output equals the target's own greedy decoding (completions and chat, streaming or not), concurrency,
client disconnects free the engine's slots, and /metrics carries the spec-decode counters."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from http_harness import DEMO_TARGET, MODEL, demo_backend, demo_tokenizer, free_slots, serve, write_demo_drafter
from prometheus_client.parser import text_string_to_metric_families

from cluster.backend import LocalBackend
from cluster.http_app import INLINE_TOKENIZE_CHARS, _Service, build_app
from verify_service.target import TargetModel

MAX_REQUESTS = 4
PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\nclass ",
    "    for key, value in sorted(",
    '"""Utilities for parsing ',
    "if __name__ == '__main__':\n",
    "try:\n    import _thread\nexcept ImportError:\n",
    "def __repr__(self):\n        return ",
    "    raise ValueError(",
]


class Server:
    def __init__(self, url: str, backend: LocalBackend, tokenizer, target: TargetModel) -> None:
        self.url = url
        self.backend = backend
        self.tokenizer = tokenizer
        self.target = target
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.eos = tuple(target.eos_token_ids)

    def greedy(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """The target's own greedy continuation (stops after EOS, which it keeps, as the engine does)."""
        outs = self.target.generate(prompts, max_new_tokens=max(max_tokens), stop_token_ids=self.eos)
        return [out[:n] for out, n in zip(outs, max_tokens, strict=True)]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def metrics(self) -> dict[str, list]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {family.name: family.samples for family in text_string_to_metric_families(text)}

    def wait_idle(self) -> tuple[int, int, bool]:
        """Poll the engine until every slot is free (bounded: a hang fails the test, no timing is asserted)."""
        deadline = time.monotonic() + 60
        state = free_slots(self.backend)
        while state != (MAX_REQUESTS, MAX_REQUESTS, False) and time.monotonic() < deadline:
            time.sleep(0.05)
            state = free_slots(self.backend)
        return state


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    draft_dir = write_demo_drafter(tmp_path_factory.mktemp("http_api"))
    backend = demo_backend(draft_dir, policy="dspark", max_requests=MAX_REQUESTS, max_seq_len=256)
    tokenizer = demo_tokenizer()
    target = TargetModel.from_pretrained(DEMO_TARGET)
    try:
        with serve(build_app(backend, tokenizer)) as url:
            yield Server(url, backend, tokenizer, target)
    finally:
        backend.close()


def _extra(obj: object, name: str) -> object:
    return (obj.model_extra or {})[name]  # type: ignore[attr-defined]


def test_completion_greedy_equals_target_greedy(server: Server) -> None:
    prompts = PROMPTS[:3]
    ids = [server.encode(p) for p in prompts]
    expected = server.greedy(ids, [40] * len(ids))
    for prompt, prompt_ids, want in zip(prompts, ids, expected, strict=True):
        resp = server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"return_token_ids": True}
        )
        choice = resp.choices[0]
        assert _extra(choice, "token_ids") == want
        assert _extra(resp, "prompt_token_ids") == prompt_ids
        assert choice.text == server.text(want)
        assert choice.finish_reason == ("stop" if want[-1] in server.eos else "length")
        assert resp.usage.prompt_tokens == len(prompt_ids)
        assert resp.usage.completion_tokens == len(want)
        assert resp.usage.total_tokens == len(prompt_ids) + len(want)
        assert resp.model == MODEL and resp.object == "text_completion"


def test_completion_from_token_ids_and_one_prompt_batch(server: Server) -> None:
    prompt_ids = server.encode(PROMPTS[3])
    want = server.greedy([prompt_ids], [24])[0]
    for prompt in (prompt_ids, [prompt_ids], [PROMPTS[3]]):
        resp = server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
        )
        assert _extra(resp.choices[0], "token_ids") == want


def test_completion_stream_equals_target_greedy(server: Server) -> None:
    prompt_ids = server.encode(PROMPTS[4])
    want = server.greedy([prompt_ids], [48])[0]
    chunks = list(
        server.client.completions.create(
            model=MODEL,
            prompt=PROMPTS[4],
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    choice_chunks = [c for c in chunks if c.choices]
    assert len(choice_chunks) > 1  # it really streamed
    text = "".join(c.choices[0].text for c in choice_chunks)
    tokens = [t for c in choice_chunks for t in _extra(c.choices[0], "token_ids")]
    assert tokens == want and text == server.text(want)
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert choice_chunks[-1].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1]
    assert not usage.choices and usage.usage.completion_tokens == len(want)
    assert usage.usage.prompt_tokens == len(prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_wire_format(server: Server) -> None:
    """Raw SSE: only `data: ...` events separated by blank lines, ending with `data: [DONE]`."""
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in p for p in payloads)  # no include_usage: no usage field


def test_chat_greedy_equals_target_greedy(server: Server) -> None:
    messages = [{"role": "system", "content": "# stdlib\n"}, {"role": "user", "content": "import json\n\n\ndef "}]
    rendered = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(rendered["input_ids"])
    want = server.greedy([prompt_ids], [32])[0]
    resp = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=32, temperature=0, extra_body={"return_token_ids": True}
    )
    assert _extra(resp, "prompt_token_ids") == prompt_ids
    assert _extra(resp.choices[0], "token_ids") == want
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == server.text(want)
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == len(want)

    stream = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == server.text(want)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_eight_concurrent_requests(server: Server) -> None:
    """8 requests against 4 slots (half of them wait), streaming and not: each equals the target's greedy."""
    max_tokens = [12, 30, 20, 40, 16, 28, 36, 24]
    expected = server.greedy([server.encode(p) for p in PROMPTS], max_tokens)

    def run(i: int) -> list[int]:
        kwargs = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": max_tokens[i], "temperature": 0.0}
        if i % 2:
            chunks = server.client.completions.create(**kwargs, stream=True, extra_body={"return_token_ids": True})
            return [t for c in chunks if c.choices for t in _extra(c.choices[0], "token_ids")]
        resp = server.client.completions.create(**kwargs, extra_body={"return_token_ids": True})
        return list(_extra(resp.choices[0], "token_ids"))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got == want, i
    assert server.wait_idle() == (MAX_REQUESTS, MAX_REQUESTS, False)


def test_bad_requests_do_not_disturb_a_running_stream(server: Server) -> None:
    """Rejections happen at the edge, never inside a round shared with other requests."""
    prompt_ids = server.encode(PROMPTS[5])
    want = server.greedy([prompt_ids], [60])[0]
    stream = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[5], max_tokens=60, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    tokens: list[int] = []
    bad = [{"top_p": 1e-45, "temperature": 1.0}, {"temperature": 1e-7}, {"prompt": [4095, 4096]}, {"max_tokens": 10**6}]
    for i, chunk in enumerate(stream):
        if chunk.choices:
            tokens += _extra(chunk.choices[0], "token_ids")
        if i < len(bad):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **bad[i]}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 400
    assert tokens == want


def test_stop_string_cuts_the_text(server: Server) -> None:
    prompt_ids = server.encode(PROMPTS[0])
    full = server.text(server.greedy([prompt_ids], [40])[0])
    stop = full[12:15]
    resp = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(server: Server) -> None:
    kwargs = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0.9, "top_p": 0.95}
    first = server.client.completions.create(**kwargs, seed=1234).choices[0].text
    again = server.client.completions.create(**kwargs, seed=1234).choices[0].text
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(**kwargs, seed=1234, stream=True))
    assert first == again == streamed


def _aborted(server: Server) -> float:
    return sum(s.value for s in server.metrics().get("dspark_requests_aborted", []) if s.name.endswith("_total"))


def _errors(server: Server) -> dict[str, float]:
    samples = server.metrics().get("dspark_http_errors", [])
    return {s.labels["status"]: s.value for s in samples if s.name.endswith("_total")}


class _ErrorRecords(logging.Handler):
    """Collects error-level records of the app's loggers and of uvicorn's (which does not propagate to root).

    Left out: asyncio's "Task was destroyed but it is pending!", logged when the garbage collector happens to
    reclaim a task of an event loop closed earlier (grpc's tasks of a stream an earlier test's server still had
    open when it stopped), at whatever moment that is: it says nothing of the request under test."""

    LOGGERS = ("", "uvicorn")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "asyncio" and record.getMessage().startswith("Task was destroyed but it is pending"):
            return
        self.records.append(record)

    def __enter__(self) -> _ErrorRecords:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def test_stream_disconnect_aborts_and_frees_slots(server: Server) -> None:
    """A client hanging up mid-stream is an abort: caches freed, counted as aborted, no error status, no
    error-level log (no traceback)."""
    before, errors_before = _aborted(server), _errors(server)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True}
    with _ErrorRecords() as errors:
        with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{server.url}/v1/completions", json=body
        ) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
            assert received
            assert free_slots(server.backend)[0] < MAX_REQUESTS  # still generating while we hold the stream
        # Leaving both blocks closed the connection mid-stream.
        assert server.wait_idle() == (MAX_REQUESTS, MAX_REQUESTS, False)
    assert _aborted(server) == before + 1
    assert _errors(server) == errors_before
    assert not errors.records, [r.getMessage() for r in errors.records]
    # The server keeps serving.
    resp = server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_non_stream_disconnect_aborts_and_frees_slots(server: Server) -> None:
    before = _aborted(server)
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 220, "temperature": 0}
    errors_before = _errors(server)
    with _ErrorRecords() as errors:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        assert server.wait_idle() == (MAX_REQUESTS, MAX_REQUESTS, False)
    assert _aborted(server) == before + 1
    assert _errors(server) == errors_before
    assert not errors.records, [r.getMessage() for r in errors.records]


def test_metrics_have_spec_decode_counters(server: Server) -> None:
    # Speculation on: every round verifies at least one draft, whatever this machine's SPS table makes Algorithm 1
    # choose for a lone request (the counters below need drafts, also when this test runs first or alone).
    server.client.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=16, temperature=0,
                                     extra_body={"speculative": "on"})
    families = server.metrics()

    def value(name: str, **labels: str) -> float:
        samples = [s for s in families[name] if all(s.labels.get(k) == v for k, v in labels.items())]
        assert samples, (name, labels)
        return sum(s.value for s in samples)

    drafts = value("vllm:spec_decode_num_drafts")
    draft_tokens = value("vllm:spec_decode_num_draft_tokens")
    accepted = value("vllm:spec_decode_num_accepted_tokens")
    assert drafts > 0 and draft_tokens > 0
    assert 0 <= accepted <= draft_tokens
    per_pos = {s.labels["position"]: s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"]}
    assert sorted(per_pos) == ["0", "1", "2", "3"] and sum(per_pos.values()) == accepted
    assert value("dspark_rounds") > 0 and value("dspark_verify_seconds") > 0 and value("dspark_draft_seconds") > 0
    assert 0 <= value("dspark_rounds_without_draft") < value("dspark_rounds")
    assert value("dspark_tau") >= 1.0 and value("dspark_verify_tokens_per_round") >= 1.0
    # The time to first token in the round driver: every request so far got its first token from its prefill.
    first = value("dspark_request_first_tokens")
    assert first > 0 and value("dspark_round_joined_prompts") == first
    assert value("dspark_request_queue_seconds") >= 0 and value("dspark_request_admission_to_first_token_seconds") > 0
    assert value("dspark_prefill_only_rounds") >= 1  # the first request joined an idle engine
    joined = value("dspark_joined_rounds")  # rounds of prompts joining running requests, and their wall time
    assert 0 <= joined <= value("dspark_rounds") and (value("dspark_joined_round_seconds") > 0) == (joined > 0)
    assert value("dspark_planned_rounds") >= 0 and value("dspark_planned_round_seconds") >= 0
    # The ingress's part of TTFT: every request so far got a first delta after its parse and tokenising.
    assert value("dspark_http_first_deltas") >= 1
    assert value("dspark_http_parse_seconds") >= 0 and value("dspark_http_tokenize_seconds") > 0
    assert value("dspark_http_backend_first_delta_seconds") > 0
    assert "dspark_http_routes" not in families  # in process: nothing is routed
    assert value("vllm:prompt_tokens") > 0 and value("vllm:generation_tokens") > 0
    assert value("vllm:request_success", finished_reason="length") > 0
    assert value("dspark_num_requests_running") >= 0 and "dspark_num_requests_waiting" in families
    assert all(s.labels["model_name"] == MODEL for s in families["vllm:spec_decode_num_drafts"])


def test_models_health_and_openapi(server: Server) -> None:
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert _extra(models.data[0], "max_model_len") == 256
    assert server.client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"):
        assert path in schema["paths"]
    completion = schema["paths"]["/v1/completions"]["post"]
    assert {"200", "400", "401", "404", "413", "429"} == set(completion["responses"])  # 400, not FastAPI's 422
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["n"]["maximum"] == 1 and request["stop"]["anyOf"]  # ranges are documented for fuzzers


def test_short_prompts_are_tokenised_on_the_event_loop_and_nothing_waits_there_for_the_tokenizer(
    server: Server,
) -> None:
    """A short prompt is tokenised on the event loop itself (no thread hop); a long one, and a short one while the
    tokenizer is busy elsewhere, in a worker thread, so the loop runs on meanwhile."""
    service = _Service(server.backend, server.tokenizer)
    short = PROMPTS[0]
    long = short * (INLINE_TOKENIZE_CHARS // len(short) + 1)

    def encode(text: str):
        return lambda: (threading.get_ident(), server.encode(text))

    async def scenario() -> None:
        loop_thread = threading.get_ident()
        assert await service.tokenize(encode(short), len(short)) == (loop_thread, server.encode(short))
        ident, ids = await service.tokenize(encode(long), len(long))
        assert ident != loop_thread and ids == server.encode(long)
        lock = service._tokenizer_lock
        lock.acquire()  # the tokenizer busy in another request's thread
        releaser = threading.Timer(2.0, lock.release)  # a loop blocked on the lock would run on after this only
        releaser.start()
        try:
            task = asyncio.ensure_future(service.tokenize(encode(short), len(short)))
            await asyncio.sleep(0.05)  # the task starts and waits for the lock in a thread, not on this loop
            assert lock.locked() and not task.done(), "the event loop waited for the tokenizer"
            ident, ids = await task
            assert ident != loop_thread and ids == server.encode(short)
        finally:
            releaser.join()

    asyncio.run(scenario())
