"""The paper's Appendix A counterexample, simulated.

A retrospective global search biases the output; Algorithm 1 does not, and neither does the asynchronous
variant (capacity planned from an earlier round).

Setup (two-token vocabulary {A, B}, one request): SPS = {1: 1.0, 2: 0.5, 3: 0.45}; target p_t = (0.7, 0.3) and
draft p_d = (0.5, 0.5) for the first token; c_1 = 0.8 and a Markov-dependent c_2 = 0.9 if x1 = A else 0.1.
Theta along the walk: 1.0 (anchor only), 0.9 (x1), 0.45 * (1.8 + 0.8 c_2) (x1, x2) = 1.134 for A, 0.85 for B.
- Algorithm 1 stops at x1 (0.9 < 1.0): l = 0, the output is the target's bonus token, (0.7, 0.3).
- A global argmax verifies both tokens exactly when x1 = A: A is then always accepted (p_t/p_d = 1.4), and
  when x1 = B the target samples from p_t: P(A) = 0.5 + 0.5 * 0.7 = 0.85.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from scheduler.algorithm import schedule_lengths
from scheduler.async_capacity import AsyncCapacityScheduler, admit_top_k, plan_capacity
from scheduler.sps import SPSTable

SPS = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
P_TARGET = np.array([0.7, 0.3])
P_DRAFT = np.array([0.5, 0.5])
C1 = 0.8
C2_GIVEN_X1 = np.array([0.9, 0.1])  # the Markov confidence head reads x1
TRIALS = 20_000


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit for two categories: 1 degree of freedom, P(chi2_1 > x) =
    erfc(sqrt(x/2)).
    """
    expected = counts.sum() * probs
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return math.erfc(math.sqrt(statistic / 2.0))


def simulate_first_token(schedule: Callable[[np.ndarray], np.ndarray], seed: int) -> tuple[np.ndarray, dict]:
    """Counts of the first output token over TRIALS rounds of draft -> schedule -> lossless verification."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(2, dtype=np.int64)
    verified_by_x1: dict[int, set[int]] = {0: set(), 1: set()}
    for _ in range(TRIALS):
        x1 = int(rng.random() >= P_DRAFT[0])
        confidences = np.array([[C1, C2_GIVEN_X1[x1]]])
        length = int(schedule(confidences)[0])
        verified_by_x1[x1].add(length)
        if length >= 1:  # verify x1: accept with min(1, p_t/p_d), else sample the residual max(0, p_t - p_d)
            if rng.random() < min(1.0, P_TARGET[x1] / P_DRAFT[x1]):
                token = x1
            else:
                residual = np.maximum(P_TARGET - P_DRAFT, 0.0)
                token = int(rng.random() >= residual[0] / residual.sum())
        else:  # nothing verified: the target's own (bonus) token
            token = int(rng.random() >= P_TARGET[0])
        counts[token] += 1
    return counts, verified_by_x1


def test_retrospective_global_search_is_biased() -> None:
    counts, verified = simulate_first_token(lambda c: admit_top_k(c, plan_capacity(c, SPS)), seed=1)
    assert verified == {0: {2}, 1: {0}}  # x1 is admitted only when x1 = A
    assert counts[0] / TRIALS > 0.83
    assert chi_square_p_value(counts, P_TARGET) < 1e-12
    assert chi_square_p_value(counts, np.array([0.85, 0.15])) > 1e-3


def test_algorithm_1_follows_the_target() -> None:
    counts, verified = simulate_first_token(lambda c: schedule_lengths(c, SPS), seed=2)
    assert verified == {0: {0}, 1: {0}}
    assert chi_square_p_value(counts, P_TARGET) > 1e-3
    assert chi_square_p_value(counts, np.array([0.85, 0.15])) < 1e-12


def test_asynchronous_capacity_from_an_earlier_round_follows_the_target() -> None:
    scheduler = AsyncCapacityScheduler(SPS, lag=1)
    counts, verified = simulate_first_token(scheduler.step, seed=3)
    # The planned capacity now varies (2 after an A round, 0 after a B round) independently of the current x1,
    # so both values of x1 get verified sometimes, and the output is still the target's.
    assert verified[0] == {0, 2} and verified[1] == {0, 2}
    assert chi_square_p_value(counts, P_TARGET) > 1e-3
