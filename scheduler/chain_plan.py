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

from collections.abc import Callable

import numpy as np

from scheduler.algorithm import DraftCost, prefix_mask
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


_UNPLANNED = -1  # ChainPlanners.plans: no drafted round of R requests yet
_NEAR = 1e-9
"""Relative distance within which :func:`uniform_plans` leaves a decision to :func:`uniform_choice`: its sums
add the same survivals in another order (at most ~1e-12 apart for the largest rounds)."""
_step_time_cache: dict[tuple[object, int], np.ndarray] = {}


def _step_times(table_for: Callable[[int], SPSTable], width: int, gamma: int) -> np.ndarray:
    """At least [width + 1, width * (gamma + 1) + 1]: row R holds ``table_for(R).dense_step_time(R * (gamma +
    1))`` up to that batch size (the values :func:`uniform_choice` and :meth:`ChainPlanner.planned` read), ones
    after (and in row 0: rounds of no request, never read)."""
    key = (table_for, gamma)
    times = _step_time_cache.get(key)
    if times is None or times.shape[0] <= width:
        if len(_step_time_cache) >= 64:
            _step_time_cache.clear()
        rows = max(width, 2 * (times.shape[0] - 1) if times is not None else 8)
        times = np.ones((rows + 1, rows * (gamma + 1) + 1))
        for count in range(1, rows + 1):
            top = count * (gamma + 1)
            times[count, : top + 1] = table_for(count).dense_step_time(top)[: top + 1]
        times.flags.writeable = False
        _step_time_cache[key] = times
    return times


def uniform_plans(
    survival: np.ndarray,
    max_lengths: np.ndarray,
    lengths: np.ndarray,
    theta_a: np.ndarray,
    num_requests: np.ndarray,
    table_for: Callable[[int], SPSTable],
    draft_cost: DraftCost | None,
    tolerance: float,
    confidences: Callable[[int], np.ndarray],
    decide: np.ndarray,
) -> np.ndarray:
    """The plan :meth:`ChainPlanner.observe` keeps after each round k of a stack where ``decide[k]`` (0 for the
    others), from :func:`uniform_choice` on it: L* if Theta_L* (1 + ``tolerance``) >= Theta_A, else 0. Round k's
    requests are rows ``0 .. num_requests[k] - 1`` (>= 1 where it decides) of ``max_lengths`` (caps, 0 on padding)
    and ``lengths`` (Algorithm 1's, 0 on padding) [N, R], ``theta_a`` [N] its objective Theta_A there, in any
    arithmetic within ~1e-12 of uniform_choice's (:func:`scheduler.algorithm.schedule_recorded_rounds`'s
    ``objective``; +infinity: unknown); ``survival`` [N, R, gamma] holds the products of their
    confidences along each row, zeroed past the caps and on padding (those below 2^-960 may read 0, as
    :class:`scheduler.algorithm.RecordedConfidences` keeps them); ``confidences(k)``: round k's own confidences
    [num_requests[k], gamma], zeroed past the caps; each round's table is ``table_for(R)``.

    Vectorised over the stack, with the quantities of uniform_choice: the batch sizes, step times and draft costs
    alike, tau_L the same survivals summed in another order (within ~1e-12 of uniform_choice's); so a round whose
    decision or L* lies within a relative 1e-9 of changing is decided by uniform_choice itself."""
    rounds, width, gamma = survival.shape
    counts = num_requests
    column = counts[:, None]
    times = _step_times(table_for, width, gamma)
    before = _before(width, gamma)  # sums over each round's positions before L, for L = 1..gamma
    flat = survival.reshape(rounds, width * gamma)
    tau = np.matmul(flat, before)  # tau_L - R
    tau += column
    # B_L - R = sum_r min(cap_r, L): the positions before L within the caps (small integers: exact as floats);
    # the step times' flat index of B_L, R * (row + 1) + (B_L - R), comes out the same
    at = np.matmul(prefix_mask(gamma, max_lengths, np.float64).reshape(rounds, width * gamma), before)
    at += column * (times.shape[1] + 1)
    round_s = times.take(at.astype(np.int64))
    if draft_cost is not None:  # (DraftCost.seconds is elementwise in the request count too)
        round_s = round_s + draft_cost.seconds(column, _batch_of(at, column, times))  # type: ignore[arg-type]
    theta = np.divide(tau, round_s, out=tau)
    best = theta.argmax(axis=1)
    theta_best = theta.reshape(-1).take(_offsets(rounds, gamma) + best)
    bound = theta_best * (1.0 + tolerance)
    plans = best + 1
    plans *= bound >= theta_a
    # Near a change: the decision, or a second L within 1e-9 of Theta_L* (then more than one L above 1 - 1e-9
    # of it in such a round; a round of no request, Theta 0, has none).
    bound -= theta_a
    near = np.abs(bound, out=bound) <= _NEAR * theta_a
    theta_best *= 1.0 - _NEAR
    if np.count_nonzero(theta > theta_best[:, None]) > np.count_nonzero(theta_best):
        near |= np.count_nonzero(theta > theta_best[:, None], axis=1) > 1
    near &= decide
    for k in np.flatnonzero(near).tolist() if np.count_nonzero(near) else ():
        count = int(counts[k])
        best_k, theta_k, theta_a_k = uniform_choice(
            confidences(k), max_lengths[k, :count], lengths[k, :count], table_for(count), draft_cost
        )
        plans[k] = best_k if theta_k * (1.0 + tolerance) >= theta_a_k else 0
    return plans


def _batch_of(at: np.ndarray, counts: np.ndarray, times: np.ndarray) -> np.ndarray:
    """The batch sizes B of flat step-time indices ``at`` of rounds of ``counts`` requests (:func:`uniform_plans`)."""
    return np.asarray(at, dtype=np.int64) - counts * times.shape[1]


