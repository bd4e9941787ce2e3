"""Skip-the-draft: decide BEFORE drafting whether a round drafts at all (load-aware, lossless).

Algorithm 1 picks verify lengths after the drafter ran, so a round with l_r = 0 for everyone still pays the
draft. Under heavy load the draft step of R requests can cost most of an autoregressive round (it did at 128
requests of the Qwen3-4B-shaped benchmark before the drafter's kernels were fused), and then a plain target round
delivers more tokens per second than the best speculative one. The gate compares, every round, the predicted
throughput of both kinds of round with the same whole-round objective Algorithm 1 uses:

  speculative:    Theta_spec = max_n  tau_n / (T_draft(R, B_n) + 1 / SPS(B_n))   (walk of Algorithm 1)
  autoregressive: Theta_ar   = R / (T_nodraft(R) + 1 / SPS(R))

and drafts iff Theta_spec >= Theta_ar (ties draft: with no draft cost the gate never skips). tau_n and B_n come
from Algorithm 1's walk over PREDICTED confidences, summarised per request: the survival probabilities a[r, j]
of a drafted round, all R * gamma of them sorted descending, sampled at K evenly spaced ranks, give Q, the
sorted survival curve of an average request (K points, each standing for gamma / K drafts per request). Q is
an exponential average over drafted rounds weighted by their rows (weight min(1, R / ``history_rows``): one
round of >= ``history_rows`` requests replaces it, at one request it averages the last ~``history_rows``
rounds). For the R current requests the walk is fluid: the n-th step admits R * gamma / K drafts,
B_n = R + n * R * gamma / K and tau_n = R + (R * gamma / K) * (Q_1 + ... + Q_n), and only the first
mean(min(cap_r, gamma)) / gamma of the curve can be admitted (caps remove the last positions, the least
likely ones). The per-round prediction costs K array elements whatever the load, and it follows the load at
once: when R drops, the same curve predicts a draft that is cheap next to the verify step and the gate flips
back to drafting without waiting for new data. Both rates price the verify step with the SPS table of the
round's R (the one token table, or R's table of a :class:`scheduler.sps.RequestSPS`).

Staleness: a skipped round yields no confidences, so after ``interval - 1`` skipped rounds in a row the next
round drafts anyway (a probe), refreshing the pool; a round with nothing observed yet always drafts. The interval
starts at ``probe_interval`` and doubles (up to ``max_probe_interval``) each time the round after a probe skips
again, i.e. while the refreshed pool keeps confirming that skipping wins (sustained high load, where every probe
is a slower round); any round that the prediction itself sends to the drafter resets it. Load changes need no
probe: the prediction follows the number of requests at once.

Cost per round: a round's confidences are only queued by ``observe`` (a copy); they are folded into Q, in
arrival order and by the same operations, when a prediction needs Q. And a prediction is only made when the
last one might have changed its answer: after a prediction to draft with ratio m = Theta_spec / Theta_ar, every
later fold multiplies Q by (1 - w) and adds non-negative terms, so each tau_n, and with it Theta_spec, is at
least prod(1 - w) of its value then, while Theta_ar is fixed by R and the costs. As long as gamma and both
cost objects are unchanged and m * prod(1 - w) > 1 (with a 1e-9 margin for rounding), the full prediction for
the same R and step count would draft too, so the round drafts without it (the same decision, found without
the ~20 numpy calls it costs between two model steps). The bound holds whatever R the rounds in between had, so
the last prediction to draft is kept per (R, step count): under load R moves between a few values as requests
finish and join, and each value reuses its own. At one request (w = 1/64) and m ~ 2.4, that is one prediction
in ~55 rounds; from ``history_rows`` rows a round (w = 1) every round predicts, as before.

Why this is lossless: the decision is a function of confidences of rounds that are already verified and
committed, of the number of running requests and of their caps (counts) -- never of the tokens this round
will verify, which do not exist yet when it is made. Given everything that happened before the round, either
kind of round emits its next tokens with the target's exact conditional distribution (a skipped round is a
plain target round: every l_r = 0, the anchor is verified and the next token sampled from the target; a
drafted round is exact by rejection sampling and Algorithm 1's causal early stop). Choosing between two exact
transitions with a rule fixed before the round is itself exact, so greedy output equals the target's greedy
output and sampled output follows the target distribution. The drafter's context cache stays correct in
skipped rounds because the round driver still appends the committed tokens' context features
(:meth:`scheduler.engine.SpeculativeEngine.step`), so any later round can draft from the right context.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from scheduler.algorithm import DraftCost, validate_confidences
from scheduler.sps import SPSSource, check_sps_source

_MAX_KEPT = 64
"""Predictions to draft kept at once (one per (R, step count)); more are dropped together."""


class _Prediction(NamedTuple):
    """A prediction to draft and what it was made for (reused while it provably holds: module docstring); kept
    per (R, step count) of its walk."""

    gamma: int
    draft_cost: DraftCost
    no_draft_cost: DraftCost
    ratio: float  # Theta_spec / Theta_ar
    log_decay: float  # the gate's running sum of log(1 - w) when it was made


class DraftGate:
    """Per round driver: ``should_draft(caps)`` before drafting; ``observe(confidences)`` after a drafted round.

    ``draft_cost``: the time a drafted round spends outside the verify step (Algorithm 1's DraftCost);
    ``no_draft_cost``: the same for a round that skips the drafter (host work, the drafter's context append),
    evaluated at B = R. Not thread-safe: one instance per round driver.
    """

    def __init__(
        self,
        sps: SPSSource,
        draft_cost: DraftCost,
        no_draft_cost: DraftCost | None = None,
        *,
        probe_interval: int = 8,
        max_probe_interval: int = 64,
        history_rows: int = 64,
        curve_points: int = 56,
    ) -> None:
        check_sps_source(sps)
        for name, value in (
            ("probe_interval", probe_interval),
            ("max_probe_interval", max_probe_interval),
            ("history_rows", history_rows),
            ("curve_points", curve_points),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_probe_interval < probe_interval:
            raise ValueError(f"max_probe_interval ({max_probe_interval}) must be >= probe_interval ({probe_interval})")
        self.sps = sps
        self.draft_cost = draft_cost
        self.no_draft_cost = no_draft_cost if no_draft_cost is not None else DraftCost()
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.interval = probe_interval  # skipped rounds in a row + 1 before a probe (backs off, see the module)
        self._probed = False  # the last round was a probe
        self.history_rows = history_rows
        self.curve_points = curve_points
        self._curve: np.ndarray | None = None  # Q, sorted survival curve of an average request (descending)
        self._cumulative = np.zeros(curve_points + 1)  # 0, Q_1, Q_1 + Q_2, ...
        self._pending: list[np.ndarray] = []  # observed confidences not yet folded into Q (oldest first)
        # The last prediction to draft per (R, step count), and the running sum of log(1 - w) over observed
        # rounds: the difference since a prediction is log prod(1 - w), a lower bound of Q's change (module
        # docstring). Emptied when a round replaces Q or gamma changes (nothing kept can hold then).
        self._drafted_at: dict[tuple[int, int], _Prediction] = {}
        self._log_decay = 0.0
        self._steps = np.arange(curve_points + 1, dtype=np.float64)
        self._ranks: dict[int, np.ndarray] = {}  # survivals per round -> where Q's ranks sit in their sort
        self._gamma = 0
        self._skipped_in_a_row = 0
        self.decisions = 0  # rounds decided (for reports)
        self.skipped = 0  # rounds that skipped the drafter
        self.predictions = 0  # rounds that made a full prediction (the others reused one or probed)

    def observe(self, confidences: np.ndarray, *, validated: bool = False) -> None:
        """Queue a drafted round's confidences [R, gamma] (uncapped) for Q. ``validated``: the caller has just
        passed this very array through ``validate_confidences`` (the policies' schedule did), so it is not
        checked twice in a round."""
        conf = confidences if validated else validate_confidences(confidences)
        rows, gamma = conf.shape
        if rows == 0 or gamma == 0:
            return
        weight = min(1.0, rows / self.history_rows)
        if weight >= 1.0:  # this round replaces Q outright: the queued ones no longer matter
            self._pending.clear()
        self._pending.append(conf.astype(np.float64))  # a copy: the caller may reuse its buffer
        if weight >= 1.0 or gamma != self._gamma:
            self._drafted_at.clear()
            self._log_decay = 0.0
        else:
            self._log_decay += math.log1p(-weight)
        if len(self._pending) >= self.history_rows:  # bounded memory when no prediction asks for Q
            self._fold()

    @property
    def curve(self) -> np.ndarray | None:
        """Q, the sorted survival curve of an average request (every observed round folded in), or None."""
        if self._pending:
            self._fold()
        return self._curve

    def _fold(self) -> None:
        """Fold the queued rounds into Q, oldest first: each replaces Q (the first round, a new gamma) or enters
        its row-weighted exponential average."""
        for conf in self._pending:
            rows, gamma = conf.shape
            curve = self._curve_of(conf)
            if self._curve is None or gamma != self._gamma:
                self._gamma = gamma
            else:
                weight = min(1.0, rows / self.history_rows)
                curve = (1.0 - weight) * self._curve + weight * curve
            self._curve = curve
        self._pending.clear()
        assert self._curve is not None  # called with rounds pending
        np.add.accumulate(self._curve, out=self._cumulative[1:])  # np.cumsum, without its Python wrapper

    def _curve_of(self, conf: np.ndarray) -> np.ndarray:
        """One round's Q: its R * gamma survivals sorted descending, sampled at K evenly spaced ranks."""
        survival = np.multiply.accumulate(conf, axis=1).ravel()  # np.cumprod into a fresh array, sorted in place
        survival.sort()
        return survival[self._sorted_ranks(survival.size)]

    def _sorted_ranks(self, size: int) -> np.ndarray:
        """Where the K evenly spaced ranks of a descending order of ``size`` items sit in the ascending sort
        (the same items as indexing the reversed array; built once per size, not every round)."""
        ranks = self._ranks.get(size)
        if ranks is None:
            descending = ((np.arange(self.curve_points) + 0.5) * (size / self.curve_points)).astype(np.int64)
            ranks = self._ranks[size] = size - 1 - descending
        return ranks

    def predicted_rates(self, max_lengths: np.ndarray) -> tuple[float, float] | None:
        """(Theta_spec, Theta_ar) in tokens/s for the current caps, or None while nothing was observed."""
        if self.curve is None:
            return None
        walk = self._walk_size(max_lengths)
        if walk is None:
            return None
        num_requests, steps = walk
        share = num_requests * self._gamma / self.curve_points  # drafts admitted per step of the fluid walk
        tau = num_requests + share * self._cumulative[: steps + 1]
        round_time, ar_rate = self._round_times(num_requests, steps)
        return float(np.maximum.reduce(tau / round_time)), ar_rate

    def _walk_size(self, max_lengths: np.ndarray) -> tuple[int, int] | None:
        """(R, steps of the fluid walk the caps admit), or None for no request. Caps are counts, so a few of
        them are summed on Python ints (the same integer as numpy's, without its per-call cost)."""
        caps = np.asarray(max_lengths, dtype=np.int64)
        num_requests = int(caps.size)
        if num_requests == 0:
            return None
        gamma = self._gamma
        if num_requests <= 16:
            admitted = sum(min(max(c, 0), gamma) for c in caps.tolist())
        else:
            admitted = int(np.add.reduce(np.maximum(np.minimum(caps, gamma), 0)))
        return num_requests, round(admitted / (num_requests * gamma) * self.curve_points)

    def _round_times(self, num_requests: int, steps: int) -> tuple[np.ndarray, float]:
        """Round time of each step 0..steps of the fluid walk, and Theta_ar: functions of R, the step count, the
        curve's gamma and the two costs only (not of Q), so they are cached on the table (SPSTable.memo) instead
        of rebuilt every round. Both kinds of round run with R requests, so both are priced by R's table."""
        table = self.sps.table_for(num_requests)
        gamma, points = self._gamma, self.curve_points
        draft_cost, no_draft_cost = self.draft_cost, self.no_draft_cost

        def build() -> tuple[np.ndarray, float]:
            share = num_requests * gamma / points
            batch = num_requests + share * self._steps[: steps + 1]
            # The verify step at the nearest integer batch (the exactly monotone dense table Algorithm 1 uses).
            step_time = table.dense_step_time(int(batch[-1]) + 1)
            round_time = draft_cost.seconds(num_requests, batch) + step_time[(batch + 0.5).astype(np.int64)]
            ar_time = float(no_draft_cost.seconds(num_requests, num_requests)) + float(step_time[num_requests])
            return round_time, num_requests / ar_time

        key = ("draft_gate", draft_cost, no_draft_cost, num_requests, steps, gamma, points)
        return table.memo(key, build)

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        """Whether this round runs the drafter (a function of past confidences and counts only)."""
        self.decisions += 1
        if self._skipped_in_a_row + 1 >= self.interval:
            probe, predicted, draft = True, False, True
        elif self._still_drafts(max_lengths):
            probe, predicted, draft = False, True, True
        else:
            rates = self.predicted_rates(max_lengths)
            self.predictions += 1
            self._remember(max_lengths, rates)
            probe, predicted, draft = False, rates is not None, rates is None or rates[0] >= rates[1]
        if draft:
            if predicted:  # the prediction itself chose to draft: probe at the base rate again
                self.interval = self.probe_interval
            self._probed = probe
            self._skipped_in_a_row = 0
            return True
        if self._probed:  # the probe refreshed the pool and skipping still wins: probe less often
            self.interval = min(2 * self.interval, self.max_probe_interval)
        self._probed = False
        self._skipped_in_a_row += 1
        self.skipped += 1
        return False

    def _remember(self, max_lengths: np.ndarray, rates: tuple[float, float] | None) -> None:
        """Keep a prediction to draft (and what it was made for) so later rounds of its R and step count can
        reuse its answer; a prediction to skip drops the one kept there."""
        if rates is None:  # nothing observed yet: nothing is kept either
            return
        walk = self._walk_size(max_lengths)
        assert walk is not None  # rates were predicted, so there were requests
        if rates[0] > rates[1] > 0.0:
            if len(self._drafted_at) >= _MAX_KEPT:  # bounded: a few R values under a steady load
                self._drafted_at.clear()
            self._drafted_at[walk] = _Prediction(
                self._gamma, self.draft_cost, self.no_draft_cost, rates[0] / rates[1], self._log_decay
            )
        else:
            self._drafted_at.pop(walk, None)

    def _still_drafts(self, max_lengths: np.ndarray) -> bool:
        """Whether the last prediction to draft for this round's R and step count provably still holds (module
        docstring: m * prod(1 - w) > 1 with the same gamma and cost objects), so the full prediction would
        draft too."""
        if not self._drafted_at:
            return False
        walk = self._walk_size(max_lengths)
        last = self._drafted_at.get(walk) if walk is not None else None
        if last is None or last.draft_cost is not self.draft_cost or last.no_draft_cost is not self.no_draft_cost:
            return False
        return last.gamma == self._gamma and last.ratio * math.exp(self._log_decay - last.log_decay) > 1.0 + 1e-9
