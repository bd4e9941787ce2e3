"""The OpenAI-compatible HTTP front end: FastAPI app over any :class:`~cluster.backend.GenerateBackend`.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (JSON or server-sent events), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus, vLLM's spec-decode metric names plus ``dspark_*``), and FastAPI's
``/openapi.json`` (the schema fuzzers run against).

Rules this module keeps:
- Bad input is always a 4xx with OpenAI's error body, decided BEFORE a 200 goes out: even a streaming response
  waits for the backend's first delta (where a backend reports rejection) before sending headers.
- A request whose client goes away is aborted in the backend at once, streaming or not, so its KV and context
  caches are freed for others; the abort is shielded from the cancellation that the disconnect itself causes.
- Every 503 (not ready yet, a replica or the scheduler gone) carries ``Retry-After``: it is retryable; so does a
  429 (a TPOT target the scheduler cannot meet at the current load, refused at admission).
- The tokenizer is used under one lock (a Rust tokenizer must not be re-entered while its settings are in use):
  a short prompt on the event loop itself when the lock is free (a thread hop costs more than its tokenising), a
  long one in a worker thread, so a long prompt never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster import __version__
from cluster.backend import (
    BackendUnavailableError,
    GenerateBackend,
    GenerateDelta,
    check_context,
)
from cluster.openai_api import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
    check_supported,
    sampling_params,
)
from cluster.readiness import RETRY_AFTER_S
from kernels.sampling import SamplingError
from scheduler.metrics import MetricsSnapshot
from scheduler.service_levels import TPOT_BUCKETS_S, SLOUnattainableError, TierSnapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 8 << 20
#: ``/health`` answers within this: a probe must learn "not ready" fast, also while the scheduler restarts.
HEALTH_TIMEOUT_S = 3.0
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    413: {"model": ErrorResponse, "description": "request body too large"},
    429: {"model": ErrorResponse, "description": "tpot_slo_ms cannot be met at the current load (Retry-After)"},
}
_SSE_DOC = {"text/event-stream": {"schema": {"type": "string"}, "description": "with stream=true"}}
#: Hints appended to pydantic's messages where its wording alone would not say what to do.
_PARAM_HINTS = {
    "n": "this server returns exactly one choice per request",
    "best_of": "this server returns exactly one choice per request",
    "prompt": "a prompt is a non-empty string or a non-empty list of token ids (one prompt per request)",
}


class ClientDisconnectedError(Exception):
    """The client went away before the response was complete; the request was aborted."""


def _error_response(error: APIError) -> Response:
    # ensure_ascii: an echoed field (e.g. a model name holding a lone surrogate) must still serialise.
    body = json.dumps(error.body(), ensure_ascii=True)
    # Every 503 is retryable (not ready yet, or a replica went away): say when to come back.
    retry_after = error.retry_after_s if error.retry_after_s is not None else RETRY_AFTER_S
    headers = {"Retry-After": str(retry_after)} if error.status in (429, 503) else None
    return Response(body, status_code=error.status, media_type="application/json", headers=headers)


# ------------------------------------------------------------------------------------------- middleware
def _hang_up_on_failure(receive: Receive) -> Receive:
    """``receive`` that reports a failure to deliver the next message as the client's disconnect.

    Under Ray Serve the ingress replica fetches a request's ASGI messages from the proxy actor; when the proxy
    drops the request because its client hung up, that fetch raises (``TaskCancelledError``) instead of
    delivering ``http.disconnect``. Either way the client is gone, and the app must treat it as a hang-up (abort,
    no 500, no traceback). A cancellation of the caller itself still propagates.
    """

    async def checked() -> Message:
        try:
            return await receive()
        except Exception:
            return {"type": "http.disconnect"}

    return checked


class _GuardMiddleware:
    """API key on /v1/*, a body size limit and UTF-8, before any parsing (pure ASGI: streaming stays intact).

    The key is checked first so an unauthenticated client learns nothing about the request format; the body is
    read here in full up to the limit (without a trusted Content-Length a chunked upload could be endless).
    ``on_error`` is told the status of every error answered here, as the app's handlers tell it theirs. Every
    HTTP request's arrival is stamped in its ``scope["state"]`` first (``ARRIVED_STATE``, read by
    :class:`_RequestClock`), so TTFT and its parse part start before the body is read.
    """

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, on_error: Callable[[int], None]
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[ARRIVED_STATE] = time.perf_counter()  # see _RequestClock
        receive = _hang_up_on_failure(receive)
        if self.api_key is not None and scope["path"].startswith("/v1/") and not self._authorised(scope):
            await self._reject(
                APIError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'"), scope, receive, send
            )
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"request body exceeds {self.max_body_bytes} bytes")
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await self._reject(too_large, scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(too_large, scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")  # JSON between systems is UTF-8 (RFC 8259 section 8.1)
        except UnicodeDecodeError as error:
            reason = f"the request body is not valid UTF-8 (byte {error.start}: {error.reason})"
            await self._reject(APIError(400, reason, code="invalid_encoding"), scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect notification

        await self.app(scope, replay, send)

    async def _reject(self, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_error(error.status)
        await _error_response(error)(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False


class _EventStream(StreamingResponse):
    """SSE response of ``run`` that always ends it, however the send ends: closing its event generator closes the
    run (aborting it when unfinished); a generator that never started (the client was gone before the first
    event: Starlette then cancels the send before iterating) runs no code of its own, so the run is aborted
    here and ``on_abort`` told."""

    def __init__(self, content: AsyncIterator[str], run: _Run, on_abort: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = content
        self._run = run
        self._on_abort = on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]
                if not self._run.closed:
                    self._on_abort()
                    await self._run.close()


# ------------------------------------------------------------------------------------------------ metrics
class _HttpMetrics:
    """Request-level counters the front end measures itself (the backend's counters come per scrape)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=self.registry
        )
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=self.registry)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.errors = Counter(
            "dspark_http_errors",
            "Error responses by HTTP status (every error status answered, and error events in started streams; "
            "client hang-ups are counted as aborted instead).",
            [*labels, "status"],
            registry=self.registry,
        )
        self.aborted = Counter(
            "dspark_requests_aborted",
            "Requests aborted because the client went away.",
            labels,
            registry=self.registry,
        )
        buckets = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=buckets,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=(*buckets, 120.0, 300.0),
            registry=self.registry,
        )
        # Where the ingress's part of TTFT goes (_RequestClock), summed over the requests that got a first delta.
        self.first_deltas = Counter(
            "dspark_http_first_deltas",
            "Generation requests whose first delta came from the backend (the count of the three time sums below).",
            labels,
            registry=self.registry,
        )
        self.parse_s = Counter(
            "dspark_http_parse_seconds",
            "Summed over those requests: arrival at the app to the endpoint's start (body, JSON, validation).",
            labels,
            registry=self.registry,
        )
        self.tokenize_s = Counter(
            "dspark_http_tokenize_seconds",
            "Summed over those requests: tokenising the prompt (or rendering the chat), waits for the tokenizer "
            "and its thread included.",
            labels,
            registry=self.registry,
        )
        self.backend_s = Counter(
            "dspark_http_backend_first_delta_seconds",
            "Summed over those requests: handing the request to the backend to its first delta (routing, the way "
            "to the round driver and back, and the round driver's own part: dspark_request_*).",
            labels,
            registry=self.registry,
        )

    def error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def abort(self) -> None:
        self.aborted.labels(self.model_name).inc()

    def first_delta(self, clock: _RequestClock) -> None:
        """A request's first delta arrived now: its TTFT (from its arrival) and the ingress's parts of it."""
        now, m = time.perf_counter(), self.model_name
        self.ttft.labels(m).observe(now - clock.arrived)
        self.first_deltas.labels(m).inc()
        self.parse_s.labels(m).inc(clock.handler - clock.arrived)
        self.tokenize_s.labels(m).inc(clock.submitted - clock.handler)
        self.backend_s.labels(m).inc(now - clock.submitted)

    def finished(self, delta: GenerateDelta, started: float) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(delta.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(delta.num_output_tokens)
        self.success.labels(m, delta.finish_reason or "unknown").inc()
        self.e2e.labels(m).observe(time.perf_counter() - started)


class _SpecDecodeCollector:
    """One snapshot of the backend's speculative-decoding counters in vLLM's names (plus dspark_* ones)."""

    def __init__(self, snap: MetricsSnapshot, model_name: str) -> None:
        self.snap = snap
        self.model_name = model_name

    def collect(self) -> Any:
        s, labels, values = self.snap, ["model_name"], [self.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield counter("vllm:spec_decode_num_drafts", "Request-rounds that verified drafts.", s.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens sent for verification.", s.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the block.",
            labels=[*labels, "position"],
        )
        per_pos_conditional = GaugeMetricFamily(
            "dspark_conditional_acceptance",
            "P(position accepted | verified and every earlier draft accepted).",
            labels=[*labels, "position"],
        )
        for pos, (accepted, reached) in enumerate(zip(s.accepted_per_position, s.reached_per_position, strict=True)):
            per_pos.add_metric([*values, str(pos)], accepted)
            if reached:
                per_pos_conditional.add_metric([*values, str(pos)], accepted / reached)
        yield per_pos
        yield per_pos_conditional
        yield counter(
            "dspark_rounds",
            "Engine rounds (one target verify pass each; up to scheduler.decode_steps passes for plain decoding "
            "in the disaggregated placement).",
            s.rounds,
        )
        yield counter(
            "dspark_rounds_without_draft",
            "Rounds that ran no drafter: the autoregressive policy, the draft gate judged a plain target round "
            "faster (high load), or no drafter replica was left (degraded mode).",
            s.rounds_without_draft,
        )
        yield counter(
            "dspark_paused_request_rounds",
            "Request-rounds sat out by requests of a lower tier than a request behind its TPOT target.",
            s.paused_request_rounds,
        )
        yield counter(
            "dspark_planned_rounds",
            "Drafted rounds whose lengths were planned before their drafts existed: chained (in process) or "
            "relayed (disaggregated) rounds.",
            s.planned_rounds,
        )
        yield counter(
            "dspark_planned_round_seconds",
            "Wall time of the planned rounds (their five round-split parts).",
            s.planned_round_time_s,
        )
        yield counter(
            "dspark_joined_rounds",
            "Rounds that prefilled joining prompts while verifying requests (never planned).",
            s.joined_rounds,
        )
        yield counter("dspark_joined_round_seconds", "Wall time of the joined rounds.", s.joined_round_time_s)
        # The time to first token in the round driver, and the prompts that join rounds (scheduler.metrics).
        yield counter(
            "dspark_request_first_tokens",
            "Requests whose first token came from their prefill (the count of the two time sums below).",
            s.first_tokens,
        )
        yield counter(
            "dspark_request_queue_seconds",
            "Summed over those requests: arrival at the round driver to admission (the round that prefills them).",
            s.queue_time_s,
        )
        yield counter(
            "dspark_request_admission_to_first_token_seconds",
            "Summed over those requests: admission to first token (the round that prefills them).",
            s.admission_to_first_token_s,
        )
        yield counter("dspark_round_joined_prompts", "Prompts prefilled by rounds (joins).", s.joined_prompts)
        yield counter(
            "dspark_prefill_only_rounds",
            "Target passes that only prefilled joining prompts, verifying no request (not in dspark_rounds).",
            s.prefill_only_rounds,
        )
        yield counter(
            "dspark_output_tokens",
            "Tokens emitted by engine rounds (a request's first token comes from its prefill, not a round).",
            s.num_output_tokens,
        )
        yield counter("dspark_draft_seconds", "Time spent drafting.", s.draft_time_s)
        yield counter("dspark_schedule_seconds", "Time spent choosing verification lengths.", s.schedule_time_s)
        yield counter("dspark_verify_seconds", "Time spent in target verify passes.", s.verify_time_s)
        # The round split: five parts that add up to the rounds' wall time (scheduler.metrics).
        split = (
            ("draft", "Drafting, in the drafter replicas' own time when remote (transfer excluded).",
             s.round_draft_time_s),
            ("verify", "Target verify passes, in the verifier replica's own time when remote (transfer excluded).",
             s.round_verify_time_s),
            ("schedule", "Choosing verification lengths.", s.schedule_time_s),
            ("transfer", "Round trips to the replicas minus the time the replicas report for them: codec, "
             "transport, thread hand-offs (0 in one process).", s.transfer_time_s),
            ("host", "The rest of the rounds in the round driver: admission, building messages, commit, releases.",
             s.host_time_s),
        )
        for part, doc, value in split:
            yield counter(f"dspark_round_{part}_seconds", doc, value)
        yield counter(
            "dspark_round_transfer_in_replica_seconds",
            "Of the transfer: the replicas' processes holding the round's messages around their engine calls "
            "(decoding, validation, thread hand-offs); the rest is the wire and the round driver's codec.",
            s.transfer_in_replica_time_s,
        )
        yield gauge("dspark_tau", "Mean tokens per request-round, bonus token included.", s.tau)
        yield gauge(
            "dspark_verify_budget",
            "Mean draft tokens verified per request-round.",
            s.num_draft_tokens / s.num_drafts if s.num_drafts else 0.0,
        )
        yield gauge("dspark_verify_tokens_per_round", "Mean verify batch size B (tokens).", s.verify_tokens_per_round)
        yield gauge("dspark_round_seconds", "Median duration of recent rounds.", s.recent_round_s)
        yield gauge("dspark_num_requests_running", "Requests holding caches.", s.running)
        yield gauge("dspark_num_requests_waiting", "Requests queued for capacity.", s.waiting)
        yield gauge("vllm:num_requests_running", "Requests holding caches.", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests queued for capacity.", s.waiting)
        yield from _tier_families(s.tiers, labels, values)


def _tier_families(tiers: Sequence[TierSnapshot], labels: list[str], values: list[str]) -> Iterator[Any]:
    """The per-tier service-level series (label ``priority``); none before a request finished or was refused."""
    if not tiers:
        return
    labels = [*labels, "priority"]
    families = {
        "requests": CounterMetricFamily("dspark_tier_requests", "Finished requests by priority tier.", labels=labels),
        "output_tokens": CounterMetricFamily(
            "dspark_tier_output_tokens", "Output tokens of finished requests by priority tier.", labels=labels
        ),
        "refused": CounterMetricFamily(
            "dspark_tier_refused", "Requests refused at admission (429): TPOT target not attainable.", labels=labels
        ),
    }
    slo = CounterMetricFamily(
        "dspark_tier_slo_requests",
        "Finished requests with a TPOT target, by whether their TPOT met it.",
        labels=[*labels, "attained"],
    )
    budget = GaugeMetricFamily(
        "dspark_tier_verify_budget", "Mean draft tokens verified per request-round of finished requests.", labels=labels
    )
    tpot = HistogramMetricFamily(
        "dspark_tier_tpot_seconds", "Time per output token after the first, per finished request.", labels=labels
    )
    for t in tiers:
        tier = [*values, str(t.priority)]
        families["requests"].add_metric(tier, t.requests)
        families["output_tokens"].add_metric(tier, t.output_tokens)
        families["refused"].add_metric(tier, t.refused)
        slo.add_metric([*tier, "true"], t.slo_attained)
        slo.add_metric([*tier, "false"], t.slo_missed)
        budget.add_metric(tier, t.draft_tokens / t.request_rounds if t.request_rounds else 0.0)
        cumulative = list(itertools.accumulate(t.tpot_buckets))
        bounds = [*(str(b) for b in TPOT_BUCKETS_S), "+Inf"]
        tpot.add_metric(tier, list(zip(bounds, cumulative, strict=True)), t.tpot_sum_s)
    yield from families.values()
    yield slo
    yield budget
    yield tpot


# ----------------------------------------------------------------------------------------------- service
#: Prompts (or chat contents) up to this many characters are tokenised on the event loop (see the module doc).
INLINE_TOKENIZE_CHARS = 4096
#: The request state key (``scope["state"]``) under which the middleware records a request's arrival.
ARRIVED_STATE = "dspark_arrived"


class _RequestClock:
    """When a generation request arrived at the app (stamped by the middleware, before it reads the body), when
    its endpoint started, and when it was handed to the backend (``time.perf_counter``): TTFT counts from the
    arrival, as vLLM's does, and ``/metrics`` sums its parts (``dspark_http_*_seconds``)."""

    def __init__(self, request: Request) -> None:
        self.handler = time.perf_counter()
        self.arrived: float = request.scope.get("state", {}).get(ARRIVED_STATE, self.handler)
        self.submitted = self.handler

    def submit(self) -> None:
        """The prompt is tokenised: the request goes to the backend now."""
        self.submitted = time.perf_counter()


class _Run:
    """One backend generation as the app sees it: the stream plus whether it reached its final delta, or was
    lost with the backend (then there is nothing to abort)."""

    def __init__(self, backend: GenerateBackend, req_id: str, stream: AsyncIterator[GenerateDelta]) -> None:
        self.backend = backend
        self.req_id = req_id
        self.stream = stream
        self.finished = False
        self.lost = False
        self.closed = False

    async def next(self) -> GenerateDelta:
        try:
            delta = await anext(self.stream)
        except BackendUnavailableError:
            self.lost = True
            raise
        self.finished = delta.finished
        return delta

    async def close(self) -> None:
        """Close the stream and, if it did not finish, abort the request (idempotent, cancellation-proof).

        A request lost with its backend (the scheduler died) is not aborted: it went with the scheduler, and
        an abort would first have to find the scheduler again, keeping the client's stream open meanwhile."""
        self.closed = True
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()  # type: ignore[attr-defined]
            if not (self.finished or self.lost):
                await self.backend.abort(self.req_id)


async def _until_disconnect(request: Request, work: Awaitable[T], on_abort: Callable[[], None]) -> T:
    """Await ``work`` unless the client disconnects first (then ``work`` is cancelled and
    :class:`ClientDisconnectedError` raised). ``on_abort`` is called once when the client went away: its
    disconnect arrived, or the server cancelled this handler (Ray Serve does when the proxy sees the hang-up)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        on_abort()
        raise
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)  # both retrieved: no "never retrieved"
    if task.cancelled():
        on_abort()
        raise ClientDisconnectedError
    return task.result()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Service:
    """Request handling shared by both generation endpoints."""

    def __init__(self, backend: GenerateBackend, tokenizer: Any) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = _HttpMetrics(backend.model_name)
        self.created = int(time.time())
        self._tokenizer_lock = threading.Lock()

    async def tokenize(self, fn: Callable[[], T], chars: int) -> T:
        """``fn()`` (tokenising ``chars`` characters) under the tokenizer's lock: here when the text is short and
        the lock free, else in a worker thread (waiting there for the lock never holds the event loop)."""
        if chars <= INLINE_TOKENIZE_CHARS and self._tokenizer_lock.acquire(blocking=False):
            try:
                return fn()
            finally:
                self._tokenizer_lock.release()

        def locked() -> T:
            with self._tokenizer_lock:
                return fn()

        return await asyncio.to_thread(locked)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.backend.model_name}`)",
                param="model",
                code="model_not_found",
            )

    async def start(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        prompt_param: str,
        prefix: str,
    ) -> tuple[_Run, GenerateDelta]:
        """Validate the budget and parameters, submit, and wait for the first delta (or a rejection)."""
        max_context = self.backend.max_context
        if len(prompt_ids) >= max_context:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context length is {max_context} "
                "tokens (prompt and completion together)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = max_context - len(prompt_ids)
        try:
            check_context(len(prompt_ids), max_tokens, max_context)
        except ValueError as error:
            raise APIError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
        try:
            params = sampling_params(body, max_tokens)
        except SamplingError as error:
            raise APIError(400, str(error), param=str(error).split(":", 1)[0], code="invalid_value") from None
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        run = _Run(self.backend, req_id, self.backend.generate(req_id, prompt_ids, params))
        try:
            first = await _until_disconnect(request, run.next(), self.metrics.abort)
        except SLOUnattainableError as error:
            run.finished = True  # refused: nothing to abort
            raise APIError(
                429, str(error), param="tpot_slo_ms", code="slo_unattainable", retry_after_s=error.retry_after_s
            ) from None
        except ValueError as error:
            run.finished = True  # rejected: nothing to abort
            raise APIError(400, str(error), param=prompt_param) from None
        except BaseException:
            await run.close()
            raise
        return run, first

    async def collect(self, request: Request, run: _Run, first: GenerateDelta) -> tuple[GenerateDelta, str, list[int]]:
        """Drain a non-streaming run; returns the last delta, the full text and all token ids."""

        async def drain() -> tuple[GenerateDelta, str, list[int]]:
            delta, texts, ids = first, [first.text], list(first.token_ids)
            while not delta.finished:
                delta = await run.next()
                texts.append(delta.text)
                ids.extend(delta.token_ids)
            return delta, "".join(texts), ids

        try:
            return await _until_disconnect(request, drain(), self.metrics.abort)
        finally:
            await run.close()


def build_app(
    backend: GenerateBackend,
    tokenizer: Any,
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    collectors: Sequence[Any] = (),
) -> FastAPI:
    """The OpenAI-compatible app for ``backend``; ``tokenizer`` is a transformers tokenizer (chat template too).

    ``api_key``: when set, every /v1/* request needs ``Authorization: Bearer <api_key>`` (health and metrics stay
    open for probes and scrapers, as in vLLM). ``collectors``: more Prometheus collectors for ``/metrics`` (the
    backend's own, e.g. :class:`~cluster.remote_backend.RouteTimes`).
    """
    app = FastAPI(
        title="dspark-serve",
        version=__version__,
        description="OpenAI-compatible API of dspark-serve (lossless DSpark speculative decoding).",
    )
    service = _Service(backend, tokenizer)
    for collector in collectors:
        service.metrics.registry.register(collector)
    app.add_middleware(
        _GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, on_error=service.metrics.error
    )
    app.state.service = service
    _install_error_handlers(app, service)
    _document_400_not_422(app)

    @app.get("/health", responses={503: {"model": ErrorResponse, "description": "not ready, or unavailable"}})
    async def health() -> Response:
        try:
            await asyncio.wait_for(backend.health(), HEALTH_TIMEOUT_S)
        except BackendUnavailableError as error:
            raise APIError(503, str(error), type="service_unavailable") from None
        except asyncio.TimeoutError:  # e.g. a restarting scheduler that cannot be found yet
            raise APIError(
                503, f"the backend did not answer within {HEALTH_TIMEOUT_S:g} s", type="service_unavailable"
            ) from None
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        snap = await backend.metrics()
        spec = CollectorRegistry(auto_describe=False)
        spec.register(_SpecDecodeCollector(snap, backend.model_name))
        text = generate_latest(service.metrics.registry) + generate_latest(spec)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def model_card() -> dict[str, Any]:
        try:
            info = await backend.model_info()
        except BackendUnavailableError as error:  # the card still lists the model; the rest says why
            info = {"unavailable": str(error)}
        return {
            "id": backend.model_name,
            "object": "model",
            "created": service.created,
            "owned_by": "dspark-serve",
            "max_model_len": backend.max_context,
            "dspark": info,
        }

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model}", responses={401: _ERRORS[401], 404: _ERRORS[404]})
    async def get_model(model: str) -> dict[str, Any]:
        service.check_model(model)
        return await model_card()

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: {"content": _SSE_DOC}},
    )
    async def completions(body: CompletionRequest, request: Request) -> Any:
        clock = _RequestClock(request)
        service.check_model(body.model)
        check_supported(body)
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of exactly one prompt (the schema allows no more)
        if isinstance(prompt, str):
            prompt_ids = await service.tokenize(
                lambda: list(tokenizer.encode(prompt, add_special_tokens=True)), len(prompt)
            )
        else:
            prompt_ids = list(prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        clock.submit()
        run, first = await service.start(request, body, prompt_ids, max_tokens, "prompt", "cmpl")
        service.metrics.first_delta(clock)
        started = clock.arrived
        created = int(time.time())
        head = {"id": run.req_id, "object": "text_completion", "created": created, "model": backend.model_name}

        def choice(text: str, ids: list[int] | tuple[int, ...], finish: str | None) -> dict[str, Any]:
            out: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if body.return_token_ids:
                out["token_ids"] = list(ids)
            return out

        if body.stream:
            return _EventStream(
                _stream_events(
                    service,
                    run,
                    first,
                    started,
                    body,
                    head,
                    prompt_ids,
                    lambda d: choice(d.text, d.token_ids, d.finish_reason),
                ),
                run,
                service.metrics.abort,
            )
        last, text, ids = await service.collect(request, run, first)
        service.metrics.finished(last, started)
        response = {**head, "choices": [choice(text, ids, last.finish_reason)], "usage": _usage(last)}
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt_ids
        return JSONResponse(response)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, 200: {"content": _SSE_DOC}},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        clock = _RequestClock(request)
        service.check_model(body.model)
        check_supported(body)
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages", code="no_chat_template"
            )
        conversation = [{"role": message.role, "content": message.text()} for message in body.messages]

        def render() -> list[int]:
            out = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=body.add_generation_prompt, tokenize=True
            )
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(t) for t in ids]

        try:
            prompt_ids = await service.tokenize(render, sum(len(m["content"]) for m in conversation))
        except (TemplateError, ValueError, TypeError) as error:  # templates may raise on messages they reject
            raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
        if not prompt_ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        clock.submit()
        run, first = await service.start(request, body, prompt_ids, max_tokens, "messages", "chatcmpl")
        service.metrics.first_delta(clock)
        started = clock.arrived
        created = int(time.time())
        if body.stream:
            head = {
                "id": run.req_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": backend.model_name,
            }

            def chunk_choice(d: GenerateDelta) -> dict[str, Any]:
                out: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": d.text} if d.text or not d.finished else {},
                    "logprobs": None,
                    "finish_reason": d.finish_reason,
                }
                if body.return_token_ids:
                    out["token_ids"] = list(d.token_ids)
                return out

            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            return _EventStream(
                _stream_events(service, run, first, started, body, head, prompt_ids, chunk_choice, prelude=role),
                run,
                service.metrics.abort,
            )
        last, text, ids = await service.collect(request, run, first)
        service.metrics.finished(last, started)
        chat_choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": last.finish_reason,
        }
        if body.return_token_ids:
            chat_choice["token_ids"] = ids
        response = {
            "id": run.req_id,
            "object": "chat.completion",
            "created": created,
            "model": backend.model_name,
            "choices": [chat_choice],
            "usage": _usage(last),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt_ids
        return JSONResponse(response)

    return app


def _document_400_not_422(app: FastAPI) -> None:
    """Validation errors are answered 400 (OpenAI's status), so the schema must not promise FastAPI's 422."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _usage(delta: GenerateDelta) -> dict[str, int]:
    return {
        "prompt_tokens": delta.num_prompt_tokens,
        "completion_tokens": delta.num_output_tokens,
        "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens,
    }


async def _stream_events(
    service: _Service,
    run: _Run,
    first: GenerateDelta,
    started: float,
    body: CompletionRequest | ChatCompletionRequest,
    head: dict[str, Any],
    prompt_ids: list[int],
    make_choice: Callable[[GenerateDelta], dict[str, Any]],
    prelude: dict[str, Any] | None = None,
) -> AsyncIterator[str]:
    """SSE events of one run: optional prelude, a chunk per delta (the last with finish_reason), optional usage
    chunk, then ``[DONE]``. Errors after the 200 went out become an error event (OpenAI clients raise on it)."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    failed = False
    try:
        if prelude is not None:
            first_chunk = {**head, "choices": [prelude], **extra}
            if body.return_token_ids:
                first_chunk["prompt_token_ids"] = prompt_ids
            yield _sse(first_chunk)
        elif body.return_token_ids:
            yield _sse({**head, "choices": [], "prompt_token_ids": prompt_ids, **extra})
        delta = first
        while True:
            if delta.text or delta.token_ids or delta.finished:
                yield _sse({**head, "choices": [make_choice(delta)], **extra})
            if delta.finished:
                break
            delta = await run.next()
        service.metrics.finished(delta, started)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(delta)})
    except Exception as error:
        failed = True
        logger.exception("stream %s failed", run.req_id)
        status = 503 if isinstance(error, BackendUnavailableError) else 500
        service.metrics.error(status)
        # Same body as the 503 answer before a stream starts: a client can tell a retryable failure.
        kind = "service_unavailable" if status == 503 else None
        yield _sse(APIError(status, str(error), type=kind).body())
    finally:
        if not run.finished and not failed:  # closed early: the client went away
            service.metrics.abort()
        await run.close()
    yield "data: [DONE]\n\n"


def _install_error_handlers(app: FastAPI, service: _Service) -> None:
    def respond(error: APIError) -> Response:
        service.metrics.error(error.status)
        return _error_response(error)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError) -> Response:
        return respond(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> Response:
        return respond(_validation_api_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> Response:
        return respond(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(ClientDisconnectedError)
    async def disconnected(_request: Request, _error: ClientDisconnectedError) -> Response:
        # Counted as aborted where it was detected; nobody reads this (nginx's "client closed request").
        return Response(status_code=499)

    @app.exception_handler(BackendUnavailableError)
    async def unavailable(_request: Request, error: BackendUnavailableError) -> Response:
        return respond(APIError(503, str(error), type="service_unavailable"))

    @app.exception_handler(Exception)
    async def internal(_request: Request, error: Exception) -> Response:
        logger.exception("internal error")
        return respond(APIError(500, f"internal server error: {type(error).__name__}: {error}"))


def _validation_api_error(error: RequestValidationError) -> APIError:
    """pydantic's error list as one OpenAI-style 400 about the first field in error, with its path as ``param``.

    A union field (prompt, stop) fails once per member type; the most specific failure is reported (a
    constraint such as "too short" rather than "not a list"), or a hint when every member merely had the wrong
    type.
    """
    problems = error.errors()
    if not problems:
        return APIError(400, "invalid request body", code="invalid_value")
    if problems[0].get("type") == "json_invalid":
        detail = problems[0].get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
    loc = _body_loc(problems[0])
    if not loc:
        return APIError(
            400, "the request body must be a JSON object (send Content-Type: application/json)", code="invalid_body"
        )
    field = str(loc[0])
    same = [p for p in problems if _body_loc(p)[:1] == loc[:1]]
    specific = [p for p in same if not str(p.get("type", "")).endswith("_type")]
    chosen = specific[0] if specific else same[0]
    # Union members add their type names to the path (prompt -> str, list[int], ...): keep names and indices.
    kept = [p for p in _body_loc(chosen) if isinstance(p, int) or (str(p).isidentifier() and str(p) not in _TYPE_TAGS)]
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(kept))
    if chosen.get("type") == "string_unicode":
        message = f"{path}: invalid Unicode (a lone surrogate escape is not text)"
    elif len(same) > 1 and not specific and field in _PARAM_HINTS:
        message = f"{field}: invalid value"
    else:
        message = f"{path}: {chosen.get('msg', 'invalid value')}"
    if field in _PARAM_HINTS:
        message += f" ({_PARAM_HINTS[field]})"
    return APIError(400, message, param=path, code="invalid_value")


def _body_loc(problem: Any) -> list[Any]:
    return [part for part in problem.get("loc", ()) if part != "body"]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
