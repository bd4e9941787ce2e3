"""Sequential Temperature Scaling (STS): making prefix products of confidences true probabilities.

Algorithm 1 adds a[r, j] = prod_{i<=j} c[r, i] to the expected accepted tokens, so what has to be calibrated
is the cumulative product, not each c on its own. STS fits one temperature T_k per position, left to right:
with T_1..T_{k-1} fixed, T_k is grid-searched to minimise the ECE of prod_{i<=k} sigmoid(z_i / T_i) against
the outcome "positions 1..k were all accepted". A temperature keeps the order of confidences at its position.

Traces and censoring. A trace is one request-round: confidence logits z[1..gamma], `verified` (how many draft
positions the verifier scored, 0..gamma) and `accepted` (how many of those it accepted, 0..verified). The
label of prefix k is 1{accepted >= k}. It is OBSERVED only when position k was verified (k <= verified): then
either the rejection fell at or before k (label 0) or k was accepted (label 1). Positions beyond `verified`
are unobserved and left out. We deliberately also leave out the known zeros of traces rejected before k but
not verified up to k: keeping them while the survivors of the same traces are unobservable would select on the
outcome and bias the estimate towards 0. With only "k was verified" as the selection, the choice of which
positions get verified is made by the scheduler before verification (from confidences, never from outcomes),
so the kept labels are missing at random given the draft and the ECE is unbiased under that assumption.
Offline traces verify all gamma positions (no censoring at all).

ECE: equal-width bins on [0, 1] (15 by default), sum over bins of (bin count / total) * |mean prediction -
mean label|. Per-position ECE is reported, and a pooled ECE over all observed (trace, position) prefix
products.

Online mode (`OnlineSTS`): a ring buffer of the latest live traces; every `check_every` records the pooled ECE
of the current calibration on the window is compared with a bound, and STS is refitted on the window when it
drifts past it. Safe for one asyncio loop (no awaits inside) and for a refit moved to a worker thread: state
changes hold a lock, the fit runs on a snapshot, and the calibration object is swapped atomically.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "dspark-sts/1"
DEFAULT_TEMPERATURE_GRID = np.geomspace(0.05, 20.0, 241)  # log-uniform, contains 1.0 exactly at index 120
_GRID_CHUNK_ELEMENTS = 1 << 21  # bounds the [temperatures x traces] work array to ~16 MiB


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # exact sigmoid without overflow warnings for large |x|


@dataclass(frozen=True)
class CalibrationTraces:
    """Held-out or live traces: logits [N, gamma] (confidence-head logits), accepted [N], verified [N]."""

    logits: np.ndarray
    accepted: np.ndarray
    verified: np.ndarray

    @classmethod
    def from_arrays(
        cls, logits: np.ndarray, accepted: np.ndarray, verified: np.ndarray | None = None
    ) -> CalibrationTraces:
        """Validates and copies. `verified` defaults to gamma (every position scored, as offline)."""
        z = np.array(logits, dtype=np.float64)
        if z.ndim != 2:
            raise ValueError(f"logits must have shape [N, gamma], got {z.shape}")
        if not np.all(np.isfinite(z)):
            raise ValueError("logits must be finite")
        n, gamma = z.shape
        acc = _as_counts(accepted, n, "accepted")
        ver = np.full(n, gamma, dtype=np.int64) if verified is None else _as_counts(verified, n, "verified")
        if np.any(ver > gamma):
            raise ValueError(f"verified must be <= gamma = {gamma}, got max {int(ver.max())}")
        if np.any(acc > ver):
            raise ValueError("accepted must be <= verified for every trace")
        return cls(z, acc, ver)

    @property
    def gamma(self) -> int:
        return self.logits.shape[1]

    def labels(self) -> tuple[np.ndarray, np.ndarray]:
        """(prefix_survived [N, gamma] float, observed [N, gamma] bool): see the module doc on censoring."""
        k = np.arange(1, self.gamma + 1)
        survived = (k[None, :] <= self.accepted[:, None]).astype(np.float64)
        observed = k[None, :] <= self.verified[:, None]
        return survived, observed


def _as_counts(values: np.ndarray, n: int, name: str) -> np.ndarray:
    try:
        counts = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must hold integers") from None
    if counts.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}], got {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts != np.round(counts)):
        raise ValueError(f"{name} must hold integers")
    counts = counts.astype(np.int64)
    if np.any(counts < 0):
        raise ValueError(f"{name} must be >= 0")
    return counts


def expected_calibration_error(predicted: np.ndarray, outcomes: np.ndarray, num_bins: int = 15) -> float:
    """ECE with equal-width bins on [0, 1]; NaN when there is nothing to measure."""
    p = np.asarray(predicted, dtype=np.float64).ravel()
    y = np.asarray(outcomes, dtype=np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"predicted and outcomes differ in size: {p.size} vs {y.size}")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if p.size == 0:
        return float("nan")
    if not (p.min() >= 0 and p.max() <= 1):
        raise ValueError("predicted probabilities must be finite and in [0, 1]")
    return float(_ece_rows(p[None, :], y, num_bins)[0])


def _ece_rows(predicted: np.ndarray, outcomes: np.ndarray, num_bins: int) -> np.ndarray:
    """ECE of each row of predicted [G, n] against the same outcomes [n], in one bincount."""
    rows, n = predicted.shape
    bins = np.minimum((predicted * num_bins).astype(np.int64), num_bins - 1)
    bins += (np.arange(rows) * num_bins)[:, None]
    flat = bins.ravel()
    gap = np.bincount(flat, weights=predicted.ravel(), minlength=rows * num_bins)
    labels = np.broadcast_to(outcomes, predicted.shape).ravel()
    gap -= np.bincount(flat, weights=labels, minlength=rows * num_bins)
    return np.abs(gap).reshape(rows, num_bins).sum(axis=1) / n


@dataclass(frozen=True)
class STSCalibration:
    """One temperature per draft position; `calibrate(logits)` = sigmoid(logits / T) per position."""

    temperatures: np.ndarray

    def __post_init__(self) -> None:
        t = np.asarray(self.temperatures, dtype=np.float64)
        if t.ndim != 1 or t.size == 0 or not np.all(np.isfinite(t)) or np.any(t <= 0):
            raise ValueError(f"temperatures must be a non-empty 1-D array of finite values > 0, got {t!r}")
        object.__setattr__(self, "temperatures", t)

    @classmethod
    def identity(cls, gamma: int) -> STSCalibration:
        return cls(np.ones(gamma))

    @property
    def gamma(self) -> int:
        return self.temperatures.size

    def calibrate(self, logits: np.ndarray) -> np.ndarray:
        """Calibrated confidences in [0, 1] for logits [..., gamma]."""
        z = np.asarray(logits, dtype=np.float64)
        if z.ndim == 0 or z.shape[-1] != self.gamma:
            raise ValueError(f"logits must end in gamma = {self.gamma} positions, got shape {z.shape}")
        if not np.all(np.isfinite(z)):
            raise ValueError("logits must be finite")
        return _sigmoid(z / self.temperatures)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "temperatures": self.temperatures.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> STSCalibration:
        if not isinstance(data, dict) or data.get("format") != FORMAT or "temperatures" not in data:
            raise ValueError(f"not an STS calibration (expected format {FORMAT!r} with temperatures)")
        return cls(np.asarray(data["temperatures"], dtype=np.float64))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> STSCalibration:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None


def fit_sts(
    traces: CalibrationTraces,
    *,
    temperature_grid: np.ndarray | None = None,
    num_bins: int = 15,
) -> STSCalibration:
    """Left-to-right grid search of T_k minimising the ECE of the calibrated prefix product at position k.

    Ties in ECE go to the temperature closest to 1 (no change unless it helps). A position without observed
    labels keeps T = 1.
    """
    grid = DEFAULT_TEMPERATURE_GRID if temperature_grid is None else np.asarray(temperature_grid, np.float64)
    if grid.ndim != 1 or grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError("temperature_grid must be a non-empty 1-D array of finite values > 0")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    preference = np.argsort(np.abs(np.log(grid)), kind="stable")  # candidates ordered by closeness to T = 1
    survived, observed = traces.labels()
    prefix = np.ones(traces.logits.shape[0])
    temperatures = np.ones(traces.gamma)
    for k in range(traces.gamma):  # sequential by definition: T_k depends on T_1..T_{k-1}
        rows = observed[:, k]
        if rows.any():
            z, base, y = traces.logits[rows, k], prefix[rows], survived[rows, k]
            chunk = max(1, _GRID_CHUNK_ELEMENTS // z.size)
            ece = np.concatenate(
                [
                    _ece_rows(base[None, :] * _sigmoid(z[None, :] / grid[i : i + chunk, None]), y, num_bins)
                    for i in range(0, grid.size, chunk)
                ]
            )
            temperatures[k] = grid[preference[np.argmin(ece[preference])]]
        prefix = prefix * _sigmoid(traces.logits[:, k] / temperatures[k])
    return STSCalibration(temperatures)


@dataclass(frozen=True)
class CalibrationReport:
    """Per-position and pooled ECE of the prefix products, raw (T = 1) versus calibrated."""

    ece_before: np.ndarray
    ece_after: np.ndarray
    pooled_before: float
    pooled_after: float
    observed: np.ndarray  # observed labels per position

    def format(self) -> str:
        lines = [f"{'pos':>4} {'n':>8} {'ECE raw':>9} {'ECE STS':>9}"]
        for k in range(self.ece_before.size):
            lines.append(
                f"{k + 1:>4} {int(self.observed[k]):>8} {self.ece_before[k]:>9.4f} {self.ece_after[k]:>9.4f}"
            )
        total = int(self.observed.sum())
        lines.append(f"{'all':>4} {total:>8} {self.pooled_before:>9.4f} {self.pooled_after:>9.4f}")
        return "\n".join(lines)


def prefix_products(traces: CalibrationTraces, calibration: STSCalibration | None = None) -> np.ndarray:
    """a[n, k] = prod_{i<=k} c[n, i] with c calibrated (or raw sigmoid when calibration is None)."""
    if calibration is None:
        calibration = STSCalibration.identity(traces.gamma)
    return np.cumprod(calibration.calibrate(traces.logits), axis=1)


def prefix_ece(
    traces: CalibrationTraces, calibration: STSCalibration | None = None, num_bins: int = 15
) -> tuple[np.ndarray, float]:
    """(per-position ECE [gamma] (NaN where unobserved), pooled ECE over all observed prefix products)."""
    survived, observed = traces.labels()
    products = prefix_products(traces, calibration)
    per_position = np.array(
        [
            expected_calibration_error(products[observed[:, k], k], survived[observed[:, k], k], num_bins)
            for k in range(traces.gamma)
        ]
    )
    return per_position, expected_calibration_error(products[observed], survived[observed], num_bins)


def calibration_report(
    traces: CalibrationTraces, calibration: STSCalibration, num_bins: int = 15
) -> CalibrationReport:
    before, pooled_before = prefix_ece(traces, None, num_bins)
    after, pooled_after = prefix_ece(traces, calibration, num_bins)
    _, observed = traces.labels()
    return CalibrationReport(before, after, pooled_before, pooled_after, observed.sum(axis=0))


def reliability_diagram(
    traces: CalibrationTraces, calibration: STSCalibration, path: str | Path, num_bins: int = 15
) -> Path:
    """PNG: reliability curves of the pooled prefix products (raw vs STS) and per-position ECE bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    survived, observed = traces.labels()
    report = calibration_report(traces, calibration, num_bins)
    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)
    curves, bars = figure.subplots(1, 2)
    curves.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    for name, cal, pooled in (
        ("raw", None, report.pooled_before),
        ("STS", calibration, report.pooled_after),
    ):
        p = prefix_products(traces, cal)[observed]
        y = survived[observed]
        bins = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
        count = np.bincount(bins, minlength=num_bins)
        keep = count > 0
        mean_p = np.bincount(bins, weights=p, minlength=num_bins)[keep] / count[keep]
        mean_y = np.bincount(bins, weights=y, minlength=num_bins)[keep] / count[keep]
        curves.plot(mean_p, mean_y, marker="o", label=f"{name} (ECE {pooled:.3f})")
    curves.set_xticks(edges[:: max(1, num_bins // 5)])
    curves.set(xlim=(0, 1), ylim=(0, 1), xlabel=r"predicted prefix survival $\prod_{i\leq k} c_i$")
    curves.set_ylabel("observed prefix survival")
    curves.set_title("Reliability of prefix survival (all positions)")
    curves.legend(loc="upper left")
    positions = np.arange(1, traces.gamma + 1)
    bars.bar(positions - 0.2, report.ece_before, width=0.4, label="raw")
    bars.bar(positions + 0.2, report.ece_after, width=0.4, label="STS")
    bars.set(xlabel="draft position k", ylabel=r"ECE of $\prod_{i\leq k} c_i$", title="Per-position ECE")
    bars.legend()
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


class OnlineSTS:
    """STS kept calibrated on live traffic: sliding window of traces, refit when the window's ECE drifts."""

    def __init__(
        self,
        gamma: int,
        *,
        window: int = 8192,
        ece_bound: float = 0.03,
        min_records: int = 1024,
        check_every: int = 512,
        num_bins: int = 15,
        temperature_grid: np.ndarray | None = None,
        initial: STSCalibration | None = None,
    ) -> None:
        if gamma < 1 or window < 1 or min_records < 1 or check_every < 1:
            raise ValueError("gamma, window, min_records and check_every must be >= 1")
        if min_records > window:
            raise ValueError(f"min_records ({min_records}) cannot exceed the window ({window})")
        if not 0 < ece_bound < 1:
            raise ValueError(f"ece_bound must be in (0, 1), got {ece_bound}")
        if initial is not None and initial.gamma != gamma:
            raise ValueError(f"initial calibration has gamma {initial.gamma}, expected {gamma}")
        self.gamma = gamma
        self.window = window
        self.ece_bound = ece_bound
        self.min_records = min_records
        self.check_every = check_every
        self.num_bins = num_bins
        self.temperature_grid = temperature_grid
        self.refits = 0
        self._calibration = initial if initial is not None else STSCalibration.identity(gamma)
        self._logits = np.zeros((window, gamma))
        self._accepted = np.zeros(window, dtype=np.int64)
        self._verified = np.zeros(window, dtype=np.int64)
        self._next = 0
        self._count = 0
        self._since_check = 0
        self._lock = threading.Lock()

    @property
    def calibration(self) -> STSCalibration:
        return self._calibration

    def calibrate(self, logits: np.ndarray) -> np.ndarray:
        """Confidences for the scheduler from raw confidence-head logits [..., gamma]."""
        return self._calibration.calibrate(logits)

    def record(self, logits: np.ndarray, accepted: np.ndarray, verified: np.ndarray) -> bool:
        """Adds one round's outcomes (raw logits [R, gamma]); returns True when this triggered a refit."""
        batch = CalibrationTraces.from_arrays(logits, accepted, verified)
        if batch.gamma != self.gamma:
            raise ValueError(f"logits have gamma {batch.gamma}, expected {self.gamma}")
        n = min(batch.logits.shape[0], self.window)
        with self._lock:
            slots = (self._next + np.arange(n)) % self.window
            self._logits[slots] = batch.logits[-n:]
            self._accepted[slots] = batch.accepted[-n:]
            self._verified[slots] = batch.verified[-n:]
            self._next = int((self._next + n) % self.window)
            self._count = min(self._count + n, self.window)
            self._since_check += batch.logits.shape[0]
            due = self._since_check >= self.check_every and self._count >= self.min_records
            if due:
                self._since_check = 0
        return self.check() if due else False

    def window_traces(self) -> CalibrationTraces:
        """A snapshot (copy) of the traces in the window."""
        with self._lock:
            count = self._count
            return CalibrationTraces(
                self._logits[:count].copy(), self._accepted[:count].copy(), self._verified[:count].copy()
            )

    def window_ece(self) -> float:
        """Pooled prefix-product ECE of the current calibration on the window (NaN when empty)."""
        return prefix_ece(self.window_traces(), self._calibration, self.num_bins)[1]

    def check(self) -> bool:
        """Refits when the window's ECE exceeds the bound; returns whether it refitted."""
        traces = self.window_traces()
        if traces.logits.shape[0] < self.min_records:
            return False
        ece = prefix_ece(traces, self._calibration, self.num_bins)[1]
        if not ece > self.ece_bound:
            return False
        calibration = fit_sts(traces, temperature_grid=self.temperature_grid, num_bins=self.num_bins)
        with self._lock:
            self._calibration = calibration
            self.refits += 1
        return True


def main(argv: list[str] | None = None) -> None:
    """`python -m scheduler.sts TRACES.npz --out sts.json [--plot reliability.png]`: fit, report, save.

    TRACES.npz holds `logits` [N, gamma], `accepted` [N] and optionally `verified` [N] (default: gamma).
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m scheduler.sts", description=main.__doc__)
    parser.add_argument("traces", type=Path, help="held-out traces (.npz with logits, accepted[, verified])")
    parser.add_argument(
        "--out", type=Path, required=True, help="where to write the fitted temperatures (JSON)"
    )
    parser.add_argument("--plot", type=Path, help="also write a reliability diagram (PNG)")
    parser.add_argument("--bins", type=int, default=15)
    args = parser.parse_args(argv)
    with np.load(args.traces) as data:
        missing = {"logits", "accepted"} - set(data.files)
        if missing:
            parser.error(f"{args.traces} lacks {sorted(missing)}")
        verified = data["verified"] if "verified" in data.files else None
        traces = CalibrationTraces.from_arrays(data["logits"], data["accepted"], verified)
    calibration = fit_sts(traces, num_bins=args.bins)
    calibration.save(args.out)
    print(calibration_report(traces, calibration, args.bins).format())
    print("temperatures:", " ".join(f"{t:.3f}" for t in calibration.temperatures))
    if args.plot:
        print("reliability diagram:", reliability_diagram(traces, calibration, args.plot, args.bins))


if __name__ == "__main__":
    main()
