"""Online draft cost: learn Algorithm 1's T_draft(R) from the round driver's own timings while serving.

The GPU benchmark hands the scheduled policies a DraftCost measured offline at each load; a served deployment has
no such table, and in disaggregated serving the real cost of drafting includes the drafter's gRPC round trip,
which depends on the network and on the drafter pool's load. :class:`OnlineDraftCost` learns it from the rounds
the scheduler runs anyway: every round reports its running requests R, whether it drafted, the time it spent
drafting and its other host time (schedule, commit: everything outside the verify step). Drafted rounds fit

  T_draft(R) = fixed_s + per_request_s * R      (draft + other host time of a drafted round)

and rounds that skipped the drafter give the no-draft overhead T_nodraft (their other host time; 0 until one is
seen), the two costs :class:`scheduler.draft_gate.DraftGate` compares. The fit is robust: over a sliding window
of the last ``window`` drafted rounds, a Theil-Sen line (median of pairwise slopes) finds the bulk, rounds whose
residual exceeds ``outlier_mads`` robust deviations (a GC pause, a retried RPC, a prefill-heavy round) are
dropped, and least squares on the rest gives the coefficients (clamped to >= 0, the DraftCost contract). Nothing
is reported before ``min_rounds`` drafted rounds (``draft_cost`` is None): the policy then uses the plain
objective and never skips, exactly the behaviour without an estimate.

A refit that moves no coefficient by more than ``keep_within`` (1%, far inside the noise of wall-clock round
timings) keeps the previous DraftCost object: the scheduler's caches (Algorithm 1's price curves and the gate's
round times, keyed by the cost; the gate's last prediction, kept while its cost objects stay the same) then survive
a refit instead of being rebuilt every ``refit_interval`` rounds. A refit that keeps it also doubles the interval to
the next one, up to ``max_refit_interval`` rounds (a steady load refits rarely: each refit is host time between
model steps, for a value that did not move; docs/benchmarks/scheduler.md); a refit that renews it, or a drafted
round at an R outside the range of the window the last fit saw (a new load: the fit would extrapolate; under a
closed loop R moves inside a small range as requests finish and join, and that does not count) or one more than 25%
off the estimate (the drafter's time may be moving: a robust fit only follows once most of the window has moved)
brings the interval back to ``refit_interval``.

Verify-time calibration: the SPS table is profiled at startup on idle steps (R requests over a short context,
nothing joining), while under load every verify step is slower: longer contexts, joining prompts prefilled in the
same pass, so under load the steps take longer than the table says (docs/SIMULATOR.md, "Calibration against the
served matrix"); priced that cheap, the verify step's share of a round looks small next to the measured host and
draft time, and the draft gate's choice between drafting and a plain round flips on noise. Rounds that report their
verify seconds and the table's prediction for them give ``verify_scale`` k = the median ratio of the window (1.0
until ``min_rounds`` such rounds; quantised to 1/32 octave so that the scheduler's per-table caches see few distinct
costs). A policy prices the verify step k times as long by dividing both round costs by k
(:meth:`scheduler.algorithm.DraftCost.scaled`: Theta only changes by a constant factor).

Why this keeps decoding lossless: the estimate is a function of wall-clock timings and request counts of rounds
that already finished, never of token values, so a policy that uses it still decides each round from the past
and counts only (and Algorithm 1's allowed dependence on the current confidences); see :mod:`scheduler.policy`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

from scheduler.algorithm import DraftCost

# A drafted round this far (relative) from the estimate ends the refits' backoff: the cost may be moving.
_DRIFT = 0.25
_MAD_TO_SIGMA = 1.4826  # median absolute deviation of a normal distribution, in standard deviations


class OnlineDraftCost:
    """Sliding-window robust fit of T_draft(R) and the no-draft overhead; one instance per round driver.

    ``observe(R, drafted, draft_s, other_s)`` once per round; ``draft_cost`` (None while warming up) and
    ``no_draft_cost`` read the current estimates. Refits happen lazily, at most every ``refit_interval`` new
    drafted rounds (backing off to ``max_refit_interval``), so the per-round cost is a deque append. Not
    thread-safe.
    """

    def __init__(
        self,
        *,
        window: int = 64,
        min_rounds: int = 8,
        refit_interval: int = 4,
        max_refit_interval: int = 32,
        outlier_mads: float = 4.0,
        keep_within: float = 0.01,
    ) -> None:
        for name, value in (
            ("window", window),
            ("min_rounds", min_rounds),
            ("refit_interval", refit_interval),
            ("max_refit_interval", max_refit_interval),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if min_rounds > window:
            raise ValueError(f"min_rounds ({min_rounds}) must not exceed window ({window})")
        if not (isinstance(outlier_mads, (int, float)) and math.isfinite(outlier_mads) and outlier_mads > 0):
            raise ValueError(f"outlier_mads must be a finite number > 0, got {outlier_mads!r}")
        if not (isinstance(keep_within, (int, float)) and 0 <= keep_within < 1):
            raise ValueError(f"keep_within must be a number in [0, 1), got {keep_within!r}")
        if max_refit_interval < refit_interval:
            raise ValueError(
                f"max_refit_interval ({max_refit_interval}) must be >= refit_interval ({refit_interval})"
            )
        self.keep_within = float(keep_within)
        self.observed = 0  # rounds taken in: readers cache what they derived from the estimates until it moves
        self.min_rounds = min_rounds
        self.refit_interval = refit_interval
        self.max_refit_interval = max_refit_interval
        self._interval = refit_interval  # drafted rounds between refits now (backs off, see the module)
        self._fitted_loads = (0, 0)  # the smallest and largest R in the window at the last refit
        self.outlier_mads = float(outlier_mads)
        self._drafted: deque[tuple[int, float]] = deque(maxlen=window)  # (R, draft + other host seconds)
        self._plain: deque[float] = deque(maxlen=window)  # other host seconds of rounds that skipped the drafter
        self._since_fit = 0
        self._cost: DraftCost | None = None
        self._no_draft = DraftCost()
        self._plain_dirty = False
        self._verify_ratios: deque[float] = deque(maxlen=window)  # measured / predicted verify seconds
        self._scale = 1.0
        self._scale_unset = True  # no median taken yet
        self._verify_new = 0  # ratios since the last median

    def observe(
        self,
        num_requests: int,
        drafted: bool,
        draft_s: float,
        other_s: float,
        verify_s: float | None = None,
        predicted_verify_s: float | None = None,
    ) -> None:
        """One finished round: R running requests, whether it drafted, its draft and other host seconds, and
        optionally its verify seconds with the SPS table's prediction for that step (for ``verify_scale``)."""
        if num_requests < 1 or not (math.isfinite(draft_s) and math.isfinite(other_s)):
            return
        self.observed += 1
        if verify_s is not None and predicted_verify_s is not None:
            ratio = verify_s / predicted_verify_s if predicted_verify_s > 0 else math.nan
            if math.isfinite(ratio) and ratio > 0:
                self._verify_ratios.append(ratio)
                self._verify_new += 1
        if drafted:
            seconds = max(draft_s, 0.0) + max(other_s, 0.0)
            self._drafted.append((int(num_requests), seconds))
            self._since_fit += 1
            cost = self._cost
            # A load the last fit saw no round of, or the drafter's time may be moving: refit at the base cadence
            # again. (The estimate at R on floats: DraftCost.seconds is vectorised, a numpy call in every round.)
            low, high = self._fitted_loads
            if not low <= num_requests <= high or (
                cost is not None
                and abs(seconds - cost.fixed_s - cost.per_request_s * num_requests) > _DRIFT * seconds
            ):
                self._interval = self.refit_interval
        else:
            self._plain.append(max(other_s, 0.0))
            self._plain_dirty = True

    @property
    def draft_cost(self) -> DraftCost | None:
        """The current T_draft(R, B) = fixed_s + per_request_s * R, or None before ``min_rounds`` drafted rounds."""
        if len(self._drafted) < self.min_rounds:
            return None
        if self._cost is None or self._since_fit >= self._interval:
            fitted = self._fit()
            if self._cost is None or not _within(fitted, self._cost, self.keep_within):
                self._cost = fitted
                self._interval = self.refit_interval
            else:
                self._interval = min(2 * self._interval, self.max_refit_interval)
            self._since_fit = 0
        return self._cost

    @property
    def no_draft_cost(self) -> DraftCost:
        """The overhead of a round that skips the drafter (robust median of the window), 0 until one is seen."""
        if self._plain_dirty:
            fitted = DraftCost(fixed_s=statistics.median(self._plain))
            if not _within(fitted, self._no_draft, self.keep_within):
                self._no_draft = fitted
            self._plain_dirty = False
        return self._no_draft

    @property
    def verify_rounds(self) -> int:
        """Rounds in the window that reported their verify time (for reports and tests)."""
        return len(self._verify_ratios)

    @property
    def verify_scale(self) -> float:
        """Measured / predicted verify time (window median, 1/32-octave steps); 1.0 before ``min_rounds``.

        Taken once ``min_rounds`` ratios are in, then again every ``refit_interval`` new ones (the draft cost's
        refit cadence): a median in every round is host time spent every round on a value that moves in
        1/32-octave steps over a window of rounds."""
        if len(self._verify_ratios) >= self.min_rounds and (self._verify_new >= self.refit_interval
                                                            or self._scale_unset):  # fmt: skip
            self._verify_new = 0
            self._scale_unset = False
            median = statistics.median(self._verify_ratios)  # a sort of <= window floats: cheaper cold than numpy
            self._scale = 2.0 ** (round(32 * math.log2(median)) / 32)
        return self._scale

    def _fit(self) -> DraftCost:
        loads = [r for r, _ in self._drafted]
        self._fitted_loads = (min(loads), max(loads))
        if self._fitted_loads[0] == self._fitted_loads[1]:  # the usual steady load: no slope to fit
            return _fit_one_load([t for _, t in self._drafted], self.outlier_mads)
        data = np.array(self._drafted, dtype=np.float64)
        r, t = data[:, 0], data[:, 1]
        slope, intercept = _theil_sen(r, t)
        residual = t - (intercept + slope * r)
        spread = _MAD_TO_SIGMA * float(np.median(np.abs(residual - np.median(residual))))
        # The floor keeps exact (noise-free) data from rejecting every round over rounding error.
        keep = np.abs(residual) <= self.outlier_mads * spread + 1e-9 * (1.0 + float(np.median(t)))
        return _nonnegative_least_squares(r[keep], t[keep])


