"""Workloads: when requests arrive and how many prompt and output tokens each has.

Three sources, one result (:class:`Workload`, arrays sorted by arrival):
- Poisson arrivals at ``rate`` requests/s;
- bursty arrivals: gamma-distributed gaps with mean 1 / rate and coefficient of variation ``cv`` (cv = 1 is
  Poisson; cv > 1 clusters requests into bursts);
- a replayed request log: one request per line, ``arrival_s input_tokens output_tokens`` (whitespace or commas;
  blank lines and lines starting with ``#`` are skipped).
Lengths of generated requests follow a :class:`LengthSpec`: ``N`` (fixed), ``uniform:A:B`` (integers A..B) or
``lognormal:MEDIAN:SIGMA:MAX`` (rounded, clipped to 1..MAX). Output lengths are exact: the simulator decodes
every request to its output length (no early stop token).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """A workload specification or request log that cannot be used (message says which and why)."""


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival: ``arrival_s`` [n] float, ``input_tokens`` and ``output_tokens`` [n] int >= 1."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = self.arrival_s.size
        if self.input_tokens.shape != (n,) or self.output_tokens.shape != (n,):
            raise WorkloadError("arrival, input and output arrays need one entry per request")
        if n and (np.any(np.diff(self.arrival_s) < 0) or self.arrival_s[0] < 0):
            raise WorkloadError("arrival times must be >= 0 and sorted")
        if n and (self.input_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise WorkloadError("every request needs at least one input and one output token")

    @property
    def size(self) -> int:
        return int(self.arrival_s.size)


@dataclass(frozen=True)
class LengthSpec:
    """A token-length distribution (module docstring for the syntax)."""

    kind: str
    a: float
    b: float = 0.0
    c: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        parts = text.split(":")
        try:
            if len(parts) == 1:
                spec = cls("fixed", float(int(parts[0])))
                ok = spec.a >= 1
            elif parts[0] == "uniform" and len(parts) == 3:
                spec = cls("uniform", float(int(parts[1])), float(int(parts[2])))
                ok = 1 <= spec.a <= spec.b
            elif parts[0] == "lognormal" and len(parts) == 4:
                spec = cls("lognormal", float(parts[1]), float(parts[2]), float(int(parts[3])))
                ok = spec.a >= 1 and spec.b >= 0 and spec.c >= 1
            else:
                ok = False
        except ValueError:
            ok = False
        if not ok:
            raise WorkloadError(f"bad length {text!r}: use N, uniform:A:B (1 <= A <= B) or lognormal:MEDIAN:SIGMA:MAX")
        return spec

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(count, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=count).astype(np.int64)
        values = np.rint(self.a * np.exp(self.b * rng.standard_normal(count)))
        return np.clip(values, 1, self.c).astype(np.int64)


def generated(
    rate: float,
    duration_s: float,
    input_len: LengthSpec,
    output_len: LengthSpec,
    rng: np.random.Generator,
    cv: float = 1.0,
) -> Workload:
    """Requests arriving over [0, duration_s): Poisson (cv = 1) or gamma gaps with coefficient of variation cv."""
    if not rate > 0 or not duration_s > 0 or not cv > 0:
        raise WorkloadError(f"need rate > 0, duration > 0 and cv > 0, got {rate}, {duration_s}, {cv}")
    expected = rate * duration_s
    arrivals: list[np.ndarray] = []
    last, total = 0.0, 0
    shape = 1.0 / cv**2
    while last < duration_s:  # draw gaps in chunks until the window is covered
        chunk = max(16, int(expected - total + 4 * np.sqrt(expected) + 16))
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=chunk)
        times = last + np.cumsum(gaps)
        arrivals.append(times)
        last, total = float(times[-1]), total + chunk
    arrival = np.concatenate(arrivals)
    arrival = arrival[arrival < duration_s]
    n = arrival.size
    return Workload(arrival, input_len.sample(n, rng), output_len.sample(n, rng))


_SPLIT = re.compile(r"[,\s]+")


def replayed(path: str | Path) -> Workload:
    """A request log, one ``arrival_s input_tokens output_tokens`` line per request (sorted by arrival here)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise WorkloadError(f"{path}: cannot read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: not a text file of requests") from None
    rows: list[tuple[float, int, int]] = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        fields = _SPLIT.split(text)
        try:
            if len(fields) != 3:
                raise ValueError
            row = (float(fields[0]), int(fields[1]), int(fields[2]))
        except ValueError:
            raise WorkloadError(
                f"{path}:{number}: expected 'arrival_s input_tokens output_tokens', got {text!r}"
            ) from None
        if not (np.isfinite(row[0]) and row[0] >= 0 and row[1] >= 1 and row[2] >= 1):
            raise WorkloadError(f"{path}:{number}: need arrival >= 0 and token counts >= 1, got {text!r}")
        rows.append(row)
    if not rows:
        raise WorkloadError(f"{path}: no requests in the log")
    rows.sort(key=lambda r: r[0])
    arrival, inputs, outputs = zip(*rows, strict=True)
    return Workload(np.array(arrival), np.array(inputs, dtype=np.int64), np.array(outputs, dtype=np.int64))
