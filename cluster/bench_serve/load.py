"""Load shapes: how a level sends its requests, when its measured window opens and closes.

- closed loop at concurrency C: C users, each sending its next request as soon as its last one ended. Warm-up
  lasts until every user finished ``warmup_requests`` requests (and at least ``warmup_s`` passed), so the first
  requests at a new batch size (compilation, graph capture) stay out of the numbers. The measured window is then
  ``duration_s`` long, and counts the requests that *ended* inside it (a steady-state rate: the load never pauses,
  and requests still running when it closes are cancelled, not waited for); or it is the next ``num_requests``
  requests, started once every user is done warming up and waited for (the server's counters then cover exactly
  the measured requests).
- open loop at rate λ: arrivals with gaps drawn from a gamma distribution of shape ``burstiness`` and mean 1/λ
  (1: Poisson; below 1: burstier; ``inf``: all at once), optionally capped at ``max_concurrency`` in flight. The
  first ``warmup_requests`` arrivals (and those of the first ``warmup_s``) warm up; the requests that arrive in
  the next ``duration_s`` (or the next ``num_requests``) are measured and waited for.
- a trace: the open loop with the trace's own arrival times, divided by a speed-up factor.

The order of requests is the workload's, from its start at every level, so levels and servers see the same ones.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from tqdm import tqdm

from cluster.bench_serve.stats import RequestRecord, distribution
from cluster.bench_serve.workload import BenchRequest

Kind = Literal["closed", "open", "trace"]
Send = Callable[[BenchRequest, int], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class LoadLevel:
    """One point of a sweep: a concurrency (closed), a request rate in requests/s (open) or a trace speed-up."""

    kind: Kind
    value: float

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"c={int(self.value)}"
        if self.kind == "open":
            return "rate=inf" if math.isinf(self.value) else f"rate={self.value:g}/s"
        return f"trace x{self.value:g}"


@dataclass(frozen=True)
class Window:
    """Warm-up and measured window of every level (exactly one of ``duration_s`` and ``num_requests``)."""

    duration_s: float | None = None
    num_requests: int | None = None
    warmup_requests: int = 1
    warmup_s: float = 0.0
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of a measured duration and a request count")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"measured duration must be positive, got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"request count must be at least 1, got {self.num_requests}")
        if self.warmup_requests < 0 or self.warmup_s < 0:
            raise ValueError("warm-up must not be negative")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")


@dataclass
class LevelRun:
    """The measured requests of a level, its window ``[t0, t1]`` on the ``perf_counter`` clock, and how many
    requests were cut off unfinished when a duration window closed.

    ``first_wave``: in a closed loop, the first request of every user (a warm-up request unless the warm-up is
    zero requests), in the order they ended: what the first requests at a new concurrency cost against the steady
    state (compilation or graph capture that the server's start-up warm-up missed shows here). Empty for open
    loops and traces."""

    records: list[RequestRecord]
    t0: float
    t1: float
    unfinished: int = 0
    first_wave: list[RequestRecord] = field(default_factory=list)

    @property
    def window_s(self) -> float:
        return max(self.t1 - self.t0, 1e-9)


Hook = Callable[[], Awaitable[None]]


class LoopLag:
    """How late the client's own event loop wakes up while a level runs: a busy client delays reading chunks,
    which shows as short ITL bursts and long TTFT that are the client's, not the server's. A level whose lag
    p99 reaches milliseconds measured the client too."""

    PERIOD_S = 0.005

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.PERIOD_S
            await asyncio.sleep(self.PERIOD_S)
            self.lags.append(max(0.0, loop.time() - due))

    def __enter__(self) -> LoopLag:
        self._task = asyncio.ensure_future(self._probe())
        return self

    def __exit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict[str, float | None]:
        return self.summarize(self.lags)

    @staticmethod
    def summarize(lags: Sequence[float]) -> dict[str, float | None]:
        """Mean and percentiles of ``lags`` in milliseconds."""
        return {k: None if v is None else v * 1e3 for k, v in distribution(lags).items()}


async def run_closed(
    send: Send,
    requests: Sequence[BenchRequest],
    concurrency: int,
    window: Window,
    *,
    on_measure_start: Hook,
    label: str = "",
    progress: bool = True,
) -> LevelRun:
    """Closed loop of ``concurrency`` users over ``requests`` (cycled in order); see the module docstring."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    order = itertools.cycle(range(len(requests)))
    warm_users = 0
    warmed = asyncio.Event() if window.warmup_requests else None
    measuring = asyncio.Event()
    stop = False
    t0 = math.inf
    measured: list[RequestRecord] = []
    first_wave: list[RequestRecord] = []
    started_measured = 0
    bar = _bar(window, label, progress)

    async def user() -> None:
        nonlocal warm_users, started_measured
        finished = 0
        while not stop:
            if window.num_requests is not None and measuring.is_set():
                if started_measured >= window.num_requests:
                    return
                started_measured += 1
            index = next(order)
            record = await send(requests[index], index)
            finished += 1
            if finished == 1:
                first_wave.append(record)
            if warmed is not None and finished == window.warmup_requests:
                warm_users += 1
                if warm_users == concurrency:
                    warmed.set()
                if window.num_requests is not None:
                    await measuring.wait()  # a counted window starts from an idle server: exact counter deltas
            if window.duration_s is not None:
                counted = t0 <= record.end_s <= t0 + window.duration_s
            else:
                counted = record.start_s >= t0
            if counted:
                measured.append(record)
                _advance(bar, window, t0, record)

    users = [asyncio.create_task(user()) for _ in range(concurrency)]
    try:
        if warmed is not None:
            await _first(warmed.wait(), users)
        await _sleep_unless_done(window.warmup_s, users)
        await on_measure_start()
        t0 = time.perf_counter()
        measuring.set()
        _start(bar)
        if window.duration_s is not None:
            await _sleep_unless_done(window.duration_s, users)
            t1 = t0 + window.duration_s
            stop = True
            unfinished = sum(not u.done() for u in users)
            return LevelRun([r for r in measured if r.end_s <= t1], t0, t1, unfinished, first_wave)
        await asyncio.gather(*users)
        return LevelRun(measured, t0, max((r.end_s for r in measured), default=t0), first_wave=first_wave)
    finally:
        stop = True
        for u in users:
            u.cancel()
        await asyncio.gather(*users, return_exceptions=True)
        if bar is not None:
            bar.close()


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """``count`` arrival offsets (seconds) of a gamma renewal process of mean rate ``rate`` (``inf``: all at 0)."""
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return np.zeros(count)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if count else np.zeros(0)


async def run_open(
    send: Send,
    requests: Sequence[BenchRequest],
    level: LoadLevel,
    window: Window,
    *,
    on_measure_start: Hook,
    label: str = "",
    progress: bool = True,
) -> LevelRun:
    """Open loop (``level.kind`` ``open``: generated arrivals; ``trace``: the requests' own, sped up)."""
    schedule = _schedule(requests, level, window)
    limit = asyncio.Semaphore(window.max_concurrency) if window.max_concurrency else None
    first_measured = min(_first_measured(np.array([at for at, _ in schedule]), window), len(schedule))
    if window.num_requests is not None:
        schedule = schedule[: first_measured + window.num_requests]
    measured: list[RequestRecord] = []
    bar = _bar(window, label, progress, total=len(schedule) - first_measured)
    begin = time.perf_counter()
    t0 = math.inf

    async def one(index: int, request_index: int) -> None:
        if limit is not None:
            async with limit:
                record = await send(requests[request_index], request_index)
        else:
            record = await send(requests[request_index], request_index)
        if index >= first_measured:
            measured.append(record)
            if bar is not None:
                bar.update(1)

    tasks: list[asyncio.Task[None]] = []
    try:
        for index, (at, request_index) in enumerate(schedule):
            delay = begin + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if index == first_measured:
                await on_measure_start()
                t0 = time.perf_counter()
                _start(bar)
            tasks.append(asyncio.create_task(one(index, request_index)))
        if t0 == math.inf:  # every request was warm-up
            await on_measure_start()
            t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        return LevelRun(measured, t0, max((r.end_s for r in measured), default=t0))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if bar is not None:
            bar.close()


def _schedule(requests: Sequence[BenchRequest], level: LoadLevel, window: Window) -> list[tuple[float, int]]:
    """(arrival offset, request index) of every request the level sends, warm-up included, in arrival order."""
    if level.kind == "trace":
        if not level.value > 0:
            raise ValueError(f"trace speed-up must be positive, got {level.value}")
        return [((r.arrival_s or 0.0) / level.value, i) for i, r in enumerate(requests)]
    if window.duration_s is not None and math.isinf(level.value):
        raise ValueError("an infinite request rate sends everything at once: measure it by a request count")
    in_warmup_s = 0 if math.isinf(level.value) else math.ceil(level.value * window.warmup_s)
    expected_warmup = window.warmup_requests + in_warmup_s
    if window.num_requests is not None:
        count = expected_warmup + window.num_requests
        while True:  # enough arrivals that num_requests of them come after the warm-up
            times = arrival_times(count, level.value, window.burstiness, window.seed)
            if len(times) - _first_measured(times, window) >= window.num_requests:
                break
            count *= 2
    else:
        assert window.duration_s is not None
        count = expected_warmup + math.ceil(level.value * window.duration_s) + 16
        while True:  # enough arrivals to cover the measured window
            times = arrival_times(count, level.value, window.burstiness, window.seed)
            first = _first_measured(times, window)
            if first < len(times) and times[-1] >= times[first] + window.duration_s:
                break
            count *= 2
        times = times[times < times[first] + window.duration_s]
    return [(float(at), i % len(requests)) for i, at in enumerate(times)]


def _first_measured(times: np.ndarray, window: Window) -> int:
    """Index of the first arrival past the warm-up (its count and its time)."""
    late = int(np.searchsorted(times, window.warmup_s, side="left"))
    return max(window.warmup_requests, late)


async def _first(awaitable: Awaitable[object], users: Sequence[asyncio.Task[None]]) -> None:
    """Wait for ``awaitable``, but return early (re-raising a user's error) when every user task has ended."""
    waiter = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait([waiter, *users], return_when=asyncio.FIRST_COMPLETED)
        while not waiter.done():
            pending = [u for u in users if not u.done()]
            for u in users:
                if u.done() and u.exception() is not None:
                    raise u.exception()  # type: ignore[misc]
            if not pending:
                return
            await asyncio.wait([waiter, *pending], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def _sleep_unless_done(seconds: float, users: Sequence[asyncio.Task[None]]) -> None:
    """Sleep ``seconds`` unless every user ends first; a user that failed re-raises its error here."""
    if seconds <= 0:
        return
    await _first(asyncio.sleep(seconds), users)


def _bar(window: Window, label: str, enabled: bool, total: int | None = None) -> tqdm | None:
    if not enabled:
        return None
    if window.duration_s is not None and total is None:
        return tqdm(total=round(window.duration_s, 1), desc=f"{label} warm-up", leave=False,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s [{elapsed}]")
    return tqdm(total=total if total is not None else window.num_requests, desc=f"{label} warm-up", unit="req",
                leave=False)


def _start(bar: tqdm | None) -> None:
    if bar is not None:
        bar.set_description(bar.desc.replace(" warm-up", ""))


def _advance(bar: tqdm | None, window: Window, t0: float, record: RequestRecord) -> None:
    if bar is None:
        return
    if window.duration_s is None:
        bar.update(1)
    else:
        bar.n = round(min(record.end_s - t0, window.duration_s), 1)
        bar.refresh()
