"""Shared pytest setup: GPU tests skip cleanly without CUDA; data under ../shared is required under CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Without CUDA the Triton kernels (kernels/) run through Triton's CPU interpreter. The variable must be set
# before triton is imported, because kernels are decorated at import time; conftest runs before test modules.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
