"""Spare Ray workers: idle worker processes that have already imported what a replica imports.

A replica that dies is replaced by Serve in a new Ray worker process, and before the replacement's constructor
runs that process starts Ray's worker, imports Serve's replica and this application's module (torch with it):
most of a restart once the engines load quickly. Ray gives an actor an idle worker that has never run anything
when one is there, so a node that always holds ``count`` such spares, each with those modules imported, starts a
replacement's constructor at once (docs/benchmarks/reliability.md, "Spare workers").

Two Ray mechanisms, both of the raylet: ``preload_python_modules`` (a system config of a new cluster: every
worker of the node imports these modules when it starts) and its ``PrestartWorkers`` call (start idle workers
kept alive for a given time). :class:`SpareWorkers` keeps the spares topped up from the application's Scheduler
replica (``AppConfig.spare_workers``): it polls each alive node's workers (``GetNodeStats``) and asks the node for
more when a replacement took one. The preload is the cluster's: ``dspark serve`` starts its embedded cluster with
:func:`preload_system_config`; any other cluster (a RayService) sets the same in every node's environment
(:func:`preload_environment`), which Ray reads as it does its system config.
Both are Ray internals (``ray._private``, ``ray.core.generated``): the keeper logs the first error they raise
and goes on trying, so a Ray that changes them serves as before, only with restarts at Ray's own speed.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

#: What a replica process imports before its constructor runs: torch, Serve's replica actor, this application.
PRELOAD_MODULES: tuple[str, ...] = ("torch", "ray.serve._private.replica", "cluster.app")
#: How long the raylet keeps a spare alive past its soft limit of idle workers (the keeper asks again after).
KEEP_ALIVE_S = 24 * 3600
#: How often the keeper looks at the nodes' workers.
POLL_S = 2.0
#: How long a requested spare may take to register before the keeper asks for it again.
START_GRACE_S = 60.0
#: How long a node stays short of spares before the keeper starts more: a replacement takes its spare when the
#: node is busiest (the replacement's constructor runs, its streams resume), and the next spare's imports, a few
#: CPU seconds, should not compete with that.
REFILL_DELAY_S = 5.0
#: ``rpc.WorkerType.WORKER`` (drivers, spill and restore workers are never spares).
_WORKER = 0
logger = logging.getLogger(__name__)


def preload_system_config() -> dict[str, Any]:
    """The ``_system_config`` of a new cluster whose workers import :data:`PRELOAD_MODULES` when they start, and
    whose raylet does not prestart idle workers for the first driver: Ray would start up to one per core, each
    holding those modules in memory, where the keeper starts only the spares asked for."""
    return {"preload_python_modules": list(PRELOAD_MODULES), "prestart_worker_first_driver": False}


def preload_environment() -> dict[str, str]:
    """:func:`preload_system_config` as the environment variables a node's raylet reads (``RAY_<name>``; a list
    is comma-separated): set in every Ray pod of a cluster that ``dspark serve`` did not start."""
    config = preload_system_config()
    return {"RAY_preload_python_modules": ",".join(config["preload_python_modules"]),
            "RAY_prestart_worker_first_driver": str(config["prestart_worker_first_driver"]).lower()}


def honour_ray_cpu_threads() -> None:
    """Give torch as many intra-op threads as Ray assigned this actor (``OMP_NUM_THREADS``; a replica's first step).

    Ray sets that variable from an actor's ``num_cpus`` (at least 1) when the actor is created, unless the operator
    set it. A worker that preloaded torch (:data:`PRELOAD_MODULES`) read it before, unset, and would use every
    core: the CPU replicas of a node would each run as many threads as it has cores, and a verifier's SPS profile
    would time its steps by the wall clock (``scheduler.profiling``)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))


def is_spare(worker: Any) -> bool:
    """Whether a ``CoreWorkerStats`` is an idle worker that can still host an actor: a task worker that has run
    nothing and hosts no actor (Ray gives an actor only a worker that never ran a plain task)."""
    return worker.worker_type == _WORKER and not _hosts_actor(worker.actor_id) and worker.num_executed_tasks == 0


