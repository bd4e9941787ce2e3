"""What the HTTP front end needs from whatever generates tokens, and the in-process implementation of it.

The OpenAI-compatible app (:mod:`cluster.http_app`) talks to a :class:`GenerateBackend` only, so the same app
serves the in-process engine (:class:`LocalBackend`, ``dspark serve --no-ray``) and the disaggregated Ray/gRPC
scheduler. A backend streams :class:`GenerateDelta` objects per request: token ids and text that are final
(detokenisation and stop strings are the backend's job, because a stop condition decides when the request ends
and frees its caches), plus the counts the API reports as usage.

:class:`LocalBackend` drives a single-threaded :class:`~scheduler.engine.SpeculativeEngine` from ONE background
thread. The asyncio side never touches the engine: it queues commands (submit, abort, inspect) that the loop
thread runs between rounds, and the loop thread hands deltas back with ``loop.call_soon_threadsafe``. One thread
keeps the engine's batching intact (every running request joins every round) and the event loop free to serve
HTTP while a round computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from cluster.rpc import NotReadyError
from kernels.sampling import SamplingParams
from scheduler.engine import DetachedRequest, RequestOutput, SpeculativeEngine
from scheduler.metrics import MetricsSnapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BackendUnavailableError(RuntimeError):
    """The backend cannot serve now (shut down, engine thread dead or wedged); HTTP 503, retryable."""


class BackendNotReadyError(BackendUnavailableError, NotReadyError):
    """The backend is not ready to serve (still starting, or it lost the replicas a completion needs) and did
    not become ready within its readiness bound; HTTP 503 with ``Retry-After``, retryable. Over gRPC it travels
    as ``FAILED_PRECONDITION`` (see :class:`cluster.rpc.NotReadyError`), so a client tells it from a scheduler
    that is gone."""


class EngineFailedError(RuntimeError):
    """The engine raised while running a round; the requests in it were aborted (HTTP 500, not the client's
    fault)."""


@dataclass(frozen=True)
class GenerateDelta:
    """What one request produced since its previous delta.

    ``token_ids`` and ``text`` are final (a stop string never appears in ``text``; the stop token, when one ends
    the request, is the last id of ``token_ids`` but adds no text). ``finish_reason`` is ``"stop"`` or
    ``"length"`` on the last delta and None before it. The counts are running totals for usage reporting.
    """

    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int

    @classmethod
    def from_output(cls, out: RequestOutput) -> GenerateDelta:
        return cls(
            token_ids=tuple(out.new_token_ids),
            text=out.new_text,
            finished=out.finished,
            finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
        )


@dataclass(frozen=True)
class Resume:
    """A request continues one whose stream was cut (its scheduler was lost) after it had streamed output.

    The last ``tokens`` ids of the prompt are that output and ``chars`` the characters of its text the client
    received; ``max_tokens`` counts the tokens still to come. The backend reports usage as the original request
    (prompt tokens without the output, completion tokens with it) and continues its text and stop strings across
    the seam, so the client gets only what it had not received (see
    :meth:`scheduler.engine.SpeculativeEngine.add_request`)."""

    tokens: int
    chars: int = 0


@runtime_checkable
class GenerateBackend(Protocol):
    """The contract between the HTTP layer and a token generator.

    - ``generate`` returns an async iterator of deltas ending with one whose ``finished`` is true. A request that
      can never be served (prompt too long for this deployment, token id outside the vocabulary, duplicate id)
      raises a ``ValueError`` from the FIRST ``__anext__``, before any token: the HTTP layer turns it into a 400.
      Other exceptions mean the backend failed (HTTP 500/503). ``resume`` makes the request a continuation of
      one whose stream was cut (:class:`Resume`).
    - ``abort`` stops a request and frees its caches; it is idempotent, unknown ids are ignored, and it returns
      once the backend has let go of the request. The HTTP layer calls it whenever it stops reading a stream
      before its final delta (client disconnect, error), shielded from cancellation.
    - ``metrics`` returns the aggregate speculative-decoding counters (cumulative since start).
    - ``health`` returns when the backend can serve a completion end to end now and raises
      :class:`BackendUnavailableError` otherwise (:class:`BackendNotReadyError` while it is not ready yet).
    - ``model_info`` describes how the model is served, for ``/v1/models``: the SPS table(s) in use and where
      each came from (a configured file, the SPS cache, or profiled at start).
    - ``model_name`` is the id served under ``/v1/models``; ``max_context`` bounds prompt + completion tokens.
    """

    @property
    def model_name(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    def generate(
        self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams, resume: Resume | None = None
    ) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, req_id: str) -> None: ...

    async def metrics(self) -> MetricsSnapshot: ...

    async def health(self) -> None: ...

    async def model_info(self) -> dict[str, Any]: ...


def check_context(num_prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """Reject a request whose prompt plus completion budget exceeds the context (vLLM's wording)."""
    if num_prompt_tokens + max_tokens > max_context:
        raise ValueError(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or the completion."
        )


@dataclass
class _Stream:
    """Where one request's deltas go: an asyncio queue owned by the event loop that submitted it.

    ``owner`` is the backend running the request now (failover moves a request, with its stream, to another
    backend); ``abandoned`` is set when the reader stops early, so a backend adopting the request drops it.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerateDelta | BaseException]
    owner: LocalBackend
    abandoned: bool = False

    def put(self, item: GenerateDelta | BaseException) -> bool:
        """Hand an item to the request's event loop; False when that loop is gone (server shut down)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


@dataclass
class Handoff:
    """A request leaving one backend for another (failover): its engine state and its client's stream."""

    request: DetachedRequest
    stream: _Stream | None


#: Called on the loop thread when a round raises; returns True when it took the requests over (through
#: :meth:`LocalBackend.detach`), False to fail them as usual. See :mod:`scheduler.failover`.
FailoverHook = Callable[["LocalBackend", Exception], bool]


class LocalBackend:
    """A :class:`GenerateBackend` over an in-process :class:`SpeculativeEngine` and its round-loop thread.

    Requests may come from any thread and any event loop. The engine is only ever touched by the loop thread,
    which sleeps on a condition variable while there is neither a command nor an unfinished request.
    ``info`` is what :meth:`model_info` reports (``/v1/models`` metadata).
    """

    def __init__(
        self,
        engine: SpeculativeEngine,
        model_name: str,
        *,
        max_context: int | None = None,
        wedge_timeout_s: float = 120.0,
        failover: FailoverHook | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.info = dict(info or {})
        self.failover = failover
        self.model_name = model_name
        self.max_context = max_context if max_context is not None else engine.verify.max_seq_len
        if not 1 < self.max_context <= engine.verify.max_seq_len:
            raise ValueError(
                f"max_context must be in [2, {engine.verify.max_seq_len}] (the verifier's slot length), "
                f"got {self.max_context}"
            )
        self.wedge_timeout_s = wedge_timeout_s
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._closing = False
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._snapshot = engine.snapshot()
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ GenerateBackend
    async def generate(
        self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams, resume: Resume | None = None
    ) -> AsyncIterator[GenerateDelta]:
        check_context(len(prompt_ids), params.max_tokens, self.max_context)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), self)
        prompt = [int(t) for t in prompt_ids]
        arrived = time.perf_counter()  # the request waits from here, through the round in flight, to admission
        self._enqueue(lambda: self._submit(req_id, prompt, params, stream, resume, arrived))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the loop thread already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                # Closed early (disconnect, cancellation): free the caches without waiting for the caller's abort,
                # on whichever backend runs the request now (flag first: see _adopt).
                stream.abandoned = True
                owner = stream.owner
                owner._try_enqueue(lambda: owner._abort(req_id))

    async def abort(self, req_id: str) -> None:
        await asyncio.wrap_future(self.call(lambda _engine: self._abort(req_id)))

    async def metrics(self) -> MetricsSnapshot:
        return self._snapshot

    @property
    def snapshot(self) -> MetricsSnapshot:
        """The metrics as of the last round (any thread)."""
        return self._snapshot

    async def health(self) -> None:
        self.check_alive()

    async def model_info(self) -> dict[str, Any]:
        """``info`` as given at construction (the engine was built, warmed up and priced before that)."""
        return self.info

    def check_alive(self) -> None:
        """Raise :class:`BackendUnavailableError` when the loop thread is gone or stuck in one round (any thread)."""
        if not self._thread.is_alive() or self._closing:
            raise BackendUnavailableError("the engine loop is not running")
        started = self._step_started
        if started is not None and time.monotonic() - started > self.wedge_timeout_s:
            raise BackendUnavailableError(
                f"the engine has been inside one round for more than {self.wedge_timeout_s:.0f} s"
            )

    # ------------------------------------------------------------------------------------------ extras
    def call(self, fn: Callable[[SpeculativeEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the loop thread between rounds (the only safe way to look inside the engine)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as error:  # handed to the caller, never swallowed
                    future.set_exception(error)

        self._enqueue(command)
        return future

    def detach(self, req_ids: Sequence[str] | None = None) -> list[Handoff]:
        """LOOP THREAD ONLY (a failover hook or a ``call``): take requests (default: all) out of this backend
        with their streams, releasing nothing on the replicas."""
        return [Handoff(req, self._streams.pop(req.req_id, None)) for req in self.engine.detach(req_ids)]

    def adopt(self, handoffs: Sequence[Handoff]) -> None:
        """Take over requests detached from another backend (or this one); thread-safe. Their next round
        re-prefills them; they keep streaming to the same client."""
        handoffs = list(handoffs)
        self._enqueue(lambda: self._adopt(handoffs))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop thread; requests still running fail with BackendUnavailableError."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        self.engine.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- loop thread
    def _enqueue(self, command: Callable[[], None]) -> None:
        if not self._try_enqueue(command):
            raise BackendUnavailableError("the backend is shut down")

    def _try_enqueue(self, command: Callable[[], None]) -> bool:
        with self._cond:
            if self._closing:
                return False
            self._commands.append(command)
            self._cond.notify()
            return True

    def _submit(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams,
        stream: _Stream,
        resume: Resume | None,
        arrived: float,
    ) -> None:
        try:
            emitted, chars = (resume.tokens, resume.chars) if resume is not None else (0, 0)
            self.engine.add_request(
                prompt, params, req_id, emitted=emitted, emitted_chars=chars, arrival_time=arrived
            )
        except ValueError as error:
            stream.put(error)
            return
        self._streams[req_id] = stream

    def _abort(self, req_id: str) -> None:
        self._streams.pop(req_id, None)
        self.engine.abort(req_id)

    def _adopt(self, handoffs: list[Handoff]) -> None:
        for handoff in handoffs:
            stream = handoff.stream
            if stream is None:
                continue
            # Owner before the abandoned check, the reader sets them the other way round: a reader leaving
            # concurrently either sees this backend as the owner (its abort lands here) or is seen here.
            stream.owner = self
            if stream.abandoned:
                continue
            try:
                self.engine.adopt(handoff.request)
            except ValueError as error:
                stream.put(EngineFailedError(f"the request could not be moved to a healthy replica: {error}"))
                continue
            self._streams[handoff.request.req_id] = stream

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._commands and not self.engine.has_unfinished():
                    self._cond.wait()
                if self._closing:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                try:
                    command()
                except Exception:  # e.g. an abort whose release hit a dead replica: the loop must survive
                    logger.exception("engine loop command failed")
            if self.engine.has_unfinished():
                self._step()
            self._snapshot = self.engine.snapshot()
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:  # resolves pending `call` futures and registers late submits ...
            command()
        # ... so that every request still known fails here instead of waiting forever.
        self._fail_all(BackendUnavailableError("the backend was shut down while the request was running"))

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as error:
            if self.failover is not None and self._failover(error):
                return
            # An engine bug must not kill the loop (every later request would hang): fail the requests of
            # this round loudly and keep serving new ones.
            logger.exception("engine round failed; aborting %d request(s)", len(self._streams))
            self._fail_all(EngineFailedError(f"the engine failed while running this request: {error}"))
            return
        finally:
            self._step_started = None
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.req_id]
            if not stream.put(GenerateDelta.from_output(out)) and not out.finished:
                self._abort(out.req_id)

    def _failover(self, error: Exception) -> bool:
        assert self.failover is not None
        try:
            return self.failover(self, error)
        except Exception:
            logger.exception("failover after a failed round failed itself")
            return False

    def _fail_all(self, error: BaseException) -> None:
        for req_id, stream in list(self._streams.items()):
            self.engine.abort(req_id)
            stream.put(error)
        self._streams.clear()
