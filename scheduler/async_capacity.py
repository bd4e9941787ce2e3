"""The asynchronous capacity variant of Algorithm 1 (production: fixed-size steps, no scheduling stall).

Two decisions with different inputs:
1. Capacity: K, the number of draft tokens the verify step of round t will hold (B = R + K), is planned from
   the confidences of round t - lag. Those drafts were verified long ago, so a GLOBAL search over all prefixes
   of their walk (no early stop) is allowed: it cannot see the current round's tokens. This lets a CUDA-graph
   / pre-launched step know its size ahead of time.
2. Admission: round t admits its top-K draft tokens by current survival probability (same order and tie-break
   as Algorithm 1; zero survival never admitted).

Why admission is lossless: (r, j) is admitted iff fewer than K items precede it in the walk. The items that
can precede it are other requests' items (independent of x[r, j]) and (r, 1..j-1) (functions of x[r, 1..j-2]);
the items that read x[r, j], i.e. (r, j' > j), always come after it. K itself is fixed before round t was
drafted. So {l_r >= j} does not depend on x[r, j]. Using lag = 0 (planning K from the current confidences with
a global search) would be the retrospective search of the paper's Appendix A, hence lag >= 1 is enforced.

K counts draft tokens, not B: when requests join or leave between planning and use, the anchors change with R
while the draft-token budget is kept.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from scheduler.algorithm import (
    DraftCost,
    check_sps,
    early_stop,
    every_step_improves,
    lengths_of_prefix,
    positive_counts,
    scalar_round,
    survival_probabilities,
    takes_scalar_walk,
    theta_path,
    thread_workspace,
    validate_confidences,
    walk_order,
    walk_prices,
)
from scheduler.sps import SPSSource, SPSTable, check_sps_source


def plan_capacity(confidences: np.ndarray, sps: SPSTable, *, draft_cost: DraftCost | None = None) -> int:
    """K = argmax_n Theta_n over ALL prefixes of the walk (first maximum): only for confidences of an earlier
    round.
    """
    conf = validate_confidences(confidences)
    check_sps(sps)
    return _lengths_and_plan(conf, sps, draft_cost, None)[1]


def admit_top_k(confidences: np.ndarray, capacity: int) -> np.ndarray:
    """Lengths l_r (int64 [R]) admitting the `capacity` draft tokens of highest survival (fewer if fewer are >
    0).
    """
    conf = validate_confidences(confidences)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")
    num_requests = conf.shape[0]
    if num_requests == 0 or conf.shape[1] == 0:
        return np.zeros(num_requests, dtype=np.int64)
    ws = thread_workspace()
    survival, n_pos, _ = survival_probabilities(conf, ws)
    if capacity >= n_pos:  # every positive item fits: no order needed
        return positive_counts(survival, num_requests)
    return lengths_of_prefix(walk_order(survival, n_pos, ws), int(capacity), num_requests, ws)


def _lengths_and_plan(
    conf: np.ndarray, sps: SPSTable, draft_cost: DraftCost | None, capacity: int | None
) -> tuple[np.ndarray, int]:
    """One round from ONE walk: lengths (top-``capacity`` admission, or Algorithm 1's early stop when
    ``capacity`` is None) and the capacity planned from the same confidences (global argmax of Theta).

    Both read the same survivals, order and Theta path, which the separate calls would each recompute. When
    Theta improves at every step (algorithm.every_step_improves), its first maximum is the last prefix, so the
    plan is n_pos and Algorithm 1 admits every positive item: neither needs the sort.
    """
    num_requests, gamma = conf.shape
    if num_requests == 0 or gamma == 0:
        return np.zeros(num_requests, dtype=np.int64), 0
    ws = thread_workspace()
    survival, n_pos, smallest = survival_probabilities(conf, ws)
    prices = walk_prices(sps, draft_cost, num_requests, gamma)
    if n_pos == 0 or every_step_improves(
        float(np.add.reduce(survival)), n_pos, smallest, num_requests, float(prices.growth[n_pos])
    ):
        if capacity is None or capacity >= n_pos:
            return positive_counts(survival, num_requests), n_pos
        return lengths_of_prefix(walk_order(survival, n_pos, ws), capacity, num_requests, ws), n_pos
    order = walk_order(survival, n_pos, ws)
    theta = theta_path(survival, order, num_requests, prices, ws)
    plan = int(theta.argmax())
    admitted = early_stop(theta, ws) if capacity is None else min(capacity, n_pos)
    return lengths_of_prefix(order, admitted, num_requests, ws), plan


class AsyncCapacityScheduler:
    """Per verifier replica: round t admits top-K_t where K_t was planned from round t - lag's confidences.

    The first `lag` rounds have no plan yet; they fall back to Algorithm 1 on their own confidences (lossless,
    and the same decision the synchronous scheduler would make). Not thread-safe: one instance per round
    driver.
    """

    def __init__(self, sps: SPSSource, *, lag: int = 2, draft_cost: DraftCost | None = None) -> None:
        check_sps_source(sps)
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be an integer >= 1 (0 = biased retrospective search), got {lag!r}")
        self.sps = sps
        self.lag = lag
        self.draft_cost = draft_cost
        self._plans: deque[int] = deque()

    @property
    def next_capacity(self) -> int | None:
        """The capacity the next round will use (None while warming up), to pre-size the step."""
        return self._plans[0] if len(self._plans) == self.lag else None

    def reset(self) -> None:
        """Forget the pending plans: the next ``lag`` rounds warm up again (Algorithm 1 on their own
        confidences)."""
        self._plans.clear()

    def step(self, confidences: np.ndarray) -> np.ndarray:
        """Lengths for this round; then plans the capacity of round t + lag from this round's confidences.

        A round of at most ``_SCALAR_MAX_ITEMS`` drafts (1-3 requests) walks on Python floats, as Algorithm 1
        does there (:func:`scheduler.algorithm.scalar_round`: the same decisions and plan, bit for bit; it checks
        the values itself, before any plan is used up)."""
        conf = np.asarray(confidences)
        small = takes_scalar_walk(conf)
        if not small:
            conf = validate_confidences(conf)
        table = self.sps.table_for(conf.shape[0])
        capacity = self._plans[0] if len(self._plans) == self.lag else None
        if small:
            num_requests, gamma = conf.shape
            lengths, plan = scalar_round(conf, table, self.draft_cost, num_requests, gamma, capacity, plan=True)
        else:
            lengths, plan = _lengths_and_plan(conf, table, self.draft_cost, capacity)
        if capacity is not None:
            self._plans.popleft()
        self._plans.append(plan)
        return lengths