def _generated(name: str) -> Any:
    """A module of Ray's generated protobuf code (``ray.core.generated``, which has no type stubs)."""
    return importlib.import_module(f"ray.core.generated.{name}")


def _hosts_actor(actor_id: bytes) -> bool:
    return bool(actor_id) and actor_id != b"\xff" * len(actor_id)


@dataclass
class _Node:
    """One raylet: its stub, since when it is short of spares, and when the keeper last asked it for spares
    that have not registered yet."""

    stub: Any
    short_since: float | None = None
    requested_at: float | None = None
    started: int = 0


class SpareWorkers:
    """Keeps ``count`` spare workers on every alive node of the connected cluster, from a daemon thread.

    Contract: call from a process connected with ``ray.init``; :meth:`stop` ends the thread. A node that has been
    short of ``count`` spares for ``refill_delay_s`` (counted from when the keeper first saw it short: a keeper
    starts with its application, or again in a restarted scheduler, when replicas are still starting) is asked for
    the missing ones, and not again until they registered or :data:`START_GRACE_S` passed (a worker that is still
    importing is already listed)."""

    def __init__(self, count: int, *, poll_s: float = POLL_S, refill_delay_s: float = REFILL_DELAY_S) -> None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.count = count
        self.poll_s = poll_s
        self.refill_delay_s = refill_delay_s
        self._nodes: dict[str, _Node] = {}
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="spare-workers", daemon=True)

    def start(self) -> None:
        """Start the keeper (no thread when ``count`` is 0)."""
        if self.count:
            self._thread.start()

    def stop(self) -> None:
        """Stop the keeper; the spares themselves end with their cluster (or when their keep-alive runs out). Waits
        at most a second: the thread is a daemon, and a stop is on the clock of a SIGTERM's grace period."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    @property
    def started(self) -> int:
        """How many spares the keeper asked the nodes for so far."""
        return sum(node.started for node in self._nodes.values())

    def top_up(self) -> dict[str, list[int]]:
        """One pass over the alive nodes: returns the pids of each node's spares now (before any start)."""
        import ray

        node_manager_pb2 = _generated("node_manager_pb2")
        spares: dict[str, list[int]] = {}
        for info in ray.nodes():
            if not info.get("Alive"):
                continue
            node = self._node(info)
            reply = node.stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(include_memory_info=False),
                                           timeout=10.0)
            pids = spares[info["NodeID"]] = [worker.pid for worker in reply.core_workers_stats if is_spare(worker)]
            have = len(pids)
            now = time.monotonic()
            if have >= self.count:
                node.short_since = node.requested_at = None
                continue
            node.short_since = now if node.short_since is None else node.short_since
            if now - node.short_since < self.refill_delay_s:
                continue
            if node.requested_at is None or now - node.requested_at > START_GRACE_S:
                self._prestart(node, self.count - have)
                node.requested_at = now
        return spares

    def _node(self, info: dict[str, Any]) -> _Node:
        node = self._nodes.get(info["NodeID"])
        if node is None:
            from ray._private.grpc_utils import init_grpc_channel

            channel = init_grpc_channel(f"{info['NodeManagerAddress']}:{info['NodeManagerPort']}")
            stub = _generated("node_manager_pb2_grpc").NodeManagerServiceStub(channel)
            node = self._nodes[info["NodeID"]] = _Node(stub)
        return node

    @staticmethod
    def _prestart(node: _Node, number: int) -> None:
        node.stub.PrestartWorkers(_generated("node_manager_pb2").PrestartWorkersRequest(
            language=_generated("common_pb2").Language.PYTHON, keep_alive_duration_secs=KEEP_ALIVE_S,
            num_workers=number,
        ), timeout=10.0)
        node.started += number

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.top_up()
                self._failing = False
            except Exception as error:  # a node going away, a Ray whose internals differ: serve on without
                if not (self._failing or self._stop.is_set()):
                    logger.warning("no spare workers for now (%r); replicas restart at Ray's own speed", error)
                self._failing = True
            self._stop.wait(self.poll_s)
