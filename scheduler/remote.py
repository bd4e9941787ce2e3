"""Remote engines for the round driver: the verify and draft engine interfaces over gRPC.

:class:`SpeculativeEngine` drives whatever offers the engine methods it calls, so the same round logic runs in one
process (tests, single-GPU benchmarks) and across replicas. ``RemoteVerifier`` speaks to one verifier replica;
``DrafterPool`` spreads requests over drafter replicas (sticky: a request keeps its drafter until it ends) and
fans each round's ``Propose`` out to all of them in parallel. Context features go from the verifier straight to
the owning drafter (the ``routes`` of a ``Step``), so only control data passes through this process.

The per-round messages (``Step``, ``Propose``) travel on long-lived bidirectional streams, one message each way
per replica per round (:class:`cluster.rpc.StreamLane`): a ``RemoteVerifier`` has one stream to its replica, and
the ``DrafterPool`` one per calling thread and drafter (the pool is shared by every verifier group's round loop,
and a stream carries one round at a time). The round loop's thread drives its streams itself, so a round hands
its messages to no other Python thread on this side (a fan-out to several drafters is one event-loop run, not a
thread pool). Control calls (``Info``, ``AddRequests``, ``Release``, ``AppendContext`` of inline features) stay
unary. A stream that broke is reopened for the next round only: the round in flight fails with the gRPC error,
as a unary call would, and failover takes it from there (:mod:`scheduler.failover`).

With ``relay`` a ``RemoteVerifier`` asks its replica, in every step, to have the drafters return their next
blocks to it (``relay_drafts``: :mod:`verify_service.relay`); a round whose lengths the policy planned before its
drafts exist is then one relayed ``Step`` (:meth:`RemoteVerifier.step_relayed`) and no ``Propose``: the drafts
never come to this process, only their confidences, for planning the next round. A round the policy decides on
its drafts' confidences sends the ``Propose`` as without relaying (the drafter still holds the same drafts made
ahead), so output is unchanged either way.

Both report the server's time of the thread's last call (:attr:`RemoteVerifier.last_server_s`,
:attr:`DrafterPool.last_server_s`, from the replies' ``engine_ms``) and how long the replica's process held it
(``last_held_s``, from the stream envelope), from which the round driver tells the replicas' compute, their
gRPC handling around it and the time on the wire apart (:class:`scheduler.metrics.EngineMetrics`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cluster import contract
from cluster.rpc import RoundStream, StreamLane, SyncRpcClient
from draft_service.engine import ContextItem, DraftItem, Proposal
from scheduler.admission import place_by_free_slots
from scheduler.interfaces import RelayedStep
from verify_service.engine import PrefillItem, StepResult, VerifyItem

logger = logging.getLogger(__name__)


class ReplicaLostError(ConnectionError):
    """A request's replica was removed from the pool (it died) while a round still referred to it."""


