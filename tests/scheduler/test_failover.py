"""Failover on real gRPC servers on loopback: a verifier or drafter replica dies mid-stream, nothing is lost.

The scheduler hub drives two verifier groups (or one) over real drafter and verifier services. A gate in front of a
replica's method lets a fixed number of calls through and then holds the next one, so the test kills that replica
at a known point of the generation (never by timing). Every stream must then complete with exactly the target's
greedy tokens (no token duplicated or missing for the client), and every cache must be free at the end.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from model_factory import PairSpec, write_pair

from cluster.rpc import ServerThread, Service, SyncRpcClient
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub
from scheduler.remote import RemoteVerifier
from scheduler.sps import SPSMonotonicityWarning, SPSTable
from verify_service.engine import PrefillItem, VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SPS = SPSTable([1, 16, 64], [1000, 900, 500]).to_dict()
MAX_TOKENS = 32
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Gate:
    """Counts calls of one method; once armed, holds the call number ``hold_from`` (and later ones) until
    released. The test kills the server while a call is held, so the failure hits a known round."""

    def __init__(self) -> None:
        self.calls = 0
        self.hold_from: int | None = None
        self.held = threading.Event()
        self.released = threading.Event()

    def arm(self, pass_more: int) -> None:
        """Let ``pass_more`` more calls through, hold the one after."""
        self.hold_from = self.calls + pass_more + 1

    async def __call__(self) -> None:
        self.calls += 1
        if self.hold_from is not None and self.calls >= self.hold_from:
            self.held.set()
            while not self.released.is_set():
                await asyncio.sleep(0.005)

    def wrap(self, service: Service, method: str) -> Service:
        handler, schema = service.methods[method]

        async def gated(request: dict[str, Any]) -> Any:
            await self()
            return await handler(request)

        return Service(service.name, {**service.methods, method: (gated, schema)})


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("failover"), PairSpec(vocab=128, block_size=5, seed=5))


@pytest.fixture(scope="module")
def target(pair: tuple[Path, Path]) -> TargetModel:
    return TargetModel.from_pretrained(pair[0])


@pytest.fixture(scope="module")
def expected(target: TargetModel) -> list[list[int]]:
    return target.generate(PROMPTS, max_new_tokens=MAX_TOKENS)


class Cluster:
    """Drafter and verifier services behind real gRPC servers, each method optionally gated."""

    def __init__(self, pair: tuple[Path, Path]) -> None:
        self.pair = pair
        self.servers: dict[str, ServerThread] = {}
        self.drafters: dict[str, DrafterService] = {}
        self.verifiers: dict[str, VerifierService] = {}
        self.gates: dict[str, Gate] = {}

    def add_drafter(self, name: str, gate: str | None = None) -> str:
        target_dir, draft_dir = self.pair
        service = DrafterService(DraftEngine(load_draft_model(draft_dir, target_dir=target_dir), 4, 128))
        self.drafters[name] = service
        return self._serve(name, service.service(), gate)

    def add_verifier(self, name: str, gate: str | None = None) -> str:
        target_dir, draft_dir = self.pair
        layers = load_draft_model(draft_dir, target_dir=target_dir).config.target_layer_ids
        target = TargetModel.from_pretrained(target_dir, feature_layer_ids=layers)
        service = VerifierService(VerifyEngine(target, max_requests=8, max_seq_len=128), timeout_s=10)
        self.verifiers[name] = service
        return self._serve(name, service.service(), gate)

    def _serve(self, name: str, service: Service, gate: str | None) -> str:
        if gate is not None:
            self.gates[name] = Gate()
            service = self.gates[name].wrap(service, gate)
        self.servers[name] = ServerThread([service])
        return self.servers[name].address

    def kill(self, name: str) -> None:
        """Stop the server at once: in-flight calls are cancelled, new ones are refused (UNAVAILABLE)."""
        self.servers[name].stop(grace_s=None)
        if name in self.gates:
            self.gates[name].released.set()

    def close(self) -> None:
        for gate in self.gates.values():
            gate.released.set()
        for server in self.servers.values():
            server.stop()


@pytest.fixture
def cluster(pair: tuple[Path, Path]) -> Iterator[Cluster]:
    c = Cluster(pair)
    yield c
    c.close()


def make_hub(request_groups: int = 1, relay_drafts: bool = True, policy: str = "dspark") -> SchedulerHub:
    return SchedulerHub(
        model_name="t",
        policy=policy,
        decode=None,
        timeout_s=10.0,
        request_groups=request_groups,
        relay_drafts=relay_drafts,
    )


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll (generous timeout: the machine is shared); the timeout is a hang detector, not an assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.01)


async def _stream_all(
    hub: SchedulerHub, params: SamplingParams, during: Callable[[dict[str, list[int]]], None]
) -> dict[str, list[int]]:
    """Stream every prompt through the hub; ``during(tokens so far)`` runs in a thread meanwhile (the fault)."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished: dict[str, int] = {}

    async def consume(req_id: str, prompt: list[int]) -> None:
        async for delta in hub.generate(req_id, prompt, params):
            tokens[req_id].extend(delta.token_ids)
            if delta.finished:
                finished[req_id] = finished.get(req_id, 0) + 1

    tasks = [asyncio.create_task(consume(f"r{i}", p)) for i, p in enumerate(PROMPTS)]
    await asyncio.sleep(0)  # every request picks its group before the fault is injected
    await asyncio.to_thread(during, tokens)
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert finished == dict.fromkeys(tokens, 1)  # one final delta each
    return tokens


