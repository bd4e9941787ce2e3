"""A closed-loop level spread over several client processes, so that the client is never what is measured.

One Python process parses a few thousand streamed chunks per second (the ``openai`` client's typed chunks); a
server emitting one token per chunk at hundreds of concurrent requests outruns it, and the client's lateness then
passes for the server's latency (it shows as :class:`~cluster.bench_serve.load.LoopLag`). Here each of P
processes runs :func:`~cluster.bench_serve.load.run_closed` for its share of the users over its share of the
workload (every P-th request, in order). The processes meet twice on barriers: once every user of every process
has warmed up (the parent then reads the server's counters), and to open the measured window together. The parent
merges their requests into one level; the window is the common one (``perf_counter`` is the system's monotonic
clock, the same in every process).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cluster.bench_serve.client import RequestOptions, make_client, send
from cluster.bench_serve.load import LevelRun, LoopLag, Window, run_closed
from cluster.bench_serve.stats import RequestRecord
from cluster.bench_serve.workload import BenchRequest


@dataclass(frozen=True)
class _Share:
    """What one client process runs: its users, its requests (with their indices in the whole workload)."""

    base_url: str
    api_key: str | None
    timeout_s: float
    options: RequestOptions
    requests: tuple[BenchRequest, ...]
    indices: tuple[int, ...]
    users: int
    window: Window


def _child(share: _Share, warmed: Any, go: Any, out: Any) -> None:
    """Entry point of a client process: run the share, send back (records, t0, t1, unfinished, loop lags, first
    wave)."""

    async def main() -> tuple[list[RequestRecord], float, float, int, list[float], list[RequestRecord]]:
        client = make_client(share.base_url, share.api_key, share.timeout_s)

        async def one(request: BenchRequest, local: int) -> RequestRecord:
            return await send(client, request, share.options, share.indices[local])

        async def meet() -> None:
            await asyncio.to_thread(warmed.wait)
            await asyncio.to_thread(go.wait)

        try:
            with LoopLag() as lag:
                run = await run_closed(one, share.requests, share.users, share.window, on_measure_start=meet,
                                       progress=False)
            return run.records, run.t0, run.t1, run.unfinished, lag.lags, run.first_wave
        finally:
            await client.close()

    try:
        out.send(("ok", asyncio.run(main())))
    except BaseException as error:  # the parent reports it; a child must not die silently behind a barrier
        warmed.abort()
        go.abort()
        out.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        out.close()


def shares(concurrency: int, processes: int) -> list[int]:
    """Users per process: ``concurrency`` split as evenly as possible over at most ``processes`` processes."""
    count = max(1, min(processes, concurrency))
    return [concurrency // count + (i < concurrency % count) for i in range(count)]


async def run_closed_fanout(
    base_url: str,
    api_key: str | None,
    timeout_s: float,
    options: RequestOptions,
    requests: Sequence[BenchRequest],
    concurrency: int,
    processes: int,
    window: Window,
    *,
    on_measure_start: Callable[[], Awaitable[None]],
) -> tuple[LevelRun, list[float]]:
    """The closed loop of ``concurrency`` users over ``processes`` client processes; returns the merged level and
    every process's event-loop lags. Raises ``RuntimeError`` naming the failure when a process fails."""
    users = shares(concurrency, processes)
    if window.num_requests is not None and window.num_requests < len(users):
        raise ValueError(f"{window.num_requests} measured requests cannot be spread over {len(users)} processes")
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding an event loop and sockets
    warmed, go = ctx.Barrier(len(users) + 1), ctx.Barrier(len(users) + 1)
    procs, pipes = [], []
    for k, n in enumerate(users):
        indices = tuple(range(k, len(requests), len(users))) or (k % len(requests),)
        part = window
        if window.num_requests is not None:
            count = window.num_requests // len(users) + (k < window.num_requests % len(users))
            part = replace(window, num_requests=count)
        share = _Share(base_url, api_key, timeout_s, options, tuple(requests[i] for i in indices), indices, n, part)
        receive, send_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(share, warmed, go, send_end), daemon=True)
        proc.start()
        send_end.close()
        procs.append(proc)
        pipes.append(receive)
    try:
        try:
            await asyncio.to_thread(warmed.wait)
            await on_measure_start()
            await asyncio.to_thread(go.wait)
        except threading.BrokenBarrierError:
            pass  # a process failed: its message comes through its pipe below
        results = [await asyncio.to_thread(_receive, pipe) for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failures = [r[1] for r in results if r[0] != "ok"]
    if failures:
        raise RuntimeError(f"a client process failed: {failures[0]}")
    runs = [r[1] for r in results]
    records = [rec for run in runs for rec in run[0]]
    t0 = min(run[1] for run in runs)
    t1 = t0 + window.duration_s if window.duration_s is not None else max(run[2] for run in runs)
    lags = [lag for run in runs for lag in run[4]]
    first_wave = sorted((rec for run in runs for rec in run[5]), key=lambda rec: rec.end_s)
    return LevelRun(records, t0, t1, sum(run[3] for run in runs), first_wave), lags


def _receive(pipe: Any) -> tuple[str, Any]:
    try:
        return pipe.recv()
    except EOFError:
        return ("error", "the process exited without a result")
