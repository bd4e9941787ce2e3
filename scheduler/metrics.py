"""Speculative decoding metrics, per request and aggregate, as plain snapshot objects.

The engine records one entry per round; exporters (Prometheus in the serving layer, tables and plots in the
benchmarks) read :class:`MetricsSnapshot`. Counters mirror vLLM's spec-decode metrics (drafts, draft tokens,
accepted tokens, accepted tokens per position) so existing dashboards work, plus what DSpark adds: the verification
budget chosen by the scheduler and the split of round time.

The round split: ``draft_time_s`` and ``verify_time_s`` are the phases as the round driver sees them (a call to a
remote replica included, from request to reply). ``transfer_time_s`` is the part of both outside the replicas
(round trips minus the time the replicas report for the calls: codec, transport, thread hand-offs; 0 in one
process; ``transfer_in_replica_time_s`` is the part of it inside the replicas' processes, around their engine
calls), ``round_draft_time_s`` and ``round_verify_time_s`` what is left of each phase, and ``host_time_s`` the
rest of the rounds' wall time (admission, building the messages' inputs, commit, releases). So round draft, round
verify, schedule, transfer and host add up to the rounds' wall time; each grows by a non-negative amount per
round (Prometheus counters).

The time to first token as the round driver sees it: ``queue_time_s`` sums, over the requests whose first token came
from their prefill (``first_tokens`` of them; a request moved here after a failure or resumed, which samples
nothing, is not counted), the time from their arrival at the round driver (handed to its backend: the wait for the
round in flight counts) to their admission (the round that prefills them), and ``admission_to_first_token_s`` the
time from there to their first token. ``joined_prompts`` counts the prompts prefilled by rounds (resumed ones
included) and ``prefill_only_rounds`` the target passes that prefilled and verified no request (not in ``rounds``):
joins and requests (``num_drafts``) per target pass divide by ``rounds + prefill_only_rounds``. Sums and counts, so
that replicas' snapshots add up and a scraper takes means over any window from two readings.
``planned_round_time_s`` and ``joined_round_time_s`` are the wall times (the five parts' sum) of the planned rounds
and of the rounds that prefilled joining prompts while verifying requests (``joined_rounds``; a round is never
both), so a scraper can say what chaining saves and what a join costs the running requests.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from scheduler.service_levels import TierSnapshot, merge_tiers


@dataclass
class RequestMetrics:
    """One request's speculative history. ``accepted[i]`` counts accepted draft tokens in round i (bonus excluded)."""

    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    arrival_time: float = 0.0
    admission_time: float = 0.0  # when the round that prefills it admitted it (its latest admission)
    finish_time: float | None = None
    num_output_tokens: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens per round including the bonus/correction token (the paper's accepted length)."""
        return float(np.mean(self.accepted) + 1.0) if self.accepted else 0.0

    @property
    def mean_verify_budget(self) -> float:
        return float(np.mean(self.verified)) if self.verified else 0.0


@dataclass(frozen=True)
class MetricsSnapshot:
    """Aggregate counters at one moment; cheap to copy, safe to hand to another thread."""

    rounds: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_output_tokens: int
    accepted_per_position: tuple[int, ...]
    verified_per_position: tuple[int, ...]
    reached_per_position: tuple[int, ...]
    draft_time_s: float
    schedule_time_s: float
    verify_time_s: float
    verify_tokens_per_round: float
    running: int
    waiting: int
    recent_round_s: float
    # Rounds that ran no drafter: the autoregressive policy, the draft gate judged a plain target round faster, or
    # no drafter replica held any of the round's requests (every one lost: degraded mode).
    rounds_without_draft: int = 0
    round_draft_time_s: float = 0.0
    round_verify_time_s: float = 0.0
    transfer_time_s: float = 0.0
    host_time_s: float = 0.0
    # Of transfer_time_s: inside the replicas' processes, around their engine calls (decode, hand-offs).
    transfer_in_replica_time_s: float = 0.0
    # Request-rounds sat out by requests of a lower tier than a request behind its TPOT target.
    paused_request_rounds: int = 0
    # Drafted rounds whose lengths were planned before their drafts existed: chained (in process) or relayed
    # (disaggregated) rounds, the ones the round pipeline overlaps most.
    planned_rounds: int = 0
    # The wall time of those rounds, and the rounds that prefilled joining prompts while verifying requests (a
    # joined round: never planned) with theirs: what a planned, a joined and any other round takes.
    planned_round_time_s: float = 0.0
    joined_rounds: int = 0
    joined_round_time_s: float = 0.0
    # The time to first token in the round driver (module docstring): requests whose first token came from their
    # prefill, and the sums over them of arrival to admission and of admission to first token.
    first_tokens: int = 0
    queue_time_s: float = 0.0
    admission_to_first_token_s: float = 0.0
    # Prompts prefilled by rounds, and target passes that verified no request (prefill only, not in ``rounds``).
    joined_prompts: int = 0
    prefill_only_rounds: int = 0
    # Per priority tier (scheduler.service_levels.TierSnapshot): requests, tokens, TPOT, SLO attainment, refusals.
    tiers: tuple[TierSnapshot, ...] = ()

    @property
    def tau(self) -> float:
        """Tokens per request-round including the bonus token."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    @property
    def conditional_acceptance(self) -> tuple[float, ...]:
        """P(position k accepted | positions < k accepted and k was verified), per position (paper Figure 2)."""
        return tuple(
            acc / reached if reached else float("nan")
            for acc, reached in zip(self.accepted_per_position, self.reached_per_position, strict=True)
        )


class EngineMetrics:
    """Accumulates per-round numbers. Single-threaded: the round driver owns it.

    A round only keeps its two count arrays; the token and per-position counts are made from the kept rounds
    in one pass when read, or every ``FOLD_ROUNDS`` rounds (a few array operations per round add up: this runs
    every round)."""

    FOLD_ROUNDS = 256

    def __init__(self, block_size: int, window: int = 256) -> None:
        self.block_size = block_size
        self.rounds = 0
        self.rounds_without_draft = 0
        self.paused_request_rounds = 0
        self.planned_rounds = 0
        self.planned_round_time_s = 0.0
        self.joined_rounds = 0
        self.joined_round_time_s = 0.0
        self.first_tokens = 0
        self.queue_time_s = 0.0
        self.admission_to_first_token_s = 0.0
        self.joined_prompts = 0
        self.prefill_only_rounds = 0
        self.num_drafts = 0
        self.num_output_tokens = 0
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._accepted_per_position = np.zeros(block_size, dtype=np.int64)
        self._verified_per_position = np.zeros(block_size, dtype=np.int64)
        # Position k was "reached" when it was verified and every earlier draft was accepted.
        self._reached_per_position = np.zeros(block_size, dtype=np.int64)
        self._positions = np.arange(block_size)[None, :]
        # Rounds not folded into the counts yet: (verified, accepted) per request.
        self._kept: list[tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]] = []
        self.draft_time_s = 0.0
        self.schedule_time_s = 0.0
        self.verify_time_s = 0.0
        self.round_draft_time_s = 0.0
        self.round_verify_time_s = 0.0
        self.transfer_time_s = 0.0
        self.transfer_in_replica_time_s = 0.0
        self.host_time_s = 0.0
        self._recent_rounds: deque[float] = deque(maxlen=window)

    def record_round(
        self,
        verified: np.ndarray | Sequence[int],
        accepted: np.ndarray | Sequence[int],
        draft_s: float,
        schedule_s: float,
        verify_s: float,
        output_tokens: int,
        drafted: bool = True,
        draft_transfer: tuple[float, float] = (0.0, 0.0),
        verify_transfer: tuple[float, float] = (0.0, 0.0),
        host_s: float = 0.0,
        planned: bool = False,
        joined: bool = False,
    ) -> None:
        """Record one round over R requests: ``verified[r]`` draft tokens sent, ``accepted[r]`` of them accepted;
        ``drafted``: whether the drafter ran; the transfer parts of the draft and verify phases (each a pair: the
        part between 0 and its phase, and of that the part inside the replicas' processes) and the round's host
        time (>= 0) as in the module docstring; ``planned``: its lengths were planned before its drafts existed;
        ``joined``: it prefilled joining prompts too. Both arrays are kept (not copied) until the next fold: pass
        arrays or lists nobody changes afterwards."""
        self.rounds += 1
        if not drafted:
            self.rounds_without_draft += 1
        wall_s = draft_s + schedule_s + verify_s + host_s
        if planned:
            self.planned_rounds += 1
            self.planned_round_time_s += wall_s
        if joined:
            self.joined_rounds += 1
            self.joined_round_time_s += wall_s
        self.num_drafts += len(verified)
        self.num_output_tokens += output_tokens
        kept = self._kept
        kept.append((verified, accepted))
        if len(kept) >= self.FOLD_ROUNDS:
            self._fold()
        self.draft_time_s += draft_s
        self.schedule_time_s += schedule_s
        self.verify_time_s += verify_s
        self.round_draft_time_s += draft_s - draft_transfer[0]
        self.round_verify_time_s += verify_s - verify_transfer[0]
        self.transfer_time_s += draft_transfer[0] + verify_transfer[0]
        self.transfer_in_replica_time_s += draft_transfer[1] + verify_transfer[1]
        self.host_time_s += host_s
        self._recent_rounds.append(draft_s + schedule_s + verify_s)

    def record_joins(self, joined: int, verified: bool) -> None:
        """Count a target pass's ``joined`` prompts (> 0); ``verified``: whether it verified a request too (a
        round :meth:`record_round` records), else it was a prefill-only pass."""
        self.joined_prompts += joined
        if not verified:
            self.prefill_only_rounds += 1

    def record_first_token(self, queue_s: float, admission_s: float) -> None:
        """Count a request's first token from its prefill: ``queue_s`` from its arrival at the round driver to
        its admission, ``admission_s`` from there to the first token."""
        self.first_tokens += 1
        self.queue_time_s += queue_s
        self.admission_to_first_token_s += admission_s

    def _fold(self) -> None:
        """Add the kept rounds to the token and per-position counts (one pass over all of them)."""
        if not self._kept:
            return
        verified = np.concatenate([np.asarray(v, dtype=np.int64) for v, _ in self._kept])[:, None]
        accepted = np.concatenate([np.asarray(a, dtype=np.int64) for _, a in self._kept])[:, None]
        self._kept.clear()
        self._num_draft_tokens += int(verified.sum())
        self._num_accepted_tokens += int(accepted.sum())
        positions = self._positions
        verified_past = verified > positions
        self._verified_per_position += verified_past.sum(axis=0)
        self._accepted_per_position += (accepted > positions).sum(axis=0)
        self._reached_per_position += (verified_past & (accepted >= positions)).sum(axis=0)

    @property
    def num_draft_tokens(self) -> int:
        self._fold()
        return self._num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        self._fold()
        return self._num_accepted_tokens

    @property
    def verify_tokens(self) -> int:
        """Tokens verified in all: every request's anchor and its drafts, every round."""
        return self.num_draft_tokens + self.num_drafts

    @property
    def accepted_per_position(self) -> np.ndarray:
        self._fold()
        return self._accepted_per_position

    @property
    def verified_per_position(self) -> np.ndarray:
        self._fold()
        return self._verified_per_position

    @property
    def reached_per_position(self) -> np.ndarray:
        self._fold()
        return self._reached_per_position

    def last_rounds_s(self, count: int) -> float:
        """Median duration of the last ``count`` rounds (0 before the first)."""
        if not self._recent_rounds:
            return 0.0
        return float(np.median(list(itertools.islice(reversed(self._recent_rounds), count))))

    def snapshot(self, running: int = 0, waiting: int = 0) -> MetricsSnapshot:
        return MetricsSnapshot(
            rounds=self.rounds,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_output_tokens=self.num_output_tokens,
            accepted_per_position=tuple(int(x) for x in self.accepted_per_position),
            verified_per_position=tuple(int(x) for x in self.verified_per_position),
            reached_per_position=tuple(int(x) for x in self.reached_per_position),
            draft_time_s=self.draft_time_s,
            schedule_time_s=self.schedule_time_s,
            verify_time_s=self.verify_time_s,
            verify_tokens_per_round=self.verify_tokens / self.rounds if self.rounds else 0.0,
            running=running,
            waiting=waiting,
            recent_round_s=float(np.median(self._recent_rounds)) if self._recent_rounds else 0.0,
            rounds_without_draft=self.rounds_without_draft,
            round_draft_time_s=self.round_draft_time_s,
            round_verify_time_s=self.round_verify_time_s,
            transfer_time_s=self.transfer_time_s,
            host_time_s=self.host_time_s,
            transfer_in_replica_time_s=self.transfer_in_replica_time_s,
            paused_request_rounds=self.paused_request_rounds,
            planned_rounds=self.planned_rounds,
            planned_round_time_s=self.planned_round_time_s,
            joined_rounds=self.joined_rounds,
            joined_round_time_s=self.joined_round_time_s,
            first_tokens=self.first_tokens,
            queue_time_s=self.queue_time_s,
            admission_to_first_token_s=self.admission_to_first_token_s,
            joined_prompts=self.joined_prompts,
            prefill_only_rounds=self.prefill_only_rounds,
        )


def merge_snapshots(snapshots: Sequence[MetricsSnapshot]) -> MetricsSnapshot:
    """Sum counters over verifier groups (times add up; the recent round time is the slowest group's)."""
    if not snapshots:
        return MetricsSnapshot(0, 0, 0, 0, 0, (), (), (), 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0)
    width = max(len(s.accepted_per_position) for s in snapshots)

    def vec(name: str) -> tuple[int, ...]:
        out = [0] * width
        for s in snapshots:
            for i, v in enumerate(getattr(s, name)):
                out[i] += v
        return tuple(out)

    rounds = sum(s.rounds for s in snapshots)
    return MetricsSnapshot(
        rounds=rounds,
        num_drafts=sum(s.num_drafts for s in snapshots),
        num_draft_tokens=sum(s.num_draft_tokens for s in snapshots),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in snapshots),
        num_output_tokens=sum(s.num_output_tokens for s in snapshots),
        accepted_per_position=vec("accepted_per_position"),
        verified_per_position=vec("verified_per_position"),
        reached_per_position=vec("reached_per_position"),
        draft_time_s=sum(s.draft_time_s for s in snapshots),
        schedule_time_s=sum(s.schedule_time_s for s in snapshots),
        verify_time_s=sum(s.verify_time_s for s in snapshots),
        verify_tokens_per_round=(
            sum(s.verify_tokens_per_round * s.rounds for s in snapshots) / rounds if rounds else 0.0
        ),
        running=sum(s.running for s in snapshots),
        waiting=sum(s.waiting for s in snapshots),
        recent_round_s=max(s.recent_round_s for s in snapshots),
        rounds_without_draft=sum(s.rounds_without_draft for s in snapshots),
        round_draft_time_s=sum(s.round_draft_time_s for s in snapshots),
        round_verify_time_s=sum(s.round_verify_time_s for s in snapshots),
        transfer_time_s=sum(s.transfer_time_s for s in snapshots),
        host_time_s=sum(s.host_time_s for s in snapshots),
        transfer_in_replica_time_s=sum(s.transfer_in_replica_time_s for s in snapshots),
        paused_request_rounds=sum(s.paused_request_rounds for s in snapshots),
        planned_rounds=sum(s.planned_rounds for s in snapshots),
        planned_round_time_s=sum(s.planned_round_time_s for s in snapshots),
        joined_rounds=sum(s.joined_rounds for s in snapshots),
        joined_round_time_s=sum(s.joined_round_time_s for s in snapshots),
        first_tokens=sum(s.first_tokens for s in snapshots),
        queue_time_s=sum(s.queue_time_s for s in snapshots),
        admission_to_first_token_s=sum(s.admission_to_first_token_s for s in snapshots),
        joined_prompts=sum(s.joined_prompts for s in snapshots),
        prefill_only_rounds=sum(s.prefill_only_rounds for s in snapshots),
        tiers=merge_tiers([s.tiers for s in snapshots]),
    )


def snapshot_to_dict(snapshot: MetricsSnapshot) -> dict[str, Any]:
    out = asdict(snapshot)
    for key, value in out.items():
        if isinstance(value, tuple):
            out[key] = list(value)
    return out


def snapshot_from_dict(data: dict[str, Any]) -> MetricsSnapshot:
    fields = dict(data)
    for key in ("accepted_per_position", "verified_per_position", "reached_per_position"):
        fields[key] = tuple(fields[key])
    fields["tiers"] = tuple(
        TierSnapshot(**{**tier, "tpot_buckets": tuple(tier["tpot_buckets"])}) for tier in fields.get("tiers", ())
    )
    return MetricsSnapshot(**fields)
