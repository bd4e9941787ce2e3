"""Hostile input against the REAL data-plane services (drafter, verifier, scheduler hub) on loopback gRPC.

Property tests (hypothesis) send random and truncated msgpack, wrongly typed fields, oversized messages, unknown
request ids and replayed messages. Expected statuses:

* undecodable, truncated, wrongly typed or over-long fields: INVALID_ARGUMENT;
* a message over the server's byte limit: RESOURCE_EXHAUSTED (grpc refuses it before it is read; documented in
  docs/SECURITY.md);
* an unknown request id where one must exist (Propose, AppendContext, a verify item): NOT_FOUND; Release and
  Abort of unknown ids succeed (they are idempotent by contract);
* a replayed message: AddRequests and AppendContext are idempotent (state unchanged), a replayed prefill, verify
  round (stale anchor position) or Generate (id in use) is INVALID_ARGUMENT.

After every example no slot may be held, and after the whole fuzz a normal generation through the hub still
equals the target's greedy output with every slot free again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_factory import PairSpec, write_pair

from cluster.rpc import ServerThread, SyncRpcClient
from cluster.wire import WireLimits, encode
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

LIMITS = WireLimits(max_message_bytes=1 << 20)
SLOTS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

DRAFTER, VERIFIER, SCHEDULER = "dspark.Drafter", "dspark.Verifier", "dspark.Scheduler"
OK, INVALID, NOT_FOUND = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


class Stack:
    """One drafter, one verifier and a hub over them, each behind a gRPC server with tight size limits."""

    def __init__(self, root: Path) -> None:
        target_dir, draft_dir = write_pair(root, PairSpec(vocab=64, block_size=3, seed=9))
        model = load_draft_model(draft_dir, target_dir=target_dir)
        self.feature_width = model.config.context_feature_size
        self.drafter = DrafterService(DraftEngine(model, SLOTS, 64))
        self.target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
        self.verifier = VerifierService(VerifyEngine(self.target, SLOTS, 64))
        self.servers = {
            DRAFTER: ServerThread([self.drafter.service()], limits=LIMITS),
            VERIFIER: ServerThread([self.verifier.service()], limits=LIMITS),
        }
        self.hub = SchedulerHub(model_name="m", policy="dspark", decode=None, timeout_s=10.0)
        self.hub.register_drafter("d", self.servers[DRAFTER].address)
        self.hub.register_verifier("v", self.servers[VERIFIER].address, SPSTable([1, 8], [1.0, 1.0]).to_dict())
        self.servers[SCHEDULER] = ServerThread([self.hub.service()], limits=LIMITS)
        options = [("grpc.max_send_message_length", 1 << 24), ("grpc.max_receive_message_length", 1 << 24)]
        self.channels = {name: grpc.insecure_channel(s.address, options=options) for name, s in self.servers.items()}

    def call(self, service: str, method: str, payload: bytes) -> grpc.StatusCode:
        """Send raw bytes; the status (a stream is read to its end)."""
        path = f"/{service}/{method}"
        try:
            if method == "Generate":
                for _ in self.channels[service].unary_stream(path)(payload, timeout=30):
                    pass
            else:
                self.channels[service].unary_unary(path)(payload, timeout=30)
        except grpc.RpcError as error:
            return error.code()
        return OK

    def send(self, service: str, method: str, message: dict[str, Any]) -> grpc.StatusCode:
        return self.call(service, method, encode(message))

    def assert_clean(self) -> None:
        """Nothing is held anywhere and every service still answers."""
        for service, slots in ((DRAFTER, SLOTS), (VERIFIER, SLOTS)):
            with SyncRpcClient(self.servers[service].address) as client:
                info = client.call(service, "Info", {})
            assert info["free_slots"] == slots and info["running"] == [], (service, info)
        with SyncRpcClient(self.servers[SCHEDULER].address) as client:
            assert client.call(SCHEDULER, "Info", {})["verifiers"] == 1
        assert not self.hub._owner

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.hub.close()
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("fuzz"))
    yield s
    s.close()


def _step(prefill: list[tuple[str, list[int]]] = (), verify: list[tuple[str, int, list[int], int]] = ()) -> dict:
    """A verifier Step message: prefills (id, tokens), verifies (id, anchor, drafts, anchor position)."""
    return {
        "prefill_req_ids": [r for r, _ in prefill],
        "prefill_params": [GREEDY.to_dict() for _ in prefill],
        "prefill_counts": [len(t) for _, t in prefill],
        "prefill_tokens": torch.tensor([t for _, ts in prefill for t in ts], dtype=torch.int64),
        "prefill_anchors": [-1 for _ in prefill],
        "verify_req_ids": [r for r, *_ in verify],
        "verify_anchors": [a for _, a, _, _ in verify],
        "verify_counts": [len(d) for _, _, d, _ in verify],
        "verify_tokens": torch.tensor([t for _, _, d, _ in verify for t in d], dtype=torch.int64),
        "verify_positions": [p for *_, p in verify],
    }


def _valid(stack: Stack) -> dict[tuple[str, str], dict[str, Any]]:
    """One well-formed message per method (ids unknown to the services unless a test adds them)."""
    return {
        (DRAFTER, "AddRequests"): {"req_ids": ["fz"], "params": [GREEDY.to_dict()]},
        (DRAFTER, "AppendContext"): {"req_ids": ["fz"], "starts": [0], "counts": [2],
                                     "features": torch.zeros(2, stack.feature_width)},
        (DRAFTER, "Propose"): {"req_ids": ["fz"], "anchors": [1], "positions": [2]},
        (DRAFTER, "Release"): {"req_ids": ["fz"]},
        (VERIFIER, "Step"): _step(prefill=[("fz", [1, 2, 3])]),
        (VERIFIER, "Release"): {"req_ids": ["fz"]},
        (SCHEDULER, "Generate"): {"req_id": "fz", "prompt_ids": [1, 2], "params": GREEDY.to_dict()},
        (SCHEDULER, "Abort"): {"req_id": "fz"},
    }


METHODS = [(DRAFTER, m) for m in ("Info", "AddRequests", "AppendContext", "Propose", "Release")] + [
    (VERIFIER, m) for m in ("Info", "Step", "Release")
] + [(SCHEDULER, m) for m in ("Generate", "Abort", "Metrics", "Info")]


@FUZZ
@given(target=st.sampled_from(METHODS), payload=st.binary(max_size=256))
def test_random_bytes(stack: Stack, target: tuple[str, str], payload: bytes) -> None:
    code = stack.call(*target, payload)
    # Random bytes are essentially never a valid message; the few that are (e.g. an empty map for a method
    # without fields) are answered normally.
    assert code in (INVALID, OK) if target[1] in ("Info", "Metrics") else code == INVALID
    stack.assert_clean()


@FUZZ
@given(data=st.data())
def test_truncated_messages(stack: Stack, data: st.DataObject) -> None:
    valid = _valid(stack)
    target = data.draw(st.sampled_from(sorted(valid)))
    payload = encode(valid[target])
    cut = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    assert stack.call(*target, payload[:cut]) == INVALID
    stack.assert_clean()


_WRONG = (
    st.none()
    | st.booleans()
    | st.floats(allow_nan=True)
    | st.text(max_size=4)
    | st.binary(max_size=4)
    | st.lists(st.floats(allow_nan=False), min_size=1, max_size=3)
    | st.lists(st.none(), min_size=1, max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(0, 9), min_size=1, max_size=2)
)
_OPTIONAL = {"draft_prob_ids", "draft_probs", "routes", "verify_positions"}


def _is_wrong(field: str, value: Any) -> bool:
    """Whether ``value`` is surely invalid for ``field`` (hypothesis may draw a value that happens to fit)."""
    if value is None:
        return field not in _OPTIONAL
    if field in ("req_id",):
        return not isinstance(value, str) or not value
    # A map is the right type for params (SamplingParams checks its content); anything else is wrong.
    return not (field == "params" and isinstance(value, dict))


@FUZZ
@given(data=st.data(), value=_WRONG)
def test_wrongly_typed_fields(stack: Stack, data: st.DataObject, value: Any) -> None:
    valid = _valid(stack)
    target = data.draw(st.sampled_from(sorted(valid)))
    message = dict(valid[target])
    field = data.draw(st.sampled_from(sorted(message)))
    if not _is_wrong(field, value):
        return
    message[field] = value
    assert stack.send(*target, message) == INVALID, (target, field, value)
    stack.assert_clean()


@FUZZ
@given(data=st.data(), excess=st.integers(1, 64))
def test_oversized_messages_and_fields(stack: Stack, data: st.DataObject, excess: int) -> None:
    valid = _valid(stack)
    target = data.draw(st.sampled_from(sorted(valid)))
    big = dict(valid[target])
    big["padding"] = b"x" * (LIMITS.max_message_bytes + excess)
    assert stack.send(*target, big) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A field over its own bound (4096 ids per batch, 128 characters per id) is refused before any work.
    many = dict(valid[target])
    field = "req_id" if "req_id" in many else "req_ids"
    many[field] = "x" * (128 + excess) if field == "req_id" else [f"id{i}" for i in range(4096 + excess)]
    assert stack.send(*target, many) == INVALID
    stack.assert_clean()


@FUZZ
@given(ghost=st.text(min_size=1, max_size=40).filter(lambda s: s != "fz"))
def test_unknown_request_ids(stack: Stack, ghost: str) -> None:
    width = stack.feature_width
    assert stack.send(DRAFTER, "Propose", {"req_ids": [ghost], "anchors": [1], "positions": [0]}) == NOT_FOUND
    features = torch.zeros(1, width)
    message = {"req_ids": [ghost], "starts": [0], "counts": [1], "features": features}
    assert stack.send(DRAFTER, "AppendContext", message) == NOT_FOUND
    assert stack.send(VERIFIER, "Step", _step(verify=[(ghost, 1, [2], 3)])) == NOT_FOUND
    # Releasing or aborting what is not there is a no-op by contract (an abort may race a natural finish).
    assert stack.send(DRAFTER, "Release", {"req_ids": [ghost]}) == OK
    assert stack.send(VERIFIER, "Release", {"req_ids": [ghost]}) == OK
    assert stack.send(SCHEDULER, "Abort", {"req_id": ghost}) == OK
    stack.assert_clean()


@FUZZ
@given(prompt=st.lists(st.integers(0, 63), min_size=1, max_size=6), drafts=st.lists(st.integers(0, 63), max_size=3))
def test_replayed_messages(stack: Stack, prompt: list[int], drafts: list[int]) -> None:
    add = encode({"req_ids": ["rp"], "params": [GREEDY.to_dict()]})
    assert stack.call(DRAFTER, "AddRequests", add) == OK
    assert stack.call(DRAFTER, "AddRequests", add) == OK  # idempotent
    assert stack.drafter.engine.num_free_slots == SLOTS - 1
    prefill = encode(_step(prefill=[("rp", prompt)]))
    assert stack.call(VERIFIER, "Step", prefill) == OK
    assert stack.call(VERIFIER, "Step", prefill) == INVALID  # already running: not loaded twice
    position = len(prompt)
    assert stack.verifier.engine.context_length("rp") == position
    features = torch.ones(position, stack.feature_width)
    append = encode({"req_ids": ["rp"], "starts": [0], "counts": [position], "features": features})
    assert stack.call(DRAFTER, "AppendContext", append) == OK
    assert stack.call(DRAFTER, "AppendContext", append) == OK  # rows replaced, not appended twice
    assert stack.drafter.engine.context_length("rp") == position
    verify = encode(_step(verify=[("rp", 1, drafts, position)]))
    assert stack.call(VERIFIER, "Step", verify) == OK
    advanced = stack.verifier.engine.context_length("rp")
    assert position < advanced <= position + 1 + len(drafts)
    assert stack.call(VERIFIER, "Step", verify) == INVALID  # a stale anchor position: not applied twice
    assert stack.verifier.engine.context_length("rp") == advanced
    assert stack.send(DRAFTER, "Release", {"req_ids": ["rp"]}) == OK
    assert stack.send(VERIFIER, "Release", {"req_ids": ["rp"]}) == OK
    stack.assert_clean()


def test_a_replayed_generate_is_refused_while_the_first_runs(stack: Stack) -> None:
    async def run() -> tuple[list[int], grpc.StatusCode]:
        first = stack.hub.generate("twice", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
        tokens = list((await anext(first)).token_ids)
        code = await asyncio.to_thread(
            stack.send, SCHEDULER, "Generate", {"req_id": "twice", "prompt_ids": [4], "params": GREEDY.to_dict()}
        )
        async for delta in first:
            tokens.extend(delta.token_ids)
        return tokens, code

    tokens, code = asyncio.run(run())
    assert code == INVALID
    assert tokens == stack.target.generate([[1, 2, 3]], max_new_tokens=20)[0]
    stack.assert_clean()


def test_after_the_fuzz_generation_is_still_exact_and_everything_is_free(stack: Stack) -> None:
    prompts = [[1, 2, 3], [7], [9, 10, 11, 12]]
    with SyncRpcClient(stack.servers[SCHEDULER].address, timeout_s=60) as client:
        outputs = []
        for i, prompt in enumerate(prompts):
            request = {"req_id": f"after-{i}", "prompt_ids": prompt,
                       "params": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True).to_dict()}
            outputs.append([t for m in client.stream(SCHEDULER, "Generate", request) for t in m["token_ids"]])
    assert outputs == stack.target.generate(prompts, max_new_tokens=12)
    stack.assert_clean()
