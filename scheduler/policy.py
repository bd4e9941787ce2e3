"""Verification policies: how many of its drafted tokens each request sends to the verifier this round.

One interface for everything the benchmarks compare: plain autoregressive decoding (no drafts), fixed lengths
(1 = MTP-1-like, the whole block = DFlash-like), DSpark's Algorithm 1, and its asynchronous capacity variant.
Every policy must be causal to stay lossless: the decision whether to verify draft x_{r,j} may depend on
confidences c_{r,<=j} (which depend on x_{r,<j}) but never on x_{r,j} itself beyond what Algorithm 1's early stop
allows. Caps (``max_lengths``) only depend on counts (tokens still allowed, KV room), never on token values. The
pre-draft decision ``should_draft`` (may this round skip the drafter, i.e. be a plain target round?) sees only
counts and the confidences of earlier, already verified rounds (:mod:`scheduler.draft_gate`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from scheduler.algorithm import DraftCost, schedule_lengths
from scheduler.async_capacity import AsyncCapacityScheduler
from scheduler.draft_gate import DraftGate
from scheduler.sps import SPSTable


class VerifyPolicy(Protocol):
    """Chooses l_r in [0, min(gamma, max_lengths[r])] for every request of one verifier replica."""

    name: str
    uses_drafter: bool

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        """Before drafting: whether this round calls the drafter at all (False: every l_r = 0, no proposal)."""
        ...

    def lengths(self, confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray: ...


def _capped(confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
    """Zero the confidences past each request's cap: a zero survival probability is never admitted."""
    gamma = confidences.shape[1]
    positions = np.arange(gamma)[None, :]
    return np.where(positions < max_lengths[:, None], confidences, 0.0)


class Autoregressive:
    """Plain target decoding: the drafter is not called, every round verifies only the anchor."""

    name = "autoregressive"
    uses_drafter = False

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        return False

    def lengths(self, confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
        return np.zeros(len(max_lengths), dtype=np.int64)


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

    def lengths(self, confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
        return np.minimum(np.minimum(self.n, confidences.shape[1]), max_lengths).astype(np.int64)


class DSparkScheduled:
    """Algorithm 1: global greedy admission by prefix survival probability with the causal early stop.

    With a ``gate`` (:class:`scheduler.draft_gate.DraftGate`) a round may also skip the drafter when a plain
    target round is predicted to deliver more tokens per second (high load, expensive draft).
    """

    name = "dspark"
    uses_drafter = True

    def __init__(self, sps: SPSTable, draft_cost: DraftCost | None = None, gate: DraftGate | None = None) -> None:
        self.sps = sps
        self.draft_cost = draft_cost
        self.gate = gate

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        return self.gate is None or self.gate.should_draft(max_lengths)

    def lengths(self, confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
        lengths = schedule_lengths(_capped(confidences, max_lengths), self.sps, draft_cost=self.draft_cost)
        if self.gate is not None:
            self.gate.observe(confidences)  # after the schedule: it validated them
        return lengths


class DSparkAsync:
    """The asynchronous variant: capacity planned from an earlier round, current round admits the top-K.

    With a ``gate`` a round may skip the drafter (as :class:`DSparkScheduled`); a skipped round drops the
    pending capacity plans (they describe a load the gate just judged not worth drafting for), so the next
    drafted round plans afresh with Algorithm 1 on its own confidences, the scheduler's lossless warm-up.
    """

    name = "dspark-async"
    uses_drafter = True

    def __init__(
        self, sps: SPSTable, lag: int = 2, draft_cost: DraftCost | None = None, gate: DraftGate | None = None
    ) -> None:
        self._scheduler = AsyncCapacityScheduler(sps, lag=lag, draft_cost=draft_cost)
        self.gate = gate

    def should_draft(self, max_lengths: np.ndarray) -> bool:
        if self.gate is None or self.gate.should_draft(max_lengths):
            return True
        self._scheduler.reset()
        return False

    def lengths(self, confidences: np.ndarray, max_lengths: np.ndarray) -> np.ndarray:
        lengths = self._scheduler.step(_capped(confidences, max_lengths))
        if self.gate is not None:
            self.gate.observe(confidences)  # after the schedule: it validated them
        return lengths


def make_policy(spec: str, sps: SPSTable | None, block_size: int) -> VerifyPolicy:
    """Build a policy from its config name: ``autoregressive``, ``fixed-N``, ``full``, ``dspark``, ``dspark-async``."""
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
            raise ValueError(f"policy {spec!r} needs an SPS table (profile one with `dspark profile-sps`)")
        return DSparkScheduled(sps) if spec == "dspark" else DSparkAsync(sps)
    raise ValueError(f"unknown policy {spec!r}: use autoregressive, fixed-N, full, dspark or dspark-async")
