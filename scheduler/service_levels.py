"""Per-request service levels: speculation on or off, priority tiers and time-per-output-token targets.

A request may carry three settings (``SamplingParams.speculative`` / ``priority`` / ``tpot_slo_ms``; None means
the server's default, :class:`ServiceLevels`). The round driver applies them with the pure functions of this
module, which read request settings, counts and wall-clock timings only, never token values, so every rule keeps
decoding lossless:

- ``speculative``: ``auto`` (the policy decides, as for every request before), ``off`` (verified with no drafts,
  length 0 every round, and never placed on a drafter: it costs no drafter slot), ``on`` (the round drafts even
  when the draft gate would run a plain target round, and the request verifies at least one draft whenever its
  cap allows; more when Algorithm 1 says so).
- ``priority``: an integer tier; a SMALLER value is served first (vLLM's convention, so clients that send vLLM's
  ``priority`` get the same order). Waiting requests are admitted in tier order, FIFO within a tier, and nobody
  overtakes a higher tier that waits. A joining prompt is prefilled in the round it joins, which lengthens that
  round for every running request (docs/benchmarks/service_levels.md measures how much), so a request of tier p
  joins only while every running request of tier p or higher with a target has the slack to absorb one more
  joining prompt's learned cost and still meet its target over its remaining tokens (:func:`join_slack_s`,
  :func:`joiners_allowed`); as requests finish and none replace them, the rounds get shorter until the targets
  hold again.
- ``tpot_slo_ms``: a target for time per output token. A round in which some request is behind its target
  (:func:`behind_target`: taking only the target's own token this round, its TPOT since its first token would exceed
  the target) stays a plain round (drafted ahead, chained or relayed where the engine can: a leveled round that
  drafts again and never chains makes every request's round longer, the late ones' too). When its lengths are
  planned before the drafts exist, each late request verifies its whole block (:func:`late_lengths`); when Algorithm
  1 decides on the drafts, the first confidence of each request that is NOT behind (and of every request without a
  target) is multiplied by ``on_target_weight``, which multiplies all of its prefix survival probabilities by the
  same factor: Algorithm 1 walks late requests' drafts first and values the others' less, so under load (where the
  SPS curve falls with B) its early stop gives the verification budget to late requests and trims the rest; on a
  flat curve everyone keeps every draft. In such a round the requests of a lower tier than a late one may sit it out
  (:func:`paused`; ``pause_lower_tiers``, off by default: it costs the lower tiers more throughput than it gives the
  late ones, docs/benchmarks/service_levels.md): they keep their slots, KV cache and drafter context and rejoin a
  later round, so the late requests' rounds are those of a smaller batch. How many sit out adapts
  (:func:`next_pause_count`): a step more for every round with a late request, one fewer for every round without. At
  admission, a request whose target cannot be met at the current round time and acceptance
  (:func:`predicted_tpot_s`) is refused (HTTP 429 with ``Retry-After``), or, with ``slo_admission: queue``, waits
  while others run until the prediction leaves :data:`BUDGET_SHARE` of the target room.

Pacing below the target: a request paced exactly at its target ends on either side of it about equally often,
so lateness and the join slack judge a request against its target times its tier's pace factor
(:class:`PaceTracker`; the slack falls back to the target itself once the paced budget is spent), while admission
(refusal, queueing) keeps the target itself: the factor is a margin, not a stricter promise. The factor falls a
step when a request of the tier finishes missing its target and rises a smaller step when one meets it, the steps
in the ratio that makes the share meeting their targets converge to ``slo_attainment`` (stochastic quantile
tracking). A tier whose requests all meet their targets keeps the factor at 1. The factor is a function of
finished requests' timings only, so it keeps decoding lossless like every other rule here.

Why the weights stay lossless: scaling request r's survivals by a factor w_r keeps each request's items in the
walk in position order (w_r * a[r, j] is still non-increasing in j), so the walk still admits prefixes, and the
early-stop argument of :mod:`scheduler.algorithm` holds unchanged as long as w_r is fixed before the round's
drafts are sampled: it is a function of past rounds' timings and counts and the request's settings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kernels.sampling import MAX_PRIORITY, MIN_PRIORITY, SPECULATIVE_MODES, Speculative

SloAdmission = Literal["refuse", "queue"]
#: TPOT histogram buckets (seconds), the per-tier ``dspark_tier_tpot_seconds``.
TPOT_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class SLOUnattainableError(ValueError):
    """A request's TPOT target cannot be met at the current load and the server refuses such requests (HTTP
    429); ``retry_after_s``: when to try again (a whole number of seconds, at least 1)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ServiceLevels:
    """The server's defaults for requests that do not set a field, and the admission rule for targets.

    ``on_target_weight`` in (0, 1]: the factor on the survival probabilities of requests that are not behind a
    target (1 turns lateness weighting off); small by default because the walk compares a late request's deeper
    drafts (survivals that fall with depth) with the others' first ones: at one half, a late request's drafts past
    a survival of 0.5 still rank behind every on-track request's first draft, and late requests got no more
    budget than the others (docs/benchmarks/service_levels.md). ``slo_admission``: ``refuse`` (429 +
    ``Retry-After``) or ``queue`` (wait, admitted once the prediction leaves :data:`BUDGET_SHARE` of the target
    room or nothing else runs). ``pause_lower_tiers``: in a round with a late request, some requests of a
    lower tier than a late one sit it out (:func:`paused`, :func:`next_pause_count`): weighting alone leaves a
    high request sharing every round with every best-effort one, whose round time it cannot shorten.
    ``slo_attainment``: the share of a tier's requests with a target that should meet it, which its pace factor
    steers to (:class:`PaceTracker`); None judges every request against its target itself. ``join_hold_ms``: while
    a running request has a target, how long a prompt may wait so that prompts join rounds together
    (:func:`holds_joiners`); 0 admits each prompt at the first round it fits."""

    default_priority: int = 0
    default_speculative: Speculative = "auto"
    default_tpot_slo_ms: float | None = None
    slo_admission: SloAdmission = "refuse"
    on_target_weight: float = 0.1
    pause_lower_tiers: bool = False
    slo_attainment: float | None = 0.95
    join_hold_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.default_speculative not in SPECULATIVE_MODES:
            raise ValueError(f"default_speculative must be one of {SPECULATIVE_MODES}: {self.default_speculative!r}")
        if not MIN_PRIORITY <= self.default_priority <= MAX_PRIORITY:
            raise ValueError(f"default_priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        if self.default_tpot_slo_ms is not None and not (
            math.isfinite(self.default_tpot_slo_ms) and self.default_tpot_slo_ms > 0
        ):
            raise ValueError("default_tpot_slo_ms must be a positive number")
        if self.slo_admission not in ("refuse", "queue"):
            raise ValueError(f"slo_admission must be refuse or queue, got {self.slo_admission!r}")
        if not 0.0 < self.on_target_weight <= 1.0:
            raise ValueError(f"on_target_weight must be in (0, 1], got {self.on_target_weight}")
        if self.slo_attainment is not None and not 0.0 < self.slo_attainment < 1.0:
            raise ValueError(f"slo_attainment must be in (0, 1) or None, got {self.slo_attainment}")
        if not (math.isfinite(self.join_hold_ms) and self.join_hold_ms >= 0.0):
            raise ValueError(f"join_hold_ms must be a number >= 0, got {self.join_hold_ms}")


