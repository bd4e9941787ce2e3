"""The Ray Serve application: drafter and verifier pools, the scheduler, and the OpenAI-compatible ingress.

Four deployments, each a thin shell over Ray-free objects:

* ``Drafter`` replicas (placed on the ``draft_pool`` resource) each own a :class:`DraftEngine` behind a gRPC server;
* ``Verifier`` replicas (``verify_pool``) each own a :class:`VerifyEngine` behind a gRPC server, profile their SPS
  table at start and push context features straight to the drafters;
* ``Scheduler`` (one replica, restarted by Serve on failure) holds the :class:`SchedulerHub`: request lifecycle and
  one round loop per verifier replica;
* ``Ingress`` serves HTTP (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/metrics``) and streams
  from the scheduler over gRPC.

Replicas announce their gRPC address to the scheduler and keep re-announcing it (a heartbeat), so a restarted
scheduler relearns the topology within seconds and autoscaled replicas join without any restart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import AppConfig
from cluster.rpc import ServerThread, SyncRpcClient

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0


def _grpc_host(config: AppConfig) -> str:
    return config.network.grpc_host or ray.util.get_node_ip_address()


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


class _Heartbeat:
    """Re-registers a replica with the scheduler every few seconds from a daemon thread (idempotent calls)."""

    def __init__(self, register: Any) -> None:
        self._register = register
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._register().result(timeout_s=30)
            except Exception as exc:  # the scheduler may be restarting; keep trying
                logger.info("registration with the scheduler failed (%s); retrying", exc)
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()


def _check_own_health(server: ServerThread, token: str | None) -> None:
    """Serve's health check: the replica's own gRPC health endpoint must answer SERVING (a wedged engine does not)."""
    client = SyncRpcClient(server.address, token=token, timeout_s=5.0)
    try:
        status = client.health()
    finally:
        client.close()
    if status.get("status") != "SERVING":
        raise RuntimeError(f"replica reports {status}")


@serve.deployment(name="Drafter", max_ongoing_requests=8, health_check_period_s=10, health_check_timeout_s=30)
class DrafterReplica:
    def __init__(self, args: dict[str, Any], scheduler: DeploymentHandle) -> None:
        from cluster.loading import build_draft_engine
        from draft_service.rpc_service import DrafterService

        self.config = AppConfig.from_args(args)
        self.service = DrafterService(build_draft_engine(self.config))
        token = self.config.network.grpc_token
        self.server = ServerThread([self.service.service()], host=_grpc_host(self.config), token=token,
                                   health=self.service.health)
        replica_id = _replica_id()
        self._heartbeat = _Heartbeat(lambda: scheduler.register_drafter.remote(replica_id, self.server.address))

    def check_health(self) -> None:
        _check_own_health(self.server, self.config.network.grpc_token)

    def address(self) -> str:
        return self.server.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def __del__(self) -> None:
        self._heartbeat.stop()
        self.server.stop()


@serve.deployment(name="Verifier", max_ongoing_requests=8, health_check_period_s=10, health_check_timeout_s=30)
class VerifierReplica:
    def __init__(self, args: dict[str, Any], scheduler: DeploymentHandle) -> None:
        from cluster.loading import build_verify_engine, load_or_profile_sps
        from draft_service.config import DraftConfig
        from verify_service.rpc_service import VerifierService

        self.config = AppConfig.from_args(args)
        engine = build_verify_engine(self.config)
        block = 0
        if self.config.models.draft is not None:
            block = DraftConfig.from_json(f"{self.config.models.draft}/config.json").block_size
        sps = load_or_profile_sps(self.config, engine, max(block, 1)).to_dict()
        token = self.config.network.grpc_token
        self.service = VerifierService(engine, token=token, timeout_s=self.config.network.grpc_timeout_s)
        self.server = ServerThread([self.service.service()], host=_grpc_host(self.config), token=token,
                                   health=self.service.health)
        replica_id = _replica_id()
        self._heartbeat = _Heartbeat(lambda: scheduler.register_verifier.remote(replica_id, self.server.address, sps))

    def check_health(self) -> None:
        _check_own_health(self.server, self.config.network.grpc_token)

    def address(self) -> str:
        return self.server.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def __del__(self) -> None:
        self._heartbeat.stop()
        self.server.stop()


@serve.deployment(name="Scheduler", num_replicas=1, max_ongoing_requests=1000, health_check_period_s=10)
class SchedulerReplica:
    def __init__(self, args: dict[str, Any]) -> None:
        from transformers import AutoTokenizer

        from scheduler.hub import SchedulerHub

        self.config = AppConfig.from_args(args)
        tokenizer = AutoTokenizer.from_pretrained(self.config.models.tokenizer_path, local_files_only=True)
        self.hub = SchedulerHub(
            model_name=self.config.model_name,
            policy=self.config.scheduler.policy,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            token=self.config.network.grpc_token,
            timeout_s=self.config.network.grpc_timeout_s,
        )
        self.server = ServerThread([self.hub.service()], host=_grpc_host(self.config),
                                   token=self.config.network.grpc_token)

    async def register_drafter(self, replica_id: str, address: str) -> None:
        await asyncio.to_thread(self.hub.register_drafter, replica_id, address)

    async def register_verifier(self, replica_id: str, address: str, sps: dict[str, Any]) -> None:
        await asyncio.to_thread(self.hub.register_verifier, replica_id, address, sps)

    def address(self) -> str:
        return self.server.address

    def topology(self) -> dict[str, int]:
        return {"drafters": self.hub.num_drafters, "verifiers": self.hub.num_verifiers}


@serve.deployment(name="Ingress", max_ongoing_requests=1000)
@serve.ingress()
class IngressReplica:
    def __init__(self, args: dict[str, Any], scheduler: DeploymentHandle, *pools: DeploymentHandle) -> None:
        # The pool handles are unused here: binding them is what makes Serve deploy the drafter and verifier pools
        # as part of this application.
        self.config = AppConfig.from_args(args)
        self.scheduler = scheduler
        self.pools = pools

    async def __serve_build_asgi_app__(self) -> Any:
        from transformers import AutoTokenizer

        from cluster.http_app import build_app
        from cluster.remote_backend import RemoteBackend

        address = await self.scheduler.address.remote()
        tokenizer = AutoTokenizer.from_pretrained(self.config.models.tokenizer_path, local_files_only=True)
        backend = RemoteBackend(
            address,
            model_name=self.config.model_name,
            max_context=self.config.engine.max_seq_len - 1,
            token=self.config.network.grpc_token,
        )
        return build_app(backend, tokenizer, api_key=self.config.network.api_key)


def build_app(
    args: dict[str, Any] | None = None, overrides: dict[str, dict[str, Any]] | None = None
) -> serve.Application:
    """Serve application builder (``import_path: cluster.app:build_app``); ``args`` is an :class:`AppConfig`.

    ``overrides`` maps a deployment name to options (as under ``deployments:`` in a Serve config file) for
    ``dspark serve --config``; ``serve deploy`` applies that section itself.
    """
    config = AppConfig.from_args(args)
    overrides = overrides or {}
    plain = config.model_dump()

    def options(deployment: Any, defaults: dict[str, Any]) -> Any:
        return deployment.options(**{**defaults, **overrides.get(deployment.name, {})})

    scheduler = options(SchedulerReplica, {}).bind(plain)
    verifier = options(VerifierReplica, {"ray_actor_options": config.verify_pool.actor_options()})
    pools: list[Any] = [verifier.bind(plain, scheduler)]
    if config.scheduler.policy != "autoregressive":
        drafter = options(DrafterReplica, {"ray_actor_options": config.draft_pool.actor_options()})
        pools.append(drafter.bind(plain, scheduler))
    return options(IngressReplica, {}).bind(plain, scheduler, *pools)
