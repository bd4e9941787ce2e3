"""Launch settings shared by the Triton kernels (compiled on GPUs, interpreted on CPU in tests)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


PDL_MAX_ROWS = 16
"""Token rows of a pass up to which its kernels launch with PDL: it shortens a pass whose kernels are all Triton
(8 rows, the skinny GEMMs included) and lengthens the larger ones, where cuBLAS GEMMs sit between the Triton
kernels (bench/profile_verify_gpu.py --pdl on off; docs/benchmarks/kernels.md, "Programmatic dependent launch")."""


def pdl_options(device: torch.device, rows: int) -> dict[str, bool]:
    """Launch arguments for programmatic dependent launch (PDL) of a kernel in a pass of ``rows`` token rows:
    ``PDL`` for the kernel's constexpr of that name, plus Triton's ``launch_pdl`` where it is on.

    Why: a verify step of a few tokens is ~340 kernels in a CUDA graph, each waiting for its predecessor to
    drain before its blocks start (docs/benchmarks/kernels.md measures the gap). With PDL (Hopper and newer) a kernel is
    launched while its predecessor's last blocks run; it calls :func:`tl_pdl_wait` before touching memory,
    which returns once the predecessor has completed and its writes are visible, so stream order is kept.
    On only where it was measured to help: CUDA devices of compute capability >= 9, passes of at most
    PDL_MAX_ROWS rows, not under the interpreter, and not with ``DSPARK_PDL=0`` (for A/B timing)."""
    on = (
        rows <= PDL_MAX_ROWS
        and device.type == "cuda"
        and not interpreting()
        and os.environ.get("DSPARK_PDL", "1") != "0"
        and _pdl_device(device.index if device.index is not None else torch.cuda.current_device())
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def tl_pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the predecessor kernel has completed (its writes visible), then let the successor
    launch (its blocks start and wait in turn). Call first, before any load or store."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
