"""Starting local Ray test clusters on a loaded 2-core machine.

Ray waits a fixed 30 s (not configurable in 2.60) for a freshly started raylet to register with the GCS and raises
"The current node timed out during startup" after it, and a fixed time for a new head's GCS server to write its
port file ("Timed out waiting for file .../gcs_server_port_..."). On CI's 2-core machine each happened once, right
after another module's cluster had shut down. The start is retried then: the processes of the node that failed
are this test process's children that Ray no longer tracks, so they are killed first (never ``ray stop``, which
would kill every Ray process on the machine). Any other start-up error is raised at once.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import ray

T = TypeVar("T")

ATTEMPTS = 3
NODE_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def is_node_start_timeout(error: BaseException) -> bool:
    return any(message in str(error) for message in NODE_START_TIMEOUTS)


def kill_stray_ray_children() -> list[int]:
    """Kill this process's descendants that run Ray's binaries or scripts; returns their pids."""
    import psutil  # Ray's vendored copy: importing ray put it on the path

    ray_dir = os.path.dirname(ray.__file__)
    strays = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if ray_dir in command or command.startswith("ray::"):
            strays.append(child)
    for child in strays:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(strays, timeout=30)
    return [child.pid for child in strays]


def start_with_retry(start: Callable[[], T], cleanup: Callable[[], None]) -> T:
    """``start()``; after a node start-up timeout, ``cleanup()`` what it registered, kill the strays, retry."""
    for _ in range(ATTEMPTS - 1):
        try:
            return start()
        except Exception as error:
            if not is_node_start_timeout(error):
                raise
            try:
                cleanup()
            except Exception as cleanup_error:  # a half-started node: killing its processes below cleans up
                warnings.warn(f"cleanup after a node start-up timeout failed: {cleanup_error!r}", stacklevel=2)
            kill_stray_ray_children()
    return start()


def init_local_ray(**init_args: Any) -> None:
    """``ray.init`` of a one-node local cluster on loopback, retried after a node start-up timeout."""
    start_with_retry(lambda: ray.init(_node_ip_address="127.0.0.1", **init_args), ray.shutdown)


def start_local_cluster(head: dict[str, Any], workers: list[dict[str, Any]], timeout_s: float = 180):
    """A ``ray.cluster_utils.Cluster`` with a head and worker nodes on loopback; returns (cluster, worker nodes).

    Worker nodes start without waiting one by one, then all are awaited (generous ``timeout_s``: node start-up on
    a loaded 2-core machine); a start-up timeout of any node restarts the whole cluster.
    """
    from ray.cluster_utils import Cluster

    clusters: list[Cluster] = []

    def start():
        cluster = Cluster()
        clusters.append(cluster)
        cluster.add_node(node_ip_address="127.0.0.1", **head)
        nodes = [cluster.add_node(wait=False, node_ip_address="127.0.0.1", **worker) for worker in workers]
        cluster.wait_for_nodes(timeout=timeout_s)
        return cluster, nodes

    return start_with_retry(start, lambda: clusters[-1].shutdown())
