"""Launch settings shared by the Triton kernels (compiled on GPUs, interpreted on CPU in tests)."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (launch heuristics size their grids by it); an H200's 132
    elsewhere (the interpreter does not care)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def launch_options() -> dict[str, bool]:
    """No FMA contraction on GPUs: float arithmetic matches the torch reference's operation by operation."""
    return {} if interpreting() else {"enable_fp_fusion": False}
