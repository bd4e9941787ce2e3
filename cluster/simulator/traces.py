"""Recorded decoding traces as the simulator's source of confidences and acceptance.

The input is what ``dspark eval --save-traces`` writes (:meth:`scheduler.evaluation.decoder.DecodeTraces.save`): an
``.npz`` with ``logits`` [N, gamma] float (confidence-head logits of every round's block), ``accepted`` [N] int
(drafts the target accepted when the WHOLE block was verified), ``request`` [N] int (which prompt the round
belongs to; its rounds in order) and ``has_confidence`` (bool). A simulated request replays the rounds of one
recorded prompt, picked at random, and moves on to another at random when they run out.

A round that verifies l drafts of a row accepts min(accepted, l): verifying a prefix of a block decides its
tokens as verifying the whole block does (the offline threshold sweep of :mod:`scheduler.evaluation.report` uses
the same rule). What is approximated: after a round that verified fewer drafts than the recorded one accepted,
the real next block starts a few tokens earlier than the recorded next row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from scheduler.sts import STSCalibration


class TraceFileError(ValueError):
    """A trace file that cannot be used, with the file and what is wrong in its message."""


@dataclass(frozen=True)
class AcceptanceTrace:
    """Rows grouped by recorded prompt: ``confidences`` [N, gamma] (calibrated, in [0, 1]) and ``accepted``
    [N], prompt k's rounds at rows ``starts[k]`` .. ``starts[k + 1] - 1`` in their recorded order."""

    confidences: np.ndarray
    accepted: np.ndarray
    starts: np.ndarray

    @property
    def gamma(self) -> int:
        return int(self.confidences.shape[1])

    @property
    def num_prompts(self) -> int:
        return int(self.starts.size - 1)

    @classmethod
    def from_arrays(
        cls,
        confidences: np.ndarray,
        accepted: np.ndarray,
        request: np.ndarray,
        where: str = "<arrays>",
    ) -> AcceptanceTrace:
        """Validate and group rows by prompt (stable: each prompt's rounds keep their order)."""
        conf = np.asarray(confidences, dtype=np.float64)
        acc = np.asarray(accepted)
        req = np.asarray(request)
        if conf.ndim != 2 or conf.shape[0] == 0 or conf.shape[1] == 0:
            raise TraceFileError(f"{where}: needs confidences of shape [rounds, gamma], got {conf.shape}")
        if acc.shape != (conf.shape[0],) or req.shape != (conf.shape[0],):
            raise TraceFileError(f"{where}: accepted and request need one entry per round ({conf.shape[0]})")
        if not np.issubdtype(acc.dtype, np.integer) or not np.issubdtype(req.dtype, np.integer):
            raise TraceFileError(f"{where}: accepted and request must be integers")
        if not np.all(np.isfinite(conf)) or conf.min() < 0 or conf.max() > 1:
            raise TraceFileError(f"{where}: confidences must lie in [0, 1]")
        if acc.min() < 0 or acc.max() > conf.shape[1]:
            raise TraceFileError(f"{where}: accepted must lie in [0, gamma = {conf.shape[1]}]")
        order = np.argsort(req, kind="stable")
        grouped = req[order]
        starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1], True])
        return cls(conf[order], acc[order].astype(np.int64), starts.astype(np.int64))

    def in_order(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """First and end row of recorded prompt i (modulo their number) for requests i = 0 .. count - 1."""
        prompts = np.arange(count) % self.num_prompts
        return self.starts[prompts], self.starts[prompts + 1]

    @cached_property
    def bounds(self) -> np.ndarray:
        """[prompts, 2]: the first and the end row of each recorded prompt."""
        return np.stack((self.starts[:-1], self.starts[1:]), axis=1)

    @cached_property
    def _bound_pairs(self) -> list[tuple[int, int]]:
        return [(first, end) for first, end in self.bounds.tolist()]

    def prompt_bound(self, rng: np.random.Generator) -> tuple[int, int]:
        """:meth:`prompt_bounds` of one request as Python ints: the same draw (one bounded integer from the
        stream), without the arrays (a simulator stores the two numbers in its request state)."""
        return self._bound_pairs[int(rng.integers(0, self.num_prompts))]

    def prompt_bounds(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """First and end row of a random recorded prompt for each of ``count`` requests, [count, 2]."""
        if count == 1:  # the same draw as size=1 (one bounded integer from the stream), without the array's overhead
            prompt = int(rng.integers(0, self.num_prompts))
            return self.bounds[prompt : prompt + 1]
        return self.bounds[rng.integers(0, self.num_prompts, size=count)]

    def row_ranges(self, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`prompt_bounds` as first rows and end rows."""
        bounds = self.prompt_bounds(count, rng)
        return bounds[:, 0], bounds[:, 1]


def load_traces(path: str | Path, calibration: STSCalibration | None = None) -> AcceptanceTrace:
    """Read a ``dspark eval --save-traces`` file; confidences are sigmoid(logits), through ``calibration``
    (the drafter's STS, as its draft engine applies it) when given."""
    try:
        data = np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError) as error:
        raise TraceFileError(f"{path}: not a readable .npz trace file ({error})") from None
    with data:
        missing = [k for k in ("logits", "accepted", "request", "has_confidence") if k not in data.files]
        if missing:
            raise TraceFileError(f"{path}: lacks {missing} (write it with `dspark eval --save-traces`)")
        if not bool(data["has_confidence"]):
            raise TraceFileError(f"{path}: its drafter has no confidence head; the scheduled policies need one")
        logits = np.asarray(data["logits"], dtype=np.float64)
        if logits.ndim != 2 or not np.all(np.isfinite(logits)):
            raise TraceFileError(f"{path}: logits must be a finite [rounds, gamma] array")
        if calibration is not None:
            if calibration.gamma < logits.shape[1]:
                raise TraceFileError(f"{path}: the calibration has {calibration.gamma} positions, fewer than gamma")
            confidences = STSCalibration(calibration.temperatures[: logits.shape[1]]).calibrate(logits)
        else:
            confidences = 0.5 * (1.0 + np.tanh(0.5 * logits))
        return AcceptanceTrace.from_arrays(confidences, data["accepted"], data["request"], str(path))
