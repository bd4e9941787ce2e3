"""A :class:`GenerateBackend` that streams from the scheduler over gRPC (what the HTTP ingress replicas use).

With ``routed`` (the ``colocated`` placement) each request first asks the scheduler where to run (``Route``:
admission, load-aware) and then streams from that engine replica directly, telling the scheduler when it ended
(``Release``), so no token passes through the scheduler. A scheduler without engine replicas answers ``Route``
with no address and the request streams from the scheduler as usual. A routed stream whose engine replica dies
is continued as below, on the replica the scheduler routes the continuation to (another one, or the restarted one;
the dead one takes no new request until it is heard from again).

The scheduler is one replica that Serve restarts when it dies, on a new port (maybe a new node). Its requests die
with it, but not their streams. A stream cut (UNAVAILABLE or CANCELLED: the scheduler died or shut down) after it
had streamed tokens is continued: the ingress waits for a scheduler to be reachable again (asking ``resolve`` for
its address, for at most ``continue_timeout_s``) and sends it the request as a continuation
(:class:`StreamSeam`: the prompt followed by the tokens streamed, ``max_tokens`` less those, and the counts of
tokens and text the client has), which streams only what the client has not received, with usage, detokenisation
and stop strings continuing across the seam; greedy output is the same as without the cut (a sampled request
continues with new random draws). A stream cut before its first token is retried once on a newly resolved
address (nothing reached the client). Otherwise a broken stream (DEADLINE_EXCEEDED, INTERNAL, UNKNOWN, no
scheduler within the bound) raises :class:`BackendUnavailableError`, which the HTTP layer answers with a
retryable 503 (an error event when the stream had started). The next call asks ``resolve`` for the scheduler's
address again, so clients that retry reach the restarted scheduler. A scheduler that runs but is not ready (no
replicas yet) answers ``FAILED_PRECONDITION`` after its readiness wait: :class:`BackendNotReadyError`, also a
retryable 503, with the channel kept. A request refused at admission for its TPOT target comes as
``RESOURCE_EXHAUSTED`` with a retry-after trailer (from the scheduler or an engine replica alike) and is raised as
the :class:`SLOUnattainableError` it was there (a 429 with ``Retry-After``). Aborts are best effort: a dead
scheduler has nothing left to abort.

Metrics stay monotonic across scheduler restarts: every ``Metrics`` reply names the scheduler incarnation whose
counters it holds, and :class:`CounterBaseline` adds the last counters read from each earlier incarnation to the
current one's (Prometheus counters served by the ingress never go down). What an incarnation counted after the
ingress last read it is lost with it, so the totals undercount by at most one scrape interval per restart. Each
ingress replica keeps its own baseline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily

from cluster import contract
from cluster.backend import BackendNotReadyError, BackendUnavailableError, GenerateDelta, Resume
from cluster.rpc import RpcClient, retry_after_s
from kernels.sampling import SamplingParams
from scheduler.metrics import MetricsSnapshot, merge_snapshots, snapshot_from_dict
from scheduler.service_levels import SLOUnattainableError

logger = logging.getLogger(__name__)

#: Statuses that mean the scheduler is gone, restarting or unreachable (not the request's fault).
UNAVAILABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
AddressResolver = Callable[[], Awaitable[str]]
#: Statuses of a stream cut by its scheduler's death or shutdown, after which it is continued (see the module doc).
CONTINUE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
#: Deadline of the unary calls (abort, metrics); health checks get less.
UNARY_TIMEOUT_S = 10.0
#: How often a cut stream looks for a scheduler to continue on.
CONTINUE_POLL_S = 0.25


class CounterBaseline:
    """Keeps a scheduler's counters monotonic across its restarts (see the module doc).

    :meth:`add` takes each reply's incarnation and snapshot and returns the totals: the current incarnation's
    counters plus the last ones read from every earlier incarnation; gauges (running, waiting, recent round
    time) are the current incarnation's alone.
    """

    def __init__(self) -> None:
        self._incarnation: str | None = None
        self._last: MetricsSnapshot | None = None  # the current incarnation's last snapshot
        self._retired: MetricsSnapshot | None = None  # the earlier incarnations' counters, summed

    def add(self, incarnation: str | None, snapshot: MetricsSnapshot) -> MetricsSnapshot:
        if self._last is not None and incarnation != self._incarnation:
            final = replace(self._last, running=0, waiting=0, recent_round_s=0.0)
            self._retired = merge_snapshots([s for s in (self._retired, final) if s is not None])
        self._incarnation, self._last = incarnation, snapshot
        return snapshot if self._retired is None else merge_snapshots([self._retired, snapshot])


class RouteTimes:
    """The ``Route`` calls of a routed backend, for the ingress's ``/metrics``: how many answered and their summed
    wall time (the ingress's call to the scheduler and back), a Prometheus collector of two counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.routes = 0
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.routes += 1
        self.seconds += seconds

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, doc, value in (
            ("dspark_http_routes", "Route calls answered by the scheduler (the colocated placement).", self.routes),
            ("dspark_http_route_seconds", "Summed wall time of those Route calls.", self.seconds),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class RemoteBackend:
    """Each request is one server stream of deltas; the first message or an INVALID_ARGUMENT arrives at once.

    ``address``: the scheduler's ``host:port``, or an async callable returning it (asked again after the
    scheduler was unreachable). ``timeout_s`` is the deadline of one whole stream. ``service``: the gRPC service
    streamed from (the scheduler's, or an engine replica's when the scheduler reads a replica's metrics through
    this class). ``routed``: ask the scheduler's ``Route`` first (see the module doc). ``continue_timeout_s``: how
    long a stream cut by the loss of its scheduler (or engine replica) waits for one to continue on (only with a
    resolver: a fixed address is not restarted elsewhere). ``route_times`` counts the ``Route`` calls.
    """

    def __init__(
        self,
        address: str | AddressResolver,
        *,
        model_name: str,
        max_context: int,
        token: str | None = None,
        timeout_s: float = 3600.0,
        resolve_timeout_s: float = 10.0,
        service: str = contract.SCHEDULER,
        routed: bool = False,
        continue_timeout_s: float = 30.0,
    ) -> None:
        self._resolve = None if isinstance(address, str) else address
        self.address: str | None = address if isinstance(address, str) else None
        self.model_name = model_name
        self.max_context = max_context
        self._token = token
        self._timeout_s = timeout_s
        self._resolve_timeout_s = resolve_timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, RpcClient] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # Generate, Abort, Metrics, Info, ModelInfo of the server this backend streams from
        self._methods = contract.BACKEND_METHODS[service]
        self._routed = routed
        self._replicas: dict[tuple[asyncio.AbstractEventLoop, str], RpcClient] = {}
        self._routes: dict[str, str] = {}  # req id -> engine replica address, while it streams from there
        self._releases: set[asyncio.Task[Any]] = set()
        self._counters = CounterBaseline()
        self._continue_timeout_s = continue_timeout_s
        self._attempts: dict[str, str] = {}  # req id -> its continuation's id, while a continued stream runs
        self.route_times = RouteTimes(model_name)

    async def _client(self) -> RpcClient:
        # grpc.aio channels belong to the event loop that created them.
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            if self._resolve is not None:
                try:
                    self.address = await asyncio.wait_for(self._resolve(), self._resolve_timeout_s)
                except Exception as exc:
                    raise BackendUnavailableError(f"the scheduler cannot be found: {exc}; retry") from None
            assert self.address is not None
            client = self._clients[loop] = RpcClient(self.address, token=self._token, timeout_s=self._timeout_s)
        return client

    def _unreachable(self, exc: grpc.aio.AioRpcError) -> BackendUnavailableError:
        """Forget this loop's channel (the next call resolves the address again) and say so retryably."""
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._forget_channel()
        return BackendUnavailableError(
            f"the scheduler is unavailable ({exc.code().name}: {exc.details()}); the request can be retried"
        )

    def _forget_channel(self) -> None:
        """New calls on this loop go on a fresh channel, to wherever the scheduler is now.

        The old channel is closed gracefully: other requests may still be running on it (a draining scheduler
        refuses new calls but finishes its streams; a dead one fails them itself with UNAVAILABLE). Closing it at
        once would cancel them: a healthy stream cut short, and a bare ``CancelledError`` in its caller. No call
        outlives its deadline, so the grace is the longest deadline.
        """
        if self._resolve is None:
            return
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            grace_s = max(self._timeout_s, UNARY_TIMEOUT_S)
            task = asyncio.get_running_loop().create_task(client.close(grace_s=grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def generate(
        self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams, resume: Resume | None = None
    ) -> AsyncIterator[GenerateDelta]:
        seam = StreamSeam(req_id, prompt_ids, params, resume)
        deadline: float | None = None  # while a cut stream waits for a scheduler (or replica) to continue on
        retried = False
        early = False  # closed or cancelled by the caller, who aborts it (by req_id: see abort)
        try:
            while True:
                received = False
                error: BackendUnavailableError
                try:
                    request = seam.request()
                    if request["req_id"] != req_id:
                        self._attempts[req_id] = request["req_id"]
                    async for message in self._stream(req_id, request):
                        received = True
                        delta = seam.add(_delta(message))
                        yield delta
                        if delta.finished:
                            return
                    return
                except (grpc.aio.AioRpcError, _ReplicaLostError) as exc:
                    cause = exc.cause if isinstance(exc, _ReplicaLostError) else exc
                    _raise_request_error(cause)
                    if cause.code() not in UNAVAILABLE_CODES:
                        raise cause from None
                    error = exc.error if isinstance(exc, _ReplicaLostError) else self._unreachable(cause)
                    if not seam.tokens:
                        # A scheduler that was restarted is only found again after a failed call: one retry, and
                        # only before any delta was received (nothing reached the client, and the failed attempt
                        # died with its scheduler or replica).
                        if received or retried or self._resolve is None or cause.code() != grpc.StatusCode.UNAVAILABLE:
                            raise error from None
                        retried = True
                        continue
                    if self._resolve is None or cause.code() not in CONTINUE_CODES:
                        raise error from None
                    if received:
                        deadline = None  # cut again after it had continued: a new wait
                except BackendUnavailableError as exc:  # the scheduler's address cannot be found now
                    if not seam.tokens:
                        raise
                    error = exc
                # Cut after it had streamed tokens: continue it where it was, on a scheduler reachable again (or,
                # routed, on the replica the scheduler admits the continuation to).
                now = asyncio.get_running_loop().time()
                if deadline is None:
                    deadline = now + self._continue_timeout_s
                    logger.info("%s: %s after %d streamed token(s); continuing the stream",
                                req_id, error, len(seam.tokens))
                elif now >= deadline:
                    raise BackendUnavailableError(
                        f"{error}; nothing could continue the stream within {self._continue_timeout_s:g} s"
                    ) from None
                await asyncio.sleep(min(CONTINUE_POLL_S, deadline - now))
        except GeneratorExit:
            early = True
            raise
        except asyncio.CancelledError:
            # As in abort: grpc.aio raises CancelledError in the calls of a channel closed under them (with
            # _forget_channel's grace, only one whose calls outlived it); that is a lost scheduler (retryable
            # 503), not a client disconnect, unless this task itself is being cancelled.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                early = True
                raise
            self._forget_channel()
            raise BackendUnavailableError(
                "the scheduler is unavailable (its channel was closed); the request can be retried"
            ) from None
        finally:
            if not early:
                self._attempts.pop(req_id, None)

    async def _stream(self, req_id: str, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """One attempt's messages: from the engine replica the scheduler routes it to (``routed``, when the
        deployment has engine replicas), else from the scheduler."""
        if self._routed:
            address = await self._route(request["req_id"])
            if address is not None:
                async for message in self._generate_on(req_id, address, request):
                    yield message
                return
        async for message in self._methods.generate.stream(await self._client(), request):
            yield message

    async def _route(self, req_id: str) -> str | None:
        """The engine replica the scheduler admitted ``req_id`` to (None: stream from the scheduler itself)."""
        client = await self._client()
        started = time.perf_counter()
        try:
            reply = await contract.ROUTE.acall(client, {"req_id": req_id}, timeout_s=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            _raise_request_error(exc)
            raise self._unreachable(exc) from None
        self.route_times.add(time.perf_counter() - started)
        return reply["address"]

    async def _generate_on(self, req_id: str, address: str, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream a routed attempt from its engine replica; the scheduler is told when it ended (and whether the
        replica was unreachable) whatever happened. A replica that fails the stream raises
        :class:`_ReplicaLostError` (its status decides, as for a scheduler, whether the stream is continued)."""
        attempt = request["req_id"]
        loop = asyncio.get_running_loop()
        client = self._replicas.get((loop, address))
        if client is None:
            client = self._replicas[(loop, address)] = RpcClient(address, token=self._token, timeout_s=self._timeout_s)
        self._routes[req_id] = address
        lost = False
        try:
            async for message in contract.ENGINE_METHODS.generate.stream(client, request):
                yield message
        except grpc.aio.AioRpcError as exc:
            _raise_request_error(exc)
            if exc.code() not in UNAVAILABLE_CODES:
                raise
            lost = exc.code() == grpc.StatusCode.UNAVAILABLE
            if lost:
                self._replicas.pop((loop, address), None)
            raise _ReplicaLostError(
                exc,
                BackendUnavailableError(
                    f"the engine replica is unavailable ({exc.code().name}: {exc.details()}); the request can be "
                    "retried"
                ),
            ) from None
        finally:
            self._routes.pop(req_id, None)
            task = loop.create_task(self._release(attempt, lost))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, req_id: str, lost: bool) -> None:
        try:
            await contract.SCHEDULER_RELEASE.acall(
                await self._client(), {"req_id": req_id, "lost": lost}, timeout_s=UNARY_TIMEOUT_S
            )
        except Exception as exc:
            logger.info("release of %s not delivered (%s)", req_id, exc)

    async def abort(self, req_id: str) -> None:
        address = self._routes.get(req_id)
        if address is not None:
            client = self._replicas.get((asyncio.get_running_loop(), address))
            if client is not None:
                attempt = self._attempts.get(req_id, req_id)  # a continued stream runs under its continuation's id
                try:
                    await contract.ENGINE_METHODS.abort.acall(client, {"req_id": attempt}, timeout_s=UNARY_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    logger.info("abort of %s not delivered (%s): its replica went with it", req_id, exc.code().name)
                return
        req_id = self._attempts.pop(req_id, req_id)  # a continued stream runs under its continuation's id
        try:
            await self._methods.abort.acall(await self._client(), {"req_id": req_id}, timeout_s=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            error = self._unreachable(exc)
            logger.info("abort of %s not delivered (%s): the scheduler went with its requests", req_id, error)
        except BackendUnavailableError as exc:
            logger.info("abort of %s not delivered (%s): the scheduler went with its requests", req_id, exc)
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError in the calls of a channel closed under them; only a cancellation
            # of this task itself (a client disconnect, shutdown) must propagate.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            logger.info("abort of %s not delivered: the scheduler's channel was closed", req_id)

    async def metrics(self) -> MetricsSnapshot:
        try:
            reply = await self._methods.metrics.acall(await self._client(), {}, timeout_s=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise self._unreachable(exc) from None
        incarnation = reply.pop("incarnation", None)
        return self._counters.add(incarnation, snapshot_from_dict(reply))

    async def health(self) -> None:
        try:
            info = await self._methods.info.acall(await self._client(), {}, timeout_s=5.0)
        except grpc.aio.AioRpcError as exc:
            raise self._unreachable(exc) from None
        if not info["ready"]:
            raise BackendNotReadyError(f"not ready: {info['reason']}")

    async def model_info(self) -> dict[str, Any]:
        try:
            return await self._methods.model_info.acall(await self._client(), {}, timeout_s=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise self._unreachable(exc) from None


class _ReplicaLostError(Exception):
    """A routed stream's engine replica failed it: the gRPC error (``cause``) and what to raise if the stream
    is not continued (``error``)."""

    def __init__(self, cause: grpc.aio.AioRpcError, error: BackendUnavailableError) -> None:
        super().__init__(str(error))
        self.cause = cause
        self.error = error


class StreamSeam:
    """One request's stream as its client received it, and the ``Generate`` request that continues it there.

    Before any token streamed, :meth:`request` is the request itself. After, it is a continuation
    (:class:`~cluster.backend.Resume`): the prompt followed by every token streamed, ``max_tokens`` less those
    tokens, the same sampling parameters otherwise, and the counts of tokens and characters the client has, so
    that the new scheduler streams only what the client has not received and reports usage as for the original
    request. Each continuation runs under its own request id (``<req_id>+<n>``): a scheduler that still knows the
    cut attempt (a broken connection, not a death) takes it as another request.
    """

    def __init__(
        self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams, resume: Resume | None = None
    ) -> None:
        self.req_id = req_id
        self.prompt = [int(t) for t in prompt_ids]
        self.params = params
        self.resume = resume
        self.tokens: list[int] = []  # streamed, in order
        self.chars = 0  # characters of text streamed
        self.continuations = 0

    def add(self, delta: GenerateDelta) -> GenerateDelta:
        """Record a delta passed on to the client; returns it."""
        self.tokens.extend(delta.token_ids)
        self.chars += len(delta.text)
        return delta

    def request(self) -> dict[str, Any]:
        """The next attempt's ``Generate`` message."""
        if not self.tokens:
            return contract.generate_request(self.req_id, self.prompt, self.params, self.resume)
        remaining = self.params.max_tokens - len(self.tokens)
        if remaining < 1:  # the last delta says finished: never continued
            raise BackendUnavailableError("the stream was cut after its last token but before it ended")
        self.continuations += 1
        emitted, chars = (self.resume.tokens, self.resume.chars) if self.resume is not None else (0, 0)
        return contract.generate_request(
            f"{self.req_id[:120]}+{self.continuations}",
            [*self.prompt, *self.tokens],
            replace(self.params, max_tokens=remaining),
            Resume(emitted + len(self.tokens), chars + self.chars),
        )


def _delta(message: dict[str, Any]) -> GenerateDelta:
    return GenerateDelta(
        token_ids=tuple(message["token_ids"]),
        text=message["text"],
        finished=message["finished"],
        finish_reason=message["finish_reason"],
        num_prompt_tokens=message["num_prompt_tokens"],
        num_output_tokens=message["num_output_tokens"],
    )


def _raise_request_error(exc: grpc.aio.AioRpcError) -> None:
    """The statuses that belong to the request, not to the server's reachability: INVALID_ARGUMENT is the
    request's fault (a 400), FAILED_PRECONDITION a server that is not ready yet (a retryable 503),
    RESOURCE_EXHAUSTED with a retry-after (:class:`cluster.rpc.RetryLaterError`) a TPOT target refused at
    admission (a 429 with ``Retry-After``)."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        raise ValueError(exc.details()) from None
    seconds = retry_after_s(exc)
    if seconds is not None:
        raise SLOUnattainableError(exc.details(), seconds) from None
    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
        raise BackendNotReadyError(exc.details()) from None
