"""Verification policies: how many of its drafted tokens each request sends to the verifier this round.

One interface for everything the benchmarks compare: plain autoregressive decoding (no drafts), fixed lengths
(1 = MTP-1-like, the whole block = DFlash-like), DSpark's Algorithm 1, and its asynchronous capacity variant.
Every policy must be causal to stay lossless: the decision whether to verify draft x_{r,j} may depend on
confidences c_{r,<=j} (which depend on x_{r,<j}) but never on x_{r,j} itself beyond what Algorithm 1's early stop
allows. Caps (``max_lengths``) only depend on counts (tokens still allowed, KV room), never on token values. The
pre-draft decision ``should_draft`` (may this round skip the drafter, i.e. be a plain target round?) sees only
counts and the confidences of earlier, already verified rounds (:mod:`scheduler.draft_gate`). A measured draft
cost (:class:`scheduler.draft_cost_estimate.OnlineDraftCost`, fed by ``observe_round`` after every round) only
adds wall-clock timings and request counts of finished rounds to what a decision sees, so it keeps all of this.
Lateness weights (``lengths(..., weights=)``, :mod:`scheduler.service_levels`) scale each request's survivals by
a factor fixed before its drafts were sampled, which keeps the walk's prefix order and its early-stop argument.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from scheduler.algorithm import (
    DraftCost,
    RecordedConfidences,
    recorded_round_survivals,
    schedule_lengths,
    schedule_lengths_rounds,
    schedule_recorded_rounds,
)
from scheduler.async_capacity import AsyncCapacityScheduler
from scheduler.chain_plan import CHAIN_TOLERANCE, ChainPlanner, ChainPlanners
from scheduler.draft_cost_estimate import OnlineDraftCost
from scheduler.draft_gate import DraftGate
from scheduler.service_levels import weighted_confidences
from scheduler.sps import SPSSource, check_sps_source


class VerifyPolicy(Protocol):
    """Chooses l_r in [0, min(gamma, max_lengths[r])] for every request of one verifier replica."""

    name: str
    uses_drafter: bool

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        """Before drafting: whether this round calls the drafter at all (False: every l_r = 0, no proposal)."""
        ...

    def lengths(
        self, confidences: np.ndarray, max_lengths: np.ndarray, *, weights: np.ndarray | None = None
    ) -> np.ndarray:
        """``weights``: per request, a factor (0, 1] on its prefix survival probabilities, fixed before the
        round's drafts (lateness, :mod:`scheduler.service_levels`); the scheduled policies rank and value drafts
        by the weighted survivals, the others ignore it."""
        ...


#: The scheduled policies also have ``observe_round(num_requests, drafted, draft_s, other_s, verify_s,
#: verify_tokens)``, which the round driver calls after every round when present (a measured draft cost and the
#: verify-time calibration learn from it); the others need no timings. A policy with ``planned_lengths(
#: max_lengths, block_size)`` may fix a round's lengths before the drafts exist (an array, or None to decide on
#: the confidences as usual), which lets a round driver chain the verify step behind the drafter on the device;
#: it then hands the round's confidences to ``observe_drafts(confidences, max_lengths)`` when present.
#:
#: A policy whose ``decides_rounds_alone`` is true decides every round from that round's confidences and caps
#: alone (nothing learned from earlier rounds, never skips the drafter); ``lengths_of_rounds(confidences [N, R,
#: gamma], max_lengths [N, R], num_requests [N])`` then decides a stack of independent rounds at once, each as
#: ``lengths`` would (a simulator batches the rounds of many replicas this way), and
#: ``lengths_of_recorded_rounds(recorded, rows [N, R], max_lengths, num_requests)`` the same for rounds whose
#: confidences are rows of recorded ones (:class:`scheduler.algorithm.RecordedConfidences`).


class DecidesRoundsAlone(Protocol):
    """A policy that decides every round from that round's confidences and caps alone, for stacks of rounds
    (see the note above); ``decides_rounds_alone`` says whether it does right now."""

    decides_rounds_alone: bool

    def lengths_of_rounds(
        self, confidences: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray: ...

    def lengths_of_recorded_rounds(
        self, recorded: RecordedConfidences, rows: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray: ...


class PlansInStacks(Protocol):
    """A policy whose planned rounds (``planned_lengths``, then ``observe_drafts``) and scheduled rounds depend
    on nothing but its chain planner's state, the caps and the confidences while ``plans_in_stacks``: the rounds
    of many round drivers, each with its own copy, are then decided in stacks, their planners held by one
    :class:`scheduler.chain_plan.ChainPlanners` (see :meth:`DSparkScheduled.plan_recorded_rounds`)."""

    plans_in_stacks: bool
    chain_tolerance: float

    def plan_recorded_rounds(
        self,
        planners: ChainPlanners,
        drivers: np.ndarray,
        recorded: RecordedConfidences,
        rows: np.ndarray,
        max_lengths: np.ndarray,
        num_requests: np.ndarray,
        asking: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]: ...


def _rounds_capped(confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
    """:func:`_capped` for a stack of rounds [N, R, gamma] (caps [N, R])."""
    gamma = confidences.shape[2]
    if max_lengths.size and int(np.minimum.reduce(max_lengths, axis=None)) >= gamma:
        return confidences
    return np.where(np.arange(gamma) < max_lengths[:, :, None], confidences, 0.0)


def _padding(max_lengths: np.ndarray, num_requests: np.ndarray) -> np.ndarray:
    return np.arange(max_lengths.shape[1])[None, :] >= np.asarray(num_requests)[:, None]


_ZERO_COST = DraftCost()  # one object: the gate reuses a prediction only while its cost objects stay the same


class _MeasuredCost:
    """The draft cost a scheduled policy uses this round: fixed, or measured online by an estimator.

    With an ``estimator`` the cost is its current estimate (None while it warms up: the plain objective, and a
    gate that never skips), pushed into the gate before each decision together with the no-draft overhead, both
    divided by the estimator's verify scale k (verify steps measured k times as long as the SPS table says are
    priced so: :meth:`DraftCost.scaled`).
    """

    def __init__(self, draft_cost: DraftCost | None, gate: DraftGate | None, estimator: OnlineDraftCost | None) -> None:
        if estimator is not None and draft_cost is not None:
            raise ValueError("give a fixed draft_cost or an estimator that measures it, not both")
        self.fixed = draft_cost
        self.gate = gate
        self.estimator = estimator
        # (estimate, no-draft overhead, scale) -> their scaled versions: the costs change every few rounds only.
        self._scaled: tuple[DraftCost | None, DraftCost, float, DraftCost | None, DraftCost] | None = None
        self._observed = -1  # the estimator's round count when ``_scaled`` was last checked

    def current(self) -> DraftCost | None:
        if self.estimator is None:
            return self.fixed
        if self.estimator.observed == self._observed and self._scaled is not None:
            return self._scaled[3]  # no round since the last call (it is called twice a round): same costs
        self._observed = self.estimator.observed
        cost, no_draft, scale = self.estimator.draft_cost, self.estimator.no_draft_cost, self.estimator.verify_scale
        kept = self._scaled
        if kept is None or kept[0] is not cost or kept[1] is not no_draft or kept[2] != scale:
            inverse = 1.0 / scale
            kept = self._scaled = (
                cost,
                no_draft,
                scale,
                None if cost is None else cost if scale == 1.0 else cost.scaled(inverse),
                no_draft if scale == 1.0 else no_draft.scaled(inverse),
            )
        if self.gate is not None:
            self.gate.draft_cost = kept[3] if kept[3] is not None else _ZERO_COST  # never skips
            self.gate.no_draft_cost = kept[4]
        return kept[3]

    def observe_round(
        self,
        sps: SPSSource,
        num_requests: int,
        drafted: bool,
        draft_s: float,
        other_s: float,
        verify_s: float | None,
        verify_tokens: int | None,
    ) -> None:
        if self.estimator is None:
            return
        predicted = None
        if verify_s is not None and verify_tokens is not None and verify_tokens >= 1:
            predicted = float(sps.table_for(num_requests).dense_step_time(verify_tokens)[verify_tokens])
        self.estimator.observe(num_requests, drafted, draft_s, other_s, verify_s, predicted)


def _capped(confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
    """Zero the confidences past each request's cap: a zero survival probability is never admitted.

    Usually no cap is below the block (caps bind only in a request's last rounds): then nothing is zeroed and
    the confidences go on as they are, without building the masked copy (a few us a round at small R).
    """
    gamma = confidences.shape[1]
    if max_lengths.size and int(np.minimum.reduce(max_lengths)) >= gamma:
        return confidences
    positions = np.arange(gamma)[None, :]
    return np.where(positions < max_lengths[:, None], confidences, 0.0)


class Autoregressive:
    """Plain target decoding: the drafter is not called, every round verifies only the anchor."""

    name = "autoregressive"
    uses_drafter = False

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        return False

    def lengths(
        self, confidences: np.ndarray, max_lengths: np.ndarray, *, weights: np.ndarray | None = None
    ) -> np.ndarray:
        return np.zeros(len(max_lengths), dtype=np.int64)

    decides_rounds_alone = True

    def lengths_of_rounds(
        self, confidences: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray:
        return np.zeros(max_lengths.shape, dtype=np.int64)

    def lengths_of_recorded_rounds(
        self, recorded: RecordedConfidences, rows: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray:
        return np.zeros(max_lengths.shape, dtype=np.int64)


class FixedLength:
    """Verify the first ``n`` drafts of every request (1: MTP-1-like; the block size: DFlash-like)."""

    uses_drafter = True

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"fixed verification length must be >= 1, got {n}")
        self.n = n
        self.name = f"fixed-{n}"

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        return True

    def lengths(
        self, confidences: np.ndarray, max_lengths: np.ndarray, *, weights: np.ndarray | None = None
    ) -> np.ndarray:
        return np.minimum(np.minimum(self.n, confidences.shape[1]), max_lengths).astype(np.int64)

    decides_rounds_alone = True

    def lengths_of_rounds(
        self, confidences: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray:
        """:meth:`lengths` of each round of a stack (zero on padding)."""
        lengths = np.minimum(np.minimum(self.n, confidences.shape[2]), max_lengths).astype(np.int64)
        lengths[_padding(max_lengths, num_requests)] = 0
        return lengths

    def lengths_of_recorded_rounds(
        self, recorded: RecordedConfidences, rows: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray:
        """:meth:`lengths` of each round of a stack whose confidences are rows of ``recorded``."""
        lengths = np.minimum(np.minimum(self.n, recorded.gamma), max_lengths).astype(np.int64)
        lengths[_padding(max_lengths, num_requests)] = 0
        return lengths

    def planned_lengths(self, max_lengths: np.ndarray, block_size: int) -> np.ndarray:
        """The lengths before the drafts exist: they never depend on the confidences (a chained round)."""
        return np.minimum(max_lengths, min(self.n, block_size)).astype(np.int64)


class _LearnsRoundCosts:
    """What both scheduled policies share: the round driver reports every finished round to them."""

    sps: SPSSource
    _cost: _MeasuredCost

    def observe_round(
        self,
        num_requests: int,
        drafted: bool,
        draft_s: float,
        other_s: float,
        verify_s: float | None = None,
        verify_tokens: int | None = None,
    ) -> None:
        """After a round: its timings (and its verify step's seconds and tokens, anchors + drafts), for a
        measured draft cost and verify-time calibration (a no-op with a fixed cost)."""
        self._cost.observe_round(self.sps, num_requests, drafted, draft_s, other_s, verify_s, verify_tokens)


class DSparkScheduled(_LearnsRoundCosts):
    """Algorithm 1: global greedy admission by prefix survival probability with the causal early stop.

    With a ``gate`` (:class:`scheduler.draft_gate.DraftGate`) a round may also skip the drafter when a plain
    target round is predicted to deliver more tokens per second (high load, expensive draft). The draft cost is
    fixed (``draft_cost``) or measured while serving (``estimator``, fed by :meth:`observe_round`). ``sps``: one
    token table, or tables by request count (:class:`scheduler.sps.RequestSPS`: each round prices its verify
    step with the table of its own R). ``chain_tolerance``: see :mod:`scheduler.chain_plan`.
    """

    name = "dspark"
    uses_drafter = True

    def __init__(
        self,
        sps: SPSSource,
        draft_cost: DraftCost | None = None,
        gate: DraftGate | None = None,
        estimator: OnlineDraftCost | None = None,
        chain_tolerance: float = CHAIN_TOLERANCE,
    ) -> None:
        check_sps_source(sps)
        self.sps = sps
        self.gate = gate
        self.chain = ChainPlanner(chain_tolerance)
        self._cost = _MeasuredCost(draft_cost, gate, estimator)

    @property
    def draft_cost(self) -> DraftCost | None:
        return self._cost.current()

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        self._cost.current()  # refreshes the gate's costs
        return self.gate is None or self.gate.should_draft(max_lengths)

    def lengths(
        self, confidences: np.ndarray, max_lengths: np.ndarray, *, weights: np.ndarray | None = None
    ) -> np.ndarray:
        capped = _capped(confidences, max_lengths)
        table = self.sps.table_for(capped.shape[0])
        cost = self._cost.current()
        ranked = capped if weights is None else weighted_confidences(capped, weights)
        lengths = schedule_lengths(ranked, table, draft_cost=cost)
        if self.gate is not None:  # after the schedule: it validated them when no cap bound (the same array)
            self.gate.observe(confidences, validated=capped is confidences)
        if weights is None:  # a weighted round is no plan for the next unweighted one (it never chains)
            self.chain.observe(capped, max_lengths, lengths, table, cost, scheduled=True)
        return lengths

    @property
    def decides_rounds_alone(self) -> bool:
        """A fixed draft cost and no gate (nothing learned from earlier rounds, the drafter always runs), and no
        chained round asked for: then each round's lengths are Algorithm 1's on its own confidences."""
        return self.gate is None and self._cost.estimator is None and not self.chain.asked

    def lengths_of_rounds(
        self, confidences: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray:
        """:meth:`lengths` of each round of a stack [N, R, gamma] (caps [N, R], round k's requests the first
        ``num_requests[k]`` rows; zero on padding), in one vectorised walk
        (:func:`scheduler.algorithm.schedule_lengths_rounds`); only while :attr:`decides_rounds_alone`."""
        if not self.decides_rounds_alone:
            raise ValueError("this policy learns from its rounds: decide them one by one with lengths()")
        capped = _rounds_capped(confidences, max_lengths)
        return schedule_lengths_rounds(capped, num_requests, self.sps.table_for, draft_cost=self._cost.current())

    def lengths_of_recorded_rounds(
        self, recorded: RecordedConfidences, rows: np.ndarray, max_lengths: np.ndarray, num_requests: np.ndarray
    ) -> np.ndarray:
        """:meth:`lengths_of_rounds` of rounds whose confidences are rows ``rows`` [N, R] of ``recorded``
        (:func:`scheduler.algorithm.schedule_recorded_rounds`: their survival products are computed once)."""
        if not self.decides_rounds_alone:
            raise ValueError("this policy learns from its rounds: decide them one by one with lengths()")
        return schedule_recorded_rounds(
            recorded, rows, max_lengths, num_requests, self.sps.table_for, draft_cost=self._cost.current()
        )

    @property
    def plans_in_stacks(self) -> bool:
        """No gate and a fixed draft cost: a planned round's lengths and what its drafts teach depend on nothing
        but the planner's state, the caps and the confidences, so the rounds of many round drivers (one policy
        each) can be decided in stacks (:meth:`plan_recorded_rounds`)."""
        return self.gate is None and self._cost.estimator is None

    def plan_recorded_rounds(
        self,
        planners: ChainPlanners,
        drivers: np.ndarray,
        recorded: RecordedConfidences,
        rows: np.ndarray,
        max_lengths: np.ndarray,
        num_requests: np.ndarray,
        asking: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """A stack of rounds of different round drivers, at most one each (round k: driver ``drivers[k]``, whose
        policy's planner is ``planners``' row; its confidences rows ``rows[k]`` of ``recorded``, its caps, its
        requests the first ``num_requests[k]``): what each driver's own policy (a copy of this one) does round by
        round. Where ``asking[k]`` the driver asks :meth:`planned_lengths`; a planned round verifies those lengths
        and its drafts go to :meth:`observe_drafts`, the others get :meth:`lengths` (Algorithm 1, one vectorised
        walk for the stack, as :meth:`lengths_of_recorded_rounds`). Returns the lengths [N, R] (zero on padding)
        and whether each round was planned. Only while :attr:`plans_in_stacks`."""
        if not self.plans_in_stacks:
            raise ValueError("this policy learns from its rounds: decide them one by one")
        table_for, cost = self.sps.table_for, self._cost.current()
        num_requests = np.asarray(num_requests, dtype=np.int64)
        caps, survival = survivals = recorded_round_survivals(recorded, rows, max_lengths, num_requests)
        key = planners.key(drivers, num_requests)
        planned, planned_lengths = planners.planned(
            drivers, key, caps, num_requests, recorded.gamma, table_for, asking
        )
        theta_a = np.empty(rows.shape[0])  # (filled for every round of a request)
        chosen = schedule_recorded_rounds(
            recorded, rows, max_lengths, num_requests, table_for, draft_cost=cost, survivals=survivals,
            objective=theta_a,
        )

        def confidences(k: int) -> np.ndarray:  # round k's own, as lengths() and observe_drafts() cap them
            count = int(num_requests[k])
            return _capped(recorded.table[rows[k, :count]], max_lengths[k, :count])

        scheduled = np.less(planned, num_requests > 0)  # drafted, Algorithm 1's lengths
        planners.observe(
            drivers, key, survival, caps, chosen, theta_a, num_requests, table_for, cost, confidences, planned,
            scheduled,
        )
        return np.where(planned[:, None], planned_lengths, chosen), planned

    def planned_lengths(self, max_lengths: np.ndarray, block_size: int) -> np.ndarray | None:
        """The lengths before the drafts exist (a chained round), or None to let Algorithm 1 decide on the
        confidences: a uniform length per request count, planned from the last drafted round of as many
        requests when it gives up at most ``chain_tolerance`` of Algorithm 1's objective there
        (:mod:`scheduler.chain_plan`; on a flat SPS curve it is Algorithm 1's own decision). It reads counts and
        earlier rounds only, so it is causal and lossless like the caps."""
        return self.chain.planned(max_lengths, block_size, self.sps.table_for(max_lengths.size))

    def observe_drafts(self, confidences: np.ndarray, max_lengths: np.ndarray) -> None:
        """The confidences of a drafted round whose lengths were planned: the draft gate learns from them as
        from a scheduled round's, and Algorithm 1 runs on them (while the device verifies) to plan the next
        round of as many requests."""
        if self.gate is not None:
            self.gate.observe(confidences)
        capped = _capped(confidences, max_lengths)
        table = self.sps.table_for(capped.shape[0])
        cost = self._cost.current()
        self.chain.observe(capped, max_lengths, schedule_lengths(capped, table, draft_cost=cost), table, cost)

    @property
    def chain_tolerance(self) -> float:
        """The share of Algorithm 1's objective a planned (chained) round may give up."""
        return self.chain.tolerance


class DSparkAsync(_LearnsRoundCosts):
    """The asynchronous variant: capacity planned from an earlier round, current round admits the top-K.

    With a ``gate`` a round may skip the drafter (as :class:`DSparkScheduled`); a skipped round drops the
    pending capacity plans (they describe a load the gate just judged not worth drafting for), so the next
    drafted round plans afresh with Algorithm 1 on its own confidences, the scheduler's lossless warm-up.
    """

    name = "dspark-async"
    uses_drafter = True

    def __init__(
        self,
        sps: SPSSource,
        lag: int = 2,
        draft_cost: DraftCost | None = None,
        gate: DraftGate | None = None,
        estimator: OnlineDraftCost | None = None,
    ) -> None:
        self._scheduler = AsyncCapacityScheduler(sps, lag=lag, draft_cost=draft_cost)
        self.decides_rounds_alone = False  # its capacity is planned from earlier rounds
        self.sps = sps
        self.gate = gate
        self._cost = _MeasuredCost(draft_cost, gate, estimator)

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        self._scheduler.draft_cost = self._cost.current()
        if self.gate is None or self.gate.should_draft(max_lengths):
            return True
        self._scheduler.reset()
        return False

    def lengths(
        self, confidences: np.ndarray, max_lengths: np.ndarray, *, weights: np.ndarray | None = None
    ) -> np.ndarray:
        self._scheduler.draft_cost = self._cost.current()
        capped = _capped(confidences, max_lengths)
        lengths = self._scheduler.step(capped if weights is None else weighted_confidences(capped, weights))
        if self.gate is not None:  # after the schedule: it validated them when no cap bound (the same array)
            self.gate.observe(confidences, validated=capped is confidences)
        return lengths

    def planned_lengths(self, max_lengths: np.ndarray, block_size: int) -> np.ndarray | None:
        """The lengths before the drafts exist (a chained round), or None to admit on the confidences: when the
        capacity planned for this round (from round t - lag) holds every draft the caps allow, the top-K
        admission admits them all (all of positive survival), so the lengths are the caps. Like the capacity
        itself, they read counts and earlier rounds only: causal and lossless."""
        capacity = self._scheduler.next_capacity
        lengths = np.minimum(max_lengths, block_size).astype(np.int64)
        if capacity is None or capacity < int(lengths.sum()):
            return None
        return lengths

    def observe_drafts(self, confidences: np.ndarray, max_lengths: np.ndarray) -> None:
        """The confidences of a drafted round whose lengths were planned: its admission (every draft the caps
        allow) uses up this round's capacity as :meth:`lengths` would, and the capacity of round t + lag is
        planned from them; the draft gate learns from them too."""
        self.lengths(confidences, max_lengths)


DRAFT_COSTS = ("none", "measured")


def uses_sps(spec: str) -> bool:
    """Whether the policy ``spec`` prices rounds with SPS tables (the scheduled ones); the others need none."""
    return spec in ("dspark", "dspark-async")


def make_policy(
    spec: str,
    sps: SPSSource | None,
    block_size: int,
    draft_cost: str = "none",
    chain_tolerance: float = CHAIN_TOLERANCE,
) -> VerifyPolicy:
    """Build a policy from its config name: ``autoregressive``, ``fixed-N``, ``full``, ``dspark``, ``dspark-async``.

    ``draft_cost``: ``none`` (Algorithm 1's plain objective, never skips the drafter) or ``measured`` (the
    scheduled policies learn T_draft online from the round driver's timings and get a draft gate that skips
    the drafter when a plain round is predicted faster); the fixed-length policies ignore it.
    ``chain_tolerance``: ``dspark``'s planned rounds (:mod:`scheduler.chain_plan`); the others ignore it.
    """
    if draft_cost not in DRAFT_COSTS:
        raise ValueError(f"unknown draft_cost {draft_cost!r}: use none or measured")
    if spec == "autoregressive":
        return Autoregressive()
    if spec == "full":
        return FixedLength(block_size)
    if spec.startswith("fixed-"):
        try:
            return FixedLength(int(spec.removeprefix("fixed-")))
        except ValueError:
            raise ValueError(f"bad policy {spec!r}: expected fixed-N with an integer N >= 1") from None
    if spec in ("dspark", "dspark-async"):
        if sps is None:
            raise ValueError(f"policy {spec!r} needs an SPS table (profile one with `dspark profile`)")
        if draft_cost == "none":
            return DSparkScheduled(sps, chain_tolerance=chain_tolerance) if spec == "dspark" else DSparkAsync(sps)
        gate = DraftGate(sps, DraftCost())  # its costs come from the estimator every round
        if spec == "dspark":
            return DSparkScheduled(sps, gate=gate, estimator=OnlineDraftCost(), chain_tolerance=chain_tolerance)
        return DSparkAsync(sps, gate=gate, estimator=OnlineDraftCost())
    raise ValueError(f"unknown policy {spec!r}: use autoregressive, fixed-N, full, dspark or dspark-async")
