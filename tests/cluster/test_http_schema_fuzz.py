"""Fuzz the OpenAI endpoints against the app's own OpenAPI schema (schemathesis): never a 5xx, and the server keeps
serving valid requests with every cache free afterwards.

Bounded: a few dozen generated cases per operation, both schema-conforming (positive) and schema-violating
(negative) ones, against a real uvicorn server on loopback over the demo target with a short context (so a
generated valid request generates at most a few dozen tokens). A few hand-written cases the issue lists complete
the table in test_http_bad_input.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from http_harness import MODEL, demo_backend, demo_tokenizer, free_slots, serve
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from cluster.http_app import build_app
from kernels.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

MAX_CONTEXT = 48
SLOTS = 2


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any, Any]]:
    backend = demo_backend(None, policy="autoregressive", max_requests=SLOTS, max_seq_len=MAX_CONTEXT)
    app = build_app(backend, demo_tokenizer(), max_body_bytes=1 << 20)
    try:
        with serve(app) as url:
            yield url, app, backend
    finally:
        backend.close()


def _operations(app: Any) -> list[Any]:
    schema = schemathesis.openapi.from_dict(app.openapi())
    return [result.ok() for result in schema.get_all_operations()]


def _valid_request_works(url: str) -> None:
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 3, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_schema_fuzz_never_gets_a_5xx(server: tuple[str, Any, Any], mode: GenerationMode) -> None:
    url, app, backend = server
    operations = _operations(app)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    seen: dict[str, set[int]] = {}
    for operation in operations:
        _fuzz_operation(url, operation, mode, seen)
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= set(seen)
    _valid_request_works(url)
    verify_free, _, busy = free_slots(backend)
    assert (verify_free, busy) == (SLOTS, False)


def _fuzz_operation(url: str, operation: Any, mode: GenerationMode, seen: dict[str, set[int]]) -> None:
    name = f"{operation.method.upper()} {operation.path}"

    # Positive cases mostly generate tokens (slower); negative ones are refused at once.
    @settings(max_examples=8 if mode is GenerationMode.POSITIVE else 20, deadline=None, database=None,
              derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        response = case.call(base_url=url, timeout=60)
        seen.setdefault(name, set()).add(response.status_code)
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
        if response.status_code >= 400 and operation.path.startswith("/v1/"):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    try:
        check()
    except Unsatisfiable:
        # An operation without inputs (GET /health, /v1/models) has no schema-violating request to send.
        assert mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET", name


# Hand-written cases the issue lists that the parametrised table in test_http_bad_input.py does not have.
EXTRA: list[tuple[str, str, Any, int]] = [
    ("thousands-of-stop-token-ids", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "stop_token_ids": list(range(5000))}, 400),
    ("invalid-utf8-in-stop", "/v1/completions", b'{"prompt": "x", "stop": ["\xff\xfe"]}', 400),
    ("lone-surrogate-in-stop", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "stop": "\\ud800"}', 400),
    ("max-tokens-int64-overflow", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2**63}, 400),
    ("max-tokens-negative-huge", "/v1/completions", {"prompt": "x", "max_tokens": -(2**70)}, 400),
    ("temperature-negative-zero-ok", "/v1/completions", {"prompt": "x", "max_tokens": 1, "temperature": -0.0}, 200),
    ("top-p-negative", "/v1/completions", {"prompt": "x", "top_p": -0.1}, 400),
    ("prompt-exactly-the-context", "/v1/completions", {"prompt": [5] * MAX_CONTEXT, "max_tokens": 1}, 400),
    ("prompt-and-budget-fill-the-context", "/v1/completions",
     {"prompt": [5] * (MAX_CONTEXT - 4), "max_tokens": 4, "temperature": 0}, 200),
    ("null-body-fields", "/v1/completions", {"prompt": None}, 400),
    ("nested-garbage", "/v1/chat/completions", {"messages": [[[[{}]]]]}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), [c[1:] for c in EXTRA], ids=[c[0] for c in EXTRA])
def test_extra_bad_input_cases(server: tuple[str, Any, Any], path: str, body: Any, status: int) -> None:
    url, _, _ = server
    if isinstance(body, bytes):
        response = httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        response = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
    _valid_request_works(url)


def test_the_most_stop_strings_allowed_stream_fine(server: tuple[str, Any, Any]) -> None:
    """The bound on stop strings keeps matching cheap; at the bound (longest strings) a stream still works."""
    url, _, backend = server
    stops = [chr(0x4E00 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 20, "temperature": 0, "stop": stops,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]
    assert free_slots(backend)[0] == SLOTS
