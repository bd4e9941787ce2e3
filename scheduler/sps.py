"""The SPS table: target forward steps per second as a function of the verify batch size B (in tokens).

Algorithm 1 prices every extra verified token through SPS(B), so the table must be (a) monotone, because the
early stop treats "one more token never makes a step faster" as a fact, and (b) cheap to evaluate at every
B = R .. R + R*gamma each round, which is why it exposes a dense per-integer view that the scheduler slices.

Rules (documented behaviour, not accidents):
- Monotone fix-up: measured steps/s are replaced by their running minimum over ascending B, so a noisy or
  tile-quantised fast point at a larger B never makes the scheduler believe that adding tokens speeds the step
  up. A table that needed fixing is accepted with a `SPSMonotonicityWarning`; the raw measurements are kept.
- Between grid points: linear interpolation of steps/s.
- Below the smallest grid point: clamped to its value (small batches are latency-bound, the step time is
  flat).
- Above the largest grid point: the token throughput B * SPS(B) is held at its last measured value, i.e.
  SPS(B) = SPS(B_max) * B_max / B (the compute-bound regime, where step time grows linearly with tokens).
- Persistence: JSON keyed by model, device and dtype; loading a table that was measured for something else
  warns with `SPSTableMismatchWarning` (the numbers are still usable as a rough prior, but the user should
  know).

SPS by request count (`RequestSPS`): a step's cost depends on how many requests share its B tokens, not on B alone
(each request adds its own KV reads and attention). A token table profiled with few requests verifying long chunks
prices a step of 128 requests verifying 1-2 tokens each far too low (docs/CHANGELOG.md), so `RequestSPS` holds one
table per profiled request count R, each over B = R * (1 .. block + 1), and a round looks its table up by its own R
(`table_for`). Both types answer `table_for`, so the scheduler takes either (`SPSSource`).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from bisect import bisect_left
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

FORMAT = "dspark-sps/1"
BY_REQUESTS_FORMAT = "dspark-sps-by-requests/1"
MEMO_ENTRIES = 64  # derived arrays kept per table (SPSTable.memo), each about 2 * R * gamma floats

Timer = Callable[[Callable[[], object]], float]
"""Runs a thunk once and returns the seconds it took (wall clock by default; CUDA events on GPUs; the calling
thread's CPU time for a CPU step on one thread, `thread_cpu_timer`)."""
#: The finest thread CPU clock that `thread_clock_usable` accepts: a coarser one (a scheduler tick, on some
#: platforms) would read a short step as 0 s.
THREAD_CLOCK_RESOLUTION_S = 1e-6


class SPSMonotonicityWarning(UserWarning):
    """The measured steps/s rose with B somewhere and were replaced by their running minimum."""


class SPSTableMismatchWarning(UserWarning):
    """A loaded SPS table was measured for another model, device or dtype than the caller expects."""


class SPSTable:
    """Steps per second SPS(B) of the target's verify step at B batched tokens.

    `steps_per_second(B)` evaluates anywhere (B >= 1); `dense(max_b)` returns an array `d` with `d[B] =
    SPS(B)` for every integer 0 <= B <= max_b (d[0] repeats SPS(1); B = 0 never occurs), grown and cached on
    demand so the scheduler's hot path is a slice, not an interpolation.
    """

    def __init__(
        self,
        batch_sizes: Sequence[int] | np.ndarray,
        steps_per_s: Sequence[float] | np.ndarray,
        *,
        model: str = "",
        device: str = "",
        dtype: str = "",
    ) -> None:
        try:
            sizes = np.asarray(batch_sizes, dtype=np.float64)
            rates = np.asarray(steps_per_s, dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise ValueError(f"SPS table needs numbers ({error})") from None
        if sizes.ndim != 1 or rates.ndim != 1 or sizes.shape != rates.shape:
            raise ValueError(
                f"SPS table needs two 1-D arrays of equal length, got shapes {sizes.shape} and {rates.shape}"
            )
        if sizes.size == 0:
            raise ValueError("SPS table is empty: profile at least one batch size")
        if not np.all(np.isfinite(sizes)) or np.any(sizes != np.round(sizes)):
            raise ValueError(f"SPS batch sizes must be integers, got {sizes.tolist()}")
        sizes = sizes.astype(np.int64)
        if np.any(sizes < 1):
            raise ValueError(f"SPS batch sizes must be >= 1, got {sizes.tolist()}")
        if not np.all(np.isfinite(rates)) or np.any(rates <= 0):
            raise ValueError(f"SPS steps/s must be finite and > 0, got {rates.tolist()}")
        order = np.argsort(sizes, kind="stable")
        sizes, rates = sizes[order], rates[order]
        if np.any(np.diff(sizes) == 0):
            raise ValueError(f"SPS batch sizes must be unique, got {sizes.tolist()}")
        fixed = np.minimum.accumulate(rates)
        if np.any(fixed != rates):
            bad = sizes[fixed != rates].tolist()
            warnings.warn(
                f"SPS table is not non-increasing in B (faster at B={bad} than at a smaller B); "
                "replaced by the running minimum",
                SPSMonotonicityWarning,
                stacklevel=2,
            )
        self.batch_sizes: np.ndarray = sizes
        self.measured_steps_per_s: np.ndarray = rates
        self.steps_per_s: np.ndarray = fixed
        self.model = model
        self.device = device
        self.dtype = dtype
        self._dense = np.empty(0, dtype=np.float64)
        self._dense_step_time = np.empty(0, dtype=np.float64)
        self._memo: dict[Hashable, Any] = {}

    def __repr__(self) -> str:
        points = ", ".join(f"{b}:{s:.4g}" for b, s in zip(self.batch_sizes, self.steps_per_s, strict=True))
        return f"SPSTable(model={self.model!r}, device={self.device!r}, dtype={self.dtype!r}, {{{points}}})"

    def steps_per_second(self, batch_tokens: int | np.ndarray) -> np.ndarray:
        """SPS at any B >= 1 (vectorised): interpolated, clamped below, constant tokens/s above."""
        b = np.asarray(batch_tokens, dtype=np.float64)
        if np.any(~np.isfinite(b)) or np.any(b < 1):
            raise ValueError("batch tokens must be finite and >= 1")
        inside = np.interp(b, self.batch_sizes, self.steps_per_s)
        b_max = float(self.batch_sizes[-1])
        above = self.steps_per_s[-1] * b_max / np.maximum(b, b_max)
        return np.where(b > b_max, above, inside)

    def __call__(self, batch_tokens: int | np.ndarray) -> np.ndarray:
        return self.steps_per_second(batch_tokens)

    def table_for(self, num_requests: int) -> SPSTable:
        """The table for a round of ``num_requests`` requests: this one (a token table ignores R)."""
        return self

    def scaled(self, factor: float) -> SPSTable:
        """The same curve for steps ``factor`` times as long (steps/s divided by it): a table profiled on idle
        requests, calibrated to the verify times measured under load (longer contexts, joining prompts'
        prefill in the same pass), which the profile's shape describes but not its scale."""
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"SPS scale factor must be a finite number > 0, got {factor!r}")
        with warnings.catch_warnings():  # a non-monotone measurement warned when this table was built
            warnings.simplefilter("ignore", SPSMonotonicityWarning)
            return SPSTable(
                self.batch_sizes,
                self.measured_steps_per_s / factor,
                model=self.model,
                device=self.device,
                dtype=self.dtype,
            )

    def _grow(self, max_batch_tokens: int) -> None:
        size = 1 << max(10, int(max_batch_tokens).bit_length())
        dense = self.steps_per_second(np.arange(size, dtype=np.float64).clip(min=1))
        # Float rounding in interpolation must not break the exact monotonicity the early stop relies on.
        dense = np.minimum.accumulate(dense)
        self._dense_step_time = 1.0 / dense
        self._dense = dense

    def dense(self, max_batch_tokens: int) -> np.ndarray:
        """`d[B] = SPS(B)` for all integers 0 <= B <= max_batch_tokens (or more): exactly non-increasing."""
        if max_batch_tokens >= self._dense.size:
            self._grow(max_batch_tokens)
        return self._dense

    def dense_step_time(self, max_batch_tokens: int) -> np.ndarray:
        """`t[B] = 1 / SPS(B)` seconds per verify step, same indexing and growth as `dense`."""
        if max_batch_tokens >= self._dense_step_time.size:
            self._grow(max_batch_tokens)
        return self._dense_step_time

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` cached under ``key``: per-table derivatives the scheduler would otherwise recompute every
        round (Algorithm 1's price curve for one R and draft cost, the gate's round times). The table never
        changes after construction, so an entry never goes stale; all go once ``MEMO_ENTRIES`` are held (R and a
        measured draft cost change while serving, so keys come and go)."""
        value = self._memo.get(key)
        if value is None:
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()  # atomic, unlike evicting one entry, when several threads schedule at once
            value = self._memo[key] = build()
        return value

    def __getstate__(self) -> dict[str, Any]:
        """Pickled / copied without the memo: it is rebuilt on demand where the table is used."""
        return {**self.__dict__, "_memo": {}}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "batch_sizes": self.batch_sizes.tolist(),
            "steps_per_s": self.measured_steps_per_s.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SPSTable:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not an SPS table (expected format {FORMAT!r})")
        try:
            return cls(
                data["batch_sizes"],
                data["steps_per_s"],
                model=str(data.get("model", "")),
                device=str(data.get("device", "")),
                dtype=str(data.get("dtype", "")),
            )
        except KeyError as missing:
            raise ValueError(f"SPS table JSON lacks {missing}") from None

    def save(self, path: str | Path) -> Path:
        """Writes the raw measurements (the fix-up is re-applied on load, so nothing is lost)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> SPSTable:
        """Loads a table; warns when it was measured for another model/device/dtype than the ones given."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        table = cls.from_dict(data)
        expected = {"model": model, "device": device, "dtype": dtype}
        mismatches = [
            f"{key} {getattr(table, key)!r} != {want!r}"
            for key, want in expected.items()
            if want is not None and getattr(table, key) != want
        ]
        if mismatches:
            warnings.warn(
                f"SPS table {path} was measured for another setup ({'; '.join(mismatches)}); "
                "re-profile for accurate scheduling",
                SPSTableMismatchWarning,
                stacklevel=2,
            )
        return table


class RequestSPS:
    """SPS tables by request count: ``tables[R]`` is SPS(B) of steps where R requests share the B tokens.

    ``table_for(R)`` returns the table of the smallest profiled count >= R (a step of fewer requests is not
    slower, so the price errs high, never low), or of the largest count when R exceeds them all.
    """

    def __init__(self, tables: Mapping[int, SPSTable]) -> None:
        if not isinstance(tables, Mapping) or not tables:
            raise ValueError("SPS by request count needs at least one (request count, SPSTable) pair")
        for count, table in tables.items():
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
                raise ValueError(f"request counts must be integers >= 1, got {count!r}")
            if not isinstance(table, SPSTable):
                raise ValueError(f"the table for R={count} must be an SPSTable, got {type(table).__name__}")
        self.request_counts: tuple[int, ...] = tuple(sorted(int(c) for c in tables))
        self.tables: dict[int, SPSTable] = {int(c): tables[c] for c in self.request_counts}

    def __repr__(self) -> str:
        return f"RequestSPS({self.tables!r})"

    def table_for(self, num_requests: int) -> SPSTable:
        """The table profiled at the smallest request count >= ``num_requests`` (the largest if none is)."""
        index = min(bisect_left(self.request_counts, num_requests), len(self.request_counts) - 1)
        return self.tables[self.request_counts[index]]

    def scaled(self, factor: float) -> RequestSPS:
        """Every table scaled alike (:meth:`SPSTable.scaled`)."""
        return RequestSPS({count: table.scaled(factor) for count, table in self.tables.items()})

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": BY_REQUESTS_FORMAT,
            "tables": [{"requests": c, "sps": self.tables[c].to_dict()} for c in self.request_counts],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestSPS:
        if not isinstance(data, dict) or data.get("format") != BY_REQUESTS_FORMAT:
            raise ValueError(f"not SPS tables by request count (expected format {BY_REQUESTS_FORMAT!r})")
        entries = data.get("tables")
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("SPS by request count JSON needs a list of {requests, sps} objects under 'tables'")
        try:
            counts = [e["requests"] for e in entries]
            tables = {c: SPSTable.from_dict(e["sps"]) for c, e in zip(counts, entries, strict=True)}
        except KeyError as missing:
            raise ValueError(f"SPS by request count JSON entry lacks {missing}") from None
        if len(tables) != len(counts):
            raise ValueError(f"SPS by request count JSON repeats a request count: {counts}")
        return cls(tables)


SPSSource = SPSTable | RequestSPS
"""What the scheduler prices verify steps with: one token table, or tables by request count."""


def check_sps_source(sps: object) -> None:
    """Raises ValueError unless ``sps`` is an SPSTable or a RequestSPS."""
    if not isinstance(sps, (SPSTable, RequestSPS)):
        raise ValueError(f"sps must be an SPSTable or a RequestSPS, got {type(sps).__name__}")


def load_sps(data: dict[str, Any]) -> SPSSource:
    """An SPS JSON object of either format (a token table, or tables by request count)."""
    if isinstance(data, dict) and data.get("format") == BY_REQUESTS_FORMAT:
        return RequestSPS.from_dict(data)
    return SPSTable.from_dict(data)


def load_sps_file(path: str | Path) -> SPSSource:
    """An SPS JSON file of either format (``SPSTable.load`` for a token table, so its checks still apply)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if isinstance(data, dict) and data.get("format") == BY_REQUESTS_FORMAT:
        return RequestSPS.from_dict(data)
    return SPSTable.load(path)


def wall_clock_timer(thunk: Callable[[], object]) -> float:
    """Seconds `thunk()` took by `time.perf_counter` (right for CPU steps and synchronising GPU steps)."""
    start = time.perf_counter()
    thunk()
    return time.perf_counter() - start


def thread_cpu_timer(thunk: Callable[[], object]) -> float:
    """CPU seconds the calling thread spent in `thunk()` (`time.thread_time_ns`: user and system time, not the
    time the OS gave other threads and processes while the thunk waited for a core).

    Right for a step that runs to completion on the calling thread (torch on a CPU with one intra-op thread);
    wrong when other threads do part of the work (an intra-op pool of several threads, a GPU), whose time it
    does not count. Check `thread_clock_usable` first: a coarse clock reads short steps as 0 s."""
    start = time.thread_time_ns()
    thunk()
    return (time.thread_time_ns() - start) / 1e9


def thread_clock_usable() -> bool:
    """Whether this platform's thread CPU clock resolves steps finer than `THREAD_CLOCK_RESOLUTION_S`."""
    try:
        return time.get_clock_info("thread_time").resolution <= THREAD_CLOCK_RESOLUTION_S
    except (OSError, ValueError):  # no per-thread CPU clock here
        return False


def cuda_event_timer(device: Any = None) -> Timer:
    """A timer measuring GPU time with CUDA events (asynchronous launches are otherwise timed as ~0 s)."""
    import torch

    def timer(thunk: Callable[[], object]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(device)
        start.record(stream)
        thunk()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    return timer


def default_batch_grid(max_batch_tokens: int, *, min_batch_tokens: int = 1) -> list[int]:
    """Powers of two and their 1.5x midpoints in [min, max], plus max: dense where step time bends."""
    if min_batch_tokens < 1 or max_batch_tokens < min_batch_tokens:
        raise ValueError(f"need 1 <= min_batch_tokens <= max_batch_tokens, got {min_batch_tokens}, {max_batch_tokens}")
    grid = {min_batch_tokens, max_batch_tokens}
    power = 1
    while power <= max_batch_tokens:
        for b in (power, power + power // 2):
            if min_batch_tokens <= b <= max_batch_tokens:
                grid.add(b)
        power *= 2
    return sorted(grid)


def profile_sps(
    run_step: Callable[[int], object],
    batch_sizes: Sequence[int],
    *,
    model: str = "",
    device: str = "",
    dtype: str = "",
    warmup: int = 3,
    repeats: int = 15,
    timer: Timer = wall_clock_timer,
    progress: bool = True,
) -> SPSTable:
    """Measures SPS(B) = 1 / step time of `run_step(B)` for each B: `warmup` untimed passes over every B, then
    `repeats` timed passes, each timing one step at every B (ascending, then descending: slow drift cancels).

    The step time of B is the table's shape times its level. The shape is the median over the passes of B's
    time relative to its own pass (divided by the pass's geometric mean over B); the level is the lower
    quartile of the passes' geometric means. Why: on a shared machine a co-tenant slows whole stretches of
    time, so it moves a pass's level, not the ratios within it, and Algorithm 1's choices depend on the ratios
    between Bs (with a plain objective, only on them); a co-tenant only ever slows a pass down, so the faster
    passes are the machine's own speed, and a quartile rather than the minimum keeps one lucky pass out. Passes
    rather than all the repeats of one B in a row, so that a burst hits one pass of every B instead of one B.
    Warm-up absorbs lazy allocation (the largest B first touches the most memory), autotuning and CUDA-graph
    capture. On GPUs pass `timer=cuda_event_timer()` (or make `run_step` synchronise and keep the wall clock);
    on a CPU with one intra-op thread, `timer=thread_cpu_timer`, which leaves out the time co-tenants hold the
    core (the statistics above then only have to absorb what contention still adds to the step's own CPU
    time: cache refills after a preemption, shared caches and memory bandwidth).
    """
    sizes = [int(b) for b in batch_sizes]
    if not sizes:
        raise ValueError("profile_sps needs at least one batch size")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
    if min(sizes) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {min(sizes)}")
    for _ in range(warmup):
        for b in sizes:
            run_step(b)
    times = np.empty((repeats, len(sizes)))  # [pass, B]
    for timed_pass in tqdm(range(repeats), desc="SPS profile", unit="pass", disable=not progress):
        order = range(len(sizes)) if timed_pass % 2 == 0 else range(len(sizes) - 1, -1, -1)
        for k in order:
            times[timed_pass, k] = timer(partial(run_step, sizes[k]))
    bad = ~(times > 0).all(axis=0)
    if bad.any():
        raise ValueError(f"timer returned a non-positive step time at B={sizes[int(np.argmax(bad))]}")
    levels = np.exp(np.log(times).mean(axis=1))
    shape = np.median(times / levels[:, None], axis=0)
    rates = (1.0 / (shape * np.quantile(levels, 0.25))).tolist()
    return SPSTable(sizes, rates, model=model, device=device, dtype=dtype)