class RemoteVerifier:
    """The VerifyEngine interface of one verifier replica."""

    def __init__(
        self,
        address: str,
        route_of: Callable[[str], str | None],
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        inline_features: bool = True,
        relay: bool = False,
    ) -> None:
        self.address = address
        self._client = SyncRpcClient(address, token=token, timeout_s=timeout_s)
        info = contract.VERIFIER_INFO.call(self._client, {})
        self.vocab_size: int = info["vocab_size"]
        self.max_seq_len: int = info["max_seq_len"]
        self.capacity: int = info["max_requests"]
        self.eos_token_ids: tuple[int, ...] = tuple(info["eos_token_ids"])
        # Fingerprint of the drafter projection this verifier applies before pushing features (None: raw).
        self.context_projection: str | None = info["context_projection"]
        self._route_of = route_of
        self._held: set[str] = set()
        # Whether the round driver wants the context features of requests without a drafter route back (it
        # appends them itself); a driver without a drafter says False and the features stay on the replica.
        self.inline_features = inline_features
        self._relay = relay
        # Step goes on one stream, driven by the thread that steps (the group's round loop).
        self._lane = StreamLane()
        self._step = contract.STEP.lane_stream(self._lane, address, token=token, timeout_s=timeout_s)
        self.last_server_s = 0.0  # the replicas' time of the last step: the verifier's engine, the drafts' wait
        self.last_held_s = 0.0  # how long the verifier's process held the last step (its engine time included)
        self.last_drafts_s = 0.0  # of last_server_s: a relayed step's wait for the drafters' blocks

    @property
    def relay(self) -> bool:
        """Whether its steps have the drafters return the next blocks to the replica (relayed rounds)."""
        return self._relay

    @property
    def bytes_sent(self) -> int:
        """Payload bytes sent to the replica (unary calls and the step stream)."""
        return self._client.bytes_sent + self._step.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._client.bytes_received + self._step.bytes_received

    @property
    def num_free_slots(self) -> int:
        return self.capacity - len(self._held)

    def has(self, req_id: str) -> bool:
        return req_id in self._held

    def release(self, req_id: str) -> None:
        if req_id in self._held:
            self._held.discard(req_id)
            contract.VERIFIER_RELEASE.call(self._client, {"req_ids": [req_id]})

    def release_many(self, req_ids: Sequence[str]) -> None:
        """Release the ones this side holds in one call (a round's finished requests)."""
        held = [r for r in req_ids if r in self._held]
        if held:
            self._held.difference_update(held)
            contract.VERIFIER_RELEASE.call(self._client, {"req_ids": held})

    def release_all(self, req_ids: Sequence[str]) -> None:
        """Release on the replica whether or not this side thinks it holds them: after a failed round the
        replica may hold slots that the failed call never confirmed (Release ignores unknown ids)."""
        self._held.difference_update(req_ids)
        if req_ids:
            contract.VERIFIER_RELEASE.call(self._client, {"req_ids": list(req_ids)})

    def step(
        self, prefills: Sequence[PrefillItem] = (), verifies: Sequence[VerifyItem] = ()
    ) -> Sequence[StepResult]:
        routes = self._routes([*(p.req_id for p in prefills), *(v.req_id for v in verifies)])
        message = contract.step_request(
            prefills, verifies, routes, inline_features=self.inline_features, relay_drafts=self._relay
        )
        return contract.parse_step_reply(self._call(message, prefills))

    def decode(
        self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem], steps: Sequence[int]
    ) -> Sequence[StepResult]:
        """Plain decoding, ``steps[i]`` tokens for verification i in one ``Step`` (the replica's
        :meth:`VerifyEngine.decode`): one message each way for several tokens."""
        message = contract.step_request(prefills, verifies, {}, inline_features=False, steps=steps)
        return contract.parse_step_reply(self._call(message, prefills))

    def step_relayed(
        self,
        prefills: Sequence[PrefillItem],
        req_ids: list[str],
        anchors: np.ndarray,
        positions: np.ndarray,
        num_drafts: np.ndarray,
    ) -> RelayedStep:
        routes = self._routes([*(p.req_id for p in prefills), *req_ids])
        message = contract.relayed_step_request(
            prefills,
            req_ids,
            anchors.tolist(),
            positions.tolist(),
            num_drafts.tolist(),
            routes,
            inline_features=self.inline_features,
        )
        reply = self._call(message, prefills)
        confidences = reply["relayed_confidences"]
        return RelayedStep(
            contract.parse_step_reply(reply),
            None if confidences is None else confidences.numpy(),
            reply["relay_missing"],
        )

    def _routes(self, req_ids: list[str]) -> dict[str, list[str]]:
        """Drafter address -> the requests whose context features the replica pushes there."""
        routes: dict[str, list[str]] = {}
        for req_id in req_ids:
            address = self._route_of(req_id)
            if address is not None:
                routes.setdefault(address, []).append(req_id)
        return routes

    def _call(self, message: dict[str, Any], prefills: Sequence[PrefillItem]) -> dict[str, Any]:
        """Send a ``Step`` on the stream; the prefills' slots count as held unless it fails."""
        for p in prefills:
            self._held.add(p.req_id)
        try:
            reply = self._step.call(message)
        except Exception:
            for p in prefills:
                self._held.discard(p.req_id)
            raise
        self.last_drafts_s = 1e-3 * reply["drafts_ms"]
        self.last_server_s = 1e-3 * reply["engine_ms"] + self.last_drafts_s
        self.last_held_s = self._step.last_held_s
        return reply

    def close(self) -> None:
        self._lane.close()
        self._client.close()


