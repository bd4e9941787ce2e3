"""gRPC servers and clients of the data plane, built from plain async Python handlers and msgpack payloads.

A service is a name and a dict ``method name -> (handler, request schema)``. A handler is an ``async def``
taking the validated request dict and returning a msgpack-able response (a unary call), or an ``async def``
generator yielding responses (a server stream, e.g. tokens). No ``.proto`` files: methods are registered with
``grpc.method_handlers_generic_handler`` and carry raw bytes that :mod:`cluster.wire` encodes and decodes.

The codec runs inside the method wrapper rather than as grpc's (de)serializer because grpc reports a failing
deserializer as ``UNKNOWN``; decoding here lets every failure map to the status a caller can act on:

=======================================  ======================
what happened                            status
=======================================  ======================
missing or wrong ``authorization``       ``UNAUTHENTICATED``
undecodable or schema-invalid request    ``INVALID_ARGUMENT``
handler raised ``ValueError``            ``INVALID_ARGUMENT``
handler raised :class:`NotFoundError`    ``NOT_FOUND``
handler raised :class:`NotReadyError`    ``FAILED_PRECONDITION`` (not logged: expected while starting)
handler raised :class:`RetryLaterError`  ``RESOURCE_EXHAUSTED``, seconds in trailer ``dspark-retry-after-s``
handler raised anything else             ``INTERNAL``
request over ``max_message_bytes``       ``RESOURCE_EXHAUSTED`` (grpc refuses it before reading it all)
call ran past its deadline               ``DEADLINE_EXCEEDED`` (the handler task is cancelled)
=======================================  ======================

The message is always in the status details, and the server keeps serving. Every server also answers
``dspark.Health/Check`` with its serving status and a payload the service fills (e.g. its load).

Security defaults (issue 10): servers bind 127.0.0.1 unless told otherwise (pass the cluster-internal address,
or ``0.0.0.0`` explicitly); message size is bounded on both ends; an optional shared-secret token travels as
``authorization: Bearer <token>`` metadata and is compared in constant time. The channel itself is plaintext:
the token keeps strangers on the cluster network out, it does not hide traffic. Clients put a deadline on
every call and never retry on their own (a retried round could be applied twice; the caller decides).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import math
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import grpc

from cluster.messages import AnyValue, Map, Message, Opt, Str, Type, validate
from cluster.wire import DEFAULT_LIMITS, WireError, WireLimits, decode, encode

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
#: Deadline of a call that does not set its own: generous for a round, short enough to notice a wedged peer.
DEFAULT_TIMEOUT_S = 10.0
HEALTH_SERVICE = "dspark.Health"
HEALTH_METHOD = "Check"
SERVING, NOT_SERVING = "SERVING", "NOT_SERVING"
# Status details travel in HTTP/2 trailers, whose size is bounded: long messages are cut.
_MAX_DETAILS_CHARS = 1000

HEALTH_REQUEST = Message("HealthCheckRequest", {"service": Opt(Str(max_len=256))})
HEALTH_REPLY = Message(
    "HealthCheckReply", {"status": Str(choices=(SERVING, NOT_SERVING)), "payload": Map(AnyValue(), max_len=256)}
)
# The envelope of a reply on a method's stream twin: {_OK: response, _HELD: microseconds} or {_CODE: status name,
# _DETAILS: message}. _HELD is how long the message stayed in the server process, from its arrival on the stream
# to its reply's encoding (decode, validation, the handler and its thread hand-offs): the caller tells the time on
# the wire from the time inside the replica with it.
_OK, _CODE, _DETAILS, _HELD = "ok", "code", "details", "held_us"
_STREAM_OPEN = "dspark-stream-open"  # header a stream twin sends once it accepted the stream
#: Trailing metadata of a RESOURCE_EXHAUSTED from :class:`RetryLaterError`: whole seconds to wait before retrying.
RETRY_AFTER_KEY = "dspark-retry-after-s"

UnaryHandler = Callable[[dict[str, Any]], Awaitable[Any]]
StreamHandler = Callable[[dict[str, Any]], AsyncGenerator[Any, None]]
Handler = UnaryHandler | StreamHandler
Trailers = tuple[tuple[str, str], ...]


class NotFoundError(LookupError):
    """A request names something this replica does not hold (an unknown or finished request id): NOT_FOUND."""


class NotReadyError(RuntimeError):
    """The service runs but cannot take this call yet (e.g. a scheduler without replicas): FAILED_PRECONDITION.

    Not ``UNAVAILABLE``, which clients read as "this server is gone, find it again"; and not logged with a
    traceback, since a retrying client meets it once per attempt while a deployment starts."""


class RetryLaterError(RuntimeError):
    """The service refuses this call for its current load; the caller may retry after ``retry_after_s`` whole
    seconds (at least 1): ``RESOURCE_EXHAUSTED`` with the seconds in the trailer :data:`RETRY_AFTER_KEY`, which
    :func:`retry_after_s` reads back. The trailer tells it from grpc's own RESOURCE_EXHAUSTED (a message over the
    size limit), which has none. Not logged: a loaded server refuses many."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = max(int(retry_after_s), 1)


