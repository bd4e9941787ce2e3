"""Bad input at the HTTP edge: every case is a 4xx with OpenAI's error body (never a 5xx), and the server
serves a valid request right after it. The server here requires an API key."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from http_harness import MODEL, demo_backend, demo_tokenizer, serve
from prometheus_client.parser import text_string_to_metric_families

from cluster.http_app import build_app
from kernels.sampling import MAX_STOP_STRINGS

KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONTEXT = 128


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    backend = demo_backend(None, policy="autoregressive", max_requests=2, max_seq_len=MAX_CONTEXT)
    try:
        with serve(build_app(backend, demo_tokenizer(), api_key=KEY, max_body_bytes=1 << 20)) as base:
            yield base
    finally:
        backend.close()


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        yield c


def _valid_request_works(client: httpx.Client) -> None:
    resp = client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 5
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["code"], str) and re.fullmatch(r"[a-z][a-z0-9_]*", error["code"]), error  # one convention
    if param is not None:  # the field, or a path inside it such as prompt[3] or messages[0].content
        assert error["param"] == param or error["param"].startswith((f"{param}[", f"{param}.")), error
    return error


COMPLETION = {"model": MODEL, "prompt": "import os\n", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "import os\n"}], "max_tokens": 4}


def _c(**overrides: Any) -> dict[str, Any]:
    return {**COMPLETION, **overrides}


def _chat(**overrides: Any) -> dict[str, Any]:
    return {**CHAT, **overrides}


# (id, path, JSON body or raw bytes, expected status, expected param or None)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    # malformed bodies
    ("truncated-json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("not-json", "/v1/completions", b"prompt=hello", 400, None),
    ("empty-body", "/v1/completions", b"", 400, None),
    ("json-array", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("json-string", "/v1/chat/completions", b'"hello"', 400, None),
    ("deeply-nested", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("nan-temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("inf-top-p", "/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    (
        "nan-penalty",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": NaN}',
        400,
        "presence_penalty",
    ),
    ("inf-logit-bias", "/v1/completions", b'{"prompt": "x", "logit_bias": {"5": -Infinity}}', 400, "logit_bias"),
    # wrong types
    ("prompt-number", "/v1/completions", _c(prompt=5), 400, "prompt"),
    ("prompt-mixed-list", "/v1/completions", _c(prompt=[1, "a"]), 400, "prompt"),
    ("prompt-missing", "/v1/completions", {"model": MODEL, "max_tokens": 3}, 400, "prompt"),
    ("temperature-string", "/v1/completions", _c(temperature="hot"), 400, "temperature"),
    ("max-tokens-string", "/v1/completions", _c(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-float", "/v1/completions", _c(max_tokens=1.5), 400, "max_tokens"),
    ("stream-string", "/v1/completions", _c(stream="yes"), 400, "stream"),
    ("stop-number", "/v1/completions", _c(stop=5), 400, "stop"),
    ("seed-bool", "/v1/completions", _c(seed=True), 400, "seed"),
    ("messages-string", "/v1/chat/completions", _chat(messages="hi"), 400, "messages"),
    ("messages-empty", "/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("content-number", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), 400, None),
    ("unknown-role", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), 400, None),
    (
        "image-part",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        None,
    ),
    # out of range
    ("temperature-negative", "/v1/completions", _c(temperature=-1), 400, "temperature"),
    ("temperature-huge", "/v1/completions", _c(temperature=1e9), 400, "temperature"),
    ("top-p-zero", "/v1/completions", _c(top_p=0), 400, "top_p"),
    ("top-p-above-one", "/v1/completions", _c(top_p=1.5), 400, "top_p"),
    ("top-p-denormal", "/v1/completions", _c(top_p=5e-324, temperature=1.0), 400, "top_p"),
    ("temperature-below-kernel-minimum", "/v1/completions", _c(temperature=1e-9), 400, "temperature"),
    ("top-k-negative", "/v1/completions", _c(top_k=-5), 400, "top_k"),
    ("max-tokens-zero", "/v1/completions", _c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", _c(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-huge", "/v1/completions", _c(max_tokens=10**12), 400, "max_tokens"),
    ("max-tokens-bignum", "/v1/completions", _c(max_tokens=10**40), 400, "max_tokens"),
    ("chat-max-completion-tokens-huge", "/v1/chat/completions", _chat(max_completion_tokens=10**9), 400, "max_tokens"),
    ("seed-negative", "/v1/completions", _c(seed=-1), 400, "seed"),
    ("seed-huge", "/v1/completions", _c(seed=2**64), 400, "seed"),
    ("n-two", "/v1/completions", _c(n=2), 400, "n"),
    ("n-zero", "/v1/chat/completions", _chat(n=0), 400, "n"),
    ("best-of", "/v1/completions", _c(best_of=3), 400, "best_of"),
    # context limit
    ("prompt-ids-over-context", "/v1/completions", _c(prompt=[5] * 400), 400, "prompt"),
    ("prompt-text-over-context", "/v1/completions", _c(prompt="value = compute(x) + 1\n" * 200), 400, "prompt"),
    ("prompt-plus-max-tokens", "/v1/completions", _c(prompt=[5] * 100, max_tokens=100), 400, "max_tokens"),
    (
        "chat-over-context",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": "import os\n" * 300}]),
        400,
        "messages",
    ),
    # stop strings
    ("thousands-of-stops", "/v1/completions", _c(stop=[f"s{i}" for i in range(5000)]), 400, "stop"),
    ("too-many-stops", "/v1/completions", _c(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), 400, "stop"),
    ("huge-stop", "/v1/completions", _c(stop="x" * 10_000), 400, "stop"),
    ("empty-stop", "/v1/chat/completions", _chat(stop=[""]), 400, "stop"),
    ("stop-token-out-of-range", "/v1/completions", _c(stop_token_ids=[-3]), 400, None),
    # invalid text and token ids
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe bad"}', 400, None),
    (
        "invalid-utf8-chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
        400,
        None,
    ),
    ("lone-surrogate", "/v1/completions", b'{"prompt": "abc \\ud800 def"}', 400, "prompt"),
    (
        "lone-surrogate-chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        None,
    ),
    ("lone-surrogate-model", "/v1/completions", b'{"prompt": "x", "model": "\\ud800"}', 400, "model"),
    ("token-id-over-vocab", "/v1/completions", _c(prompt=[1, 2, 4096]), 400, "prompt"),
    ("token-id-negative", "/v1/completions", _c(prompt=[1, -2]), 400, "prompt"),
    ("token-id-bignum", "/v1/completions", _c(prompt=[10**30]), 400, "prompt"),
    ("empty-prompt", "/v1/completions", _c(prompt=""), 400, "prompt"),
    ("empty-id-list", "/v1/completions", _c(prompt=[]), 400, "prompt"),
    ("two-prompts", "/v1/completions", _c(prompt=["a", "b"]), 400, "prompt"),
    # features this server does not implement (rejected, never silently ignored)
    ("logprobs", "/v1/completions", _c(logprobs=2), 400, "logprobs"),
    ("chat-logprobs", "/v1/chat/completions", _chat(logprobs=True), 400, "logprobs"),
    ("echo", "/v1/completions", _c(echo=True), 400, "echo"),
    ("presence-penalty", "/v1/completions", _c(presence_penalty=0.5), 400, "presence_penalty"),
    ("repetition-penalty-extra", "/v1/completions", _c(repetition_penalty=1.3), 400, "repetition_penalty"),
    ("tools", "/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("json-mode", "/v1/chat/completions", _chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("stream-options-without-stream", "/v1/completions", _c(stream_options={"include_usage": True}), 400, None),
    # unknown model
    ("unknown-model", "/v1/completions", _c(model="gpt-4"), 404, "model"),
    ("unknown-model-chat", "/v1/chat/completions", _chat(model="nope"), 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_4xx_and_server_keeps_serving(
    client: httpx.Client, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        resp = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = client.post(path, json=body)
    _assert_error(resp, status, param)
    _valid_request_works(client)


def test_error_messages_say_what_is_wrong(client: httpx.Client) -> None:
    message = _assert_error(client.post("/v1/completions", json=_c(n=3)), 400)["message"]
    assert "one choice" in message
    message = _assert_error(client.post("/v1/completions", json=_c(prompt=[5] * 100, max_tokens=100)), 400)["message"]
    assert "maximum context length is 128" in message and "100 in the prompt" in message
    message = _assert_error(client.post("/v1/completions", json=_c(stop=["a"] * 40)), 400)["message"]
    assert "stop" in message and str(MAX_STOP_STRINGS) in message
    message = _assert_error(client.post("/v1/completions", content=b'{"prompt": "\xff"}'), 400)["message"]
    assert "UTF-8" in message
    json_type = {"Content-Type": "application/json"}
    message = _assert_error(client.post("/v1/completions", content=b'{"prompt": "\\ud800"}', headers=json_type), 400)
    assert "Unicode" in message["message"]
    chat = b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'
    message = _assert_error(client.post("/v1/chat/completions", content=chat, headers=json_type), 400)
    assert "Unicode" in message["message"] and message["param"] == "messages[0].content"
    message = _assert_error(client.post("/v1/completions", content=b'{"prompt": "x"}'), 400)["message"]
    assert "Content-Type: application/json" in message
    for field, value in (("temperature", "NaN"), ("top_p", "Infinity"), ("frequency_penalty", "-Infinity")):
        body = f'{{"prompt": "x", "{field}": {value}}}'.encode()
        error = _assert_error(client.post("/v1/completions", content=body, headers=json_type), 400, field)
        assert "finite number" in error["message"] and "equal to" not in error["message"], error


def _error_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "dspark_http_errors"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_every_error_status_is_counted(url: str, client: httpx.Client) -> None:
    """Errors answered before the app parses anything (key, size, encoding) are counted like the others."""
    before = _error_counts(url)
    assert httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30).status_code == 401
    assert client.post("/v1/completions", json=_c(prompt="x" * (2 << 20))).status_code == 413
    assert client.post("/v1/completions", content=b'{"prompt": "\xff"}').status_code == 400
    assert client.post("/v1/completions", json=_c(temperature=-1)).status_code == 400
    assert client.get("/v1/nope").status_code == 404
    after = _error_counts(url)
    increase = {status: after[status] - before.get(status, 0.0) for status in after}
    assert {k: v for k, v in increase.items() if v} == {"401": 1, "413": 1, "400": 2, "404": 1}


def test_routes_and_methods(client: httpx.Client) -> None:
    assert _assert_error(client.get("/v1/nope"), 404)["code"] == "not_found"
    assert _assert_error(client.get("/v1/completions"), 405)["code"] == "method_not_allowed"
    assert _assert_error(client.get("/v1/models/other-model"), 404, "model")["code"] == "model_not_found"
    _valid_request_works(client)


def test_oversized_body_is_413(client: httpx.Client) -> None:
    assert _assert_error(client.post("/v1/completions", json=_c(prompt="x" * (2 << 20))), 413)["code"] == (
        "request_too_large"
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    _assert_error(client.post("/v1/completions", content=chunks()), 413)
    _valid_request_works(client)


def test_api_key(url: str, client: httpx.Client) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        resp = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=headers, timeout=30)
        assert _assert_error(resp, 401)["code"] == "invalid_api_key"
        _assert_error(httpx.get(f"{url}/v1/models", headers=headers, timeout=30), 401)
    # The key is checked before the body is looked at.
    _assert_error(httpx.post(f"{url}/v1/completions", content=b"{", timeout=30), 401)
    # Probes and scrapers do not need it.
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x = ", max_tokens=2).usage.completion_tokens >= 1


def test_openai_client_sees_bad_request_errors(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-0.5)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):  # rejected before the stream starts: a 400, not a broken stream
        list(client.completions.create(model=MODEL, prompt=[7] * 500, stream=True))


def test_unknown_and_neutral_fields_are_tolerated(client: httpx.Client) -> None:
    body = _c(
        user="someone",
        metadata={"k": "v"},
        some_future_field={"x": 1},
        presence_penalty=0,
        logprobs=None,
        top_k=-1,
        echo=False,
        n=1,
    )
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = _chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "import os\n"}], "name": "me"}],
        response_format={"type": "text"},
        tool_choice="none",
        store=False,
    )
    resp = client.post("/v1/chat/completions", json=chat)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"


def test_error_body_is_valid_json_for_every_case(client: httpx.Client) -> None:
    """The error body is JSON with ASCII escapes even when the request carried odd characters."""
    resp = client.post("/v1/completions", json=_c(model="modèle-😀"))
    error = _assert_error(resp, 404, "model")
    assert "modèle-😀" in error["message"]
    json.loads(resp.content.decode("ascii"))