@dataclass
class _Lane:
    """One calling thread's streams to the drafters: ``Propose`` streams by address."""

    thread: threading.Thread
    lane: StreamLane = field(default_factory=StreamLane)
    streams: dict[str, RoundStream] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)  # drafters removed since: their streams close at the next call
    last_server_s: float = 0.0
    last_held_s: float = 0.0


class DrafterPool:
    """The DraftEngine interface over one or more drafter replicas.

    Degraded mode: while the pool has no drafter at all (every replica died), new and re-homed requests join
    *detached*: they get placeholder proposals with confidence 0 (so the scheduler verifies no drafts: plain
    autoregressive decoding through the verifier, still exact) until :mod:`scheduler.failover` re-prefills them
    onto a drafter that registers.
    """

    def __init__(self, addresses: Sequence[str], *, token: str | None = None, timeout_s: float = 60.0) -> None:
        if not addresses:
            raise ValueError("DrafterPool needs at least one drafter address")
        self._token = token
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # several verifier groups share one pool
        self._clients: dict[str, SyncRpcClient] = {}
        self._capacity: dict[str, int] = {}
        self._owner: dict[str, str] = {}
        self._draining: set[str] = set()  # addresses that take no new requests
        self._detached: set[str] = set()  # requests admitted while no drafter was there (degraded mode)
        self._projections: dict[str, str] = {}  # address -> fingerprint of the drafter's context projection
        self._required_projection: str | None = None  # what the verifiers project with (require_projection)
        self._local = threading.local()  # this thread's _Lane
        self._lanes: list[_Lane] = []  # every thread's, to close them
        self._retired_bytes = [0, 0]  # sent / received on the streams of lanes closed already
        first = self.add_drafter(addresses[0])
        self.block_size: int = first["block_size"]
        self.has_confidence_head: bool = first["has_confidence_head"]
        self._vocab_size: int = first["vocab_size"]
        for address in addresses[1:]:
            self.add_drafter(address)

    def add_drafter(self, address: str) -> dict[str, Any]:
        """Connect a drafter replica (e.g. one the autoscaler just started); it takes new requests at once."""
        client = SyncRpcClient(address, token=self._token, timeout_s=self._timeout_s)
        info = contract.DRAFTER_INFO.call(client, {})
        if hasattr(self, "block_size") and (
            info["block_size"] != self.block_size or info["vocab_size"] != self._vocab_size
        ):
            client.close()
            raise ValueError(f"drafter {address} differs from the others (block size / vocabulary)")
        projection = info["context_projection"]
        if self._required_projection is not None and projection != self._required_projection:
            client.close()
            raise ValueError(
                f"drafter {address} has context projection {projection}, but the verifiers project features with "
                f"{self._required_projection}: it runs other drafter weights (or another dtype)"
            )
        with self._lock:
            self._clients[address] = client
            self._capacity[address] = info["max_requests"]
            self._projections[address] = projection
        return info

    def require_projection(self, fingerprint: str | None, verifier: str) -> None:
        """A verifier that projects context features (``fingerprint``; None: it sends them raw) must do so with
        the weights of every drafter, present and future: refuse it now, clearly, rather than fail every round
        (each drafter would answer INVALID_ARGUMENT to its feature pushes)."""
        if fingerprint is None:
            return
        with self._lock:
            other = {a: p for a, p in self._projections.items() if p != fingerprint}
            if self._required_projection not in (None, fingerprint):
                other["(another verifier)"] = self._required_projection
            if other:
                raise ValueError(
                    f"verifier {verifier} projects context features with {fingerprint}, but {other} differ: "
                    f"deploy the same drafter checkpoint and dtype everywhere, or context_projection: drafter"
                )
            self._required_projection = fingerprint

    def drain_drafter(self, address: str) -> int:
        """Give this drafter no new requests (it is going away); returns how many requests it still drafts for."""
        with self._lock:
            if address in self._capacity:
                self._draining.add(address)
            return self._load(address)

    def _address_of(self, req_id: str) -> str:
        address = self._owner.get(req_id)
        if address is None:
            raise ReplicaLostError(f"request {req_id!r} lost its drafter")
        return address

    def _client(self, address: str) -> SyncRpcClient:
        client = self._clients.get(address)
        if client is None:
            raise ReplicaLostError(f"drafter {address} left the pool")
        return client

    def remove_drafter(self, address: str) -> list[str]:
        """Disconnect a drafter replica (drained, or dead); returns the requests it still held (they need a new
        drafter: failover re-prefills them)."""
        with self._lock:
            client = self._clients.pop(address, None)
            self._capacity.pop(address, None)
            self._projections.pop(address, None)
            self._draining.discard(address)
            lost = [r for r, a in self._owner.items() if a == address]
            for req_id in lost:
                del self._owner[req_id]
            for lane in self._lanes:
                lane.gone.add(address)
        if client is not None:
            client.close()
        return lost

    def _lane(self) -> _Lane:
        """The calling thread's lane; lanes of threads that ended are closed on the way (nobody drives them)."""
        lane: _Lane | None = getattr(self._local, "lane", None)
        if lane is not None:
            return lane
        lane = self._local.lane = _Lane(threading.current_thread())
        with self._lock:
            ended = [old for old in self._lanes if not old.thread.is_alive()]
            self._lanes = [old for old in self._lanes if old.thread.is_alive()]
            self._lanes.append(lane)
        for old in ended:
            self._close_lane(old)
        return lane

    def _close_lane(self, lane: _Lane) -> None:
        with self._lock:
            self._retired_bytes[0] += sum(s.bytes_sent for s in lane.streams.values())
            self._retired_bytes[1] += sum(s.bytes_received for s in lane.streams.values())
        lane.lane.close()

    def _stream(self, lane: _Lane, address: str) -> RoundStream:
        stream = lane.streams.get(address)
        if stream is None:
            self._client(address)  # still in the pool
            stream = lane.streams[address] = contract.PROPOSE.lane_stream(
                lane.lane, address, token=self._token, timeout_s=self._timeout_s
            )
        return stream

    @property
    def last_server_s(self) -> float:
        """The drafters' time of the calling thread's last ``Propose`` (engine time and waiting for context;
        the slowest drafter's when it fanned out)."""
        lane: _Lane | None = getattr(self._local, "lane", None)
        return 0.0 if lane is None else lane.last_server_s

    @property
    def last_held_s(self) -> float:
        """How long the drafters' processes held the calling thread's last ``Propose`` (the slowest's)."""
        lane: _Lane | None = getattr(self._local, "lane", None)
        return 0.0 if lane is None else lane.last_held_s

    @property
    def last_drafts_s(self) -> float:
        """Always 0: the pool's time is all drafting (a relayed step's wait for its blocks is the verifier's)."""
        return 0.0

    @property
    def bytes_sent(self) -> int:
        """Payload bytes sent to the drafters (unary calls and every thread's streams)."""
        with self._lock:
            streams = [s for lane in self._lanes for s in lane.streams.values()]
            clients = list(self._clients.values())
        return self._retired_bytes[0] + sum(c.bytes_sent for c in clients) + sum(s.bytes_sent for s in streams)

    @property
    def bytes_received(self) -> int:
        with self._lock:
            streams = [s for lane in self._lanes for s in lane.streams.values()]
            clients = list(self._clients.values())
        return self._retired_bytes[1] + sum(c.bytes_received for c in clients) + sum(
            s.bytes_received for s in streams
        )

    @property
    def addresses(self) -> list[str]:
        return list(self._capacity)

    def is_detached(self, req_id: str) -> bool:
        return req_id in self._detached

    def _load(self, address: str) -> int:
        return sum(1 for a in list(self._owner.values()) if a == address)

    @property
    def num_free_slots(self) -> int:
        if not self._capacity:
            return 1 << 30  # degraded mode: the verifier's slots are the only bound
        return sum(cap - self._load(a) for a, cap in list(self._capacity.items()) if a not in self._draining)

    def route_of(self, req_id: str) -> str | None:
        return self._owner.get(req_id)

    def has(self, req_id: str) -> bool:
        return req_id in self._owner or req_id in self._detached

    def add_request(self, req_id: str, params: Any) -> None:
        if self.add_requests([(req_id, params)]) != 1:
            raise ValueError("no drafter has a free context slot")

    def add_requests(self, requests: Sequence[tuple[str, Any]]) -> int:
        """Place new requests (each on the accepting drafter with the most free slots, in order, until none has
        one) with one ``AddRequests`` call per drafter; returns how many were placed (a prefix of
        ``requests``). While no drafter is there at all they join detached (degraded mode). A failed call
        places none of them: the others' are released again, best effort, and the error is raised."""
        with self._lock:
            if not self._capacity:
                self._detached.update(r for r, _ in requests)
                return len(requests)
            accepting = [a for a in self._capacity if a not in self._draining]
            if not accepting:
                raise ValueError("no drafter replica is accepting requests (all are draining)")
            free = {a: self._capacity[a] - self._load(a) for a in accepting}
            groups: dict[str, list[tuple[str, Any]]] = {}
            addresses = place_by_free_slots(free, len(requests))
            for (req_id, params), address in zip(requests, addresses, strict=False):
                self._owner[req_id] = address
                groups.setdefault(address, []).append((req_id, params))
            placed = len(addresses)
        done: list[str] = []
        try:
            for address, group in groups.items():
                message = {"req_ids": [r for r, _ in group], "params": [p.to_dict() for _, p in group]}
                contract.ADD_REQUESTS.call(self._clients[address], message)
                done.append(address)
        except Exception:
            with self._lock:
                for group in groups.values():
                    for req_id, _ in group:
                        self._owner.pop(req_id, None)
            for address in done:
                try:
                    contract.DRAFTER_RELEASE.call(self._clients[address], {"req_ids": [r for r, _ in groups[address]]})
                except Exception as error:  # the replica is failing too: its failover cleans up
                    logger.warning("undoing AddRequests on %s failed (%s)", address, error)
            raise
        return placed

    def release(self, req_id: str) -> None:
        self.release_many([req_id])

    def release_many(self, req_ids: Sequence[str]) -> None:
        """Free requests on their drafters, one ``Release`` call per drafter."""
        groups: dict[str, list[str]] = {}
        with self._lock:
            for req_id in req_ids:
                self._detached.discard(req_id)
                address = self._owner.pop(req_id, None)
                if address is not None and address in self._clients:  # else its drafter went, caches and all
                    groups.setdefault(address, []).append(req_id)
            clients = {a: self._clients[a] for a in groups}
        for address, ids in groups.items():
            contract.DRAFTER_RELEASE.call(clients[address], {"req_ids": ids})

    def append_context(self, items: Sequence[ContextItem]) -> None:
        """Only for features the verifier returned inline (no direct route): forwarded to the owners."""
        groups: dict[str, list[ContextItem]] = {}
        for item in items:
            if item.req_id not in self._detached:
                groups.setdefault(self._address_of(item.req_id), []).append(item)
        for address, group in groups.items():
            contract.APPEND_CONTEXT.call(
                self._client(address),
                contract.append_request(
                    [i.req_id for i in group],
                    [i.start for i in group],
                    [int(i.features.shape[0]) for i in group],
                    torch.cat([i.features for i in group]),
                ),
            )

    def propose(self, items: Sequence[DraftItem]) -> Proposal:
        groups: dict[str, list[int]] = {}
        detached: list[int] = []
        for index, item in enumerate(items):
            if item.req_id in self._detached:
                detached.append(index)
            else:
                groups.setdefault(self._address_of(item.req_id), []).append(index)

        lane = self._lane()
        if lane.gone:
            with self._lock:
                gone, lane.gone = lane.gone, set()
            for address in gone:
                lane.streams.pop(address, None)
                lane.lane.forget(address)
        calls = [
            (self._stream(lane, address), contract.propose_request([items[i] for i in indices]))
            for address, indices in groups.items()
        ]
        replies = dict(zip(groups, lane.lane.call_many(calls), strict=True)) if calls else {}
        lane.last_server_s = 1e-3 * max((r["engine_ms"] + r["wait_ms"] for r in replies.values()), default=0.0)
        lane.last_held_s = max((stream.last_held_s for stream, _ in calls), default=0.0)
        if detached:
            groups[""] = detached
            replies[""] = self._placeholder_reply(len(detached), next(iter(replies.values()), None))
        order = np.concatenate([np.asarray(idx) for idx in groups.values()])
        inverse = torch.from_numpy(np.argsort(order))

        def gather(key: str) -> torch.Tensor | None:
            parts = [replies[a][key] for a in groups]
            if any(p is None for p in parts):
                return None
            return torch.cat(parts)[inverse]

        def gather_distribution(key: str, dtype: torch.dtype) -> torch.Tensor:
            """[R, gamma, K]; rows a drafter left out (greedy requests: never read) stay zero."""
            width = max(int(replies[a][key].shape[-1]) for a in groups)
            out = torch.zeros(len(items), self.block_size, width, dtype=dtype)
            for a, idx in groups.items():
                rows = replies[a].get("distribution_rows")
                targets = idx if rows is None else [idx[r] for r in rows]
                part = replies[a][key]
                out[torch.tensor(targets, dtype=torch.int64), :, : part.shape[-1]] = part.to(dtype)
            return out

        confidences = gather("confidences")
        logits = gather("confidence_logits")
        return Proposal(
            req_ids=[item.req_id for item in items],
            tokens=gather("tokens"),  # type: ignore[arg-type]
            confidences=None if confidences is None else confidences.numpy(),
            confidence_logits=None if logits is None else logits.numpy(),
            topk_ids=gather_distribution("topk_ids", torch.int64),
            topk_probs=gather_distribution("topk_probs", torch.float32),
        )

    def _placeholder_reply(self, n: int, like: dict[str, Any] | None) -> dict[str, Any]:
        """Proposals for detached requests: draft token 0 sampled from a one-hot distribution (so verifying it
        would still be exact) with confidence 0, which makes the confidence scheduler verify none of them."""
        gamma = self.block_size
        width = 1 if like is None else int(like["topk_ids"].shape[-1])
        probs = torch.zeros(n, gamma, width, dtype=torch.float32)
        probs[..., 0] = 1.0
        confidence = self.has_confidence_head if like is None else like["confidences"] is not None
        return {
            "tokens": torch.zeros(n, gamma, dtype=torch.int64),
            "confidences": torch.zeros(n, gamma, dtype=torch.float64) if confidence else None,
            "confidence_logits": torch.full((n, gamma), -30.0, dtype=torch.float64) if confidence else None,
            "topk_ids": torch.zeros(n, gamma, width, dtype=torch.int32),
            "topk_probs": probs,
        }

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = self._lanes, []
        for lane in lanes:
            self._close_lane(lane)
        for client in self._clients.values():
            client.close()
