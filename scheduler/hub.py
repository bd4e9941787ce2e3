"""The scheduler hub: request lifecycle across replicas, one round loop per verifier replica.

Drafter and verifier replicas register here with their gRPC addresses. Each verifier replica gets its own round
driver (a :class:`SpeculativeEngine` over a :class:`RemoteVerifier`, with the shared :class:`DrafterPool`) running
on its own loop thread, so one central process works per verifier step over all of that replica's requests: one
``Step`` message in, one out, plus one ``Propose`` per drafter replica. New requests go to the verifier group with
the fewest requests and stay there (sticky KV cache). The hub knows nothing of Ray; the Serve deployment in
:mod:`cluster.app` and the standalone ``dspark scheduler`` process are thin shells around it.

Replicas leave gracefully in two steps (autoscaling down, rolling updates): ``drain_*`` stops giving the replica
new requests and reports how many of its requests are still running; once that reaches zero (or the replica's
shutdown budget runs out), ``unregister_*`` forgets it. A draining replica keeps serving the requests it holds
until they finish. Replicas that DIE are another matter: :mod:`scheduler.failover` moves their requests to live
replicas (re-prefilled from prompt + emitted tokens, nothing lost); a restarted hub releases what replicas still
hold for its predecessor before using them.

Readiness: the hub is *ready* when a completion can be served end to end, i.e. a verifier replica accepts new
requests and, for a policy that drafts, so does a drafter replica (replicas register only once their engines
are built and warmed up). ``health`` reports exactly that. A new request that finds no accepting verifier waits
for one up to ``readiness_timeout_s`` and is then refused with :class:`BackendNotReadyError` (logged once per
interval, not per request). A request admitted while no drafter is there runs without drafts (degraded mode,
still lossless) until one registers.
"""

from __future__ import annotations

import logging
import secrets
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cluster import contract
from cluster.backend import BackendNotReadyError, BackendUnavailableError, GenerateDelta, LocalBackend, Resume
from cluster.backend_rpc import backend_methods
from cluster.readiness import IntervalLog, Readiness, ReadinessGate
from cluster.rpc import Service
from kernels.sampling import SamplingParams
from scheduler.admission import least_loaded
from scheduler.chain_plan import CHAIN_TOLERANCE
from scheduler.colocated import EngineReplica, EngineReplicas
from scheduler.engine import RequestRejectedError, SpeculativeEngine
from scheduler.failover import Failover, release_stale
from scheduler.metrics import MetricsSnapshot, merge_snapshots, snapshot_to_dict
from scheduler.pipeline import PipelinedEngine
from scheduler.policy import make_policy
from scheduler.remote import DrafterPool, RemoteVerifier
from scheduler.service_levels import ServiceLevels
from scheduler.sps import SPSMonotonicityWarning, load_sps

logger = logging.getLogger(__name__)



@dataclass
class _Group:
    address: str
    backend: LocalBackend
    verifier: RemoteVerifier
    active: set[str] = field(default_factory=set)
    draining: bool = False  # takes no new requests; still serves the ones it holds


