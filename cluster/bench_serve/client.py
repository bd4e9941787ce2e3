"""One benchmark request through the ``openai`` client, timed chunk by chunk.

The official client does the HTTP and the server-sent-event parsing, so any OpenAI-compatible server works
(dspark-serve, vLLM, SGLang). Streaming asks for ``stream_options.include_usage``: the token count comes from the
server's usage, not from counting chunks (a speculative server emits several tokens per chunk); a server that
sends no usage is counted one token per text chunk. Retries are off: a failure is measured, not hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

from cluster.bench_serve.stats import RequestRecord
from cluster.bench_serve.workload import BenchRequest

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class RequestOptions:
    """How every request of a run is sent (the sampling settings are the same for all of them)."""

    model: str
    endpoint: Endpoint = "completions"
    stream: bool = True
    temperature: float = 0.0
    top_p: float | None = None
    ignore_eos: bool = False
    seed: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)


def api_base(base_url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> the ``/v1`` base the openai client takes."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def make_client(base_url: str, api_key: str | None, timeout_s: float) -> openai.AsyncOpenAI:
    """An async client without retries (the client's own connection pool holds up to 1000 streams)."""
    return openai.AsyncOpenAI(base_url=api_base(base_url), api_key=api_key or "EMPTY", max_retries=0, timeout=timeout_s)


def _arguments(request: BenchRequest, options: RequestOptions, index: int) -> dict[str, Any]:
    extra = dict(options.extra_body)
    if options.ignore_eos:
        extra["ignore_eos"] = True
    args: dict[str, Any] = {
        "model": options.model,
        "max_tokens": request.output_len,
        "temperature": options.temperature,
        "stream": options.stream,
        "extra_body": extra,
    }
    if options.top_p is not None:
        args["top_p"] = options.top_p
    if options.seed is not None:
        args["seed"] = options.seed + index  # reproducible sampling, yet not the same draw for every request
    if options.stream:
        args["stream_options"] = {"include_usage": True}
    if options.endpoint == "chat":
        args["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        args["prompt"] = list(request.prompt) if isinstance(request.prompt, tuple) else request.prompt
    return args


def _chunk_text(chunk: Any, endpoint: Endpoint) -> str:
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    if endpoint == "chat":
        return (choice.delta.content or "") if choice.delta is not None else ""
    return choice.text or ""


async def send(client: openai.AsyncOpenAI, request: BenchRequest, options: RequestOptions, index: int) -> RequestRecord:
    """Send one request and measure it; failures come back as a record with ``error`` set, never raised."""
    create = client.chat.completions.create if options.endpoint == "chat" else client.completions.create
    args = _arguments(request, options, index)
    start = time.perf_counter()
    record = RequestRecord(start_s=start, end_s=start)
    try:
        if not options.stream:
            response = await create(**args)
            record.end_s = time.perf_counter()
            usage = response.usage
            record.output_tokens = usage.completion_tokens if usage is not None else 0
            record.prompt_tokens = usage.prompt_tokens if usage is not None else 0
            return record
        last: float | None = None
        gaps: list[float] = []
        text_chunks = 0
        usage = None
        async with await create(**args) as stream:  # closed on cancellation too: the server sees the hang-up
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                if not _chunk_text(chunk, options.endpoint):
                    continue
                text_chunks += 1
                if last is None:
                    record.ttft_s = now - start
                else:
                    gaps.append(now - last)
                last = now
        record.end_s = time.perf_counter()
        record.itl_s = tuple(gaps)
        record.output_tokens = usage.completion_tokens if usage is not None else text_chunks
        record.prompt_tokens = usage.prompt_tokens if usage is not None else 0
    except openai.APIStatusError as error:
        _failed(record, str(error.status_code), error.message)
    except openai.APITimeoutError as error:
        _failed(record, "timeout", str(error))
    except openai.APIConnectionError as error:
        _failed(record, "connection", str(error.__cause__ or error))
    except openai.APIError as error:  # an error event inside an open stream
        _failed(record, "stream", error.message)
    return record


def _failed(record: RequestRecord, kind: str, message: str) -> None:
    record.end_s = time.perf_counter()
    record.error = kind
    record.error_message = message
