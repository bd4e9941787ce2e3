"""CUDA-graph plumbing shared by the draft and verify engines: batch-size buckets and captured steps.

A round's GPU work is hundreds of small kernel launches (a few layers of a small model, the sequential head,
rejection sampling); on a fast GPU launching them costs more than running them. Both engines therefore run
their steady-state step on static buffers laid out for a bucketed number of requests (the next bucket up, the
rest padded with a dummy request that owns a reserved slot) and replay that step as one CUDA graph.

Modes (per engine): ``off`` is the plain eager path; ``static`` runs the bucketed step eagerly (no capture),
which exercises the padding logic anywhere, CPU included, and is what the exactness tests compare; ``capture``
records the bucketed step once per bucket and replays it (CUDA only).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

GRAPH_MODES = ("off", "static", "capture")
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)

T = TypeVar("T")


def check_graph_mode(mode: str, device: torch.device) -> str:
    if mode not in GRAPH_MODES:
        raise ValueError(f"unknown graph mode {mode!r}; use one of {GRAPH_MODES}")
    if mode == "capture" and device.type != "cuda":
        raise ValueError(f"graph mode 'capture' needs a CUDA device, the model is on {device}")
    return mode


def resolve_graph_mode(mode: str, device: torch.device | str) -> str:
    """A configured step mode with ``auto`` resolved: CUDA graphs on a GPU (a small model's eager step is
    launch-bound there), eager steps elsewhere; any other mode as it is."""
    if mode != "auto":
        return mode
    return "capture" if torch.device(device).type == "cuda" else "off"


def bucket_sizes(max_requests: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The bucket sizes used for an engine holding up to ``max_requests``: the given sizes below it, and
    ``max_requests`` itself as the top bucket (so every admissible batch has a bucket)."""
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    sizes = sorted({int(b) for b in buckets if 1 <= int(b) < max_requests} | {max_requests})
    return tuple(sizes)


def pick_bucket(num_requests: int, sizes: Sequence[int]) -> int | None:
    """Smallest bucket holding ``num_requests`` (sizes ascending); None if none does."""
    if num_requests < 1:
        raise ValueError(f"a bucketed step needs at least one request, got {num_requests}")
    for size in sizes:
        if size >= num_requests:
            return size
    return None


class GraphStep(Generic[T]):
    """``fn`` (a function of static buffers only, returning tensors) run directly or replayed as a CUDA graph.

    Capture warms ``fn`` up on a side stream first (Triton compiles, cuBLAS picks its kernels, the caching
    allocator settles), then records it into ``pool`` so that all buckets share one memory pool. The returned
    tensors are the graph's static outputs: each call overwrites them, so callers copy what they keep.
    ``fn`` must only write memory that no live request owns (warm-up and capture run it for real), and may only
    launch device work on device memory: no host read of a device value, no host <-> device copy (``t[i] = x``
    with a Python ``x`` is one on CUDA; ``t[i:].fill_(x)`` is not), no tensor from Python data, no op that syncs
    to size its output, no torch RNG (tests/capture_guard.py checks the engines' steps for these on CPU).
    """

    def __init__(
        self,
        fn: Callable[[], T],
        mode: str,
        pool: torch.cuda._POOL_HANDLE | None = None,
        warmup: int = 2,
    ) -> None:
        self.fn = fn
        self.mode = mode
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: T | None = None
        self.time_s = 0.0  # time inside the step (device time of the replays when captured), when timed
        self._pending: tuple[torch.Event, torch.Event] | None = None
        self._events: tuple[torch.Event, torch.Event] | None = None  # made once, on the first timed replay
        if mode == "capture":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn()
            torch.cuda.synchronize()

    def __call__(self, timed: bool = False) -> T:
        if self.graph is None:
            if not timed:
                return self.fn()
            start = time.perf_counter()
            out = self.fn()
            self.time_s += time.perf_counter() - start
            return out
        if timed:
            if self._events is None:
                self._events = device_event(timing=True), device_event(timing=True)
            begin, end = self._events
            begin.record()
            self.graph.replay()
            end.record()
            self._pending = (begin, end)
        else:
            self.graph.replay()
        assert self.outputs is not None
        return self.outputs

    def settle_timing(self) -> None:
        """Add the last timed replay's device time (call after the host has waited for its results)."""
        if self._pending is not None:
            self.time_s += self._pending[0].elapsed_time(self._pending[1]) / 1000.0
            self._pending = None


@dataclass(frozen=True)
class DeviceDrafts:
    """Drafted token ids still on the device: a draft step's output, before the host has read it.

    Token j of request r is ``flat[r * row_stride + j]`` (any dtype that holds the ids exactly). A verify step
    launched right behind the draft step reads them there (a chained round: no host round trip between the
    two steps, see :meth:`verify_service.graphs.VerifyGraphRunner.start_verify`); with captured graphs
    ``flat`` is the draft step's static output, so the reading work must be queued before the next draft step.
    """

    flat: torch.Tensor
    row_stride: int


@dataclass(frozen=True)
class DeviceVerified:
    """A verify-only step's outcome still on the device, for a draft step queued right behind it (the next
    round's drafting without a host round trip: :meth:`draft_service.graphs.DraftGraphRunner.launch_behind`).

    Row r of ``packed`` (int64) is request r's accepted draft count a_r, then its emitted tokens: the a_r
    accepted drafts and the target's own token at column 1 + a_r, the request's next anchor. ``features`` holds
    every request's 1 + a_r committed context rows back to back, in request order. With captured graphs both
    are the verify step's static outputs, so the reading work must be queued before the next verify step.
    """

    packed: torch.Tensor
    features: torch.Tensor


def split_views(buffer: torch.Tensor | np.ndarray, fields: dict[str, int]) -> dict:
    """Named consecutive views of one flat staging buffer: the host fills every field, then one copy uploads all."""
    views = {}
    offset = 0
    for name, length in fields.items():
        views[name] = buffer[offset : offset + length]
        offset += length
    return views


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host staging memory: page-locked when the engine runs on CUDA (async copies, no hidden sync)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def device_event(timing: bool = False, device: torch.device | None = None) -> torch.Event:
    """A CUDA event whose ``record()`` finds the current stream in C++: ``torch.cuda.Event.record`` looks it up
    through ``torch.cuda.current_stream()`` in Python, tens of microseconds per call on a slow host, and a
    round records several."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return torch.Event(torch.device("cuda", index), enable_timing=timing)


class StagingFence:
    """Host staging buffers are read by asynchronous host-to-device copies: before the host writes them again,
    it waits for the last copy that read them (usually long done: a result copy has synced since).

    A runner whose step ends in a blocking result copy on the same stream needs none: that copy returns after
    the upload that preceded it."""

    def __init__(self, device: torch.device) -> None:
        self._event = device_event(device=device) if device.type == "cuda" else None

    def copies_issued(self) -> None:
        if self._event is not None:
            self._event.record()

    def wait_before_write(self) -> None:
        if self._event is not None:
            self._event.synchronize()