@dataclass(frozen=True)
class RequestLevel:
    """One request's resolved service level: its own settings, else the server's defaults."""

    speculative: Speculative
    priority: int
    tpot_slo_s: float | None

    @classmethod
    def resolve(
        cls, speculative: str | None, priority: int | None, tpot_slo_ms: float | None, defaults: ServiceLevels
    ) -> RequestLevel:
        mode = speculative if speculative is not None else defaults.default_speculative
        target_ms = tpot_slo_ms if tpot_slo_ms is not None else defaults.default_tpot_slo_ms
        return cls(
            mode,  # type: ignore[arg-type]  # validated by SamplingParams / ServiceLevels
            priority if priority is not None else defaults.default_priority,
            None if target_ms is None else target_ms / 1000.0,
        )


#: The level of a request that sets nothing on a server with the default :class:`ServiceLevels`.
PLAIN_LEVEL = RequestLevel("auto", 0, None)


def admission_order(priorities: Sequence[int]) -> list[int]:
    """Indices of waiting requests (given in queue order) in the order they are admitted: by tier, smaller
    value first, queue order (FIFO) within a tier (a stable sort)."""
    return sorted(range(len(priorities)), key=priorities.__getitem__)


def behind_target(tpot_slo_s: float, elapsed_s: float, num_output: int, round_s: float) -> bool:
    """Whether a request with target ``tpot_slo_s`` is behind it: ``num_output`` tokens emitted, the first one
    ``elapsed_s`` ago; if this round (``round_s``, the recent median) gives it only the target's own token, its
    TPOT since the first token, (elapsed + round) / num_output, would exceed the target."""
    return elapsed_s + round_s > tpot_slo_s * max(num_output, 1)


