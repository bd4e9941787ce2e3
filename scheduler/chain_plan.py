"""Planned lengths for chained rounds: DSpark's verify lengths fixed before a round's drafts exist.

A round whose lengths are known before drafting can queue its verify step right behind the draft step on the
device (:meth:`scheduler.engine.SpeculativeEngine._chained_round`): the host's round trip between the two steps
(draft result copy, confidences, Algorithm 1, verify packing, upload, launch) overlaps the draft step instead of
stalling the device, a sizeable share of a round at low load (docs/CHANGELOG.md, "Chained rounds").
Algorithm 1 needs the confidences, so it cannot chain; but a *uniform* length L for every request (capped)
needs none, and on the round's own confidences one can say what it would have delivered:

  Algorithm 1:  Theta_A = tau_A / (T_draft(R, B_A) + t(B_A)),  its lengths l_r, B_A = R + sum_r l_r
  uniform L:    Theta_L = tau_L / (T_draft(R, B_L) + t(B_L)),  l_r = min(L, cap_r)

with tau the expected accepted tokens (R + the admitted survival probabilities) and t the SPS table's step time.
After every drafted round of R requests (scheduled or planned) the planner keeps L* = argmax_L Theta_L for the next
round of R requests when Theta_L* * (1 + tolerance) >= Theta_A, i.e. when the uniform round loses at most
``tolerance`` of Algorithm 1's objective, about what chaining saves; otherwise the next round lets Algorithm 1
decide on its confidences. Every planned round's confidences refresh the plan the same way, off the critical path
(the host reads them while the device runs the chained verify step); of the rounds Algorithm 1 schedules, where the
evaluation delays the verify step, every ``RECHECK``-th does, and none until a round driver has asked for a plan
(one that cannot chain never pays). On a flat SPS curve L* = the whole block and Theta_L* >= Theta_A (every draft
adds to tau and nothing to the step): the plan is Algorithm 1's own decision. Under load, where Algorithm 1
verifies a few drafts per request, L* is the best uniform length by the same objective: more drafts per request
than Algorithm 1 takes, in rounds that chain (docs/benchmarks/policies.md; the change's paired runs in
docs/CHANGELOG.md).

Before any drafted round of R requests the plan is the whole block iff its step takes at most ``tolerance``
longer than the anchors' step alone (the flat part of the curve, where any positive survival admits it).

Why this is lossless: a plan is a function of request counts, caps and the confidences of rounds already
drafted and verified, never of the tokens the planned round verifies; rejection sampling then verifies
whatever lengths the round has (as with the fixed-length policies).
"""

from __future__ import annotations

import numpy as np

from scheduler.algorithm import DraftCost
from scheduler.sps import SPSTable

CHAIN_TOLERANCE = 0.05
"""How much of Algorithm 1's objective a planned uniform round may give up (0.05: 5%): about the share of a
round that chaining saves at 1-8 requests (docs/CHANGELOG.md, "Chained rounds")."""


def uniform_choice(
    confidences: np.ndarray,
    max_lengths: np.ndarray,
    lengths: np.ndarray,
    sps: SPSTable,
    draft_cost: DraftCost | None,
) -> tuple[int, float, float]:
    """For one drafted round (confidences [R, gamma], already zeroed past each cap; ``lengths``: Algorithm 1's
    choice for them): the best uniform length L* (1..gamma), its objective Theta_L* and Algorithm 1's Theta_A,
    both in expected tokens per second."""
    num, gamma = confidences.shape
    survival = np.multiply.accumulate(confidences, axis=1)
    positions = np.arange(gamma)
    tau_a = num + float(survival[positions[None, :] < lengths[:, None]].sum())
    tau = num + np.add.accumulate(survival.sum(axis=0))  # tau_L for L = 1..gamma
    if int(np.minimum.reduce(max_lengths)) >= gamma:  # no cap binds (all but a request's last rounds)
        batch = num * (positions + 2)  # B_L = R (L + 1) for L = 1..gamma
    else:
        widths = np.minimum(max_lengths, gamma)
        batch = num + np.minimum(widths[:, None], positions[None, :] + 1).sum(axis=0)
    batch_a = num + int(lengths.sum())
    times = sps.dense_step_time(num * (gamma + 1))
    round_s = times[batch]
    round_a = float(times[batch_a])
    if draft_cost is not None:
        round_s = round_s + draft_cost.seconds(num, batch)
        round_a += float(draft_cost.seconds(num, np.array(batch_a)))
    theta = tau / round_s
    best = int(theta.argmax())
    return best + 1, float(theta[best]), tau_a / round_a


RECHECK = 8
"""Of the rounds Algorithm 1 schedules for one request count, every RECHECK-th (from the first) re-plans."""


class ChainPlanner:
    """The uniform length planned for the next round of each request count (module docstring)."""

    def __init__(self, tolerance: float = CHAIN_TOLERANCE) -> None:
        if not tolerance >= 0:
            raise ValueError(f"chain_tolerance must be >= 0, got {tolerance}")
        self.tolerance = tolerance
        self._plans: dict[int, int] = {}  # R -> L (0: let Algorithm 1 decide)
        self._scheduled: dict[int, int] = {}  # R -> rounds Algorithm 1 scheduled since the last re-plan
        self._asked = False  # a round driver asked for a plan (one that never chains pays nothing here)

    @property
    def asked(self) -> bool:
        """Whether a round driver has asked for a plan (until then :meth:`observe` does nothing)."""
        return self._asked

    def planned(self, max_lengths: np.ndarray, block_size: int, sps: SPSTable) -> np.ndarray | None:
        """The next round's lengths for these caps, or None (Algorithm 1 decides on the confidences)."""
        self._asked = True
        num = max_lengths.size
        if not num:
            return None
        plan = self._plans.get(num)
        if plan is None:  # no drafted round of R requests yet: the whole block, if its step is nearly flat
            lengths = np.minimum(max_lengths, block_size).astype(np.int64)
            times = sps.dense_step_time(num * (block_size + 1))
            return lengths if times[num + int(lengths.sum())] <= (1.0 + self.tolerance) * times[num] else None
        if plan == 0:
            return None
        return np.minimum(max_lengths, plan).astype(np.int64)

    def observe(
        self,
        confidences: np.ndarray,
        max_lengths: np.ndarray,
        lengths: np.ndarray,
        sps: SPSTable,
        draft_cost: DraftCost | None,
        scheduled: bool = False,
    ) -> None:
        """A drafted round of R requests (confidences zeroed past the caps, Algorithm 1's lengths for them):
        plan the next round of R requests. ``scheduled``: Algorithm 1 chose this round's lengths (re-plans
        every ``RECHECK``-th such round only)."""
        if not (self._asked and confidences.size):
            return
        num = confidences.shape[0]
        if scheduled:
            since = self._scheduled.get(num, 0)
            self._scheduled[num] = since + 1
            if since % RECHECK:
                return
        best, theta_best, theta_a = uniform_choice(confidences, max_lengths, lengths, sps, draft_cost)
        self._plans[num] = best if theta_best * (1.0 + self.tolerance) >= theta_a else 0