def retry_after_s(error: grpc.RpcError) -> int | None:
    """The seconds a :class:`RetryLaterError` refusal asks the caller to wait (None: not such a refusal)."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(int(value), 1)
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class Service:
    """A named group of methods: ``methods[name] = (handler, request schema)``.

    An ``async def`` handler is a unary method; an ``async def`` generator is a server-streaming method.
    """

    name: str
    methods: Mapping[str, tuple[Handler, Type]]

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"service name must be non-empty and contain no '/': {self.name!r}")
        if not self.methods:
            raise ValueError(f"service {self.name} has no methods")
        for method, spec in self.methods.items():
            if not method or "/" in method:
                raise ValueError(f"method name must be non-empty and contain no '/': {method!r}")
            if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], Type)):
                raise TypeError(f"{self.name}/{method}: expected (handler, request schema)")
            handler = spec[0]
            if not (inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler)):
                raise TypeError(f"{self.name}/{method}: the handler must be an async def or async generator")
        for method, (handler, _) in self.methods.items():
            if inspect.iscoroutinefunction(handler) and stream_method(method) in self.methods:
                raise ValueError(f"{self.name}/{stream_method(method)} is taken by the stream of {method}")


@dataclass(frozen=True)
class HealthStatus:
    """What a service reports on ``Health/Check``: whether it takes work, and what a router wants to see."""

    serving: bool = True
    payload: dict[str, Any] = field(default_factory=dict)


HealthFn = Callable[[], HealthStatus | Awaitable[HealthStatus]]


def _method_path(service: str, method: str) -> str:
    return f"/{service}/{method}"


def stream_method(method: str) -> str:
    """The bidirectional-stream twin of a unary method: the same handler and schema, one message each way."""
    return f"{method}Stream"


def _join_host_port(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):  # bare IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


def _grpc_options(limits: WireLimits) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
    ]


def _bearer(token: str | None) -> str | None:
    if token is None:
        return None
    if not isinstance(token, str) or not token or not token.isascii() or not token.isprintable():
        raise ValueError("the gRPC token must be a non-empty printable ASCII string")
    return f"Bearer {token}"


def _status_for(exc: Exception, where: str) -> tuple[grpc.StatusCode, str, Trailers]:
    """Map a handler's exception to a status, its details and trailing metadata: bad input and unknown ids are
    the caller's, a refusal for load says when to retry, the rest is ours."""
    if isinstance(exc, RetryLaterError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), ((RETRY_AFTER_KEY, str(exc.retry_after_s)),)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc) or "not found", ()
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc) or type(exc).__name__, ()
    if isinstance(exc, NotReadyError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc) or "not ready", ()
    log.exception("%s failed", where)
    if isinstance(exc, grpc.aio.AioRpcError):
        return grpc.StatusCode.INTERNAL, f"upstream call failed: {exc.code().name}: {exc.details()}", ()
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}", ()


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, trailers: Trailers = ()
) -> NoReturn:
    await context.abort(code, message[:_MAX_DETAILS_CHARS], trailing_metadata=trailers)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


# ----------------------------------------------------------------------------------------------------------
# Server