#: Share of a running request's time budget that admissions plan with: the requests admitted now lengthen
#: every later round of the running ones a little, which the pace measured so far does not show yet.
BUDGET_SHARE = 0.8


def join_slack_s(
    tpot_slo_s: float, since_first_s: float, num_output: int, max_tokens: int, per_round: float, round_s: float
) -> float | None:
    """Seconds of rounds that prefill joining prompts a running request with a target can still absorb and
    meet it; None once it cannot meet it whatever happens next (its time budget is spent), so it holds no
    admission back.

    Its budget to its last token is ``tpot_slo_s * (max_tokens - 1)`` from its first token, ``since_first_s``
    ago; of what is left (:data:`BUDGET_SHARE` of it) the rounds its ``max_tokens - num_output`` remaining
    tokens need at the current pace (``round_s`` per round without a joining prompt, ``per_round`` tokens a
    round) are taken; the rest is the slack. Negative: it misses at this pace unless the batch shrinks.
    Settings, counts and timings only."""
    left = tpot_slo_s * max(max_tokens - 1, 1) - since_first_s
    if left <= 0.0:
        return None
    rounds = math.ceil(max(max_tokens - num_output, 0) / max(per_round, 1.0))
    return BUDGET_SHARE * left - rounds * round_s


def joiners_allowed(slacks: Sequence[float], join_cost_s: float) -> int:
    """How many prompts may join this round beside running requests of these slacks (``join_slack_s``), each
    joining prompt costing every running request ``join_cost_s`` (the learned extra time of a round per
    prompt it prefills): as many as the smallest slack pays for. No slack: no limit (-1)."""
    if not slacks:
        return -1
    least = min(slacks)
    if least < 0.0:
        return 0
    return -1 if join_cost_s <= 0.0 else int(least // join_cost_s)


def holds_joiners(hold_s: float, oldest_wait_s: float, targets_running: bool) -> bool:
    """Whether a round admits no prompt yet (``join_hold_ms``): a round that a prompt joins is not planned (its
    verify step also prefills, so it is not chained behind the drafts), so while running requests have targets,
    prompts that arrive within ``hold_s`` of the oldest waiting one join one round together, and the rounds
    between are planned. The oldest prompt never waits longer than ``hold_s``; with no running target nothing is
    held (an idle or best-effort server admits at once). Timings and counts only: lossless."""
    return hold_s > 0.0 and targets_running and oldest_wait_s < hold_s


def lateness_weights(late: np.ndarray, on_target_weight: float) -> np.ndarray | None:
    """Per request, the factor on its survival probabilities this round: 1 for a request behind its target
    (``late``), ``on_target_weight`` for all others; None when no request is behind or the weight is 1 (nothing
    to reorder: every weight would be the same, and one common factor changes no comparison of the walk except
    against the anchors' tau)."""
    if not late.any() or on_target_weight >= 1.0:
        return None
    return np.where(late, 1.0, on_target_weight)


def late_lengths(planned: np.ndarray, caps: np.ndarray, late: np.ndarray | None, block_size: int) -> np.ndarray:
    """A planned round's lengths (fixed before its drafts exist, so the round can chain or relay) when some
    requests are behind their TPOT targets (``late``; None when none is): each late request verifies every
    draft of its block that its cap allows, the most tokens per round it can get without leaving the planned
    (chained) pipeline; the others keep their planned lengths. Counts and timings only: lossless."""
    if late is None:
        return planned
    return np.where(late, np.minimum(caps, block_size), planned).astype(np.int64)


#: How far a tier's pace factor moves per finished request with a target: down by PACE_STEP * attainment on a
#: miss, up by PACE_STEP * (1 - attainment) on a hit. At 0.05 and 0.95, ten misses in a row take it from 1 to
#: about 0.53, and nineteen hits undo one miss: it settles within a few hundred requests.
PACE_STEP = 0.05
#: The pace factor's floor: no tier is paced faster than twice its target.
MIN_PACE = 0.5


class PaceTracker:
    """Per priority tier, the factor on its requests' TPOT targets that the scheduler's rules judge them by.

    Starts at 1. :meth:`finished` moves it after each request of the tier with a target: down on a miss, up on a
    hit, in the ratio ``attainment : 1 - attainment``, so it settles where that share of the tier's requests meet
    their targets (on average the steps cancel exactly when the miss rate is ``1 - attainment``); clipped to
    [:data:`MIN_PACE`, 1]. ``attainment`` None keeps every factor at 1. Timings only: lossless."""

    def __init__(self, attainment: float | None) -> None:
        self.attainment = attainment
        self._factors: dict[int, float] = {}

    def factor(self, priority: int) -> float:
        """The tier's current factor (1 for a tier none of whose requests finished yet)."""
        return self._factors.get(priority, 1.0)

    def finished(self, priority: int, met: bool) -> None:
        """A request of tier ``priority`` with a target finished and ``met`` it or not."""
        if self.attainment is None:
            return
        step = PACE_STEP * (1.0 - self.attainment) if met else -PACE_STEP * self.attainment
        self._factors[priority] = min(1.0, max(MIN_PACE, self.factor(priority) + step))


#: A round with a late request pauses up to 1/PAUSE_STEPS more of the lower-tier candidates than the last one.
PAUSE_STEPS = 8


def pause_candidates(priorities: np.ndarray, late: np.ndarray) -> np.ndarray:
    """Per request, whether it may sit out a round in which the ``late`` requests are behind their targets:
    every request of a lower tier (a larger ``priorities`` value) than some late request. A late request is
    never one (nobody is of a lower tier than itself)."""
    if not late.any():
        return np.zeros(len(priorities), dtype=bool)
    return priorities > priorities[late].min()


def next_pause_count(count: int, candidates: int) -> int:
    """How many candidates sit out a round with a late request, after ``count`` in the last such round: a
    step of ``ceil(candidates / PAUSE_STEPS)`` more, at most all of them (rounds without a late request take
    one off the count: :meth:`scheduler.engine.SpeculativeEngine.step`)."""
    return min(candidates, count + -(-candidates // PAUSE_STEPS))


def paused(priorities: np.ndarray, candidates: np.ndarray, count: int) -> np.ndarray:
    """Which ``count`` of the ``candidates`` sit the round out: the lowest tier first, within a tier the ones
    latest in the round's order (the most recently admitted, which have waited least). Pausing delays a
    request's tokens and never changes them: the rule reads settings, counts and timings only, and a paused
    request resumes at its committed anchor and position."""
    out = np.zeros(len(priorities), dtype=bool)
    rows = np.flatnonzero(candidates)
    if count <= 0 or not len(rows):
        return out
    order = np.lexsort((-rows, -priorities[rows]))  # by tier (lowest first), then latest first
    out[rows[order[:count]]] = True
    return out


def weighted_confidences(confidences: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Confidences whose prefix products are ``weights[r] * a[r, j]``: the first column scaled (a copy)."""
    out = np.array(confidences, dtype=np.float64, copy=True)
    out[:, 0] *= weights
    return out


def predicted_tpot_s(round_s: float, tau: float, speculative: str) -> float:
    """TPOT a request joining now is predicted to get: the recent median round time over the tokens a request
    gets per round (``tau``, bonus included; 1 for a request verified without drafts). 0 with no history."""
    if round_s <= 0.0:
        return 0.0
    per_round = 1.0 if speculative == "off" or tau < 1.0 else tau
    return round_s / per_round


@dataclass
class _Tier:
    requests: int = 0
    output_tokens: int = 0
    slo_attained: int = 0
    slo_missed: int = 0
    refused: int = 0
    request_rounds: int = 0
    draft_tokens: int = 0
    tpot_sum_s: float = 0.0
    tpot_buckets: list[int] = field(default_factory=lambda: [0] * (len(TPOT_BUCKETS_S) + 1))


@dataclass(frozen=True)
class TierSnapshot:
    """Counters of one priority tier (cumulative): finished requests, their output tokens, TPOT histogram
    (``tpot_buckets[i]``: requests with TPOT <= ``TPOT_BUCKETS_S[i]``, not cumulative; the last: above all),
    requests with a target that met / missed it, requests refused at admission, and the finished requests'
    rounds and the drafts they verified in them (their verification budget)."""

    priority: int
    requests: int
    output_tokens: int
    slo_attained: int
    slo_missed: int
    refused: int
    request_rounds: int
    draft_tokens: int
    tpot_sum_s: float
    tpot_buckets: tuple[int, ...]


class TierMetrics:
    """Per-tier counters, kept by the round driver (single-threaded)."""

    def __init__(self) -> None:
        self._tiers: dict[int, _Tier] = {}

    def _tier(self, priority: int) -> _Tier:
        tier = self._tiers.get(priority)
        if tier is None:
            tier = self._tiers[priority] = _Tier()
        return tier

    def finished(self, level: RequestLevel, num_output: int, tpot_s: float | None, verified: Sequence[int]) -> None:
        """A request finished with ``num_output`` tokens, ``verified[i]`` drafts verified in its round i;
        ``tpot_s`` None when it emitted fewer than two."""
        tier = self._tier(level.priority)
        tier.requests += 1
        tier.output_tokens += num_output
        tier.request_rounds += len(verified)
        tier.draft_tokens += sum(verified)
        if tpot_s is None:
            return
        tier.tpot_sum_s += tpot_s
        tier.tpot_buckets[int(np.searchsorted(TPOT_BUCKETS_S, tpot_s))] += 1
        if level.tpot_slo_s is not None:
            if tpot_s <= level.tpot_slo_s:
                tier.slo_attained += 1
            else:
                tier.slo_missed += 1

    def refused(self, priority: int) -> None:
        self._tier(priority).refused += 1

    def snapshot(self) -> tuple[TierSnapshot, ...]:
        return tuple(
            TierSnapshot(p, t.requests, t.output_tokens, t.slo_attained, t.slo_missed, t.refused, t.request_rounds,
                         t.draft_tokens, t.tpot_sum_s, tuple(t.tpot_buckets))
            for p, t in sorted(self._tiers.items())
        )


def merge_tiers(groups: Sequence[Sequence[TierSnapshot]]) -> tuple[TierSnapshot, ...]:
    """Per-tier sums over several round drivers' snapshots (the scheduler hub's verifier groups)."""
    merged: dict[int, TierSnapshot] = {}
    for tiers in groups:
        for t in tiers:
            m = merged.get(t.priority)
            merged[t.priority] = t if m is None else TierSnapshot(
                t.priority, m.requests + t.requests, m.output_tokens + t.output_tokens,
                m.slo_attained + t.slo_attained, m.slo_missed + t.slo_missed, m.refused + t.refused,
                m.request_rounds + t.request_rounds, m.draft_tokens + t.draft_tokens, m.tpot_sum_s + t.tpot_sum_s,
                tuple(a + b for a, b in zip(m.tpot_buckets, t.tpot_buckets, strict=True)),
            )
    return tuple(merged[p] for p in sorted(merged))
