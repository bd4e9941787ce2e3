"""A colocated engine replica dies mid-stream: the ingress continues the stream on another replica.

Real pieces on loopback: two engine replicas (the demo target's in-process round pipeline behind the
``dspark.Engine`` gRPC service each), the scheduler hub routing to them, and :class:`RemoteBackend` as the Serve
ingress uses it (``routed``, resolving the scheduler's address). A gate holds the replica that runs the request
once it has streamed its first tokens, so the replica provably dies mid-stream; the stream then ends with exactly
the tokens and text of an uncut run, nothing twice, and the dead replica takes no new request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from http_harness import MODEL, demo_backend

from cluster import contract
from cluster.backend import GenerateDelta, LocalBackend
from cluster.backend_rpc import backend_methods
from cluster.remote_backend import RemoteBackend
from cluster.rpc import ServerThread
from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub

PROMPT = [5, 6, 7, 8]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class HoldRunning:
    """Holds a replica's round loop, before a round, once request ``req_id`` runs there with output streamed."""

    def __init__(self, backend: LocalBackend, req_id: str, any_held: threading.Event) -> None:
        self.held = threading.Event()
        self.released = threading.Event()
        engine = backend.engine
        step = engine.step

        def held_step() -> Any:
            running = engine._running.get(req_id)
            if running is not None and running.output and not self.released.is_set():
                self.held.set()
                any_held.set()
                self.released.wait(120)
            return step()

        engine.step = held_step  # type: ignore[method-assign]


@pytest.fixture
def cluster() -> Iterator[dict[str, Any]]:
    backends = [demo_backend(None, policy="autoregressive", max_requests=2) for _ in range(2)]
    any_held = threading.Event()
    gates = [HoldRunning(b, "r", any_held) for b in backends]
    engines = []
    for backend in backends:
        info = {"ready": True, "reason": ""}
        engines.append(ServerThread([contract.service(contract.ENGINE, backend_methods(backend, lambda i=info: i,
                                                                                      contract.ENGINE))]))
    hub = SchedulerHub(model_name=MODEL, policy="autoregressive", decode=None, readiness_timeout_s=30.0)
    for i, server in enumerate(engines):
        hub.register_engine(f"e{i}", server.address, None)
    scheduler = ServerThread([hub.service()])
    yield {"backends": backends, "gates": gates, "any_held": any_held, "engines": engines, "hub": hub,
           "scheduler": scheduler}
    for gate in gates:
        gate.released.set()
    scheduler.stop()
    hub.close()
    for server in engines:
        server.stop()
    for backend in backends:
        backend.close()


def _ingress(address: str) -> RemoteBackend:
    async def resolve() -> str:
        return address

    return RemoteBackend(resolve, model_name=MODEL, max_context=255, routed=True, continue_timeout_s=60.0)


async def _collect(
    backend: RemoteBackend, hub: SchedulerHub, req_id: str, after_first: Any = None
) -> list[GenerateDelta]:
    """The stream's deltas, once the ingress's releases of its attempts reached the hub: they are sent after the
    stream ends, on the ingress's event loop, which here lives only as long as this coroutine (a generous bound,
    not a sleep)."""
    deltas = []
    async for delta in backend.generate(req_id, PROMPT, PARAMS):
        deltas.append(delta)
        if after_first is not None and len(deltas) == 1:
            await asyncio.to_thread(after_first)
    deadline = time.monotonic() + 60.0
    while any(hub.engines.loads().values()):
        assert time.monotonic() < deadline, f"the hub still counts requests: {hub.engines.loads()}"
        await asyncio.sleep(0.01)
    return deltas


def test_a_stream_cut_by_its_engine_replica_continues_on_another(cluster: dict[str, Any]) -> None:
    hub: SchedulerHub = cluster["hub"]
    uncut = asyncio.run(_collect(_ingress(cluster["scheduler"].address), hub, "uncut"))
    expected = [t for d in uncut for t in d.token_ids]
    assert len(expected) == PARAMS.max_tokens and uncut[-1].finished

    killed: list[int] = []

    def after_first() -> None:
        """The replica running "r" holds its next round (the bound is a hang detector); kill it there."""
        assert cluster["any_held"].wait(120), "the replica never reached its second round"
        owner = next(i for i, gate in enumerate(cluster["gates"]) if gate.held.is_set())
        killed.append(owner)
        cluster["engines"][owner].stop(grace_s=0)

    deltas = asyncio.run(_collect(_ingress(cluster["scheduler"].address), hub, "r", after_first))
    tokens = [t for d in deltas for t in d.token_ids]
    assert killed and tokens == expected  # every token once, the uncut greedy output
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert deltas[-1].num_output_tokens == PARAMS.max_tokens and deltas[-1].num_prompt_tokens == len(PROMPT)
    assert "".join(d.text for d in deltas) == "".join(d.text for d in uncut)
    survivor = 1 - killed[0]
    assert hub.engines.loads() == {"e0": 0, "e1": 0}  # both attempts released (what _collect waited for)
    assert asyncio.run(hub.route("next")) == cluster["engines"][survivor].address  # the dead one takes none
