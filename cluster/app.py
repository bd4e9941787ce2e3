"""The Ray Serve application: drafter and verifier pools, the scheduler, and the OpenAI-compatible ingress.

Four deployments in the ``disaggregated`` placement (the default), each a thin shell over Ray-free objects:

* ``Drafter`` replicas (placed on the ``draft_pool`` resource) each own a :class:`DraftEngine` behind a gRPC server;
* ``Verifier`` replicas (``verify_pool``) each own a :class:`VerifyEngine` behind a gRPC server, profile their SPS
  table at start and push context features straight to the drafters;
* ``Scheduler`` (one replica, restarted by Serve on failure) holds the :class:`SchedulerHub`: request lifecycle and
  one round loop per verifier replica;
* ``Ingress`` serves HTTP (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/metrics``) and streams
  from the scheduler over gRPC.

In the ``colocated`` placement ``Engine`` replicas (``verify_pool``) take the place of both pools: each builds
the in-process round pipeline (:func:`cluster.loading.build_local_backend`, the same builder as ``dspark serve
--no-ray``) and serves its requests over gRPC (``dspark.Engine``); the scheduler admits and routes requests to
them and the ingress streams from the chosen replica directly.

Replicas announce their gRPC address to the scheduler and keep re-announcing it (a heartbeat), so a restarted
scheduler relearns the topology within seconds and autoscaled replicas join without any restart.

Readiness: a pool replica's constructor builds its engine, warms it up (every step variant it can launch, so no
request pays a compilation), loads or profiles its SPS table, and returns only once its first registration with
the scheduler went through (a verifier registers after a drafter is there). Serve reports a replica, and the
application, RUNNING only after its constructor, so a RUNNING application (what ``serve.run`` waits for and
what KubeRay switches traffic on) can serve a completion end to end. The ingress answers from the start:
``/health`` says 503 until the scheduler is ready, and requests wait for readiness up to
``network.readiness_timeout_s`` (then 503 with ``Retry-After``).

Autoscaling: drafter and verifier replicas report their engine load through ``record_autoscaling_stats`` for the
policy in :mod:`cluster.autoscaling` (their work arrives over gRPC, invisible to Serve's own request counts). When
Serve stops one of them (scaling down, rolling update) it leaves gracefully in ``__del__``: the scheduler stops
giving it new requests, the replica keeps serving the ones it holds until they finish (bounded by
``scheduler.drain_timeout_s``), then unregisters and stops its gRPC server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.autoscaling import engine_load
from cluster.config import AppConfig
from cluster.rpc import HealthStatus, ServerThread, SyncRpcClient
from cluster.spare_workers import SpareWorkers, honour_ray_cpu_threads

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
#: After a failed registration (the scheduler restarting, or a verifier that came before any drafter) the heartbeat
#: tries again this soon: a restarted scheduler is back in service only once its replicas registered again.
HEARTBEAT_RETRY_S = 0.2
#: Serve learns that a replica's process died only from its next health check (a pending check then fails at
#: once), so this period bounds how long a dead replica goes unnoticed and unreplaced, and half of it is what a
#: restart waits on average before the replacement even starts. Each check is one loopback gRPC health call
#: (pool replicas) or a look at the round loops (scheduler): cheap enough twice a second.
HEALTH_CHECK_PERIOD_S = 0.5
DRAIN_POLL_S = 0.5
#: Bound on one call to the scheduler while leaving: when the whole application is being deleted the scheduler
#: may already be gone, and a replica must not wait its full shutdown budget for it.
LEAVE_CALL_TIMEOUT_S = 10.0
#: Serve's graceful-shutdown budget of a pool replica is the drain timeout plus this (model and server teardown).
SHUTDOWN_MARGIN_S = 30.0
#: How long the scheduler holds a verifier's registration that came before any drafter's. After a scheduler restart
#: the replicas' heartbeats, queued in Serve's handles, all arrive as it starts, in any order: held, the verifier
#: is registered as soon as the drafter is, instead of at its heartbeat's retry.
DRAFTER_WAIT_S = 1.0
#: How long a pool replica's constructor waits for its first registration (a verifier waits for a drafter that
#: may still be loading); after it the replica starts anyway and its heartbeat keeps trying.
FIRST_REGISTRATION_S = 600.0


def _grpc_host(config: AppConfig) -> str:
    return config.network.grpc_host or ray.util.get_node_ip_address()


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


class _Heartbeat:
    """Re-registers a replica with the scheduler every few seconds from a daemon thread (idempotent calls)."""

    def __init__(self, register: Any) -> None:
        self._register = register
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            wait_s = HEARTBEAT_RETRY_S
            try:
                if self._register().result(timeout_s=30) is not False:  # False: not yet (see register_verifier)
                    self._registered.set()
                    wait_s = HEARTBEAT_S
            except Exception as exc:  # the scheduler may be restarting; keep trying
                logger.debug("registration with the scheduler failed (%s); retrying", exc)
            self._stop.wait(wait_s)

    def wait_registered(self, kind: str, timeout_s: float = FIRST_REGISTRATION_S) -> None:
        """Block until the first registration went through (the constructor's last step; see the module doc)."""
        if not self._registered.wait(timeout_s):
            logger.warning("%s not registered with the scheduler within %.0f s; starting anyway, the heartbeat "
                           "keeps trying", kind, timeout_s)

    def stop(self, timeout_s: float = 35.0) -> None:
        """Stop and wait for a registration in flight, so none can land after the replica unregistered."""
        self._stop.set()
        self._thread.join(timeout_s)


async def _leave(kind: str, replica_id: str, scheduler: DeploymentHandle, heartbeat: _Heartbeat,
                 timeout_s: float) -> None:
    """Graceful exit of a pool replica (``kind``: ``drafter`` or ``verifier``) while its gRPC server still runs.

    The scheduler stops giving it new requests (``drain_*`` also reports how many it still holds); the replica
    waits until they have finished, at most ``timeout_s``, then unregisters. Requests are not moved elsewhere, so
    a request outliving the budget fails: size ``scheduler.drain_timeout_s`` for the longest completion.
    """
    if await asyncio.to_thread(_application_deleting):
        # The scheduler goes with it: nobody to drain for, and every call to it (a heartbeat's registration in
        # flight too) could only wait for its timeout.
        heartbeat.stop(timeout_s=0)
        return
    await asyncio.to_thread(heartbeat.stop)
    drain = getattr(scheduler, f"drain_{kind}")
    deadline = time.monotonic() + timeout_s
    try:
        while (held := await asyncio.wait_for(drain.remote(replica_id), LEAVE_CALL_TIMEOUT_S)) > 0:
            if time.monotonic() >= deadline:
                logger.warning("%s %s leaves with %d requests still running (drain budget %.0f s)",
                               kind, replica_id, held, timeout_s)
                break
            await asyncio.sleep(DRAIN_POLL_S)
        await asyncio.wait_for(getattr(scheduler, f"unregister_{kind}").remote(replica_id), LEAVE_CALL_TIMEOUT_S)
    except Exception as exc:  # the scheduler is gone too (application deleted): nobody left to drain for
        logger.warning("%s %s could not drain through the scheduler (%r)", kind, replica_id, exc)


def _application_deleting() -> bool:
    """Whether this replica's whole application is being deleted (``serve.delete``, ``dspark serve`` stopping)
    rather than this replica alone being stopped (scaling down, rolling update); unknown counts as not."""
    try:
        status = serve.status().applications.get(serve.get_replica_context().app_name)
    except Exception:
        return False
    return status is not None and status.status == "DELETING"


class _OwnHealth:
    """Serve's health check of a pool replica: its own gRPC health endpoint must answer SERVING (a wedged engine
    does not). One channel for the replica's life (the check runs every ``HEALTH_CHECK_PERIOD_S``). Serve runs it
    first after the constructor, which has already warmed the engine up and registered it."""

    def __init__(self, server: ServerThread, token: str | None) -> None:
        self._client = SyncRpcClient(server.address, token=token, timeout_s=5.0)

    def check(self) -> None:
        status = self._client.health()
        if status.get("status") != "SERVING":
            raise RuntimeError(f"replica reports {status}")

    def close(self) -> None:
        self._client.close()


@serve.deployment(name="Drafter", max_ongoing_requests=8, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                  health_check_timeout_s=30)
class DrafterReplica:
    def __init__(self, args: dict[str, Any], scheduler: DeploymentHandle) -> None:
        from cluster.loading import build_drafter_service

        honour_ray_cpu_threads()
        self.config = AppConfig.from_args(args).resolve_secrets()
        self.service = build_drafter_service(self.config, _grpc_host(self.config))
        token = self.config.network.grpc_token
        self.server = ServerThread([self.service.service()], host=_grpc_host(self.config), token=token,
                                   health=self.service.health)
        self._own_health = _OwnHealth(self.server, token)
        self._scheduler = scheduler
        self._replica_id = replica_id = _replica_id()
        self._heartbeat = _Heartbeat(lambda: scheduler.register_drafter.remote(replica_id, self.server.address))
        self._heartbeat.wait_registered("drafter")

    def check_health(self) -> None:
        self._own_health.check()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: requests holding a context-cache slot here (see cluster.autoscaling)."""
        engine = self.service.engine
        return engine_load(engine.max_requests - engine.num_free_slots, engine.max_requests)

    def address(self) -> str:
        return self.server.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def __del__(self) -> None:
        """Serve awaits this when it stops the replica: drain, then stop serving (see :func:`_leave`)."""
        if hasattr(self, "_heartbeat"):  # absent when the constructor failed
            await _leave("drafter", self._replica_id, self._scheduler, self._heartbeat,
                         self.config.scheduler.drain_timeout_s)
        if hasattr(self, "_own_health"):
            self._own_health.close()
        if hasattr(self, "server"):
            await asyncio.to_thread(self.server.stop)
        if hasattr(self, "service"):
            self.service.close()  # its feature links and their store


@serve.deployment(name="Verifier", max_ongoing_requests=8, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                  health_check_timeout_s=30)
class VerifierReplica:
    def __init__(self, args: dict[str, Any], scheduler: DeploymentHandle) -> None:
        from cluster.loading import build_verifier_service

        honour_ray_cpu_threads()
        self.config = AppConfig.from_args(args).resolve_secrets()
        self.service = build_verifier_service(self.config)
        sps = self.service.sps
        token = self.config.network.grpc_token
        self.server = ServerThread([self.service.service()], host=_grpc_host(self.config), token=token,
                                   health=self.service.health)
        self._own_health = _OwnHealth(self.server, token)
        self._scheduler = scheduler
        self._replica_id = replica_id = _replica_id()
        self._heartbeat = _Heartbeat(lambda: scheduler.register_verifier.remote(replica_id, self.server.address, sps))
        self._heartbeat.wait_registered("verifier")

    def check_health(self) -> None:
        self._own_health.check()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: requests holding a KV slot here (see cluster.autoscaling)."""
        return engine_load(len(self.service.engine.running), self.config.engine.max_requests)

    def address(self) -> str:
        return self.server.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def __del__(self) -> None:
        """Serve awaits this when it stops the replica: drain, then stop serving (see :func:`_leave`)."""
        if hasattr(self, "_heartbeat"):  # absent when the constructor failed
            await _leave("verifier", self._replica_id, self._scheduler, self._heartbeat,
                         self.config.scheduler.drain_timeout_s)
        if hasattr(self, "_own_health"):
            self._own_health.close()
        if hasattr(self, "server"):
            try:  # pushes in flight, feature links (each wait on one is bounded by its timeout), engine thread
                wait_s = 3 * self.config.engine.feature_link_timeout_s
                await asyncio.to_thread(self.server.run, self.service.close(), wait_s)
            finally:
                await asyncio.to_thread(self.server.stop)


@serve.deployment(name="Engine", max_ongoing_requests=8, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                  health_check_timeout_s=30)
class EngineReplica:
    """A colocated replica: target and drafter on one device, the round pipeline in this process."""

    def __init__(self, args: dict[str, Any], scheduler: DeploymentHandle) -> None:
        from transformers import AutoTokenizer

        from cluster import contract
        from cluster.backend_rpc import backend_methods
        from cluster.loading import build_local_backend

        honour_ray_cpu_threads()
        self.config = AppConfig.from_args(args).resolve_secrets()
        tokenizer = AutoTokenizer.from_pretrained(self.config.models.tokenizer_path, local_files_only=True)
        self.backend = build_local_backend(self.config, tokenizer=tokenizer)
        sps = self.backend.info["sps"].get("local")
        service = contract.service(contract.ENGINE, backend_methods(self.backend, self._info, contract.ENGINE))
        self.server = ServerThread([service], host=_grpc_host(self.config), token=self.config.network.grpc_token,
                                   health=self._health)
        self._own_health = _OwnHealth(self.server, self.config.network.grpc_token)
        self._scheduler = scheduler
        self._replica_id = replica_id = _replica_id()
        self._heartbeat = _Heartbeat(lambda: scheduler.register_engine.remote(replica_id, self.server.address, sps))
        self._heartbeat.wait_registered("engine")

    def _info(self) -> dict[str, Any]:
        try:
            self.backend.check_alive()
        except Exception as error:  # reported, not raised: Info must answer
            return {"ready": False, "reason": str(error)}
        return {"ready": True, "reason": ""}

    def _health(self) -> HealthStatus:
        state = self._info()
        return HealthStatus(state["ready"], {"reason": state["reason"]})

    def check_health(self) -> None:
        self._own_health.check()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: requests running or waiting here (see cluster.autoscaling)."""
        snapshot = self.backend.snapshot
        return engine_load(snapshot.running + snapshot.waiting, self.config.engine.max_requests)

    def address(self) -> str:
        return self.server.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def __del__(self) -> None:
        """Serve awaits this when it stops the replica: drain, then stop serving (see :func:`_leave`)."""
        if hasattr(self, "_heartbeat"):  # absent when the constructor failed
            await _leave("engine", self._replica_id, self._scheduler, self._heartbeat,
                         self.config.scheduler.drain_timeout_s)
        if hasattr(self, "_own_health"):
            self._own_health.close()
        if hasattr(self, "server"):
            await asyncio.to_thread(self.server.stop)
        if hasattr(self, "backend"):
            await asyncio.to_thread(self.backend.close)


#: The scheduler's calls are control traffic: every pool replica's heartbeat every HEARTBEAT_S, drains, lookups.
#: Serve's access log would print a line per call forever; the hub itself logs what changes (registrations).
@serve.deployment(name="Scheduler", num_replicas=1, max_ongoing_requests=1000,
                  health_check_period_s=HEALTH_CHECK_PERIOD_S,
                  logging_config={"enable_access_log": False})
class SchedulerReplica:
    def __init__(self, args: dict[str, Any]) -> None:
        from cluster.tokenizer_cache import load_decode
        from scheduler.hub import SchedulerHub

        honour_ray_cpu_threads()
        self.config = AppConfig.from_args(args).resolve_secrets()
        # Not AutoTokenizer: a restarted scheduler reads its detokeniser from the start-up cache and never imports
        # transformers, which it needs for nothing else (see cluster.tokenizer_cache).
        decode = load_decode(self.config.models.tokenizer_path, self.config.cache_path)
        self.hub = SchedulerHub(
            model_name=self.config.model_name,
            policy=self.config.scheduler.policy,
            draft_cost=self.config.scheduler.draft_cost,
            chain_tolerance=self.config.scheduler.chain_tolerance,
            request_groups=self.config.scheduler.request_groups,
            decode=decode,
            token=self.config.network.grpc_token,
            timeout_s=self.config.network.grpc_timeout_s,
            readiness_timeout_s=self.config.network.readiness_timeout_s,
            service_levels=self.config.scheduler.service_levels.levels(),
            relay_drafts=self.config.engine.relay_drafts and self.config.engine.draft_ahead,
            decode_steps=self.config.scheduler.decode_steps_on(self.config.models.device),
        )
        self.server = ServerThread([self.hub.service()], host=_grpc_host(self.config),
                                   token=self.config.network.grpc_token)
        self._drafter_registered = asyncio.Event()  # set by the first drafter registration (register_verifier)
        # The one keeper of the application's spare workers: the scheduler is its one replica that always runs.
        self._spares = SpareWorkers(self.config.spare_workers)
        self._spares.start()

    async def __del__(self) -> None:
        self._spares.stop()

    async def register_drafter(self, replica_id: str, address: str) -> bool:
        """The drafter's heartbeat (:meth:`SchedulerHub.heartbeat`): False when refused, logged once per
        interval; the heartbeat tries again soon."""
        registered = await asyncio.to_thread(self.hub.heartbeat, "drafter", replica_id, address)
        if registered:
            self._drafter_registered.set()
        return registered

    async def register_verifier(self, replica_id: str, address: str, sps: dict[str, Any] | None) -> bool:
        """False while no drafter is registered (a verifier's round loop needs one) or when the hub refuses
        the replica (:meth:`SchedulerHub.heartbeat`): a restarted scheduler hears its replicas' heartbeats in any
        order. Refused before any drafter registered, the call waits up to ``DRAFTER_WAIT_S`` for one and tries
        once more; then it answers False and the verifier's heartbeat tries again soon."""
        registered = await asyncio.to_thread(self.hub.heartbeat, "verifier", replica_id, address, sps)
        if registered or self._drafter_registered.is_set():
            return registered
        try:
            await asyncio.wait_for(self._drafter_registered.wait(), DRAFTER_WAIT_S)
        except TimeoutError:
            return False
        return await asyncio.to_thread(self.hub.heartbeat, "verifier", replica_id, address, sps)

    async def register_engine(self, replica_id: str, address: str, sps: dict[str, Any] | None) -> bool:
        """The engine replica's heartbeat (:meth:`SchedulerHub.heartbeat`)."""
        return await asyncio.to_thread(self.hub.heartbeat, "engine", replica_id, address, sps)

    async def drain_engine(self, replica_id: str) -> int:
        return await asyncio.to_thread(self.hub.drain_engine, replica_id)

    async def unregister_engine(self, replica_id: str) -> None:
        await asyncio.to_thread(self.hub.unregister_engine, replica_id)

    async def drain_drafter(self, replica_id: str) -> int:
        return await asyncio.to_thread(self.hub.drain_drafter, replica_id)

    async def unregister_drafter(self, replica_id: str) -> None:
        await asyncio.to_thread(self.hub.unregister_drafter, replica_id)

    async def drain_verifier(self, replica_id: str) -> int:
        return await asyncio.to_thread(self.hub.drain_verifier, replica_id)

    async def unregister_verifier(self, replica_id: str) -> None:
        await asyncio.to_thread(self.hub.unregister_verifier, replica_id)

    def check_health(self) -> None:
        """A round loop that died or hangs fails the check and Serve restarts the scheduler (clients get a
        retryable 503; replicas re-register by heartbeat). No verifier registered yet is not a failure."""
        from scheduler.failover import check_round_loops

        check_round_loops(self.hub)

    def address(self) -> str:
        return self.server.address

    def topology(self) -> dict[str, int]:
        return {"drafters": self.hub.num_drafters, "verifiers": self.hub.num_verifiers}

    def endpoints(self) -> dict[str, Any]:
        """The gRPC addresses of the deployment: this scheduler's and those of the registered pool replicas."""
        return {"scheduler": self.server.address, **self.hub.addresses()}


@serve.deployment(name="Ingress", max_ongoing_requests=1000, health_check_period_s=HEALTH_CHECK_PERIOD_S)
@serve.ingress()
class IngressReplica:
    def __init__(self, args: dict[str, Any], scheduler: DeploymentHandle, *pools: DeploymentHandle) -> None:
        # The pool handles are unused here: binding them is what makes Serve deploy the drafter and verifier pools
        # as part of this application.
        honour_ray_cpu_threads()
        self.config = AppConfig.from_args(args).resolve_secrets()
        self.scheduler = scheduler
        self.pools = pools

    async def __serve_build_asgi_app__(self) -> Any:
        from transformers import AutoTokenizer

        from cluster.http_app import build_app
        from cluster.remote_backend import RemoteBackend

        async def scheduler_address() -> str:  # asked again after the scheduler was restarted
            return await self.scheduler.address.remote()

        tokenizer = AutoTokenizer.from_pretrained(self.config.models.tokenizer_path, local_files_only=True)
        backend = RemoteBackend(
            scheduler_address,
            model_name=self.config.model_name,
            max_context=self.config.engine.max_seq_len,  # as --no-ray and the scheduler's engines: a slot's length
            token=self.config.network.grpc_token,
            routed=self.config.placement == "colocated",
            # A stream cut by the scheduler's death waits this long for its replacement to continue it.
            continue_timeout_s=self.config.network.readiness_timeout_s,
        )
        return build_app(backend, tokenizer, api_key=self.config.network.api_key, collectors=[backend.route_times])


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder (``import_path: cluster.app:build_app``); ``args`` is an :class:`AppConfig`.

    Serve (``serve deploy``, KubeRay's ``serveConfigV2``) calls it with the config file's ``args`` and applies the
    file's ``deployments:`` section itself; it requires a builder of exactly one parameter.
    """
    return assemble_app(args)


def assemble_app(
    args: dict[str, Any] | None = None, overrides: dict[str, dict[str, Any]] | None = None
) -> serve.Application:
    """The application for ``serve.run``: ``overrides`` maps a deployment name to options, as under
    ``deployments:`` in a Serve config file (``dspark serve --config`` passes that section here)."""
    config = AppConfig.from_args(args)
    config.require_grpc_auth()  # here too, so that a deployment without a token fails before any replica starts
    overrides = overrides or {}
    plain = config.model_dump()

    def options(deployment: Any, defaults: dict[str, Any]) -> Any:
        return deployment.options(**{**defaults, **overrides.get(deployment.name, {})})

    # A pool replica's drain (see _leave) must fit in Serve's shutdown budget, or Serve kills it mid-drain.
    shutdown = {"graceful_shutdown_timeout_s": config.scheduler.drain_timeout_s + SHUTDOWN_MARGIN_S}
    scheduler = options(SchedulerReplica, {}).bind(plain)
    if config.placement == "colocated":
        engine = options(EngineReplica, {"ray_actor_options": config.verify_pool.actor_options(), **shutdown})
        return options(IngressReplica, {}).bind(plain, scheduler, engine.bind(plain, scheduler))
    verifier = options(VerifierReplica, {"ray_actor_options": config.verify_pool.actor_options(), **shutdown})
    pools: list[Any] = [verifier.bind(plain, scheduler)]
    if config.scheduler.policy != "autoregressive":
        drafter = options(DrafterReplica, {"ray_actor_options": config.draft_pool.actor_options(), **shutdown})
        pools.append(drafter.bind(plain, scheduler))
    return options(IngressReplica, {}).bind(plain, scheduler, *pools)
