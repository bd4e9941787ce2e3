"""Failover: requests survive the death of a verifier or drafter replica with nothing lost.

A replica that dies mid-stream makes the round of every verifier group that touches it fail with a gRPC error
(UNAVAILABLE when the process is gone, DEADLINE_EXCEEDED when it hangs, INTERNAL when a verifier could not push
features to a dead drafter). A failed round commits nothing, so each request's state in the scheduler (prompt,
tokens the client has seen, detokenizer and stop-string state) is exactly what the client has. The group's loop
thread then calls :meth:`Failover.on_round_error`, which:

1. takes every request of the group out of its engine, with its client's stream (:meth:`LocalBackend.detach`);
2. probes the group's verifier and every drafter with a short health call and drops the dead ones (a dead
   verifier's group is retired; a dead drafter leaves the shared :class:`DrafterPool`);
3. releases what the requests still hold on live replicas, and moves them: to the same group when its verifier
   is alive (a drafter died), else to the least loaded live group. The next round re-prefills each request from
   prompt + output[:-1] with its last emitted token as the anchor (no sampling: nothing is emitted twice), and
   the verifier pushes the full context to the request's (new) drafter. Greedy output is unchanged; sampled
   output too, since randomness is a pure function of (seed, position).

With no drafter left, requests run detached (:class:`DrafterPool` degraded mode: plain decoding through the
verifier) and are re-prefilled onto a drafter when one registers (:meth:`Failover.drafter_joined`). With no
verifier left, they wait (``orphan_wait_s``) for one to register (Serve restarts dead replicas; the heartbeat
re-registers them), then fail with a retryable :class:`BackendUnavailableError` (HTTP 503). A request moved more
than ``max_rehomes`` times fails instead of bouncing forever (a persistent bug, not a dead replica).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc

from cluster import contract
from cluster.backend import BackendUnavailableError, EngineFailedError, FailoverHook, Handoff, LocalBackend
from cluster.rpc import SERVING, SyncRpcClient
from scheduler.remote import ReplicaLostError

if TYPE_CHECKING:
    from scheduler.engine import SpeculativeEngine
    from scheduler.hub import SchedulerHub

logger = logging.getLogger(__name__)


def is_replica_failure(error: BaseException) -> bool:
    """Errors that may mean a replica died or hangs: every gRPC error (even INVALID_ARGUMENT can follow a
    half-applied round, e.g. a drafter missing context a dead verifier never pushed) and a replica that left the
    pool. Engine bugs in this process (anything else) are not failed over."""
    return isinstance(error, grpc.RpcError | ReplicaLostError)


def probe(address: str, token: str | None, timeout_s: float, max_busy_s: float = 10.0) -> bool:
    """Whether the replica at ``address`` answers its health check with SERVING within ``timeout_s`` and its
    engine thread has not been inside one call for more than ``max_busy_s`` (a round takes milliseconds; a
    replica whose call just hit the round deadline is hung even before its own wedge timeout reports it)."""
    try:
        with SyncRpcClient(address, token=token, timeout_s=timeout_s) as client:
            status = client.health()
    except Exception:
        return False
    return status.get("status") == SERVING and status.get("payload", {}).get("busy_s", 0.0) <= max_busy_s


def release_stale(
    address: str, info: contract.Method, release: contract.Method, token: str | None, timeout_s: float
) -> list[str]:
    """Release every request a replica holds (its ``info`` lists them as ``running``; ``release`` frees them),
    before a scheduler that does not own them starts using it.

    A scheduler that restarted lost its requests; the replicas still hold their caches. Run before the replica
    takes new work, so nothing of this scheduler is released. Returns the released ids.
    """
    with SyncRpcClient(address, token=token, timeout_s=timeout_s) as client:
        stale = list(info.call(client, {})["running"])
        if stale:
            release.call(client, {"req_ids": stale})
    if stale:
        logger.warning("released %d request(s) %s held on %s from before this scheduler", len(stale),
                       info.service, address)
    return stale


def check_round_loops(hub: SchedulerHub) -> None:
    """Raise when a verifier group's round loop is dead or stuck in one round (the scheduler's health check).
    A loop blocked in a call to a hung replica is not stuck: the call's deadline ends it and failover runs."""
    with hub._lock:
        groups = list(hub._groups.items())
    for replica_id, group in groups:
        try:
            group.backend.check_alive()
        except BackendUnavailableError as error:
            raise BackendUnavailableError(f"round loop of verifier {replica_id}: {error}") from None


