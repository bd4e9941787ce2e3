"""Timing helpers the benchmarks share: median of CUDA-event timings (wall clock on CPU), one replay of a
captured CUDA graph (how the engines run their steps), the device copy bandwidth the kernels' achieved bandwidth
is compared with, and the CPU's name for a result's machine record."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median time of ``fn`` in milliseconds (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def graph_timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (compiled and warmed up on a side
    stream first, as torch.cuda.graphs recommends)."""
    fn()  # compile outside the capture
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, device, repeats)


def copy_bandwidth(num_bytes: int, device: torch.device, repeats: int) -> float:
    """Device copy bandwidth in GB/s of a bf16 copy of ``num_bytes``, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else what :mod:`platform` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