def _within(new: DraftCost, old: DraftCost, fraction: float) -> bool:
    """Every coefficient of ``new`` within ``fraction`` (relative) of ``old``'s."""
    return all(
        abs(a - b) <= fraction * max(abs(a), abs(b))
        for a, b in ((new.fixed_s, old.fixed_s), (new.per_request_s, old.per_request_s),
                     (new.per_token_s, old.per_token_s))
    )  # fmt: skip


def _fit_one_load(times: list[float], outlier_mads: float) -> DraftCost:
    """What ``_fit`` computes when every round had the same R (slope 0; the rounds within ``outlier_mads``
    robust sigmas of the median kept; their mean), on Python floats: a refit runs between model steps with the
    CPU's caches cold, where the dozen numpy calls on 64 numbers it replaces cost several times as much
    (bench/bench_sched_in_engine.py, docs/CHANGELOG.md)."""
    median = statistics.median(times)
    residual = [t - median for t in times]
    center = statistics.median(residual)
    spread = _MAD_TO_SIGMA * statistics.median([abs(e - center) for e in residual])
    bound = outlier_mads * spread + 1e-9 * (1.0 + median)
    kept = [t for t, e in zip(times, residual, strict=True) if abs(e) <= bound]
    return DraftCost(fixed_s=max(math.fsum(kept) / len(kept), 0.0))