class Failover:
    """The failover policy of one :class:`~scheduler.hub.SchedulerHub` (it reads and updates the hub's routing
    tables under the hub's lock; the hub calls the ``*_joined`` methods when replicas register)."""

    def __init__(
        self,
        hub: SchedulerHub,
        *,
        probe_timeout_s: float = 2.0,
        max_rehomes: int = 3,
        orphan_wait_s: float = 60.0,
    ) -> None:
        self._hub = hub
        self.probe_timeout_s = probe_timeout_s
        self.max_rehomes = max_rehomes
        self.orphan_wait_s = orphan_wait_s
        self._lock = threading.Lock()
        self._orphans: dict[int, Handoff] = {}  # waiting for a verifier group; keyed by id(handoff)

    def hook(self, replica_id: str) -> FailoverHook:
        """The :class:`LocalBackend` failover hook of verifier group ``replica_id``."""
        return lambda backend, error: self.on_round_error(replica_id, backend, error)

    @property
    def num_orphans(self) -> int:
        return len(self._orphans)

    # ------------------------------------------------------------------------------------------ a failed round
    def on_round_error(self, replica_id: str, backend: LocalBackend, error: Exception) -> bool:
        """Runs on the failed group's loop thread. Returns False for errors that are not replica failures."""
        if not is_replica_failure(error):
            return False
        handoffs = backend.detach()
        logger.warning("round of verifier group %s failed (%s); moving %d request(s)", replica_id,
                       _describe(error), len(handoffs))
        try:
            hub = self._hub
            group = hub._groups.get(replica_id)
            verifier_alive = group is not None and self._probe(group.address)
            self.prune_drafters()
            ids = [h.request.req_id for h in handoffs]
            if group is not None and verifier_alive:
                _best_effort(lambda: group.verifier.release_all(ids), "release on the verifier")
            pool = hub._pool
            if pool is not None:
                for req_id in ids:
                    _best_effort(functools.partial(pool.release, req_id), "release on the drafter")
            if not verifier_alive:
                self._retire(replica_id)
            movable = []
            for handoff in handoffs:
                if handoff.stream is None or handoff.stream.abandoned:
                    continue
                handoff.request.rehomed += 1
                if handoff.request.rehomed > self.max_rehomes:
                    handoff.stream.put(EngineFailedError(
                        f"request moved {self.max_rehomes} times after replica failures; last: {_describe(error)}"
                    ))
                    continue
                movable.append(handoff)
            self.place(movable, prefer=replica_id if verifier_alive else None)
            handoffs = []
        finally:
            for handoff in handoffs:  # only when failover itself failed: nothing may be left hanging
                if handoff.stream is not None:
                    handoff.stream.put(EngineFailedError(f"failover after a replica failure failed: {error}"))
        return True

    def _probe(self, address: str) -> bool:
        return probe(address, self._hub.token, self.probe_timeout_s)

    def prune_drafters(self) -> list[str]:
        """Drop every drafter that does not answer its health check; returns their addresses."""
        hub = self._hub
        pool = hub._pool
        if pool is None:
            return []
        dead = [a for a in pool.addresses if not self._probe(a)]
        for address in dead:
            lost = pool.remove_drafter(address)
            with hub._lock:
                for replica_id in [r for r, a in hub._drafters.items() if a == address]:
                    del hub._drafters[replica_id]
                    hub._draining_drafters.discard(replica_id)
            hub._readiness_changed()
            logger.warning("drafter %s is gone; %d request(s) lose their drafter", address, len(lost))
        return dead

    def _retire(self, replica_id: str) -> None:
        hub = self._hub
        with hub._lock:
            group = hub._groups.pop(replica_id, None)
            hub._sps.pop(replica_id, None)
        hub._readiness_changed()
        if group is None:
            return
        logger.warning("verifier %s at %s is gone; its group is retired", replica_id, group.address)

        def close() -> None:  # not on the group's own loop thread, which is the caller
            from scheduler.metrics import merge_snapshots

            try:  # keep its counters in the totals (a Prometheus counter must not go down)
                final = group.backend.call(lambda engine: engine.snapshot()).result(hub.timeout_s)
                retired = replace(final, running=0, waiting=0, recent_round_s=0.0)
                with hub._lock:
                    hub._retired = merge_snapshots([s for s in (hub._retired, retired) if s is not None])
            except Exception as exc:
                logger.info("verifier %s: final metrics unavailable (%s)", replica_id, exc)
            group.backend.close()
            group.verifier.close()

        threading.Thread(target=close, name="dspark-retire", daemon=True).start()

    # --------------------------------------------------------------------------------------------- placement
    def place(self, handoffs: Sequence[Handoff], prefer: str | None = None) -> None:
        """Hand requests to ``prefer`` when it is live, else spread them over the least loaded live groups;
        park them while there is none."""
        if not handoffs:
            return
        hub = self._hub
        targets: dict[str, list[Handoff]] = {}
        with hub._lock:
            accepting = [r for r, g in hub._groups.items() if not g.draining]
            if not accepting and prefer not in hub._groups:
                self._park(handoffs)
                return
            for handoff in handoffs:
                req_id = handoff.request.req_id
                if prefer in accepting or (prefer in hub._groups and not accepting):
                    target = prefer  # the group is alive (a drafter died): it keeps its requests
                else:
                    target = min(accepting, key=lambda r: len(hub._groups[r].active))
                old = hub._owner.get(req_id)
                if old in hub._groups:
                    hub._groups[old].active.discard(req_id)
                hub._groups[target].active.add(req_id)
                hub._owner[req_id] = target
                targets.setdefault(target, []).append(handoff)
            backends = {r: hub._groups[r].backend for r in targets}
        for replica_id, group_handoffs in targets.items():
            try:
                backends[replica_id].adopt(group_handoffs)
            except BackendUnavailableError:  # retired meanwhile
                self._park(group_handoffs)

    def _park(self, handoffs: Sequence[Handoff]) -> None:
        logger.warning("no verifier replica is live; %d request(s) wait up to %.1f s for one", len(handoffs),
                       self.orphan_wait_s)
        batch = list(handoffs)
        with self._lock:
            for handoff in batch:
                self._orphans[id(handoff)] = handoff
        timer = threading.Timer(self.orphan_wait_s, self._expire, args=(batch,))
        timer.daemon = True
        timer.start()

    def _expire(self, batch: list[Handoff]) -> None:
        with self._lock:
            expired = [self._orphans.pop(id(h)) for h in batch if id(h) in self._orphans]
        for handoff in expired:
            if handoff.stream is not None:
                handoff.stream.put(BackendUnavailableError(
                    f"no verifier replica came back within {self.orphan_wait_s:g} s; retry the request"
                ))

    # --------------------------------------------------------------------------------------- replicas joining
    def verifier_joined(self) -> None:
        """A verifier group started: requests waiting for one move there."""
        with self._lock:
            orphans = list(self._orphans.values())
            self._orphans.clear()
        if orphans:
            logger.info("moving %d waiting request(s) to the new verifier", len(orphans))
            self.place(orphans)

    def drafter_joined(self) -> None:
        """A drafter registered: requests running without one (degraded mode) are re-prefilled onto it."""
        hub = self._hub
        pool = hub._pool
        if pool is None:
            return
        with hub._lock:
            groups = list(hub._groups.items())
        for replica_id, group in groups:
            try:
                group.backend.call(functools.partial(self._reattach, replica_id))
            except BackendUnavailableError:
                continue

    def _reattach(self, replica_id: str, _engine: SpeculativeEngine) -> None:
        """On the group's loop thread (``backend.call`` passes its engine, not needed here): move the group's
        detached requests through a re-prefill onto a drafter."""
        hub = self._hub
        group = hub._groups.get(replica_id)
        pool = hub._pool
        if group is None or pool is None:
            return
        ids = [r for r, owner in list(hub._owner.items()) if owner == replica_id and pool.is_detached(r)]
        handoffs = group.backend.detach(ids)
        if not handoffs:
            return
        moved = [h.request.req_id for h in handoffs]
        _best_effort(lambda: group.verifier.release_all(moved), "release on the verifier")
        for req_id in moved:
            pool.release(req_id)
        group.backend.adopt(handoffs)
        logger.info("re-prefilling %d request(s) of verifier %s onto a drafter", len(moved), replica_id)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def _best_effort(fn: Callable[[], object], what: str) -> None:
    try:
        fn()
    except Exception as error:
        logger.info("%s failed during failover: %s", what, _describe(error))
