"""SPS profiling of a verify engine: target steps per second as a function of the verify batch size B.

Algorithm 1 needs SPS(B) for the exact replica it schedules. A verify step of B tokens is emulated as it happens in
serving: R requests, each verifying a chunk of up to ``chunk`` tokens (anchor + drafts) over a short context, in
one ragged pass over the slot cache. The slots are scratch: allocated, filled, and released by the profiler, so it
can run at startup before any request arrives.

Two flavours: :func:`profile_target_sps` times eager ``TargetModel.forward`` passes; :func:`profile_graph_sps`
times the verify engine's own graph-path step (:mod:`verify_service.graphs`), the step a graph-mode engine runs.
:func:`profile_graph_sps_by_requests` times the same step at fixed request counts R (R requests verifying 1 ..
chunk tokens each), the tables by request count the scheduler prices a round of R requests with.

Clocks: on a GPU, CUDA events (eager passes) or the wall clock of a step that synchronises (the graph step); on a
CPU with one intra-op thread, the profiling thread's CPU time (:func:`host_step_timer` says why); else the wall
clock.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kernels.sampling import SamplingParams
from scheduler.sps import (
    RequestSPS,
    SPSTable,
    Timer,
    cuda_event_timer,
    default_batch_grid,
    profile_sps,
    thread_clock_usable,
    thread_cpu_timer,
    wall_clock_timer,
)
from verify_service.engine import PrefillItem, VerifyEngine
from verify_service.graphs import GraphItem
from verify_service.target import TargetModel

#: The version of what these profilers measure and how; part of the SPS cache's fingerprint, so raise it when a
#: change makes tables profiled before it wrong (cluster.sps_cache).
PROFILER_VERSION = 3


def host_step_timer(device: torch.device) -> Timer:
    """The clock for a step that ends, results on the host, before its call returns: on a CPU whose torch runs
    one intra-op thread, the calling thread's CPU time (:func:`scheduler.sps.thread_cpu_timer`), else the wall
    clock (a GPU step that synchronises, or a CPU step spread over several threads, whose work the calling
    thread's clock does not see).

    Why CPU time on a CPU replica: the table prices the relative cost of verify steps of different B (Algorithm
    1's plain objective depends only on these ratios), and the step's own CPU time is that cost, while its wall
    time adds however long co-tenants held the core, which varies from one profile to the next by far more than
    the step does. What it leaves out: waiting for a core while serving, which scales every step alike and which
    ``draft_cost: measured`` calibrates from the verify steps' measured wall time (``verify_scale``,
    :mod:`scheduler.draft_cost_estimate`). What it keeps: contention the step pays in its own CPU time (cache
    refills after a preemption, caches and memory bandwidth shared with co-tenants), so a profile on a busy
    machine still reads somewhat slower than one on an idle machine."""
    if device.type == "cpu" and torch.get_num_threads() == 1 and thread_clock_usable():
        return thread_cpu_timer
    return wall_clock_timer


def profile_target_sps(
    target: TargetModel,
    *,
    chunk: int,
    max_batch_tokens: int,
    context: int = 64,
    batch_sizes: Sequence[int] | None = None,
    warmup: int = 2,
    repeats: int = 15,
    progress: bool = True,
) -> SPSTable:
    """Measure SPS(B) for B in ``batch_sizes`` (default: a grid up to ``max_batch_tokens``).

    ``chunk`` is the largest verify chunk (block size + 1); each step uses ceil(B / chunk) requests whose
    contexts are ``context`` tokens long, which is what a verify pass of B tokens looks like.
    """
    sizes = list(batch_sizes) if batch_sizes is not None else default_batch_grid(max_batch_tokens)
    max_requests = -(-max(sizes) // chunk)
    cache = target.new_kv_cache(max_requests, context + chunk + 1)
    slots = [cache.allocate() for _ in range(max_requests)]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (max_requests, context), generator=generator)
    batch = target.prepare(cache, [(s, prompt[i].tolist()) for i, s in enumerate(slots)])
    target.forward(
        cache,
        batch,
        logits_rows=torch.empty(0, dtype=torch.int64, device=target.device),
        feature_rows=torch.empty(0, dtype=torch.int64, device=target.device),
    )
    drafts = torch.randint(0, target.vocab_size, (max_requests, chunk), generator=generator).tolist()

    def run_step(batch_tokens: int) -> None:
        chunks, remaining = [], batch_tokens
        for i, slot in enumerate(slots):
            if remaining <= 0:
                break
            n = min(chunk, remaining)
            chunks.append((slot, drafts[i][:n]))
            remaining -= n
        step = target.prepare(cache, chunks)
        target.forward(cache, step)
        for slot, _ in chunks:
            cache.truncate(slot, context)

    timer = cuda_event_timer(target.device) if target.device.type == "cuda" else host_step_timer(target.device)
    try:
        return profile_sps(
            run_step,
            sizes,
            model=str(target.config.name_or_path or "target"),
            device=str(target.device),
            dtype=str(target.dtype).removeprefix("torch."),
            warmup=warmup,
            repeats=repeats,
            timer=timer,
            progress=progress,
        )
    finally:
        for slot in slots:
            cache.free(slot)


def graph_verify_items(
    engine: VerifyEngine, batch_tokens: int, chunk: int, context: int
) -> tuple[list[GraphItem], list[str]]:
    """Scratch requests for a graph-path verify step of ``batch_tokens`` rows: ceil(B / chunk) requests verifying
    chunks of up to ``chunk`` tokens, each over ``context`` cached tokens (prefilled through the engine so the
    cache holds real K/V). Returns the items and the scratch request ids (release them after)."""
    num = -(-batch_tokens // chunk)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, engine.vocab_size, (num, context), generator=generator).tolist()
    ids = [f"sps-{i}" for i in range(num)]
    greedy = SamplingParams(temperature=0.0)
    for begin in range(0, num, 8):  # a few prompts a pass: big eager prefills are not what is measured
        engine.step([PrefillItem(ids[i], prompts[i], greedy) for i in range(begin, min(begin + 8, num))])
    drafts = torch.randint(0, engine.vocab_size, (num, chunk), generator=generator).tolist()
    items, remaining = [], batch_tokens
    for i, req_id in enumerate(ids):
        n = min(chunk, remaining)
        remaining -= n
        slot = engine.slot_of(req_id)
        items.append(GraphItem(slot, engine.cache.length(slot), drafts[i][:n], (0.0, 0, 1.0, 0)))
    return items, ids


def _run_graph_verify(engine: VerifyEngine, step: Sequence[GraphItem]) -> None:
    """One graph-path verify step of ``step``: the verify-only path a round takes (arrays, greedy requests)."""
    assert engine.graphs is not None
    engine.graphs.run_verify(
        np.array([i.slot for i in step], dtype=np.int64),
        np.array([i.start for i in step], dtype=np.int64),
        np.array([i.tokens[0] for i in step] + [t for i in step for t in i.tokens[1:]], dtype=np.int64),
        np.array([len(i.tokens) - 1 for i in step], dtype=np.int64),
        np.tile(np.array([0.0, 1.0], dtype=np.float32), (len(step), 1)),
        np.zeros((len(step), 2), dtype=np.int64),
        [],
    )


def _profile_graph_steps(
    engine: VerifyEngine, run_step: Callable[[int], None], sizes: list[int], warmup: int, repeats: int
) -> tuple[SPSTable, list[float]]:
    """SPS(B) of ``run_step(B)`` by :func:`host_step_timer` (the wall clock on a GPU: the step's result copy
    synchronises), and the median device time of its replays per B."""
    runner = engine.graphs
    assert runner is not None
    table = profile_sps(
        run_step,
        sizes,
        model=str(engine.target.config.name_or_path or "target"),
        device=str(engine.target.device),
        dtype=str(engine.target.dtype).removeprefix("torch."),
        warmup=warmup,
        repeats=repeats,
        timer=host_step_timer(engine.target.device),
        progress=False,
    )
    device_times: list[float] = []
    try:
        for b in sizes:
            times = []
            for _ in range(repeats):
                before = runner.step_time_s
                runner.timed = True
                run_step(b)
                runner.timed = False
                times.append(runner.step_time_s - before)
            device_times.append(statistics.median(times))
    finally:
        runner.timed = False
    return table, device_times


def profile_graph_sps(
    engine: VerifyEngine,
    *,
    chunk: int,
    batch_sizes: Sequence[int],
    context: int = 64,
    warmup: int = 2,
    repeats: int = 15,
) -> tuple[SPSTable, list[float]]:
    """SPS(B) of the engine's own graph-path verify step (host packing, replay and result copy: what a round
    pays), and the device time of the replays alone (seconds, median per B). The runner never advances the
    slots, so a step repeats exactly; the scratch requests are released after."""
    if engine.graphs is None:
        raise ValueError("profile_graph_sps needs a VerifyEngine with graphs on")
    sizes = sorted(int(b) for b in batch_sizes)
    items, ids = graph_verify_items(engine, max(sizes), chunk, context)

    def run_step(batch_tokens: int) -> None:
        num = -(-batch_tokens // chunk)
        last = batch_tokens - (num - 1) * chunk
        _run_graph_verify(
            engine, [*items[: num - 1], dataclasses.replace(items[num - 1], tokens=items[num - 1].tokens[:last])]
        )

    try:
        return _profile_graph_steps(engine, run_step, sizes, warmup, repeats)
    finally:
        for req_id in ids:
            engine.release(req_id)


def profile_graph_sps_by_requests(
    engine: VerifyEngine,
    *,
    chunk: int,
    request_counts: Sequence[int],
    context: int = 64,
    warmup: int = 2,
    repeats: int = 15,
) -> tuple[RequestSPS, dict[int, list[float]]]:
    """SPS tables by request count of the engine's graph-path verify step: for every R, the step where R
    requests each verify the anchor and l drafts (B = R * (l + 1), l = 0 .. chunk - 1), as
    :func:`profile_graph_sps` times it; and the replays' device times per R (seconds, one per B). The cost of a
    step of B tokens depends on R too (each request reads its own KV), which a token table cannot tell apart."""
    if engine.graphs is None:
        raise ValueError("profile_graph_sps_by_requests needs a VerifyEngine with graphs on")
    counts = sorted({int(r) for r in request_counts})
    if not counts or counts[0] < 1:
        raise ValueError(f"request counts must be >= 1, got {list(request_counts)}")
    items, ids = graph_verify_items(engine, counts[-1] * chunk, chunk, context)
    tables: dict[int, SPSTable] = {}
    device_times: dict[int, list[float]] = {}
    try:
        for r in counts:

            def run_step(batch_tokens: int, r: int = r) -> None:
                rows = batch_tokens // r
                _run_graph_verify(engine, [dataclasses.replace(i, tokens=i.tokens[:rows]) for i in items[:r]])

            sizes = [r * rows for rows in range(1, chunk + 1)]
            tables[r], device_times[r] = _profile_graph_steps(engine, run_step, sizes, warmup, repeats)
    finally:
        for req_id in ids:
            engine.release(req_id)
    return RequestSPS(tables), device_times