class RpcServer:
    """A grpc.aio server for ``services`` and ``dspark.Health/Check``; create and start it in an event loop.

    ``port=0`` picks a free port (read it from :attr:`port` after :meth:`start`). Port reuse is off so that a
    second server on a taken port fails instead of silently sharing it. ``max_concurrent_rpcs`` (None = no
    bound) makes an overloaded replica answer RESOURCE_EXHAUSTED instead of queueing without end.
    ``health`` is called on each health check (sync or async); it gets ``health_timeout_s`` to answer, after
    which the server reports NOT_SERVING (an engine too busy or wedged to answer should not get new work).
    """

    def __init__(
        self,
        services: Sequence[Service],
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        token: str | None = None,
        limits: WireLimits = DEFAULT_LIMITS,
        health: HealthFn | None = None,
        health_timeout_s: float = 2.0,
        max_concurrent_rpcs: int | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if not health_timeout_s > 0:
            raise ValueError(f"health_timeout_s must be > 0, got {health_timeout_s}")
        names = [s.name for s in services]
        if len(set(names)) != len(names) or HEALTH_SERVICE in names:
            raise ValueError(f"service names must be unique and not {HEALTH_SERVICE!r}: {names}")
        self.host = host
        self.limits = limits
        self._requested_port = port
        bearer = _bearer(token)
        self._auth = None if bearer is None else bearer.encode()
        self._health_fn = health
        self._health_timeout_s = health_timeout_s
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._serving = True
        health_service = Service(HEALTH_SERVICE, {HEALTH_METHOD: (self._health_check, HEALTH_REQUEST)})
        self._services = [*services, health_service]
        self._server: grpc.aio.Server | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` as bound (for a wildcard host, clients use a concrete address of this machine)."""
        return _join_host_port(self.host, self.port)

    def set_serving(self, serving: bool) -> None:
        """Report (NOT_)SERVING on health checks, e.g. while draining before shutdown."""
        self._serving = serving

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("the server is already started")
        server = grpc.aio.server(
            options=[*_grpc_options(self.limits), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=self._max_concurrent_rpcs,
        )
        server.add_generic_rpc_handlers([self._generic_handler(s) for s in self._services])
        address = _join_host_port(self.host, self._requested_port)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot bind the gRPC server to {address}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot bind the gRPC server to {address}")
        await server.start()
        self._server, self._port = server, port
        log.info("gRPC server for %s listening on %s", [s.name for s in self._services], self.address)
        return port

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop taking calls; in-flight calls get ``grace_s`` seconds to finish, then they are cancelled."""
        self._serving = False
        if self._server is not None:
            await self._server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        if self._server is None:
            raise RuntimeError("the server is not started")
        await self._server.wait_for_termination()

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(grace_s=None)

    # -- method plumbing -----------------------------------------------------------------------------------

    def _generic_handler(self, service: Service) -> grpc.GenericRpcHandler:
        handlers = {}
        for method, (handler, schema) in service.methods.items():
            where = f"{service.name}/{method}"
            # Service checked that each handler is an async def or an async generator function.
            if inspect.isasyncgenfunction(handler):
                streamed = self._stream_behavior(where, cast(StreamHandler, handler), schema)
                handlers[method] = grpc.unary_stream_rpc_method_handler(streamed)
            else:
                unary = cast(UnaryHandler, handler)
                handlers[method] = grpc.unary_unary_rpc_method_handler(self._unary_behavior(where, unary, schema))
                bidi = self._bidi_behavior(where, unary, schema)
                handlers[stream_method(method)] = grpc.stream_stream_rpc_method_handler(bidi)
        return grpc.method_handlers_generic_handler(service.name, handlers)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self._auth is None:
            return
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                if hmac.compare_digest(value.encode(), self._auth):
                    return
                break
        await _abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid authorization token")

    async def _parse(self, raw: bytes, schema: Type, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)  # before decoding: no work for unauthenticated bytes
        try:
            return validate(schema, decode(raw, limits=self.limits))
        except WireError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _encode(self, value: Any, where: str, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return encode(value, limits=self.limits)
        except WireError as exc:
            log.error("%s returned a value that cannot be sent: %s", where, exc)
            await _abort(context, grpc.StatusCode.INTERNAL, f"cannot encode the response: {exc}")

    def _unary_behavior(
        self, where: str, handler: UnaryHandler, schema: Type
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        async def behavior(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            request = await self._parse(raw, schema, context)
            try:
                response = await handler(request)
            except Exception as exc:
                await _abort(context, *_status_for(exc, where))
            return await self._encode(response, where, context)

        return behavior

    def _stream_behavior(
        self, where: str, handler: StreamHandler, schema: Type
    ) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        async def behavior(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            request = await self._parse(raw, schema, context)
            items = handler(request)
            try:
                while True:
                    try:
                        item = await anext(items)
                    except StopAsyncIteration:
                        return
                    except Exception as exc:
                        await _abort(context, *_status_for(exc, where))
                    yield await self._encode(item, where, context)
            finally:
                # On cancellation (client gone, deadline) this runs the handler's finally blocks.
                await items.aclose()

        return behavior

    def _bidi_behavior(
        self, where: str, handler: UnaryHandler, schema: Type
    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        """The stream twin of a unary method: authorised once when the stream opens, then every message is
        answered in order by the unary handler with an envelope (:func:`_envelope`), so that a refused message
        fails only itself and the stream serves the next one. Messages are handled one at a time: a caller
        sends its next message after the previous reply (one round in flight per stream)."""

        async def behavior(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            await self._authorize(context)
            # Headers now, marked: the client knows the stream is open before its first message (a refusal
            # comes as trailers only, and a write racing it would turn its status into INTERNAL).
            await context.send_initial_metadata(((_STREAM_OPEN, "1"),))
            async for raw in requests:
                arrived = time.perf_counter()
                try:
                    request = validate(schema, decode(raw, limits=self.limits))
                except WireError as exc:
                    yield self._stream_error(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    continue
                try:
                    response = await handler(request)
                except asyncio.CancelledError:  # the handler gave up on this message: the stream ends with it
                    await _abort(context, grpc.StatusCode.CANCELLED, f"{where} was cancelled")
                except Exception as exc:
                    code, message, _ = _status_for(exc, where)  # a stream twin's envelope has no trailers
                    yield self._stream_error(code, message)
                    continue
                held_us = int(1e6 * (time.perf_counter() - arrived))
                try:
                    yield encode({_OK: response, _HELD: held_us}, limits=self.limits)
                except WireError as exc:
                    log.error("%s returned a value that cannot be sent: %s", where, exc)
                    yield self._stream_error(grpc.StatusCode.INTERNAL, f"cannot encode the response: {exc}")

        return behavior

    def _stream_error(self, code: grpc.StatusCode, message: str) -> bytes:
        return encode({_CODE: code.name, _DETAILS: message[:_MAX_DETAILS_CHARS]}, limits=self.limits)

    async def _health_check(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self._serving:
            return {"status": NOT_SERVING, "payload": {"reason": "draining"}}
        if self._health_fn is None:
            return {"status": SERVING, "payload": {}}
        try:
            result = self._health_fn()
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, self._health_timeout_s)
            if not isinstance(result, HealthStatus):
                raise TypeError(f"the health callback returned {type(result).__name__}, not HealthStatus")
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return {"status": NOT_SERVING, "payload": {"reason": "health check timed out"}}
        except Exception as exc:
            log.exception("health check failed")
            return {"status": NOT_SERVING, "payload": {"reason": f"{type(exc).__name__}: {exc}"}}
        return {"status": SERVING if result.serving else NOT_SERVING, "payload": result.payload}


async def start_server(services: Sequence[Service], **options: Any) -> RpcServer:
    """Create and start an :class:`RpcServer` (keyword options as in its constructor)."""
    server = RpcServer(services, **options)
    await server.start()
    return server


class ServerThread:
    """An :class:`RpcServer` on its own event loop in a daemon thread, for tests, scripts and sync programs.

    Handlers run on that loop; :meth:`run` executes a coroutine there (e.g. to inspect service state).
    :meth:`stop` stops the loop and ends the thread but never closes the loop, for the reason given at
    :class:`_ThreadLoop`: the handlers' own channels (a verifier's feature links to a drafter) are torn down on
    it, and grpc may deliver such a channel's last event (a GOAWAY from a peer stopping at the same time) after
    ``close`` returned; for a closed loop that event raises inside grpc's poller.
    """

    def __init__(self, services: Sequence[Service], **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rpc-server", daemon=True)
        self._thread.start()
        try:
            self.server: RpcServer = self.run(start_server(services, **options))
        except BaseException:
            self._shutdown_loop()
            raise

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return self.server.address

    def run(self, coro: Awaitable[Any], timeout_s: float | None = 30.0) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return future.result(timeout_s)

    def stop(self, grace_s: float | None = None) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.run(self.server.stop(grace_s))
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------------------------------------
# Clients


class _ClientBase:
    """What the async and sync clients share: deadline policy, metadata, codec and size limits."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        limits: WireLimits = DEFAULT_LIMITS,
    ) -> None:
        self.target = target
        self.limits = limits
        self.timeout_s = self._check_timeout(timeout_s)
        bearer = _bearer(token)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", bearer),) if bearer else ()
        # No transparent or configured retries: a retried round could be applied twice; callers decide.
        self._options = [*_grpc_options(limits), ("grpc.enable_retries", 0)]
        # Payload bytes through this client (msgpack bodies, without HTTP/2 framing): bytes-per-round accounting.
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0  # requests encoded (unary calls, or messages on a stream)

    @staticmethod
    def _check_timeout(timeout_s: float) -> float:
        if not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"every call needs a deadline: timeout_s must be > 0, got {timeout_s!r}")
        return float(timeout_s)

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else self._check_timeout(timeout_s)

    def _encode(self, request: Any) -> bytes:
        payload = encode(request, limits=self.limits)
        self.bytes_sent += len(payload)
        self.messages_sent += 1
        return payload

    def _decode(self, raw: bytes, schema: Type | None) -> Any:
        self.bytes_received += len(raw)
        value = decode(raw, limits=self.limits)
        return value if schema is None else validate(schema, value)


class RpcClient(_ClientBase):
    """grpc.aio client: create it inside the event loop that uses it; close it with ``await close()``.

    Requests are encoded here (an oversized or unencodable request raises :class:`WireError` before sending);
    responses are decoded with the same limits and, when ``response_schema`` is given, validated. grpc
    failures surface as ``grpc.aio.AioRpcError`` (``.code()``, ``.details()``).
    """

    def __init__(self, target: str, **options: Any) -> None:
        super().__init__(target, **options)
        self._client_options = options  # token, timeout_s, limits: what its round streams are built with
        self._channel = grpc.aio.insecure_channel(target, options=self._options)
        self._unary_calls: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._stream_calls: dict[str, grpc.aio.UnaryStreamMultiCallable] = {}

    def unary(
        self, service: str, method: str, response_schema: Type | None = None
    ) -> Callable[..., Awaitable[Any]]:
        """A stub for one unary method: ``await stub(request, timeout_s=None)``."""

        async def stub(request: Any, *, timeout_s: float | None = None) -> Any:
            return await self.call(
                service, method, request, timeout_s=timeout_s, response_schema=response_schema
            )

        return stub

    async def call(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        timeout_s: float | None = None,
        response_schema: Type | None = None,
    ) -> Any:
        path = _method_path(service, method)
        callable_ = self._unary_calls.get(path)
        if callable_ is None:
            callable_ = self._unary_calls.setdefault(path, self._channel.unary_unary(path))
        payload = self._encode(request)
        raw = await callable_(payload, timeout=self._timeout(timeout_s), metadata=self._metadata)
        return self._decode(raw, response_schema)

    def round_stream(self, service: str, method: str, response_schema: Type | None = None) -> RoundStream:
        """A long-lived stream to the stream twin of ``service/method`` on this client's channel, for messages
        sent from this client's loop (``await stream.exchange(request)``), e.g. a replica's per-round push to
        another replica. Opened on its first message; it ends with the channel (:meth:`close`)."""
        return RoundStream(
            lambda target, options: self._channel, self.target, service, method, response_schema=response_schema,
            **self._client_options,
        )

    async def stream(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        timeout_s: float | None = None,
        response_schema: Type | None = None,
    ) -> AsyncIterator[Any]:
        """Iterate a server stream; the deadline covers the whole stream; leaving the loop cancels it."""
        path = _method_path(service, method)
        callable_ = self._stream_calls.get(path)
        if callable_ is None:
            callable_ = self._stream_calls.setdefault(path, self._channel.unary_stream(path))
        payload = self._encode(request)
        call = callable_(payload, timeout=self._timeout(timeout_s), metadata=self._metadata)
        try:
            async for raw in call:
                yield self._decode(raw, response_schema)
        finally:
            call.cancel()

    async def health(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``{"status": "SERVING" | "NOT_SERVING", "payload": {...}}`` of the server."""
        return await self.call(HEALTH_SERVICE, HEALTH_METHOD, {}, timeout_s=timeout_s, response_schema=HEALTH_REPLY)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the channel connects (e.g. to a server process just started); TimeoutError otherwise."""
        await asyncio.wait_for(self._channel.channel_ready(), self._timeout(timeout_s))

    async def close(self, grace_s: float | None = None) -> None:
        """Close the channel; calls still running get ``grace_s`` seconds to end, then they are cancelled.

        ``None`` cancels them at once: grpc.aio raises ``asyncio.CancelledError`` in their callers.
        """
        await self._channel.close(grace_s)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class SyncRpcClient(_ClientBase):
    """Blocking twin of :class:`RpcClient` for tests and scripts; grpc failures raise ``grpc.RpcError``."""

    def __init__(self, target: str, **options: Any) -> None:
        super().__init__(target, **options)
        self._channel = grpc.insecure_channel(target, options=self._options)
        self._unary_calls: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def call(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        timeout_s: float | None = None,
        response_schema: Type | None = None,
    ) -> Any:
        payload = self._encode(request)
        path = _method_path(service, method)
        callable_ = self._unary_calls.get(path)
        if callable_ is None:
            callable_ = self._unary_calls.setdefault(path, self._channel.unary_unary(path))
        raw = callable_(payload, timeout=self._timeout(timeout_s), metadata=self._metadata)
        return self._decode(raw, response_schema)

    def stream(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        timeout_s: float | None = None,
        response_schema: Type | None = None,
    ) -> Iterator[Any]:
        payload = self._encode(request)
        callable_ = self._channel.unary_stream(_method_path(service, method))
        call = callable_(payload, timeout=self._timeout(timeout_s), metadata=self._metadata)
        try:
            for raw in call:
                yield self._decode(raw, response_schema)
        finally:
            call.cancel()

    def health(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call(HEALTH_SERVICE, HEALTH_METHOD, {}, timeout_s=timeout_s, response_schema=HEALTH_REPLY)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=self._timeout(timeout_s))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SyncRpcClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------
# Long-lived streams for the per-round messages


class StreamCallError(grpc.RpcError):
    """One message on a stream failed (its envelope carried an error status, or it ran past its deadline).

    A ``grpc.RpcError`` with ``code()`` and ``details()`` like the error of a unary call, so that callers (the
    round driver's failover, tests) treat a refused message exactly as a refused call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_STATUS_BY_NAME = {code.name: code for code in grpc.StatusCode}


class _ThreadLoop:
    """The event loop on which one thread drives its streams, and the lock held while it runs.

    Never closed: grpc delivers events of a channel's teardown some time after ``close`` returns, and an event
    for a closed loop raises inside grpc's poller. A thread's loop lives as long as the process (a few
    descriptors per thread that drove streams)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.lock = threading.Lock()


_THREAD_LOOPS = threading.local()


def _this_thread_loop() -> _ThreadLoop:
    slot: _ThreadLoop | None = getattr(_THREAD_LOOPS, "slot", None)
    if slot is None:
        slot = _THREAD_LOOPS.slot = _ThreadLoop()
    return slot


class StreamLane:
    """grpc.aio channels and long-lived streams driven by the thread that calls them, on that thread's loop.

    The per-round messages of a round loop go here (one message each way per replica per round) instead of one
    unary call each. The calling thread runs the event loop itself for each message or fan-out
    (``run_until_complete``): it encodes, writes and waits for the reply there, so the message is handed to no
    other Python thread. What remains is grpc's own: its poller thread wakes the loop when the reply arrives
    (and when other event loops run in the process, e.g. a server's, the one that sees the wake-up first
    forwards it to this loop). Between messages the loop does not run; grpc queues what arrives meanwhile.

    One thread: the lane binds to the thread of its first call (a round loop, or a pipelined engine's drafter
    thread), which makes one call at a time; a call from another thread while that thread's loop runs raises
    ``RuntimeError``. :meth:`close` may come from any thread (it waits for a call in progress).
    """

    def __init__(self) -> None:
        self._slot: _ThreadLoop | None = None  # the loop of the thread that drives the lane
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: list[RoundStream] = []
        self._closed = False

    def stream(
        self,
        target: str,
        service: str,
        method: str,
        *,
        response_schema: Type | None = None,
        **options: Any,
    ) -> RoundStream:
        """A stream to the stream twin of ``service/method`` at ``target`` (keyword options as in
        :class:`RpcClient`: token, timeout_s, limits). Opened lazily on its first message."""
        stream = RoundStream(self._channel, target, service, method, lane=self, response_schema=response_schema,
                             **options)
        self._streams.append(stream)
        return stream

    def call(self, stream: RoundStream, request: Any, *, timeout_s: float | None = None) -> Any:
        """Send one message on ``stream`` and return its reply (``timeout_s``: this message's deadline)."""
        return self.call_many([(stream, request)], timeout_s=timeout_s)[0]

    def call_many(
        self, calls: Sequence[tuple[RoundStream, Any]], *, timeout_s: float | None = None
    ) -> list[Any]:
        """One message on each stream, all in flight at once (a round's fan-out to several replicas); returns
        the replies in order once every one has ended, or raises the first error among them. The deadline
        (default: the first stream's) covers the whole fan-out."""
        if not calls:
            return []
        timeout = calls[0][0]._timeout(timeout_s)
        outcomes = self._run(lambda: self._exchange_all(calls), timeout)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    async def _exchange_all(self, calls: Sequence[tuple[RoundStream, Any]]) -> list[Any]:
        if len(calls) == 1:
            stream, request = calls[0]
            try:
                return [await stream._exchange(request)]
            except Exception as exc:
                return [exc]
        return await asyncio.gather(*(s._exchange(r) for s, r in calls), return_exceptions=True)

    def _run(
        self, make: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float | None = None, wait_s: float = 0.0
    ) -> Any:
        """Run ``make()`` on the lane's loop in this thread; ``wait_s``: how long to wait for a run in progress."""
        if self._slot is None:
            self._slot = _this_thread_loop()
        slot = self._slot
        if not slot.lock.acquire(timeout=wait_s) if wait_s > 0 else not slot.lock.acquire(blocking=False):
            raise RuntimeError("a StreamLane serves one thread at a time and another thread is using its loop")
        try:
            if self._closed:
                raise RuntimeError("the StreamLane is closed")
            loop = slot.loop
            task = loop.create_task(make())
            expired: list[bool] = []
            timer = None
            if timeout_s is not None:

                def expire() -> None:
                    expired.append(True)
                    task.cancel()

                timer = loop.call_later(timeout_s, expire)
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                if not expired:
                    raise
                # Each stream that was in flight dropped its call: it reopens for its next message.
                raise StreamCallError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout_s:g} s (the stream is dropped)"
                ) from None
            finally:
                if timer is not None:
                    timer.cancel()
        finally:
            slot.lock.release()

    def _channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = grpc.aio.insecure_channel(target, options=options)
        return channel

    def forget(self, target: str) -> None:
        """Close the streams and the channel to ``target`` (a replica that left); from the driving thread."""
        streams = [s for s in self._streams if s.target == target]
        self._streams = [s for s in self._streams if s.target != target]
        channel = self._channels.pop(target, None)
        if self._slot is not None and (channel is not None or streams):
            self._run(lambda: self._close_all(streams, [channel] if channel is not None else []))

    async def _close_all(self, streams: Sequence[RoundStream], channels: Sequence[grpc.aio.Channel]) -> None:
        calls = [call for call in (stream._drop() for stream in streams) if call is not None]
        for call in calls:
            await call.code()
        for channel in channels:
            await channel.close(None)

    def close(self, wait_s: float = 10.0) -> None:
        """Cancel the streams and close the channels, from any thread: waits up to ``wait_s`` for a call in
        progress on the lane's loop; if it does not end, the lane is only marked closed (its sockets close with
        the process)."""
        if self._closed:
            return
        streams, self._streams = self._streams, []
        channels = list(self._channels.values())
        self._channels.clear()
        try:
            if self._slot is not None:
                self._run(lambda: self._close_all(streams, channels), wait_s=wait_s)
        except RuntimeError as exc:
            log.warning("stream lane not closed cleanly: %s", exc)
        finally:
            self._closed = True


class RoundStream(_ClientBase):
    """One long-lived bidirectional stream to the stream twin of a unary method (:func:`stream_method`).

    Each message is the unary method's request, answered with its response (the server wraps it in an envelope
    that also carries a refusal: an ``INVALID_ARGUMENT`` fails that message only, as :class:`StreamCallError`,
    and the stream serves the next). The stream opens on its first message and is reopened for the next
    message after it broke (a server restart, a cancelled call, a deadline): never for the message that was in
    flight, which fails with the stream's error, because a resent round could be applied twice. The bearer
    token travels once, when the stream opens. Used through its :class:`StreamLane` (``call``)."""

    def __init__(
        self,
        channel: Callable[[str, list[tuple[str, Any]]], grpc.aio.Channel],
        target: str,
        service: str,
        method: str,
        *,
        lane: StreamLane | None = None,
        response_schema: Type | None = None,
        **options: Any,
    ) -> None:
        super().__init__(target, **options)
        self.service = service
        self.method = method
        self._channel_for = channel
        self._lane = lane
        self._path = _method_path(service, stream_method(method))
        self._response_schema = response_schema
        self._call: grpc.aio.StreamStreamCall | None = None
        self._turn: asyncio.Lock | None = None  # one message at a time when awaited from coroutines (exchange)
        self.streams_opened = 0
        self.last_held_s = 0.0  # how long the server held the last reply's message (its envelope's _HELD)

    def call(self, request: Any, *, timeout_s: float | None = None) -> Any:
        """Send one message and wait for its reply (on the calling thread, through the lane's loop)."""
        if self._lane is None:
            raise RuntimeError("this stream belongs to an RpcClient: await exchange() on its loop")
        return self._lane.call(self, request, timeout_s=timeout_s)

    async def exchange(self, request: Any, *, timeout_s: float | None = None) -> Any:
        """Send one message and await its reply on the running loop (the loop of the stream's channel). Callers
        may overlap: messages go one at a time, in the order the callers came (``timeout_s``: this message's
        deadline, its wait for an earlier one included)."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        try:
            async with asyncio.timeout(self._timeout(timeout_s)):
                async with self._turn:
                    return await self._exchange(request)
        except TimeoutError:
            raise StreamCallError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {self._timeout(timeout_s):g} s"
            ) from None

    async def _open(self) -> grpc.aio.StreamStreamCall:
        """A new stream, once the server accepted it (its marked headers): else the refusal's status."""
        channel = self._channel_for(self.target, self._options)
        call = self._call = channel.stream_stream(self._path)(metadata=self._metadata)
        self.streams_opened += 1
        headers = await call.initial_metadata()
        if headers is None or headers.get(_STREAM_OPEN) is None:  # trailers only: refused or gone
            code, details = await call.code(), await call.details()  # the server's status, before cancelling
            self._drop()
            raise StreamCallError(code, details)
        return call

    async def _write(self, call: grpc.aio.StreamStreamCall, payload: bytes) -> None:
        try:
            await call.write(payload)
        except asyncio.InvalidStateError:  # the call had ended: an RpcError with its status, as a unary call's
            raise StreamCallError(await call.code(), await call.details()) from None

    async def _exchange(self, request: Any) -> Any:
        payload = self._encode(request)
        call = self._call
        fresh = call is None or call.done()
        try:
            if fresh:
                call = await self._open()
            try:
                await self._write(call, payload)
            except grpc.RpcError:
                if fresh:
                    raise
                # The stream broke while idle (its end not seen yet: the lane's loop was not running), so the
                # message did not leave this process: it goes on a new stream. Never after a successful write.
                self._drop()
                call = await self._open()
                await self._write(call, payload)
            assert call is not None  # open, or opened just now
            raw = await call.read()
        except BaseException:  # broken, refused, cancelled, past the deadline: no reply to match any more
            self._drop()
            raise
        if raw is grpc.aio.EOF:  # the server ended the stream without an error status
            self._drop()
            raise StreamCallError(grpc.StatusCode.UNAVAILABLE, "the stream ended")
        reply = self._decode(raw, None)
        if type(reply) is dict and _OK in reply:
            self.last_held_s = 1e-6 * float(reply.get(_HELD, 0))
            body = reply[_OK]
            return body if self._response_schema is None else validate(self._response_schema, body)
        if type(reply) is dict and _CODE in reply:
            code = _STATUS_BY_NAME.get(reply[_CODE], grpc.StatusCode.UNKNOWN)
            raise StreamCallError(code, str(reply.get(_DETAILS, "")))
        self._drop()
        raise StreamCallError(grpc.StatusCode.INTERNAL, "malformed reply on the stream")

    def _drop(self) -> grpc.aio.StreamStreamCall | None:
        """Cancel the stream (the next message opens a new one); returns the cancelled call, if any."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        return call
