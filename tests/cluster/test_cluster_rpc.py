"""The gRPC data plane against real grpc.aio servers on 127.0.0.1.

The service under test is a miniature replica (:class:`Ledger`): per-request state that advances one round
at a time, like a verifier's KV cache, so unknown ids, replayed rounds and disconnects have real consequences.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.messages import AnyValue, Float, Int, List, Map, Message, Opt, Str, Tensor
from cluster.rpc import (
    HealthStatus,
    NotFoundError,
    RetryLaterError,
    RpcClient,
    RpcServer,
    ServerThread,
    Service,
    SyncRpcClient,
    retry_after_s,
    start_server,
)
from cluster.wire import WIRE_DTYPES, WireError, WireLimits, encode

SERVICE = "test.Ledger"
REQUEST_ID = Str(min_len=1, max_len=64)
ECHO = Message("Echo", {"tensors": Map(Tensor(sorted(WIRE_DTYPES))), "meta": AnyValue()})
OPEN = Message("Open", {"request_id": REQUEST_ID})
STEP = Message(
    "Step", {"request_id": REQUEST_ID, "round": Int(min=0), "tokens": List(Int(min=0), max_len=64)}
)
CLOSE = Message("Close", {"request_id": REQUEST_ID})
SLOW = Message("Slow", {"seconds": Float(min=0.0, max=60.0)})
TOKENS = Message("Tokens", {"n": Int(min=0, max=10**7), "fail_at": Opt(Int(min=0))})
EMPTY = Message("Empty", {})


class Ledger:
    """A miniature replica: each request's tokens grow by one step per round, exactly once per round."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[list[int]]] = {}
        self.cancelled = 0
        self.streams_closed = 0
        self.entered = asyncio.Event()

    async def echo(self, request: dict[str, Any]) -> dict[str, Any]:
        return request

    async def open(self, request: dict[str, Any]) -> dict[str, Any]:
        if request["request_id"] in self.tokens:
            raise ValueError(f"request {request['request_id']!r} is already open")
        self.tokens[request["request_id"]] = []
        return {"round": 0}

    def _get(self, request_id: str) -> list[list[int]]:
        try:
            return self.tokens[request_id]
        except KeyError:
            raise NotFoundError(f"unknown request id {request_id!r}") from None

    async def step(self, request: dict[str, Any]) -> dict[str, Any]:
        steps = self._get(request["request_id"])
        if request["round"] != len(steps):
            raise ValueError(
                f"round {request['round']} does not follow round {len(steps) - 1} (replayed message?)"
            )
        steps.append(request["tokens"])
        return {"round": len(steps)}

    async def close(self, request: dict[str, Any]) -> dict[str, Any]:
        steps = self._get(request["request_id"])
        del self.tokens[request["request_id"]]
        return {"tokens": [t for step in steps for t in step]}

    async def slow(self, request: dict[str, Any]) -> dict[str, Any]:
        self.entered.set()
        try:
            await asyncio.sleep(request["seconds"])
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return {"slept": request["seconds"]}

    async def boom(self, request: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("kaboom")

    async def unsendable(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"value": {1, 2}}

    async def stream_tokens(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            for i in range(request["n"]):
                if i == request["fail_at"]:
                    raise NotFoundError("request finished while streaming")
                await asyncio.sleep(0.001)
                yield {"token": i}
        finally:
            self.streams_closed += 1

    async def busy(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Refuses before the first item while asked to wait (an admission refusal for load)."""
        if request["seconds"] > 0:
            raise RetryLaterError("too busy now", math.ceil(request["seconds"]))
        yield {"busy": False}

    def service(self) -> Service:
        return Service(
            SERVICE,
            {
                "Echo": (self.echo, ECHO),
                "Open": (self.open, OPEN),
                "Step": (self.step, STEP),
                "Close": (self.close, CLOSE),
                "Slow": (self.slow, SLOW),
                "Boom": (self.boom, EMPTY),
                "Unsendable": (self.unsendable, EMPTY),
                "Tokens": (self.stream_tokens, TOKENS),
                "Busy": (self.busy, SLOW),
            },
        )


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 2, 3, generator=g).bfloat16(),
        "int64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "bool": torch.rand(2, 6, generator=g) > 0.5,
        "empty_fp32": torch.zeros(0, 8),
        "empty_bool": torch.zeros(3, 0, dtype=torch.bool),
        "scalar_fp16": torch.tensor(1.5, dtype=torch.float16),
        "large_fp32": torch.randn(64, 1024, generator=g),  # above the zero-copy threshold
    }


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, t in want.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key


def _eventually(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait for something that happens asynchronously on the server (not a timing assertion; the bound is a hang
    detector, generous because the test machine is shared)."""
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def _code(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.fixture(scope="module")
def ledger_server() -> Iterator[tuple[Ledger, ServerThread]]:
    ledger = Ledger()
    load = {"active_requests": 0}
    with ServerThread([ledger.service()], health=lambda: HealthStatus(True, load)) as server:
        yield ledger, server


@pytest.fixture(scope="module")
def client(ledger_server: tuple[Ledger, ServerThread]) -> Iterator[SyncRpcClient]:
    with SyncRpcClient(ledger_server[1].address, timeout_s=10.0) as c:
        yield c


# ------------------------------------------------------------------------------------------- round trips


def test_async_round_trip_of_nested_tensors_in_one_event_loop() -> None:
    async def scenario() -> None:
        server = await start_server([Ledger().service()])
        try:
            assert server.host == "127.0.0.1" and server.port > 0
            async with RpcClient(server.address) as c:
                want = _tensors()
                meta = {"round": 3, "nested": [{"ids": [1, 2, 3]}, {"probs": torch.rand(2, 8)}], "name": "ü"}
                got = await c.call(SERVICE, "Echo", {"tensors": want, "meta": meta})
                _assert_same_tensors(got["tensors"], want)
                assert got["meta"]["round"] == 3 and got["meta"]["name"] == "ü"
                assert torch.equal(got["meta"]["nested"][1]["probs"], meta["nested"][1]["probs"])
                step = c.unary(SERVICE, "Open")
                assert await step({"request_id": "r"}) == {"round": 0}
                assert (await c.health())["status"] == "SERVING"
        finally:
            await server.stop(grace_s=None)

    asyncio.run(scenario())


def test_sync_round_trip_and_request_lifecycle(client: SyncRpcClient) -> None:
    want = _tensors()
    _assert_same_tensors(client.call(SERVICE, "Echo", {"tensors": want, "meta": None})["tensors"], want)
    client.call(SERVICE, "Open", {"request_id": "life"})
    for round_index, tokens in enumerate([[5, 6], [7], []]):
        assert client.call(
            SERVICE, "Step", {"request_id": "life", "round": round_index, "tokens": tokens}
        ) == {"round": round_index + 1}
    assert client.call(SERVICE, "Close", {"request_id": "life"}) == {"tokens": [5, 6, 7]}


def test_response_schema_is_checked_on_the_client(client: SyncRpcClient) -> None:
    reply = Message("OpenReply", {"round": Int(min=0)})
    assert client.call(SERVICE, "Open", {"request_id": "schema"}, response_schema=reply) == {"round": 0}
    with pytest.raises(WireError, match="invalid Strict: unknown field"):
        client.call(
            SERVICE,
            "Step",
            {"request_id": "schema", "round": 0, "tokens": []},
            response_schema=Message("Strict", {}),
        )


# ---------------------------------------------------------------------------------------- status mapping


def test_errors_map_to_statuses_and_the_server_keeps_serving(client: SyncRpcClient) -> None:
    client.call(SERVICE, "Open", {"request_id": "s"})
    cases = [
        (
            "Step",
            {"request_id": "nobody", "round": 0, "tokens": []},
            grpc.StatusCode.NOT_FOUND,
            "unknown request",
        ),
        ("Close", {"request_id": "nobody"}, grpc.StatusCode.NOT_FOUND, "unknown request id 'nobody'"),
        ("Open", {"request_id": "s"}, grpc.StatusCode.INVALID_ARGUMENT, "already open"),
        ("Step", {"request_id": "s", "round": 1, "tokens": []}, grpc.StatusCode.INVALID_ARGUMENT, "replayed"),
        (
            "Step",
            {"request_id": "s", "round": 0, "tokens": [1, "2"]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid Step: tokens[1]: expected int, got str",
        ),
        (
            "Step",
            {"request_id": "s", "round": 0},
            grpc.StatusCode.INVALID_ARGUMENT,
            "tokens: missing required",
        ),
        ("Boom", {}, grpc.StatusCode.INTERNAL, "RuntimeError: kaboom"),
        ("Unsendable", {}, grpc.StatusCode.INTERNAL, "cannot encode the response"),
        ("NoSuchMethod", {}, grpc.StatusCode.UNIMPLEMENTED, ""),
    ]
    for method, request, code, details in cases:
        error = _code(lambda method=method, request=request: client.call(SERVICE, method, request))
        assert error.code() == code, (method, error.details())
        assert details in (error.details() or ""), (method, error.details())
        assert client.call(SERVICE, "Step", {"request_id": "s", "round": 0, "tokens": [9]}) == {"round": 1}
        client.call(SERVICE, "Close", {"request_id": "s"})
        client.call(SERVICE, "Open", {"request_id": "s"})


def test_server_stream_delivers_items_and_errors(client: SyncRpcClient) -> None:
    assert [m["token"] for m in client.stream(SERVICE, "Tokens", {"n": 5})] == [0, 1, 2, 3, 4]
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for message in client.stream(SERVICE, "Tokens", {"n": 5, "fail_at": 2}):
            received.append(message["token"])
    assert received == [0, 1] and info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: list(client.stream(SERVICE, "Tokens", {"n": -1}))).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_a_refusal_for_load_is_resource_exhausted_with_its_retry_after(client: SyncRpcClient) -> None:
    error = _code(lambda: list(client.stream(SERVICE, "Busy", {"seconds": 2.5})))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "too busy now" in error.details()
    assert retry_after_s(error) == 3
    assert list(client.stream(SERVICE, "Busy", {"seconds": 0.0})) == [{"busy": False}]  # still serving
    other = _code(lambda: list(client.stream(SERVICE, "Tokens", {"n": 5, "fail_at": 0})))
    assert other.code() == grpc.StatusCode.NOT_FOUND and retry_after_s(other) is None

    async def over_aio() -> grpc.aio.AioRpcError:
        async with RpcClient(client.target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in c.stream(SERVICE, "Busy", {"seconds": 1.0}):
                    pass
            return info.value

    assert retry_after_s(asyncio.run(over_aio())) == 1


def test_client_leaving_a_stream_runs_the_handlers_cleanup(
    ledger_server: tuple[Ledger, ServerThread], client: SyncRpcClient
) -> None:
    ledger, server = ledger_server
    before = ledger.streams_closed
    stream = client.stream(SERVICE, "Tokens", {"n": 1_000_000})
    assert next(stream) == {"token": 0}
    stream.close()  # a disconnecting client
    _eventually(lambda: ledger.streams_closed == before + 1)

    async def leave_early() -> None:
        async with RpcClient(server.address) as c:
            async for message in c.stream(SERVICE, "Tokens", {"n": 1_000_000}):
                if message["token"] == 3:
                    break

    asyncio.run(leave_early())
    _eventually(lambda: ledger.streams_closed == before + 2)


def test_deadline_exceeded_cancels_the_slow_handler(
    ledger_server: tuple[Ledger, ServerThread], client: SyncRpcClient
) -> None:
    ledger, server = ledger_server
    before = ledger.cancelled
    error = _code(lambda: client.call(SERVICE, "Slow", {"seconds": 30.0}, timeout_s=0.2))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _eventually(lambda: ledger.cancelled == before + 1)

    async def async_deadline() -> grpc.StatusCode:
        async with RpcClient(server.address, timeout_s=0.2) as c:  # the client's default deadline applies
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.call(SERVICE, "Slow", {"seconds": 30.0})
            return info.value.code()

    assert asyncio.run(async_deadline()) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert client.call(SERVICE, "Slow", {"seconds": 0.0}) == {"slept": 0.0}


# ----------------------------------------------------------------------------------- health and security


def test_health_reports_status_and_the_service_payload(client: SyncRpcClient) -> None:
    assert client.health() == {"status": "SERVING", "payload": {"active_requests": 0}}


def test_health_detects_failing_wedged_and_draining_services() -> None:
    async def wedged() -> HealthStatus:
        await asyncio.sleep(30)
        return HealthStatus()

    def failing() -> HealthStatus:
        raise RuntimeError("engine lost its device")

    async def overloaded() -> HealthStatus:
        return HealthStatus(serving=False, payload={"queue": 99})

    service = Ledger().service()
    with (
        ServerThread([service], health=wedged, health_timeout_s=0.1) as server,
        SyncRpcClient(server.address) as c,
    ):
        assert c.health() == {"status": "NOT_SERVING", "payload": {"reason": "health check timed out"}}
    with ServerThread([service], health=failing) as server, SyncRpcClient(server.address) as c:
        assert c.health()["payload"]["reason"] == "RuntimeError: engine lost its device"
    with ServerThread([service], health=lambda: {"load": 1}) as server, SyncRpcClient(server.address) as c:
        assert "returned dict, not HealthStatus" in c.health()["payload"]["reason"]
    with ServerThread([service], health=overloaded) as server, SyncRpcClient(server.address) as c:
        assert c.health() == {"status": "NOT_SERVING", "payload": {"queue": 99}}
        server.server.set_serving(False)
        assert c.health() == {"status": "NOT_SERVING", "payload": {"reason": "draining"}}


def test_shared_secret_token_is_required_on_every_method() -> None:
    with ServerThread([Ledger().service()], token="s3cret-token") as server:
        for token in (None, "wrong-token", "s3cret-tokeN"):
            with SyncRpcClient(server.address, token=token) as c:
                for call in (c.health, lambda c=c: c.call(SERVICE, "Open", {"request_id": "x"})):
                    error = _code(call)
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "authorization token" in error.details()
        with SyncRpcClient(server.address, token="s3cret-token") as c:
            assert c.call(SERVICE, "Open", {"request_id": "x"}) == {"round": 0}
            assert c.health()["status"] == "SERVING"
        # Auth is checked before decoding: garbage from a stranger is UNAUTHENTICATED, not parsed.
        with grpc.insecure_channel(server.address) as channel:
            error = _code(lambda: channel.unary_unary(f"/{SERVICE}/Open")(b"\xc1", timeout=5))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_size_limits_on_both_ends() -> None:
    limits = WireLimits(max_message_bytes=64 * 1024, max_array_len=100)
    with ServerThread([Ledger().service()], limits=limits) as server:
        with (
            SyncRpcClient(server.address, limits=limits) as c,
            pytest.raises(WireError, match="exceeds the limit of 65536 bytes"),  # refused before sending
        ):
            c.call(SERVICE, "Echo", {"tensors": {"x": torch.zeros(20_000)}, "meta": None})
        with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 1 << 22)]) as ch:
            oversized = encode({"tensors": {"x": torch.zeros(20_000)}, "meta": None})
            error = _code(lambda: ch.unary_unary(f"/{SERVICE}/Echo")(oversized, timeout=5))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert retry_after_s(error) is None  # grpc's own: no retry-after trailer
            too_long = encode({"request_id": "x", "round": 0, "tokens": list(range(101))})
            error = _code(lambda: ch.unary_unary(f"/{SERVICE}/Step")(too_long, timeout=5))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        with SyncRpcClient(server.address, limits=limits) as c:
            assert c.call(SERVICE, "Open", {"request_id": "after"}) == {"round": 0}


def test_max_concurrent_rpcs_sheds_load() -> None:
    async def scenario() -> grpc.StatusCode:
        ledger = Ledger()
        async with (
            RpcServer([ledger.service()], max_concurrent_rpcs=1) as server,
            RpcClient(server.address) as c,
        ):
            busy = asyncio.create_task(c.call(SERVICE, "Slow", {"seconds": 30.0}, timeout_s=20))
            await ledger.entered.wait()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.call(SERVICE, "Open", {"request_id": "x"})
            busy.cancel()
            return info.value.code()

    assert asyncio.run(scenario()) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_server_and_client_options_are_checked() -> None:
    with ServerThread([Ledger().service()]) as server:
        assert server.address == f"127.0.0.1:{server.port}"
        with pytest.raises(OSError, match="cannot bind"):  # port reuse is off: a taken port is an error
            ServerThread([Ledger().service()], port=server.port)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    with ServerThread([Ledger().service()], port=free_port) as server:
        assert server.port == free_port
    for bad in (0, -1.0, float("inf"), float("nan"), None):
        with pytest.raises(ValueError, match="deadline"):
            SyncRpcClient("127.0.0.1:1", timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token"):
        SyncRpcClient("127.0.0.1:1", token="")
    with pytest.raises(ValueError, match="unique"):
        RpcServer([Ledger().service(), Ledger().service()])
    with pytest.raises(TypeError, match="async def"):
        Service("x", {"M": (lambda request: request, EMPTY)})


# ----------------------------------------------------------------------------------- hostile input (issue 10)

FUZZ_LIMITS = WireLimits(max_message_bytes=256 * 1024, max_array_len=4096, max_map_len=64, max_str_len=1024)


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[tuple[Ledger, ServerThread, grpc.Channel]]:
    """A server with tight limits and a raw channel that sends whatever bytes a test makes up."""
    ledger = Ledger()
    with ServerThread([ledger.service()], limits=FUZZ_LIMITS) as server:
        options = [("grpc.max_send_message_length", 1 << 24), ("grpc.max_receive_message_length", 1 << 24)]
        with grpc.insecure_channel(server.address, options=options) as channel:
            yield ledger, server, channel


def _raw(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    try:
        channel.unary_unary(f"/{SERVICE}/{method}")(payload, timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def _still_serving(channel: grpc.Channel) -> None:
    assert (
        _raw(channel, "Echo", encode({"tensors": {"t": torch.arange(3)}, "meta": [1]})) == grpc.StatusCode.OK
    )


_METHODS = st.sampled_from(["Echo", "Open", "Step", "Close", "Tokens"])


@settings(max_examples=60, deadline=None)
@given(method=_METHODS, payload=st.binary(max_size=512))
def test_fuzz_random_bytes(
    fuzz_target: tuple[Ledger, ServerThread, grpc.Channel], method: str, payload: bytes
) -> None:
    _, _, channel = fuzz_target
    if method == "Tokens":
        stream = channel.unary_stream(f"/{SERVICE}/Tokens")(payload, timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        code = info.value.code()
    else:
        code = _raw(channel, method, payload)
    # Random bytes are essentially never a valid message; if one happened to be, it names an unknown id.
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    _still_serving(channel)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fuzz_truncated_valid_messages(
    fuzz_target: tuple[Ledger, ServerThread, grpc.Channel], data: st.DataObject
) -> None:
    _, _, channel = fuzz_target
    payload = encode({"request_id": "t", "round": 0, "tokens": data.draw(st.lists(st.integers(0, 10**9)))})
    cut = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    assert _raw(channel, "Step", payload[:cut]) == grpc.StatusCode.INVALID_ARGUMENT
    _still_serving(channel)


_WRONG_VALUES = (
    st.none()
    | st.booleans()
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=5)
    | st.lists(st.text(max_size=3), min_size=1, max_size=3)
    | st.dictionaries(st.text(max_size=3), st.integers(0, 9))
)


@settings(max_examples=80, deadline=None)
@given(field=st.sampled_from(["request_id", "round", "tokens"]), value=_WRONG_VALUES)
def test_fuzz_wrong_field_types(
    fuzz_target: tuple[Ledger, ServerThread, grpc.Channel], field: str, value: Any
) -> None:
    ledger, _, channel = fuzz_target
    expected = {"request_id": str, "round": int, "tokens": list}[field]
    if type(value) is expected and not (field == "tokens" and value):  # the right type is not a wrong value
        return
    message = {"request_id": "fuzz-types", "round": 0, "tokens": [1]}
    message[field] = value
    try:
        channel.unary_unary(f"/{SERVICE}/Step")(encode(message), timeout=10)
        raise AssertionError("a wrongly typed field was accepted")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"invalid Step: {field}" in error.details()
    assert "fuzz-types" not in ledger.tokens
    _still_serving(channel)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["bytes", "array", "map", "str", "rank"]), excess=st.integers(1, 1000))
def test_fuzz_oversized_messages(
    fuzz_target: tuple[Ledger, ServerThread, grpc.Channel], kind: str, excess: int
) -> None:
    _, _, channel = fuzz_target
    if kind == "bytes":
        payload = encode(
            {"tensors": {"x": torch.zeros(FUZZ_LIMITS.max_message_bytes + excess, dtype=torch.uint8)}}
        )
        assert _raw(channel, "Echo", payload) == grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        meta: Any = {
            "array": list(range(FUZZ_LIMITS.max_array_len + excess)),
            "map": {str(i): 0 for i in range(FUZZ_LIMITS.max_map_len + excess)},
            "str": "x" * (FUZZ_LIMITS.max_str_len + excess),
            "rank": torch.zeros([1] * (FUZZ_LIMITS.max_tensor_rank + 1 + excess % 4)),
        }[kind]
        assert (
            _raw(channel, "Echo", encode({"tensors": {}, "meta": meta})) == grpc.StatusCode.INVALID_ARGUMENT
        )
    _still_serving(channel)


@settings(max_examples=40, deadline=None)
@given(
    actions=st.lists(
        st.tuples(st.sampled_from(["next", "replay", "skip", "unknown"]), st.integers(0, 50)), max_size=12
    )
)
def test_fuzz_replayed_and_unknown_messages_never_corrupt_state(
    fuzz_target: tuple[Ledger, ServerThread, grpc.Channel], actions: list[tuple[str, int]]
) -> None:
    ledger, server, channel = fuzz_target
    request_id = f"replay-{id(actions)}-{time.monotonic_ns()}"
    assert _raw(channel, "Open", encode({"request_id": request_id})) == grpc.StatusCode.OK
    sent: list[bytes] = []
    accepted: list[int] = []
    for action, token in actions:
        if action == "next":
            payload = encode({"request_id": request_id, "round": len(sent), "tokens": [token]})
            assert _raw(channel, "Step", payload) == grpc.StatusCode.OK
            sent.append(payload)
            accepted.append(token)
        elif action == "replay" and sent:  # the very same bytes again
            assert _raw(channel, "Step", sent[token % len(sent)]) == grpc.StatusCode.INVALID_ARGUMENT
        elif action == "skip":
            payload = encode({"request_id": request_id, "round": len(sent) + 1 + token, "tokens": [token]})
            assert _raw(channel, "Step", payload) == grpc.StatusCode.INVALID_ARGUMENT
        elif action == "unknown":
            payload = encode({"request_id": f"ghost-{token}", "round": 0, "tokens": [token]})
            assert _raw(channel, "Step", payload) == grpc.StatusCode.NOT_FOUND
    with SyncRpcClient(server.address) as c:
        assert c.call(SERVICE, "Close", {"request_id": request_id}) == {"tokens": accepted}
    assert _raw(channel, "Close", encode({"request_id": request_id})) == grpc.StatusCode.NOT_FOUND
    assert not any(key.startswith("ghost-") for key in ledger.tokens)