class SchedulerHub:
    """Routes requests to per-verifier round loops; a :class:`GenerateBackend` for the HTTP layer."""

    def __init__(
        self,
        *,
        model_name: str,
        policy: str,
        draft_cost: str = "none",
        chain_tolerance: float = CHAIN_TOLERANCE,
        request_groups: int = 1,
        decode: Callable[[Sequence[int]], str] | None,
        eos_token_ids: Sequence[int] = (),
        token: str | None = None,
        timeout_s: float = 60.0,
        max_context: int | None = None,
        readiness_timeout_s: float = 0.0,
        service_levels: ServiceLevels | None = None,
        relay_drafts: bool = False,
        decode_steps: int = 1,
    ) -> None:
        self.model_name = model_name
        # Verifier groups have the drafters return their next blocks to the replica, which verifies them in the
        # rounds with planned lengths (relayed rounds, no Propose); not with request groups, whose drafter thread
        # drafts one group while another verifies.
        self.relay_drafts = relay_drafts and request_groups == 1
        self.decode_steps = decode_steps  # plain decoding (no drafter): tokens per Step
        self.service_levels = service_levels
        self.policy = policy
        self.draft_cost = draft_cost
        self.chain_tolerance = chain_tolerance
        self.request_groups = request_groups
        self.decode = decode
        self.eos_token_ids = tuple(eos_token_ids)
        self.token = token
        self.timeout_s = timeout_s
        self._max_context = max_context
        self.readiness_timeout_s = readiness_timeout_s
        # Whether a verifier group accepts new requests (what a new request waits for); see readiness().
        self._admission = ReadinessGate(Readiness(False, "no verifier replica is registered yet"))
        self._refusals = IntervalLog(logger)
        self._refused_registrations = IntervalLog(logger, what="registration(s) refused")
        self._lock = threading.Lock()
        self._drafters: dict[str, str] = {}  # replica id -> address
        self._draining_drafters: set[str] = set()  # replica ids
        self._sps: dict[str, dict[str, Any]] = {}  # verifier replica id -> the SPS table it registered with
        self._pool: DrafterPool | None = None
        self._groups: dict[str, _Group] = {}  # verifier replica id -> group
        self._owner: dict[str, str] = {}  # req id -> verifier replica id
        self._retired: MetricsSnapshot | None = None  # counters of unregistered verifier groups
        self._gone: set[str] = set()  # unregistered replica ids (Serve never reuses one): a late heartbeat is ignored
        # Names this hub's counters in its Metrics replies: a client that sees another one knows they restarted
        # from zero (a restarted scheduler) and keeps them monotonic (cluster.remote_backend).
        self.incarnation = secrets.token_hex(8)
        self.failover = Failover(self)
        self.engines = EngineReplicas(model_name=model_name, token=token, max_context=max_context or 0)

    # ---------------------------------------------------------------------------------------- registration
    def register_drafter(self, replica_id: str, address: str) -> None:
        """Idempotent; a new drafter joins the pool shared by every verifier group at once."""
        with self._lock:
            if self._drafters.get(replica_id) == address or replica_id in self._gone:
                return
            release_stale(address, contract.DRAFTER_INFO, contract.DRAFTER_RELEASE, self.token, self.timeout_s)
            self._drafters[replica_id] = address
            if self._pool is None:
                self._pool = DrafterPool([address], token=self.token, timeout_s=self.timeout_s)
            else:
                self._pool.add_drafter(address)
            logger.info("drafter %s registered at %s", replica_id, address)
        self._readiness_changed()
        self.failover.drafter_joined()

    def register_verifier(self, replica_id: str, address: str, sps: dict[str, Any] | None) -> None:
        """Idempotent; starts the round loop of a new verifier replica. ``sps``: its table (None or empty when
        the policy prices nothing with SPS)."""
        with self._lock:
            group = self._groups.get(replica_id)
            if (group is not None and group.address == address) or replica_id in self._gone:
                return
            if self.policy != "autoregressive" and self._pool is None:
                raise BackendUnavailableError("no drafter registered yet; register drafters first")
            pool = self._pool if self.policy != "autoregressive" else None
            release_stale(address, contract.VERIFIER_INFO, contract.VERIFIER_RELEASE, self.token, self.timeout_s)
            route_of = pool.route_of if pool is not None else (lambda _req_id: None)
            verifier = RemoteVerifier(
                address,
                route_of,
                token=self.token,
                timeout_s=self.timeout_s,
                inline_features=pool is not None,
                relay=pool is not None and self.relay_drafts,
            )
            if pool is not None:
                try:
                    pool.require_projection(verifier.context_projection, address)
                except ValueError:
                    verifier.close()
                    raise
            block_size = pool.block_size if pool is not None else 0
            # An empty table: the verifier's policy prices nothing with SPS, so it profiled none.
            with warnings.catch_warnings():  # the verifier warned when it measured or loaded it, once per start
                warnings.simplefilter("ignore", SPSMonotonicityWarning)
                table = load_sps(sps) if sps else None
            policy = make_policy(self.policy, table, block_size, self.draft_cost, self.chain_tolerance)
            options: dict[str, Any] = {
                "decode": self.decode,
                "eos_token_ids": self.eos_token_ids or verifier.eos_token_ids,
                "service_levels": self.service_levels,
            }
            engine = (
                PipelinedEngine(verifier, pool, policy, groups=self.request_groups, **options)
                if self.request_groups > 1 and pool is not None
                else SpeculativeEngine(verifier, pool, policy, decode_steps=self.decode_steps, **options)
            )
            backend = LocalBackend(
                engine, self.model_name, max_context=self._max_context, failover=self.failover.hook(replica_id)
            )
            self._groups[replica_id] = _Group(address, backend, verifier)
            self._sps[replica_id] = sps or {}
            logger.info("verifier %s registered at %s", replica_id, address)
        self._readiness_changed()
        self.failover.verifier_joined()

    def heartbeat(self, kind: str, replica_id: str, address: str, sps: dict[str, Any] | None = None) -> bool:
        """A pool replica's periodic registration (``kind``: ``drafter``, ``verifier`` or ``engine``): whether it
        is registered now. A refusal answers False, for the replica to try again at its next heartbeat: no
        drafter yet for a verifier (debug), or a replica this hub cannot use (unreachable, a wire-contract or
        projection mismatch, a refused token), logged as one line per interval with the count and the last
        reason, not as a traceback per heartbeat. Direct callers of ``register_*`` (the standalone scheduler)
        get the exception instead."""
        if kind not in ("drafter", "verifier", "engine"):
            raise ValueError(f"unknown replica kind {kind!r}")
        try:
            if kind == "drafter":
                self.register_drafter(replica_id, address)
            elif kind == "verifier":
                self.register_verifier(replica_id, address, sps)
            else:
                self.register_engine(replica_id, address, sps)
        except BackendUnavailableError as error:
            logger.debug("%s %s not registered yet: %s", kind, replica_id, error)
            return False
        except Exception as error:  # reported once per interval: the replica's heartbeat retries every few seconds
            self._refused_registrations.record(
                f"{kind} {replica_id} at {address}: {type(error).__name__}: {error}"
            )
            return False
        return True

    def drain_verifier(self, replica_id: str) -> int:
        """Stop routing new requests to this verifier; returns how many of its requests are still running.

        Idempotent (a replica polls it while it waits); an unknown replica has nothing running. A later heartbeat
        of the same replica does not undo it.
        """
        with self._lock:
            group = self._groups.get(replica_id)
            if group is None:
                return 0
            if not group.draining:
                group.draining = True
                logger.info("verifier %s draining (%d requests running)", replica_id, len(group.active))
            held = len(group.active)
        self._readiness_changed()
        return held

    def unregister_verifier(self, replica_id: str) -> None:
        """Forget a verifier and stop its round loop; requests it still holds fail (drain first to avoid that)."""
        with self._lock:
            group = self._groups.pop(replica_id, None)
            self._sps.pop(replica_id, None)
            self._gone.add(replica_id)
        self._readiness_changed()
        if group is None:
            return
        if group.active:
            logger.warning("verifier %s removed with %d requests running", replica_id, len(group.active))
        try:  # keep its counters in the totals (a Prometheus counter must not go down)
            final = group.backend.call(lambda engine: engine.snapshot()).result(self.timeout_s)
            retired = replace(final, running=0, waiting=0, recent_round_s=0.0)
            with self._lock:
                self._retired = merge_snapshots([s for s in (self._retired, retired) if s is not None])
        except Exception as exc:  # a wedged group loses its counters, nothing else
            logger.warning("verifier %s: final metrics unavailable (%s)", replica_id, exc)
        group.backend.close()
        group.verifier.close()
        logger.info("verifier %s unregistered", replica_id)

    def drain_drafter(self, replica_id: str) -> int:
        """Stop giving new requests to this drafter; returns how many requests it still drafts for."""
        with self._lock:
            address = self._drafters.get(replica_id)
            if address is None or self._pool is None:
                return 0
            self._draining_drafters.add(replica_id)
            held = self._pool.drain_drafter(address)
        self._readiness_changed()
        return held

    def unregister_drafter(self, replica_id: str) -> None:
        """Forget a drafter; requests it still drafts for are re-prefilled onto another drafter (failover)."""
        with self._lock:
            address = self._drafters.pop(replica_id, None)
            self._draining_drafters.discard(replica_id)
            self._gone.add(replica_id)
            if address is None or self._pool is None:
                return
            self._pool.remove_drafter(address)
        self._readiness_changed()
        logger.info("drafter %s unregistered", replica_id)

    def register_engine(self, replica_id: str, address: str, sps: dict[str, Any] | None) -> None:
        """Idempotent (the heartbeat); a colocated engine replica (both engines and the round pipeline in one
        process, see :mod:`scheduler.colocated`) takes requests from now on."""
        if self.engines.register(replica_id, address, sps):
            logger.info("engine %s registered at %s", replica_id, address)
        self._readiness_changed()

    def drain_engine(self, replica_id: str) -> int:
        """Stop routing new requests to this engine replica; returns how many of its requests still run."""
        held = self.engines.drain(replica_id)
        self._readiness_changed()
        return held

    def unregister_engine(self, replica_id: str) -> None:
        self.engines.unregister(replica_id)
        self._readiness_changed()
        logger.info("engine %s unregistered", replica_id)

    def verifier_loads(self) -> dict[str, int]:
        """Requests each registered verifier group holds (running or waiting for a slot), by replica id."""
        with self._lock:
            return {replica_id: len(group.active) for replica_id, group in self._groups.items()}

    def addresses(self) -> dict[str, dict[str, str]]:
        """gRPC addresses of the registered replicas: ``{"drafters": {id: address}, "verifiers": {id: address}}``."""
        with self._lock:
            verifiers = {replica_id: group.address for replica_id, group in self._groups.items()}
            return {"drafters": dict(self._drafters), "verifiers": verifiers, "engines": self.engines.addresses()}

    def readiness(self) -> Readiness:
        """Whether a completion can be served end to end now, and what is missing when not."""
        if self.engines.accepting():
            return Readiness(True)
        with self._lock:
            accepting = [g for g in self._groups.values() if not g.draining]
            groups = len(self._groups)
            drafters = len(self._drafters)
            accepting_drafters = drafters - len(self._draining_drafters)
        if not accepting and len(self.engines):
            return Readiness(False, "every engine replica is draining or unreachable")
        if not accepting:
            return Readiness(False, "every verifier replica is draining" if groups else
                             "no verifier replica is registered yet")
        if self.policy != "autoregressive" and accepting_drafters <= 0:
            return Readiness(False, "every drafter replica is draining" if drafters else
                             "no drafter replica is registered")
        return Readiness(True)

    def _readiness_changed(self) -> None:
        """Re-evaluate admission (an accepting verifier group) and wake the requests waiting for it."""
        with self._lock:
            can_admit = any(not g.draining for g in self._groups.values())
        can_admit = can_admit or bool(self.engines.accepting())
        self._admission.set(Readiness(True) if can_admit else self.readiness())

    @property
    def num_waiting_for_readiness(self) -> int:
        """New requests waiting for an accepting verifier right now (see ``readiness_timeout_s``)."""
        return self._admission.waiters

    @property
    def num_verifiers(self) -> int:
        return len(self._groups)

    @property
    def num_drafters(self) -> int:
        return len(self._drafters)

    # ------------------------------------------------------------------------------------ GenerateBackend
    @property
    def max_context(self) -> int:
        groups = list(self._groups.values())
        if not groups:
            return self._max_context or 0
        return min(g.backend.max_context for g in groups)

    async def _admit(self, req_id: str) -> _Group | EngineReplica:
        """Assign a new request to the accepting engine replica (colocated) or verifier group with the fewest
        requests, waiting for one up to ``readiness_timeout_s``.

        Under the lock, so a concurrent drain either sees the request (and waits for it) or excludes the group.
        """
        if req_id in self._owner or self.engines.owns(req_id):
            # A replayed Generate must not take over the running request's routing.
            raise RequestRejectedError(f"request id {req_id!r} is already in use")
        waited = await self._admission.wait(self.readiness_timeout_s)
        routed = self.engines.admit(req_id)
        if routed is not None:
            return routed[1]
        with self._lock:
            accepting = {r: g for r, g in self._groups.items() if not g.draining}
            if not accepting:
                reason = waited.reason or "no verifier replica is accepting requests"
                self._refusals.record(reason)
                raise BackendNotReadyError(
                    f"the model is not ready to serve: {reason} (waited {self.readiness_timeout_s:g} s); "
                    "retry later"
                )
            replica_id = least_loaded({r: len(g.active) for r, g in accepting.items()})
            group = accepting[replica_id]
            group.active.add(req_id)
            self._owner[req_id] = replica_id
            return group

    async def route(self, req_id: str) -> str | None:
        """Admit a new request to a colocated engine replica and return its address, for a caller that
        streams from the replica itself and calls ``Release`` when done; None when this deployment has no
        engine replica (the caller then streams through :meth:`generate`)."""
        if not len(self.engines):
            return None
        target = await self._admit(req_id)
        if isinstance(target, EngineReplica):
            return target.address
        self._forget(req_id, target)
        return None

    def _forget(self, req_id: str, group: _Group) -> None:
        with self._lock:
            group.active.discard(req_id)
            current = self._groups.get(self._owner.pop(req_id, ""))  # failover may have moved it
            if current is not None:
                current.active.discard(req_id)

    async def generate(
        self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams, resume: Resume | None = None
    ) -> AsyncIterator[GenerateDelta]:
        group = await self._admit(req_id)
        if isinstance(group, EngineReplica):  # relayed from the replica (callers that do not route themselves)
            try:
                async for delta in group.backend.generate(req_id, prompt_ids, params, resume):
                    yield delta
            finally:
                self.engines.release(req_id)
            return
        try:
            async for delta in group.backend.generate(req_id, prompt_ids, params, resume):
                yield delta
        finally:
            self._forget(req_id, group)

    async def abort(self, req_id: str) -> None:
        engine = self.engines.owner(req_id)
        if engine is not None:
            await engine.backend.abort(req_id)
            return
        replica_id = self._owner.get(req_id)
        if replica_id is not None and replica_id in self._groups:
            await self._groups[replica_id].backend.abort(req_id)

    async def metrics(self) -> MetricsSnapshot:
        snapshots = [await g.backend.metrics() for g in list(self._groups.values())]
        if self._retired is not None:
            snapshots.append(self._retired)
        return merge_snapshots([*snapshots, *await self.engines.snapshots()])

    async def health(self) -> None:
        state = self.readiness()
        if not state.ready:
            raise BackendNotReadyError(f"not ready: {state.reason}")
        for group in list(self._groups.values()):
            await group.backend.health()

    async def model_info(self) -> dict[str, Any]:
        """The SPS table each verifier replica registered with (and where it came from), by replica id."""
        with self._lock:
            return {"sps": {**self._sps, **self.engines.sps()}}

    def close(self) -> None:
        for group in list(self._groups.values()):
            group.backend.close()
            group.verifier.close()
        if self._pool is not None:
            self._pool.close()

    # ----------------------------------------------------------------------------------------------- gRPC
    def info(self) -> dict[str, Any]:
        """What ``Info`` answers: the model, the topology and readiness."""
        state = self.readiness()
        return {
            "model_name": self.model_name,
            "max_context": self.max_context,
            "verifiers": self.num_verifiers,
            "drafters": self.num_drafters,
            "engines": len(self.engines),
            "ready": state.ready,
            "reason": state.reason,
        }

    def service(self) -> Service:
        """``dspark.Scheduler``: what the HTTP ingress replicas call (the request-level methods of
        :mod:`cluster.backend_rpc`, plus ``Route`` / ``Release`` of the colocated placement)."""

        async def route(request: dict[str, Any]) -> dict[str, Any]:
            return {"address": await self.route(request["req_id"])}

        async def release(request: dict[str, Any]) -> dict[str, Any]:
            self.engines.release(request["req_id"], lost=request["lost"])
            self._readiness_changed()
            return {}

        async def metrics(request: dict[str, Any]) -> dict[str, Any]:
            return {**snapshot_to_dict(await self.metrics()), "incarnation": self.incarnation}

        methods = backend_methods(self, self.info, contract.SCHEDULER)
        methods[contract.SCHEDULER_METHODS.metrics] = metrics  # named by incarnation (see __init__)
        methods[contract.ROUTE] = route
        methods[contract.SCHEDULER_RELEASE] = release
        return contract.service(contract.SCHEDULER, methods)
