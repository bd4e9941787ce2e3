"""Launch settings shared by the Triton kernels (compiled on GPUs, interpreted on CPU in tests)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch_options() -> dict[str, bool]:
    """No FMA contraction on GPUs: float arithmetic matches the torch reference's operation by operation."""
    return {} if interpreting() else {"enable_fp_fusion": False}
