"""Replicas leaving the scheduler hub gracefully (autoscaling down): real drafter and verifier gRPC servers.

A draining verifier gets no new requests but finishes the ones it holds, losslessly; once unregistered it is gone
for good (a late heartbeat cannot bring it back) and its counters stay in the totals. A draining drafter gets no
new requests either, and requests keep working after it is removed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from model_factory import PairSpec, write_pair

from cluster.backend import BackendUnavailableError, GenerateDelta
from cluster.rpc import ServerThread
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SPS = SPSTable([1, 16, 64], [1000, 900, 500]).to_dict()
T = TypeVar("T")
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@dataclass
class Topology:
    hub: SchedulerHub
    target: TargetModel
    drafters: list[DrafterService]
    verifiers: list[VerifierService]
    servers: list[ServerThread]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("drain"), PairSpec(vocab=128, block_size=4, seed=11))


@pytest.fixture
def topology(pair: tuple[Path, Path]) -> Iterator[Topology]:
    target_dir, draft_dir = pair
    drafters, verifiers = [], []
    for _ in range(2):
        model = load_draft_model(draft_dir, target_dir=target_dir)
        drafters.append(DrafterService(DraftEngine(model, max_requests=4, max_seq_len=128)))
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    for _ in range(2):
        verifiers.append(VerifierService(VerifyEngine(target, max_requests=4, max_seq_len=128)))
    servers = [ServerThread([s.service()]) for s in [*drafters, *verifiers]]
    hub = SchedulerHub(model_name="tiny", policy="dspark", decode=None)
    hub.register_drafter("d0", servers[0].address)
    hub.register_drafter("d1", servers[1].address)
    hub.register_verifier("v0", servers[2].address, SPS)
    hub.register_verifier("v1", servers[3].address, SPS)
    yield Topology(hub, target, drafters, verifiers, servers)
    hub.close()
    for server in servers:
        server.stop()


async def _first(stream: AsyncIterator[GenerateDelta]) -> list[int]:
    """Read one delta: the request is admitted and stays held by the hub until the stream is exhausted."""
    return list((await stream.__anext__()).token_ids)


async def _until(read: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout_s: float = 60.0) -> T:
    """Poll ``read`` until ``done``; the bound is a hang detector (generous: the test machine is shared)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done(value := await read()):
        assert asyncio.get_running_loop().time() < deadline, f"condition not reached, last value {value}"
        await asyncio.sleep(0.01)
    return value


async def _rest(stream: AsyncIterator[GenerateDelta], tokens: list[int]) -> list[int]:
    async for delta in stream:
        tokens.extend(delta.token_ids)
    return tokens


def test_draining_verifier_finishes_its_requests_and_gets_no_new_ones(topology: Topology) -> None:
    hub, target = topology.hub, topology.target
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}

    async def scenario() -> dict[str, list[int]]:
        a = hub.generate("a", prompts["a"], GREEDY)
        got = {"a": await _first(a)}
        owner_of_a = next(r for r, n in hub.verifier_loads().items() if n == 1)
        other = "v1" if owner_of_a == "v0" else "v0"
        assert hub.drain_verifier(owner_of_a) == 1  # a is still held there
        assert hub.drain_verifier(owner_of_a) == 1  # idempotent
        b, c = hub.generate("b", prompts["b"], GREEDY), hub.generate("c", prompts["c"], GREEDY)
        got["b"], got["c"] = await _first(b), await _first(c)
        assert hub.verifier_loads() == {owner_of_a: 1, other: 2}
        # A heartbeat of the draining replica does not reopen it.
        hub.register_verifier(owner_of_a, topology.servers[2 if owner_of_a == "v0" else 3].address, SPS)
        d = hub.generate("d", [10, 11], GREEDY)
        got["d"] = await _first(d)
        assert hub.verifier_loads() == {owner_of_a: 1, other: 3}
        for name, stream in (("a", a), ("b", b), ("c", c), ("d", d)):
            await _rest(stream, got[name])
        assert hub.drain_verifier(owner_of_a) == 0
        # Each group publishes its counters after a round; once none runs anything, the totals are final.
        before = await _until(hub.metrics, lambda m: m.running == m.waiting == 0)
        hub.unregister_verifier(owner_of_a)
        assert hub.num_verifiers == 1
        after = await hub.metrics()  # the removed group's counters stay in the totals
        counters = ("rounds", "num_drafts", "num_accepted_tokens", "num_output_tokens", "accepted_per_position",
                    "first_tokens", "queue_time_s", "admission_to_first_token_s", "joined_prompts")
        assert [getattr(after, k) for k in counters] == [getattr(before, k) for k in counters]
        assert after.num_output_tokens > 0
        # Both groups' first tokens and joins, summed: a, b, c and d, each prefilled once.
        assert after.first_tokens == after.joined_prompts == 4 and after.admission_to_first_token_s > 0
        # Gone for good: a late heartbeat is ignored, unknown ids are harmless.
        hub.register_verifier(owner_of_a, topology.servers[2].address, SPS)
        assert hub.num_verifiers == 1
        assert hub.drain_verifier(owner_of_a) == 0
        hub.unregister_verifier(owner_of_a)
        e = hub.generate("e", [12, 13, 14], GREEDY)
        got["e"] = await _rest(e, [])
        return got

    got = asyncio.run(scenario())
    prompts |= {"d": [10, 11], "e": [12, 13, 14]}
    for name, prompt in prompts.items():
        assert got[name] == target.generate([prompt], max_new_tokens=GREEDY.max_tokens)[0], name
    assert all(v.engine.num_free_slots == 4 for v in topology.verifiers)


def test_no_accepting_verifier_is_a_retryable_error(topology: Topology) -> None:
    hub = topology.hub
    hub.drain_verifier("v0")
    hub.drain_verifier("v1")

    async def scenario() -> None:
        with pytest.raises(BackendUnavailableError, match="draining"):
            await _first(hub.generate("x", [1, 2], GREEDY))

    asyncio.run(scenario())
    assert hub.verifier_loads() == {"v0": 0, "v1": 0}


def test_draining_drafter_gets_no_new_requests_and_removal_keeps_serving(topology: Topology) -> None:
    hub, target = topology.hub, topology.target
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
    assert hub.drain_drafter("d0") == 0
    assert hub.drain_drafter("nope") == 0

    async def run_all() -> list[list[int]]:
        streams = [hub.generate(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        firsts = [await _first(s) for s in streams]
        # Every admitted request drafts on d1: d0 keeps all its context slots free.
        assert topology.drafters[0].engine.num_free_slots == 4
        return [await _rest(s, t) for s, t in zip(streams, firsts, strict=True)]

    outputs = asyncio.run(run_all())
    hub.unregister_drafter("d0")
    assert hub.num_drafters == 1
    hub.register_drafter("d0", topology.servers[0].address)  # late heartbeat: ignored
    assert hub.num_drafters == 1
    outputs += asyncio.run(run_all())
    expected = target.generate(prompts, max_new_tokens=GREEDY.max_tokens)
    assert outputs == expected + expected
    assert all(d.engine.num_free_slots == 4 for d in topology.drafters)
