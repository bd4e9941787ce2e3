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
    _lengths_of_prefix,
    _sorted_walk,
    _theta_path,
    _workspace,
    check_sps,
    schedule_lengths,
    validate_confidences,
)
from scheduler.sps import SPSTable


def plan_capacity(confidences: np.ndarray, sps: SPSTable, *, draft_cost: DraftCost | None = None) -> int:
    """K = argmax_n Theta_n over ALL prefixes of the walk (first maximum): only for confidences of an earlier
    round.
    """
    conf = validate_confidences(confidences)
    check_sps(sps)
    num_requests = conf.shape[0]
    if num_requests == 0:
        return 0
    ws = _workspace()
    survival, order, _ = _sorted_walk(conf, ws)
    theta = _theta_path(survival, order, num_requests, sps, draft_cost, ws)
    return int(theta.argmax())


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
    ws = _workspace()
    _, order, n_pos = _sorted_walk(conf, ws)
    return _lengths_of_prefix(order, min(int(capacity), n_pos), num_requests, ws)


class AsyncCapacityScheduler:
    """Per verifier replica: round t admits top-K_t where K_t was planned from round t - lag's confidences.

    The first `lag` rounds have no plan yet; they fall back to Algorithm 1 on their own confidences (lossless,
    and the same decision the synchronous scheduler would make). Not thread-safe: one instance per round
    driver.
    """

    def __init__(self, sps: SPSTable, *, lag: int = 2, draft_cost: DraftCost | None = None) -> None:
        check_sps(sps)
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
        """Lengths for this round; then plans the capacity of round t + lag from this round's confidences."""
        conf = validate_confidences(confidences)
        if len(self._plans) == self.lag:
            lengths = admit_top_k(conf, self._plans.popleft())
        else:
            lengths = schedule_lengths(conf, self.sps, draft_cost=self.draft_cost)
        self._plans.append(plan_capacity(conf, self.sps, draft_cost=self.draft_cost))
        return lengths
