"""The scheduler's view of the ``colocated`` placement: engine replicas that each run the whole round pipeline.

A colocated replica holds the target and the drafter on one device and runs the in-process round pipeline
(:func:`cluster.loading.build_round_engine`: Algorithm 1 and the other policies priced with the replica's own SPS
table, rounds chained on the device). The scheduler does what only a central process can: load-aware admission
(least loaded accepting replica, requests sticky to it), readiness, drain, and the deployment-wide metrics. A
request is routed once; its tokens then stream from the replica to the ingress directly (``Route`` /
``Release``), or through the scheduler for a caller that only speaks ``dspark.Scheduler/Generate``.

Liveness comes from the replicas' heartbeats: a replica not heard from for :data:`STALE_S` (or reported lost by
an ingress whose stream to it broke) takes no new requests until its next heartbeat; Serve restarts dead
replicas under new ids, which register afresh.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from cluster import contract
from cluster.remote_backend import RemoteBackend
from scheduler.admission import least_loaded
from scheduler.metrics import MetricsSnapshot, merge_snapshots

#: A replica whose last heartbeat is older than this takes no new requests (heartbeats come every 2 s).
STALE_S = 10.0


@dataclass
class EngineReplica:
    address: str
    backend: RemoteBackend  # streams, aborts, metrics and health of the replica's dspark.Engine service
    last_seen: float  # monotonic time of its last registration; 0 after an ingress reported it lost
    active: set[str] = field(default_factory=set)  # routed request ids not released yet
    draining: bool = False


class EngineReplicas:
    """Registry and router of colocated engine replicas (thread-safe)."""

    def __init__(self, *, model_name: str, token: str | None, max_context: int) -> None:
        self._model_name = model_name
        self._token = token
        self._max_context = max_context
        self._lock = threading.Lock()
        self._replicas: dict[str, EngineReplica] = {}
        self._sps: dict[str, dict[str, Any]] = {}
        self._owner: dict[str, str] = {}  # req id -> replica id
        self._gone: set[str] = set()
        # Counters last read from each replica, and those of replicas that left: a Prometheus counter must not
        # go down when a replica goes or misses a scrape.
        self._last: dict[str, MetricsSnapshot] = {}
        self._retired: list[MetricsSnapshot] = []

    def register(self, replica_id: str, address: str, sps: dict[str, Any] | None) -> bool:
        """Idempotent (the heartbeat); returns True when the replica is new (or moved to a new address)."""
        with self._lock:
            if replica_id in self._gone:
                return False
            known = self._replicas.get(replica_id)
            if known is not None and known.address == address:
                known.last_seen = time.monotonic()
                return False
            backend = RemoteBackend(address, model_name=self._model_name, max_context=self._max_context,
                                    token=self._token, service=contract.ENGINE)
            self._replicas[replica_id] = EngineReplica(address, backend, time.monotonic())
            self._sps[replica_id] = sps or {}
            return True

    def drain(self, replica_id: str) -> int:
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is None:
                return 0
            replica.draining = True
            return len(replica.active)

    def unregister(self, replica_id: str) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)
            self._sps.pop(replica_id, None)
            self._gone.add(replica_id)
            last = self._last.pop(replica_id, None)
            if last is not None:
                gone = replace(last, running=0, waiting=0, recent_round_s=0.0)
                self._retired = [merge_snapshots([*self._retired, gone])]

    def accepting(self) -> list[str]:
        """Replica ids that take new requests: not draining and heard from within :data:`STALE_S`."""
        now = time.monotonic()
        with self._lock:
            return [r for r, e in self._replicas.items() if not e.draining and now - e.last_seen <= STALE_S]

    def admit(self, req_id: str) -> tuple[str, EngineReplica] | None:
        """Route a new request to the least loaded accepting replica (None when there is none)."""
        accepting = set(self.accepting())
        with self._lock:
            loads = {r: len(e.active) for r, e in self._replicas.items() if r in accepting}
            if not loads:
                return None
            replica_id = least_loaded(loads)
            replica = self._replicas[replica_id]
            replica.active.add(req_id)
            self._owner[req_id] = replica_id
            return replica_id, replica

    def owner(self, req_id: str) -> EngineReplica | None:
        with self._lock:
            return self._replicas.get(self._owner.get(req_id, ""))

    def owns(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._owner

    def release(self, req_id: str, *, lost: bool = False) -> None:
        """The request ended; ``lost``: its stream broke because the replica could not be reached, so the
        replica takes no new requests until it is heard from again."""
        with self._lock:
            replica = self._replicas.get(self._owner.pop(req_id, ""))
            if replica is None:
                return
            replica.active.discard(req_id)
            if lost:
                replica.last_seen = 0.0

    def __len__(self) -> int:
        with self._lock:
            return len(self._replicas)

    def addresses(self) -> dict[str, str]:
        with self._lock:
            return {r: e.address for r, e in self._replicas.items()}

    def loads(self) -> dict[str, int]:
        with self._lock:
            return {r: len(e.active) for r, e in self._replicas.items()}

    def sps(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._sps)

    def backends(self) -> dict[str, RemoteBackend]:
        with self._lock:
            return {r: e.backend for r, e in self._replicas.items()}

    async def snapshots(self) -> list[MetricsSnapshot]:
        """Each registered replica's metrics, plus those of replicas that left; a replica that cannot answer
        now counts with what it reported last."""
        for replica_id, backend in self.backends().items():
            try:
                snapshot = await backend.metrics()
            except Exception:
                continue
            with self._lock:
                if replica_id in self._replicas:
                    self._last[replica_id] = snapshot
        with self._lock:
            return [*self._last.values(), *self._retired]