def _all_free(cluster: Cluster, hub: SchedulerHub, alive: list[str]) -> None:
    for name in alive:
        if name in cluster.verifiers:
            service = cluster.verifiers[name]
            _wait(lambda s=service: s.engine.num_free_slots == 8, 30, f"{name} to free its slots")
        else:
            service = cluster.drafters[name]
            _wait(lambda s=service: s.engine.num_free_slots == 4, 30, f"{name} to free its slots")
    assert not hub._owner
    assert all(not g.active for g in hub._groups.values())


@pytest.mark.parametrize("request_groups", [1, 2])
def test_verifier_dies_mid_stream_requests_finish_on_the_other(
    cluster: Cluster, expected: list[list[int]], request_groups: int
) -> None:
    hub = make_hub(request_groups)
    hub.register_drafter("d0", cluster.add_drafter("d0"))
    hub.register_drafter("d1", cluster.add_drafter("d1"))
    hub.register_verifier("vA", cluster.add_verifier("vA", gate="Step"), SPS)
    hub.register_verifier("vB", cluster.add_verifier("vB"), SPS)
    gate = cluster.gates["vA"]
    gate.arm(pass_more=3)  # prefill + 2 verify rounds on A, then A dies inside its 4th round
    seen_on_a: dict[str, int] = {}

    def kill_a(tokens: dict[str, list[int]]) -> None:
        assert gate.held.wait(60), "verifier A never reached its 4th round"
        seen_on_a.update({r: len(tokens[r]) for r, owner in hub._owner.items() if owner == "vA"})
        cluster.kill("vA")

    try:
        tokens = asyncio.run(_stream_all(hub, GREEDY, kill_a))
        assert len(seen_on_a) == 3  # half of the requests were on A ...
        assert any(0 < n < MAX_TOKENS for n in seen_on_a.values())  # ... streaming when it died
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
        assert hub.num_verifiers == 1 and "vA" not in hub._groups
        _all_free(cluster, hub, ["vB", "d0", "d1"])
    finally:
        hub.close()


@pytest.mark.parametrize(
    ("request_groups", "relay_drafts", "policy", "gated"),
    [(1, True, "full", "AppendContext"), (1, False, "dspark", "Propose"), (2, True, "dspark", "Propose")],
)
def test_drafter_dies_mid_stream_requests_get_the_other_drafter(
    cluster: Cluster, expected: list[list[int]], request_groups: int, relay_drafts: bool, policy: str, gated: str
) -> None:
    """The drafter dies inside the call that carries its round: the feature push whose reply relays the next
    blocks to the verifier (relayed rounds: "full" plans every round's lengths), or ``Propose``."""
    hub = make_hub(request_groups, relay_drafts, policy)
    hub.register_drafter("d0", cluster.add_drafter("d0", gate=gated))
    hub.register_drafter("d1", cluster.add_drafter("d1"))
    hub.register_verifier("v", cluster.add_verifier("v"), SPS)
    gate = cluster.gates["d0"]
    gate.arm(pass_more=2)

    def kill_d0(tokens: dict[str, list[int]]) -> None:
        assert gate.held.wait(60), f"drafter 0 never reached its 3rd {gated}"
        cluster.kill("d0")

    try:
        tokens = asyncio.run(_stream_all(hub, GREEDY, kill_d0))
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
        assert hub.num_drafters == 1
        assert hub._pool is not None and hub._pool.addresses == [cluster.servers["d1"].address]
        _all_free(cluster, hub, ["v", "d1"])
    finally:
        hub.close()


def test_last_drafter_dies_requests_continue_without_one_then_reattach(
    cluster: Cluster, expected: list[list[int]]
) -> None:
    hub = make_hub(relay_drafts=False)  # the drafter's rounds are its Propose calls (held there)
    hub.register_drafter("d0", cluster.add_drafter("d0", gate="Propose"))
    hub.register_verifier("v", cluster.add_verifier("v", gate="Step"), SPS)
    drafter_gate, verifier_gate = cluster.gates["d0"], cluster.gates["v"]
    drafter_gate.arm(pass_more=2)
    detached_at_kill: list[str] = []
    without_draft: list[int] = []

    def kill_then_replace(tokens: dict[str, list[int]]) -> None:
        assert drafter_gate.held.wait(60), "the drafter never reached its 3rd round"
        # The loop is blocked in Propose: no Step runs now. After the kill, the re-prefill and one round without
        # a drafter pass, then the verifier holds the next round while a new drafter registers.
        verifier_gate.arm(pass_more=2)
        cluster.kill("d0")
        assert verifier_gate.held.wait(60), "the verifier never ran without a drafter"
        pool = hub._pool
        assert pool is not None and not pool.addresses
        detached_at_kill.extend(r for r in tokens if pool.is_detached(r))
        # The round that ran without a drafter is counted as one (dspark with draft_cost none drafts every other).
        without_draft.append(asyncio.run(hub.metrics()).rounds_without_draft)
        hub.register_drafter("d1", cluster.add_drafter("d1", gate="Propose"))
        verifier_gate.released.set()

    try:
        tokens = asyncio.run(_stream_all(hub, GREEDY, kill_then_replace))
        assert detached_at_kill  # requests ran without a drafter ...
        assert without_draft[0] >= 1  # ... and those rounds are counted
        assert cluster.gates["d1"].calls > 0  # ... and drafted again once one was back
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
        _all_free(cluster, hub, ["v", "d1"])
        assert hub._pool is not None and not any(hub._pool.is_detached(f"r{i}") for i in range(len(PROMPTS)))
    finally:
        hub.close()


