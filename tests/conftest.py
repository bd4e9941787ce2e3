"""Shared pytest setup: GPU tests skip cleanly without CUDA; data under ../shared is required under CI."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def _interpret_triton_without_cuda() -> None:
    """Triton kernels run through its CPU interpreter on machines without CUDA. Triton decides at decoration
    time (when a kernel module is imported), so this must happen before any test module imports kernels."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_cuda()

# Local Ray test clusters live on loopback only: token auth off, and Ray must not swap 127.0.0.1 for the
# machine's routable address when a driver connects (both are read when ray is first imported).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# A loaded 2-core machine can take longer than Ray's default 30 s to bring a node's GCS up (seen once in a
# failover test while other jobs ran): wait for the port file (and the connect) up to 120 s instead.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

# Profiled SPS tables go to a cache folder of this test session, never to the user's ~/.cache/dspark (servers
# started by tests find each other's tables there; a test that checks the cache passes its own folder).
os.environ.setdefault("DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark-test-cache-"))

ROOT = Path(__file__).resolve().parents[1]
# DSPARK_SHARED_DIR overrides the location, e.g. for a git worktree whose parent folder has no shared/.
SHARED = Path(os.environ.get("DSPARK_SHARED_DIR", ROOT.parent / "shared"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def shared_path(relative: str) -> Path:
    """Path of third-party data under ../shared; missing: fails under CI, skips with the reason elsewhere."""
    path = SHARED / relative
    if not path.exists():
        message = f"{path} is missing (shared third-party data is read by path, never committed)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op torch thread: the suite runs tiny models on a shared 2-core machine, where torch's default
    thread pool oversubscribes the cores (a 48-token greedy decode of the fixture target: 1.7 s with 2
    threads, 0.28 s with 1)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run through the device tool)")
    for item in items:
        # The marker, not `"gpu" in item.keywords`: keywords also hold folder names (a checkout named gpu/).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
