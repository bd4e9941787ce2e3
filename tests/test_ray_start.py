"""The Ray test-cluster starter retries only Ray's node start-up timeout and kills only Ray's stray children."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import ray
from ray_start import ATTEMPTS, kill_stray_ray_children, start_with_retry

TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


def _skip_ray_node_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Ray's node start-up waits up to its fixed 30 s for the node to register, timed by ``time.monotonic`` of
    ``ray._private.node``: that clock is given an offset, and a test that makes a node's lookup fail adds 31 s
    to it (the returned list's one value), so Ray's own wait times out at its next check instead of 30 s later."""
    import ray._private.node as node_module

    offset = [0.0]
    clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    clock.monotonic = lambda: time.monotonic() + offset[0]
    monkeypatch.setattr(node_module, "time", clock)
    return offset


def test_a_node_start_timeout_is_retried_after_cleanup() -> None:
    calls: list[str] = []

    def start() -> str:
        calls.append("start")
        if calls.count("start") < ATTEMPTS:
            raise TIMEOUT
        return "cluster"

    assert start_with_retry(start, lambda: calls.append("cleanup")) == "cluster"
    assert calls == ["start", "cleanup"] * (ATTEMPTS - 1) + ["start"]


def test_a_gcs_port_file_timeout_is_retried_and_a_failing_cleanup_is_survived() -> None:
    """A new head whose GCS server did not write its port file in time is a start-up timeout too; a cleanup that
    fails on the half-started cluster is reported and the start retried."""
    calls: list[str] = []

    def start() -> str:
        calls.append("start")
        if len(calls) == 1:
            raise RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc")
        return "cluster"

    def cleanup() -> None:
        raise RuntimeError("no head node to shut down")

    with pytest.warns(UserWarning, match="cleanup after a node start-up timeout failed"):
        assert start_with_retry(start, cleanup) == "cluster"
    assert calls == ["start", "start"]


def test_the_last_timeout_and_any_other_error_are_raised() -> None:
    def always_times_out() -> None:
        raise TIMEOUT

    cleanups: list[int] = []
    with pytest.raises(Exception, match="timed out during startup"):
        start_with_retry(always_times_out, lambda: cleanups.append(1))
    assert len(cleanups) == ATTEMPTS - 1

    def broken() -> None:
        raise ValueError("bad resources")

    with pytest.raises(ValueError, match="bad resources"):
        start_with_retry(broken, lambda: cleanups.append(1))
    assert len(cleanups) == ATTEMPTS - 1  # no cleanup, no retry


def test_only_children_running_rays_code_are_killed() -> None:
    sleeper = "import time; time.sleep(120)"
    ray_dir = str(Path(ray.__file__).parent)
    ray_like = subprocess.Popen([sys.executable, "-c", sleeper, ray_dir])
    other = subprocess.Popen([sys.executable, "-c", sleeper])
    try:
        assert ray_like.pid in kill_stray_ray_children()
        assert not Path(f"/proc/{ray_like.pid}").exists()  # killed and reaped
        assert other.poll() is None
    finally:
        for process in (ray_like, other):
            process.kill()
            process.wait(timeout=30)


@pytest.mark.ray
@pytest.mark.slow
def test_a_real_node_start_timeout_is_recovered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first node's raylet never shows up in the GCS (its lookup is made to fail), so Ray gives up (its 30 s
    skipped: ``_skip_ray_node_waits``); the starter kills that node's processes and the second start gives a
    working one-node cluster."""
    import ray._private.services as services
    from ray_start import init_local_ray

    real_get_node = services.get_node
    lookups = {"failed": 0}
    offset = _skip_ray_node_waits(monkeypatch)

    def get_node_failing_for_the_first_node(gcs_address: str, node_id: str):
        if lookups.setdefault("first", node_id) == node_id:
            lookups["failed"] += 1
            if lookups["failed"] > 1:  # Ray's wait retried the lookup: its 30 s are up at its next check
                offset[0] += 31.0
            raise RuntimeError("node info not available (test)")
        return real_get_node(gcs_address, node_id)

    monkeypatch.setattr(services, "get_node", get_node_failing_for_the_first_node)
    init_local_ray(num_cpus=1, object_store_memory=96 * 2**20, include_dashboard=False)
    try:
        assert lookups["failed"] > 1  # the first start ran into Ray's node wait
        assert ray.get(ray.remote(lambda: 42).remote(), timeout=120) == 42
        assert len(ray.nodes()) == 1  # the first attempt's GCS and raylet are gone, not a second cluster
    finally:
        ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_a_worker_node_start_timeout_restarts_the_whole_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first worker node never registers: the cluster (head included) is shut down, the worker's processes are
    killed, and the second attempt gives a head and a worker with its pool resource."""
    import ray._private.services as services
    from ray_start import start_local_cluster

    real_get_node = services.get_node
    seen: list[str] = []
    offset = _skip_ray_node_waits(monkeypatch)  # Ray's 30 s wait for the worker, skipped

    def get_node_failing_for_the_first_worker(gcs_address: str, node_id: str):
        if node_id not in seen:
            seen.append(node_id)
        if len(seen) >= 2 and node_id == seen[1]:  # seen[0] is the first head
            offset[0] += 31.0
            raise RuntimeError("node info not available (test)")
        return real_get_node(gcs_address, node_id)

    monkeypatch.setattr(services, "get_node", get_node_failing_for_the_first_worker)
    cluster, (worker,) = start_local_cluster(
        head={"num_cpus": 1, "object_store_memory": 96 * 2**20},
        workers=[{"num_cpus": 1, "resources": {"draft_pool": 1}, "object_store_memory": 96 * 2**20}],
    )
    try:
        assert len(seen) >= 4  # two heads and two workers were started
        ray.init(address=cluster.address)
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 2 and any(n["Resources"].get("draft_pool") == 1 for n in alive)
        assert worker.node_id in {n["NodeID"] for n in alive}
    finally:
        ray.shutdown()
        cluster.shutdown()