def test_only_verifier_dies_requests_wait_for_its_replacement(cluster: Cluster, expected: list[list[int]]) -> None:
    hub = make_hub()
    hub.register_drafter("d0", cluster.add_drafter("d0"))
    hub.register_verifier("v0", cluster.add_verifier("v0", gate="Step"), SPS)
    gate = cluster.gates["v0"]
    gate.arm(pass_more=2)

    def replace_verifier(tokens: dict[str, list[int]]) -> None:
        assert gate.held.wait(60)
        cluster.kill("v0")
        _wait(lambda: hub.failover.num_orphans == len(PROMPTS), 30, "the requests to wait for a verifier")
        hub.register_verifier("v1", cluster.add_verifier("v1"), SPS)  # what Serve's restart + heartbeat do

    try:
        tokens = asyncio.run(_stream_all(hub, GREEDY, replace_verifier))
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
        _all_free(cluster, hub, ["v1", "d0"])
    finally:
        hub.close()


def test_no_verifier_back_in_time_fails_with_a_retryable_error(cluster: Cluster) -> None:
    from cluster.backend import BackendUnavailableError

    hub = make_hub()
    hub.failover.orphan_wait_s = 0.5
    hub.register_drafter("d0", cluster.add_drafter("d0"))
    hub.register_verifier("v0", cluster.add_verifier("v0", gate="Step"), SPS)
    gate = cluster.gates["v0"]
    gate.arm(pass_more=1)

    async def run() -> list[BaseException | None]:
        async def one(i: int) -> BaseException | None:
            try:
                async for _ in hub.generate(f"r{i}", PROMPTS[i], GREEDY):
                    pass
            except BackendUnavailableError as error:
                return error
            return None

        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await asyncio.to_thread(gate.held.wait, 60)
        cluster.kill("v0")
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    try:
        errors = asyncio.run(run())
        assert all(isinstance(e, BackendUnavailableError) and "retry" in str(e) for e in errors)
        # The drafter's slots came back; new requests get a clear 503-style error while nothing is there.
        _wait(lambda: cluster.drafters["d0"].engine.num_free_slots == 4, 30, "the drafter to free its slots")
        with pytest.raises(BackendUnavailableError):
            asyncio.run(anext(hub.generate("late", [1, 2], GREEDY)))
    finally:
        hub.close()


def test_a_restarted_hub_releases_what_the_old_one_left_on_the_replicas(cluster: Cluster) -> None:
    drafter, verifier = cluster.add_drafter("d0"), cluster.add_verifier("v0")
    # What a scheduler that died mid-request leaves behind: a context slot and a KV slot nobody will release.
    with SyncRpcClient(drafter) as client:
        client.call("dspark.Drafter", "AddRequests", {"req_ids": ["orphan"], "params": [GREEDY.to_dict()]})
    old = RemoteVerifier(verifier, lambda _req_id: drafter)
    old.step([PrefillItem("orphan", [1, 2, 3], GREEDY)])
    old.close()
    assert cluster.verifiers["v0"].engine.num_free_slots == 7
    assert cluster.drafters["d0"].engine.num_free_slots == 3
    new = make_hub()
    try:
        new.register_drafter("d0", drafter)
        new.register_verifier("v0", verifier, SPS)
        assert cluster.verifiers["v0"].engine.num_free_slots == 8
        assert cluster.drafters["d0"].engine.num_free_slots == 4
    finally:
        new.close()


def test_a_verifier_table_is_not_warned_about_again_at_registration(cluster: Cluster) -> None:
    """A measured table faster at a larger B is fixed up and warned about by the verifier that measured it; the
    hub that receives it at every (re-)registration stays quiet (one warning per replica start, not two)."""
    bumpy = {**SPS, "steps_per_s": [900, 1000, 500]}
    with pytest.warns(SPSMonotonicityWarning):
        SPSTable.from_dict(bumpy)  # what the verifier logs when it profiles or loads the table
    hub = make_hub()
    try:
        hub.register_drafter("d", cluster.add_drafter("d"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", SPSMonotonicityWarning)
            hub.register_verifier("v", cluster.add_verifier("v"), bumpy)
        assert hub.num_verifiers == 1
    finally:
        hub.close()