def _theil_sen(r: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line; slope 0 when every round had the same R."""
    i, j = np.triu_indices(r.size, k=1)
    dr = r[j] - r[i]
    distinct = dr != 0
    slope = float(np.median((t[j] - t[i])[distinct] / dr[distinct])) if distinct.any() else 0.0
    return slope, float(np.median(t - slope * r))


def _nonnegative_least_squares(r: np.ndarray, t: np.ndarray) -> DraftCost:
    """Least squares t = fixed + per_request * R with both coefficients >= 0 (the DraftCost contract).

    With a single R the two terms cannot be told apart; the whole time goes into fixed_s, which is right at
    that R (and Algorithm 1 only evaluates T_draft at the current R).
    """
    if np.ptp(r) > 0:
        per_request, fixed = np.polyfit(r, t, 1)
        if per_request >= 0 and fixed >= 0:
            return DraftCost(fixed_s=float(fixed), per_request_s=float(per_request))
        if per_request < 0:  # time falls with load (noise): the flat fit
            return DraftCost(fixed_s=max(float(np.mean(t)), 0.0))
        return DraftCost(per_request_s=max(float(np.dot(r, t) / np.dot(r, r)), 0.0))  # negative fixed: origin
    return DraftCost(fixed_s=max(float(np.mean(t)), 0.0))
