"""Skip-the-draft: decide BEFORE drafting whether a round drafts at all (load-aware, lossless).

Algorithm 1 picks verify lengths after the drafter ran, so a round with l_r = 0 for everyone still pays the
draft. Under heavy load the draft step of R requests can cost most of an autoregressive round (128 requests of
the 4B benchmark: 8.6 ms of drafting against an 11.9 ms autoregressive round), and then a plain target round
delivers more tokens per second than the best speculative one. The gate compares, every round, the predicted
throughput of both kinds of round with the same whole-round objective Algorithm 1 uses:

  speculative:    Theta_spec = max_n  tau_n / (T_draft(R, B_n) + 1 / SPS(B_n))   (walk of Algorithm 1)
  autoregressive: Theta_ar   = R / (T_nodraft(R) + 1 / SPS(R))

and drafts iff Theta_spec >= Theta_ar (ties draft: with no draft cost the gate never skips). tau_n and B_n come
from Algorithm 1's walk over PREDICTED confidences: the rows of the most recent drafted rounds (a pool of at
least ``history_rows`` rows, whole rounds, newest first), each pool row standing for R / N of the R current
requests (a fluid version of the walk: B_n = R + (R / N) * n, tau_n = R + (R / N) * sum of the first n
survivals, the survival of position j further weighted by the fraction of current requests whose cap allows
j drafts). The weighting makes the prediction follow the load at once: when R drops, the same pool predicts a
cheaper draft relative to the verify step and the gate flips back to drafting without waiting for new data.

Staleness: a skipped round yields no confidences, so after ``probe_interval - 1`` skipped rounds in a row the
next round drafts anyway (a probe), refreshing the pool; a round with nothing observed yet always drafts.

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

from collections import deque

import numpy as np

from scheduler.algorithm import DraftCost, _check_sps, validate_confidences
from scheduler.sps import SPSTable


class DraftGate:
    """Per round driver: ``should_draft(caps)`` before drafting; ``observe(confidences)`` after a drafted round.

    ``draft_cost``: the time a drafted round spends outside the verify step (Algorithm 1's DraftCost);
    ``no_draft_cost``: the same for a round that skips the drafter (host work, the drafter's context append),
    evaluated at B = R. Not thread-safe: one instance per round driver.
    """

    def __init__(
        self,
        sps: SPSTable,
        draft_cost: DraftCost,
        no_draft_cost: DraftCost | None = None,
        *,
        probe_interval: int = 8,
        history_rows: int = 64,
    ) -> None:
        _check_sps(sps)
        if isinstance(probe_interval, bool) or not isinstance(probe_interval, int) or probe_interval < 1:
            raise ValueError(f"probe_interval must be an integer >= 1, got {probe_interval!r}")
        if isinstance(history_rows, bool) or not isinstance(history_rows, int) or history_rows < 1:
            raise ValueError(f"history_rows must be an integer >= 1, got {history_rows!r}")
        self.sps = sps
        self.draft_cost = draft_cost
        self.no_draft_cost = no_draft_cost if no_draft_cost is not None else DraftCost()
        self.probe_interval = probe_interval
        self.history_rows = history_rows
        self._rounds: deque[np.ndarray] = deque()
        self._skipped_in_a_row = 0
        self.decisions = 0  # rounds decided (for reports)
        self.skipped = 0  # rounds that skipped the drafter

    def observe(self, confidences: np.ndarray) -> None:
        """Keep a drafted round's confidences [R, gamma] (uncapped) as the newest prediction data."""
        conf = validate_confidences(confidences)
        if conf.shape[0] == 0 or conf.shape[1] == 0:
            return
        self._rounds.appendleft(np.array(conf, dtype=np.float64))
        rows = 0
        for n, block in enumerate(self._rounds):
            rows += block.shape[0]
            if rows >= self.history_rows:
                while len(self._rounds) > n + 1:
                    self._rounds.pop()
                break

    def predicted_rates(self, max_lengths: np.ndarray) -> tuple[float, float] | None:
        """(Theta_spec, Theta_ar) in tokens/s for the current caps, or None while nothing was observed."""
        caps = np.asarray(max_lengths, dtype=np.int64)
        num_requests = int(caps.size)
        if num_requests == 0 or not self._rounds:
            return None
        pool = np.concatenate(list(self._rounds))
        survival = np.cumprod(pool, axis=1)  # a[n, j]
        gamma = survival.shape[1]
        allowed = (caps[:, None] >= np.arange(1, gamma + 1)[None, :]).mean(axis=0)  # requests allowing j drafts
        weight = (num_requests / pool.shape[0]) * np.broadcast_to(allowed, survival.shape)
        keep = (survival > 0) & (weight > 0)
        values, weights = survival[keep], weight[keep]
        order = np.argsort(-values, kind="stable")
        tau = num_requests + np.concatenate([[0.0], np.cumsum(values[order] * weights[order])])
        batch = num_requests + np.concatenate([[0.0], np.cumsum(weights[order])])
        round_time = self.draft_cost.seconds(num_requests, batch) + 1.0 / self.sps.steps_per_second(batch)
        spec = float((tau / round_time).max())
        ar_time = float(self.no_draft_cost.seconds(num_requests, num_requests)) + 1.0 / float(
            self.sps.steps_per_second(num_requests)
        )
        return spec, num_requests / ar_time

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        """Whether this round runs the drafter (a function of past confidences and counts only)."""
        self.decisions += 1
        rates = None if self._skipped_in_a_row + 1 >= self.probe_interval else self.predicted_rates(max_lengths)
        if rates is None or rates[0] >= rates[1]:
            self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        self.skipped += 1
        return False
