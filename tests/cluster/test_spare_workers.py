"""Spare Ray workers: a new actor starts in a spare that already imported the preloaded modules, and the keeper
starts another in its place (a real one-node Ray cluster on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.core.generated import common_pb2

from cluster.spare_workers import PRELOAD_MODULES, SpareWorkers, is_spare, preload_environment
from tests.ray_start import init_local_ray

pytestmark = [pytest.mark.ray, pytest.mark.slow]

#: A stdlib module no Ray worker imports by itself: seen in an actor's process only if the worker preloaded it.
#: (The cluster is configured as ``preload_system_config`` configures one, with this module: no idle workers
#: but the keeper's.)
MARKER = "colorsys"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    init_local_ray(address="local", num_cpus=2, object_store_memory=96 * 2**20, include_dashboard=False,
                   _system_config={"preload_python_modules": [MARKER], "prestart_worker_first_driver": False})
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self) -> None:
        self.preloaded = MARKER in sys.modules  # before this actor imports anything

    def where(self) -> tuple[int, bool]:
        return os.getpid(), self.preloaded


def _spares(keeper: SpareWorkers, want: int, timeout_s: float = 120) -> set[int]:
    """The pids of the node's spares once there are ``want`` of them (the keeper tops up meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        (pids,) = (set(node) for node in keeper.top_up().values())
        if len(pids) >= want or time.monotonic() > deadline:
            assert len(pids) >= want, f"{len(pids)} spares after {timeout_s:.0f} s"
            return pids
        time.sleep(0.5)


def test_an_actor_starts_in_a_preloaded_spare_and_the_keeper_replaces_it(cluster: None) -> None:
    keeper = SpareWorkers(1, refill_delay_s=0.0)
    before = _spares(keeper, 1)
    probe = Probe.remote()
    pid, preloaded = ray.get(probe.where.remote(), timeout=120)
    assert pid in before, "the actor took a spare instead of a new process"
    assert preloaded, "the spare had imported the preloaded module before the actor's constructor ran"
    after = _spares(keeper, 1)
    assert pid not in after and after, "the keeper started another spare in its place"
    ray.kill(probe)


def test_only_idle_workers_that_never_ran_anything_are_spares() -> None:
    idle = common_pb2.CoreWorkerStats(worker_type=0, actor_id=b"\xff" * 16, num_executed_tasks=0)
    assert is_spare(idle)
    assert is_spare(common_pb2.CoreWorkerStats(worker_type=0))  # no actor id at all
    assert not is_spare(common_pb2.CoreWorkerStats(worker_type=0, actor_id=b"\x01" * 16))  # hosts an actor
    assert not is_spare(common_pb2.CoreWorkerStats(worker_type=0, num_executed_tasks=3))  # ran plain tasks
    assert not is_spare(common_pb2.CoreWorkerStats(worker_type=1))  # a driver


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="count must be >= 0"):
        SpareWorkers(-1)


def test_a_node_that_lost_its_spare_waits_the_refill_delay(cluster: None) -> None:
    """A node whose spare a new actor just took waits the refill delay, as does a node the keeper first sees."""
    _spares(SpareWorkers(1, refill_delay_s=0.0), 1)
    keeper = SpareWorkers(1, refill_delay_s=3600.0)
    _spares(keeper, 1)
    started = keeper.started
    probe = Probe.remote()
    ray.get(probe.where.remote(), timeout=120)  # took the spare
    assert all(not pids for pids in keeper.top_up().values())
    keeper.top_up()
    assert keeper.started == started, "no spare is started while the node recovers"
    ray.kill(probe)


_PRELOADED_ACTOR = """
import os, ray
ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=96 * 2**20,
         include_dashboard=False)

@ray.remote(num_cpus=0)
class Probe:
    def __init__(self):
        import sys
        self.preloaded = sorted(m for m in {PRELOAD_MODULES!r} if m in sys.modules)
        from cluster.spare_workers import honour_ray_cpu_threads
        honour_ray_cpu_threads()  # what every replica does first

    def modules(self):
        import torch
        return self.preloaded, os.environ["OMP_NUM_THREADS"], torch.get_num_threads()

print(ray.get(Probe.remote().modules.remote(), timeout=120))
"""


def test_a_cluster_configured_by_environment_preloads_the_application() -> None:
    """What a RayService sets in its pods (docs/DEPLOYMENT.md): with :func:`preload_environment` a node's workers
    import torch, Serve's replica and this application before an actor's constructor runs, and a replica's torch
    still runs as many threads as Ray assigned it (:func:`honour_ray_cpu_threads`)."""
    env = preload_environment()
    assert env == {"RAY_preload_python_modules": ",".join(PRELOAD_MODULES),
                   "RAY_prestart_worker_first_driver": "false"}
    script = _PRELOADED_ACTOR.replace("{PRELOAD_MODULES!r}", repr(PRELOAD_MODULES))
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "RAY_AUTH_MODE": "disabled", **env},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    # The preloaded torch read OMP_NUM_THREADS before Ray set it for the actor (1 thread for less than one CPU);
    # the replica's first step gives torch that count instead of every core.
    assert done.stdout.strip().splitlines()[-1] == repr((sorted(PRELOAD_MODULES), "1", 1)), done.stdout