_offset_tables: dict[int, np.ndarray] = {}


def _offsets(rounds: int, gamma: int) -> np.ndarray:
    """0, gamma, 2 gamma, ...: each row's start in a C-contiguous [rounds, gamma] array."""
    table = _offset_tables.get(gamma)
    if table is None or table.size < rounds:
        table = _offset_tables[gamma] = np.arange(0, max(rounds, 256) * gamma, gamma)
    return table[:rounds]


_before_tables: dict[tuple[int, int], np.ndarray] = {}


def _before(width: int, gamma: int) -> np.ndarray:
    """[width * gamma, gamma] float: entry (r * gamma + j, L - 1) is 1 where j < L."""
    table = _before_tables.get((width, gamma))
    if table is None:
        one = (np.arange(gamma)[:, None] < np.arange(1, gamma + 1)[None, :]).astype(np.float64)
        table = _before_tables[(width, gamma)] = np.tile(one, (width, 1))
    return table


class ChainPlanners:
    """The :class:`ChainPlanner` of each of ``drivers`` round drivers (rounds of at most ``max_requests``
    requests), as arrays, for deciding rounds of many drivers at once (a simulator's stacks of rounds, at most one
    per driver in a stack: a driver's next plan depends on its last round). :meth:`planned` and :meth:`observe`
    do for each round of a stack what that driver's ChainPlanner does for it
    (tests/scheduler/test_sched_planned_lengths.py checks them against planners called round by round). A round
    is named by its driver and its :meth:`key` (driver and request count)."""

    def __init__(self, drivers: int, max_requests: int, tolerance: float = CHAIN_TOLERANCE) -> None:
        ChainPlanner(tolerance)  # (checks it)
        self.tolerance = tolerance
        self.stride = max_requests + 1
        self.plans = np.full((drivers, self.stride), _UNPLANNED, dtype=np.int64)  # ChainPlanner._plans
        self.scheduled = np.zeros((drivers, self.stride), dtype=np.int64)  # ChainPlanner._scheduled
        self.asked = np.zeros(drivers, dtype=bool)

    def grow(self, drivers: int) -> None:
        """Room for ``drivers`` round drivers (new ones as a new ChainPlanner)."""
        more = drivers - self.asked.size
        if more > 0:
            self.plans = np.concatenate([self.plans, np.full((more, self.stride), _UNPLANNED)])
            self.scheduled = np.concatenate([self.scheduled, np.zeros((more, self.stride), np.int64)])
            self.asked = np.concatenate([self.asked, np.zeros(more, dtype=bool)])

    def key(self, drivers: np.ndarray, num_requests: np.ndarray) -> np.ndarray:
        """Each round's entry in the planners' tables: its driver's plan for its request count."""
        key = drivers * self.stride
        key += num_requests
        return key

    def planned(
        self,
        drivers: np.ndarray,
        key: np.ndarray,
        max_lengths: np.ndarray,
        num_requests: np.ndarray,
        block_size: int,
        table_for: Callable[[int], SPSTable],
        asking: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`ChainPlanner.planned` of driver ``drivers[k]`` for round k's caps (``max_lengths`` [N, R], 0 on
        the padding past its ``num_requests[k]`` requests), table ``table_for(R)``, for the rounds that ask
        (``asking[k]``: rounds of >= 1 request; the others ask nothing). Returns whether each round is planned
        (None: False) and the planned lengths [N, R] (0 on padding; those of rounds not planned mean nothing)."""
        self.asked[drivers[asking]] = True
        plan = self.plans.reshape(-1).take(key)
        planned = plan != 0
        planned &= asking
        unplanned = plan < 0
        lengths = np.minimum(max_lengths, np.where(unplanned, block_size, plan)[:, None])
        unplanned &= planned
        if np.count_nonzero(unplanned):  # no drafted round of R requests yet: the whole block, if nearly flat
            fresh = np.flatnonzero(unplanned)
            times = _step_times(table_for, max_lengths.shape[1], block_size)
            num = num_requests[fresh]
            planned[fresh] = times[num, num + lengths[fresh].sum(axis=1)] <= (1.0 + self.tolerance) * times[num, num]
        return planned, lengths

    def observe(
        self,
        drivers: np.ndarray,
        key: np.ndarray,
        survival: np.ndarray,
        max_lengths: np.ndarray,
        lengths: np.ndarray,
        theta_a: np.ndarray,
        num_requests: np.ndarray,
        table_for: Callable[[int], SPSTable],
        draft_cost: DraftCost | None,
        confidences: Callable[[int], np.ndarray],
        planned: np.ndarray,
        scheduled: np.ndarray,
    ) -> None:
        """:meth:`ChainPlanner.observe` of driver ``drivers[k]`` for each round k of a stack that drafted
        with lengths ``planned[k]`` or ``scheduled[k]`` (Algorithm 1 chose them), as :func:`uniform_plans` takes
        the rounds (``lengths``: Algorithm 1's, ``theta_a`` its objective)."""
        todo = self.asked.take(drivers)
        counters = self.scheduled.reshape(-1)
        since = counters.take(key)
        scheduled = scheduled & todo
        counters.put(key, since + scheduled)  # (one round per driver: no key twice)
        # of the rounds Algorithm 1 schedules, every RECHECK-th re-plans
        scheduled &= since % RECHECK == 0
        scheduled |= planned
        todo &= scheduled
        if not np.count_nonzero(todo):
            return
        plans = uniform_plans(
            survival, max_lengths, lengths, theta_a, num_requests, table_for, draft_cost, self.tolerance,
            confidences, todo,
        )
        self.plans.reshape(-1).put(key[todo], plans[todo])
