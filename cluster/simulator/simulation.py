"""The simulation loop: a cluster serving a workload, round by round, in simulated time.

A round of one round driver (a verifier replica's request group), as the served pipeline runs it:
1. admission (:mod:`cluster.simulator.router`): waiting requests join; they are prefilled in this round's
   target pass;
2. the policy's pre-draft decision (``should_draft``) on the count caps of the running requests; if it drafts,
   one message to each drafter holding some of them, each drafter's GPU runs one draft step for its share,
   and the replies come back (a hop each way);
3. the policy (:mod:`scheduler.policy`, the project's own objects) picks the lengths from the recorded
   confidences of each request's current trace row; each request accepts min(recorded accepted, length);
4. one message to the verifier, whose GPU runs the target pass (verify B = R + sum of lengths tokens, plus the
   joiners' prompt tokens), and the reply;
5. host time (commit), then every request emits accepted + 1 tokens (at most what it still needs); finished
   requests free their slots; the policy gets the round's timings (``observe_round``); the next round starts.

Steps queue on the GPUs they run on (:class:`cluster.simulator.replicas.Gpu`), which is where placement,
pipelined groups and a drafter pool shared by several verifiers interact. Autoscaling runs at every control
tick (:mod:`cluster.simulator.autoscaler`); new replicas take requests once started; replicas scaled down drain
(keep serving their requests, take no new ones) and go when empty.

Costs come from a cost file (:mod:`cluster.simulator.costs`), confidences and acceptance from recorded traces
(:mod:`cluster.simulator.traces`), requests from a workload (:mod:`cluster.simulator.workload`). A run is a
function of those and the seed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from tqdm import tqdm

from cluster.simulator.autoscaler import PoolAutoscaler, PoolScaling
from cluster.simulator.clock import EventQueue
from cluster.simulator.costs import PLACEMENTS, Costs
from cluster.simulator.replicas import DrafterReplica, Gpu, RoundDriver, VerifierReplica
from cluster.simulator.router import Router
from cluster.simulator.traces import AcceptanceTrace
from cluster.simulator.workload import Workload
from scheduler.admission import draft_caps
from scheduler.algorithm import RecordedConfidences
from scheduler.policy import DecidesRoundsAlone, make_policy

_DRAFT_DONE, _ROUND_END, _TICK, _READY, _WAKE = 0, 1, 2, 3, 4
_E, _ROW, _ROUNDS, _ROW_END, _OUT, _INP = range(6)  # columns of a batched run's request state
_HUGE = 1 << 62
_NONE: list[int] = []  # a round's joiners when none join (never changed)
_minimum = np.minimum.reduce
_SAFE = 1.0 - 1e-6  # a round's lower bound on its duration, less a margin far above the rounding of its end time


class _VerifyTable:
    """``Costs.verify_s(max(R, 1), max(B, 1))`` by request count R <= ``slots`` and batch tokens B, rows filled on
    demand (the cost function's own values: a batch of rounds gathers them instead of calling it per round)."""

    def __init__(self, costs: Costs, slots: int) -> None:
        self.costs = costs
        self.width = costs.block_size + 1  # tokens per request at most
        self.table = np.zeros((slots + 1, slots * self.width + 1))
        self.filled = 0  # rows 0 .. filled - 1

    def __call__(self, counts: np.ndarray, tokens: np.ndarray, top: int) -> np.ndarray:
        """The step times of rounds of ``counts`` requests (at most ``top``) and ``tokens`` tokens."""
        while self.filled <= top:
            count = self.filled
            requests = max(count, 1)
            self.table[count, : count * self.width + 1] = [
                self.costs.verify_s(requests, max(b, 1)) for b in range(count * self.width + 1)
            ]
            self.filled += 1
        return self.table[counts, tokens]


class SimulationError(ValueError):
    """A cluster specification the simulator cannot run (message says which setting and why)."""


@dataclass(frozen=True)
class ClusterSpec:
    """What is deployed: placement, pool sizes (initial sizes when autoscaled), engine limits, policy.

    ``drafters`` counts the disaggregated drafter pool; colocated replicas hold their own drafter.
    ``verifier_scaling`` / ``drafter_scaling``: the pools' autoscaling_config (None: fixed size; colocated
    replicas scale as one pool with ``verifier_scaling``). ``control_interval_s``: how often the autoscaler
    decides.
    """

    placement: str = "disaggregated"
    verifiers: int = 1
    drafters: int = 1
    verifier_slots: int = 128
    drafter_slots: int = 128
    groups: int = 1
    max_seq_len: int = 4096
    policy: str = "dspark"
    draft_cost: str = "none"
    verifier_scaling: PoolScaling | None = None
    drafter_scaling: PoolScaling | None = None
    control_interval_s: float = 1.0

    def check(self, uses_drafter: bool) -> None:
        if self.placement not in PLACEMENTS:
            raise SimulationError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.verifiers < 1 or self.verifier_slots < 1 or self.drafter_slots < 1 or self.groups < 1:
            raise SimulationError("need >= 1 verifier, >= 1 slot per replica and >= 1 request group")
        if uses_drafter and self.placement == "disaggregated" and self.drafters < 1:
            raise SimulationError(f"policy {self.policy!r} drafts: a disaggregated cluster needs >= 1 drafter")
        if not self.control_interval_s > 0:
            raise SimulationError("control_interval_s must be > 0")

    @property
    def gpus(self) -> int:
        """GPUs of the initial deployment (a colocated replica holds one GPU for both engines)."""
        return self.verifiers + (self.drafters if self.placement == "disaggregated" else 0)


@dataclass(frozen=True)
class ClosedLoop:
    """A closed-loop workload, as ``dspark bench serve --concurrency`` sends it: ``users`` users each send
    their next request (the workload's next, in order) when their last one ended; it reaches the scheduler
    ``delay_s`` later (the client-to-scheduler path the simulator does not model: HTTP, ingress, tokenising).
    The workload's own arrival times are ignored."""

    users: int
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.users < 1 or not self.delay_s >= 0:
            raise SimulationError(f"a closed loop needs >= 1 user and a delay >= 0, got {self}")


@dataclass
class SimResult:
    """Per request (index as in the workload; NaN where it never happened) and per run."""

    arrival_s: np.ndarray
    admit_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output_tokens: np.ndarray
    emitted: np.ndarray
    rounds: np.ndarray  # verify rounds each request took part in (its prefill round not counted)
    rejected: np.ndarray
    end_s: float
    total_rounds: int
    drafted_rounds: int  # rounds that ran the drafter (the others: plain target rounds, prefill-only rounds)
    verifier_busy_s: float
    drafter_busy_s: float
    verifier_gpu_s: float  # GPU-seconds the verifier pool held (colocated: the whole cluster)
    drafter_gpu_s: float  # GPU-seconds the disaggregated drafter pool held
    in_system_area: float  # integral over time of requests arrived and not finished
    waiting_area: float  # integral over time of requests routed and not admitted
    running_area: float  # integral over time of requests holding slots (admitted, not finished)
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, verifiers, drafters, in system)

    @property
    def gpu_seconds(self) -> float:
        return self.verifier_gpu_s + self.drafter_gpu_s


class Simulation:
    """One run; :func:`simulate` is the entry point."""

    def __init__(
        self,
        workload: Workload,
        costs: Costs,
        trace: AcceptanceTrace | None,
        spec: ClusterSpec,
        seed: int,
        replay_in_order: bool = False,
        closed_loop: ClosedLoop | None = None,
    ) -> None:
        self.costs = costs
        self.spec = spec
        try:
            prototype = make_policy(spec.policy, costs.sps, costs.block_size, spec.draft_cost)
        except ValueError as error:
            raise SimulationError(str(error)) from None
        self.uses_drafter = prototype.uses_drafter
        spec.check(self.uses_drafter)
        if self.uses_drafter:
            if trace is None:
                raise SimulationError(
                    f"policy {spec.policy!r} drafts: give decoding traces (`dspark eval --save-traces` writes them)"
                )
            if trace.gamma != costs.block_size:
                raise SimulationError(f"the traces have gamma {trace.gamma}, the cost file block {costs.block_size}")
        self._prototype = prototype
        self.trace = trace
        self.block = costs.block_size
        self.colocated = spec.placement == "colocated"
        self.hop = costs.hop_s(spec.placement)
        self.rng = np.random.default_rng(seed)
        # Per request state as Python lists: a round reads and writes a few entries of each, where a list index
        # costs a fraction of a numpy element access or a fancy index over two or three requests.
        n = workload.size
        arrival = workload.arrival_s.astype(np.float64)
        self.closed_loop = closed_loop
        self._released = n
        if closed_loop is not None:  # the first `users` requests start at once, each later one when one ends
            arrival[:] = np.inf
            arrival[: closed_loop.users] = closed_loop.delay_s
            self._released = min(closed_loop.users, n)
        self.arrival: list[float] = arrival.tolist()
        self.inputs: list[int] = workload.input_tokens.astype(np.int64).tolist()
        self.output_tokens: list[int] = workload.output_tokens.astype(np.int64).tolist()
        self.emitted = [0] * n
        self.rounds = [0] * n
        self.admit_s = [math.nan] * n
        self.first_s = [math.nan] * n
        self.finish_s = [math.nan] * n
        self.rejected = [False] * n
        self.drafter_of = [-1] * n
        if trace is not None:
            self._accepted: list[int] = trace.accepted.tolist()
            if replay_in_order:
                row, row_end = trace.in_order(n)
            else:
                row, row_end = trace.row_ranges(n, self.rng)
            self.row: list[int] = row.tolist()
            self.row_end: list[int] = row_end.tolist()
        self.queue = EventQueue()
        # Batched rounds (:meth:`_flush`): replicas that run their rounds on their own GPU (colocated, one request
        # group) with a policy that decides every round alone. Per request state then lives in numpy arrays.
        self.batched = (
            self.colocated
            and spec.groups == 1
            and bool(getattr(prototype, "decides_rounds_alone", False))
            and 2 * self.hop + costs.round_overhead_s > 0
        )
        # Rounds started and not yet decided: (driver, start, requests, joiners, drafting, ahead, deadline, replica).
        self._pending: list[tuple[RoundDriver, float, list[int], list[int], bool, bool, float, int]] = []
        self._cancelled: set[RoundDriver] = set()  # whose round pending ahead will not start as it was
        self._gpu_busy = np.zeros(max(1, spec.verifiers))  # Gpu.busy_s of each verifier replica
        # Each verifier replica's requests (its one round driver's members, in order), padded with the padding
        # row of the request state: a batch gathers its rounds' requests in one step.
        self._member_table = np.full((max(1, spec.verifiers), spec.verifier_slots), workload.size, dtype=np.int64)
        self._deadline = math.inf
        self._clock = 0.0
        self._lower_s: dict[tuple[int, bool], float] = {}
        if self.batched:
            # The policy decides each round alone: one object decides for every round driver (theirs are copies).
            self._rounds_policy = cast(DecidesRoundsAlone, prototype)
            # Per request, one row: emitted tokens, trace row, rounds, end of its recorded prompt's rows, output
            # and prompt tokens (a round reads and writes them in one gather and one scatter); the last row is
            # the padding of a batch (never finishes, never runs out of rows).
            self._state = np.zeros((n + 1, 6), dtype=np.int64)
            self._state[:n, _OUT] = self.output_tokens
            self._state[:n, _INP] = self.inputs
            if trace is not None:
                self._state[:n, _ROW] = self.row
                self._state[:n, _ROW_END] = self.row_end
                self._recorded = RecordedConfidences(trace.confidences)
                self._accepted_rows = trace.accepted.astype(np.int64)
            self._record = np.dtype((np.void, self._state.itemsize * 6))  # one request's row, as one value
            self._records = self._state.view(self._record).reshape(n + 1)
            self._padding = np.array([0, 0, 0, _HUGE, _HUGE, 0], dtype=np.int64)
            self._state[n] = self._padding
            # Costs by request count, as arrays (the cost functions' own values, bit for bit).
            counts = range(spec.verifier_slots + 1)
            self._draft_by_count = np.array([costs.draft(c) if c else 0.0 for c in counts])
            self._host_drafted_by_count = np.array([costs.host_drafted(c) for c in counts])
            self._host_plain_by_count = np.array([costs.host_plain(c) for c in counts])
            self._verify_table = _VerifyTable(costs, spec.verifier_slots)
            self._prefill: dict[int, float] = {}
            self._ones = np.ones(spec.verifier_slots + 1, dtype=np.int64)
            # A lower bound on the duration of a round of R requests that drafts (a round after one that changed
            # nothing outside its replica always does, when the policy drafts).
            self._lower_by_count = np.array([self._lower_bound(c, self.uses_drafter and c > 0) for c in counts])
        self.router = Router(self.colocated, self.uses_drafter, spec.groups)
        self.verifiers: list[VerifierReplica] = []
        self.drafters: list[DrafterReplica] = []
        self._starved: set[VerifierReplica] = set()
        self.total_rounds = 0
        self.drafted_rounds = 0
        self._in_system = 0
        self._waiting = 0
        self._last_t = 0.0
        self.in_system_area = 0.0
        self.waiting_area = 0.0
        self.running_area = 0.0
        self.timeline: list[tuple[float, int, int, int]] = []
        self._scalers: dict[str, PoolAutoscaler] = {}
        if spec.verifier_scaling is not None:
            self._scalers["verifier"] = PoolAutoscaler(spec.verifier_scaling, spec.verifiers)
        if spec.drafter_scaling is not None and not self.colocated and self.uses_drafter:
            self._scalers["drafter"] = PoolAutoscaler(spec.drafter_scaling, spec.drafters)
        for _ in range(spec.verifiers):
            self._start_verifier(0.0, ready=0.0)
        if not self.colocated and self.uses_drafter:
            for _ in range(spec.drafters):
                self._start_drafter(0.0, ready=0.0)

    # ------------------------------------------------------------------------------------------- replicas
    def _new_drafter(self, now: float, ready: float, gpu: Gpu) -> DrafterReplica:
        drafter = DrafterReplica(
            f"drafter-{len(self.drafters)}", len(self.drafters), self.spec.drafter_slots, gpu, now, ready
        )
        self.drafters.append(drafter)
        return drafter

    def _start_verifier(self, now: float, ready: float) -> None:
        gpu = Gpu()
        replica = VerifierReplica(
            f"verifier-{len(self.verifiers)}", len(self.verifiers), self.spec.verifier_slots, gpu, now, ready
        )
        if self.colocated and self.uses_drafter:
            replica.drafter = self._new_drafter(now, ready, gpu)
        # Every round driver starts from a fresh policy (nothing learned yet), also one started by the autoscaler.
        replica.drivers = [RoundDriver(replica, copy.deepcopy(self._prototype)) for _ in range(self.spec.groups)]
        self.verifiers.append(replica)
        if self.batched and replica.index >= self._gpu_busy.size:
            grown = max(replica.index + 1, 2 * self._gpu_busy.size)
            self._gpu_busy = np.concatenate([self._gpu_busy, np.zeros(grown - self._gpu_busy.size)])
            table = np.full((grown, self.spec.verifier_slots), len(self.arrival), dtype=np.int64)
            table[: self._member_table.shape[0]] = self._member_table
            self._member_table = table
        if ready <= now:
            self.router.add_verifier(replica)
        else:
            self.queue.push(ready, _READY, replica)

    def _start_drafter(self, now: float, ready: float) -> None:
        drafter = self._new_drafter(now, ready, Gpu())
        if ready <= now:
            self.router.add_drafter(drafter)
        else:
            self.queue.push(ready, _READY, drafter)

    def _ready(self, replica: VerifierReplica | DrafterReplica, now: float) -> None:
        if replica.removed_s is not None:  # scaled down again before it started
            return
        if isinstance(replica, VerifierReplica):
            self.router.add_verifier(replica)
        else:
            self.router.add_drafter(replica)
            self._wake_starved(now)

    def _remove_if_done(self, replica: VerifierReplica | DrafterReplica, now: float) -> None:
        if not replica.draining or replica.removed_s is not None:
            return
        empty = replica.active == 0 if isinstance(replica, VerifierReplica) else replica.held == 0
        if empty:
            replica.removed_s = now

    # ---------------------------------------------------------------------------------------- bookkeeping
    def _advance(self, now: float) -> None:
        """Integrate the number of requests in the system and waiting up to ``now`` (for Little's law)."""
        dt = now - self._last_t
        if dt > 0:
            self.in_system_area += self._in_system * dt
            self.waiting_area += self._waiting * dt
            self.running_area += (self._in_system - self._waiting) * dt
            self._last_t = now

    def _arrive(self, i: int, now: float) -> None:
        self._advance(now)
        if self.inputs[i] + self.output_tokens[i] > self.spec.max_seq_len:
            self.rejected[i] = True
            self._release(now)
            return
        replica = self.router.route()
        if replica is None:
            self.rejected[i] = True
            self._release(now)
            return
        self._in_system += 1
        self._waiting += 1
        replica.waiting.append(i)
        for driver in replica.drivers:
            if driver.ahead is not None:
                self._run_ahead_stops(driver, now)
            if driver.idle:  # after every arrival of this instant: a round admits all of them, as the engine does
                driver.idle = False
                self.queue.push(now, _WAKE, driver)

    def _release(self, now: float) -> None:
        """Closed loop: the user whose request just ended (finished or rejected) sends the workload's next
        request, which arrives ``delay_s`` later. Releases happen in time order, so arrivals stay sorted."""
        if self.closed_loop is not None and self._released < len(self.arrival):
            self.arrival[self._released] = now + self.closed_loop.delay_s
            self._released += 1

    def _wake_starved(self, now: float) -> None:
        starved, self._starved = self._starved, set()
        for replica in starved:
            for driver in replica.drivers:
                if driver.idle:
                    self._start_round(driver, now)

    # ------------------------------------------------------------------------------------------- the round
    def _start_round(self, driver: RoundDriver, now: float) -> None:
        replica = driver.replica
        joined = self.router.admit(driver)
        if joined:
            self._advance(now)
            self._waiting -= len(joined)
            for i, drafter in joined:
                self.admit_s[i] = now
                if drafter is not None:
                    self.drafter_of[i] = drafter.index
            replica.running += len(joined)
        if replica.waiting and not self.colocated and self.uses_drafter:
            self._starved.add(replica)  # it may be short of drafter slots: woken when one frees
        verified = driver.members  # a new list replaces it whenever members change: the round keeps this one
        if not verified and not joined:
            driver.idle = True
            return
        driver.idle = False
        admitted = [i for i, _ in joined]
        if admitted:
            driver.members = verified + admitted
        driver.verified, driver.admitted = verified, admitted
        costs = self.costs
        drafting = False
        if verified and self.uses_drafter:
            emitted, outputs, inputs = self.emitted, self.output_tokens, self.inputs
            caps = draft_caps(
                np.array([outputs[i] - emitted[i] for i in verified], dtype=np.int64),
                np.array([inputs[i] + emitted[i] - 1 for i in verified], dtype=np.int64),
                self.spec.max_seq_len,
                self.block,
            )
            driver.caps = caps
            drafting = driver.policy.should_draft(caps)
        driver.drafting = drafting
        num = len(verified)
        driver.host_s = (costs.host_drafted if drafting else costs.host_plain)(num + len(admitted))
        if not drafting:
            driver.draft_s = 0.0
            self._verify(driver, now)
            return
        arrival = now + self.hop
        if self.colocated:  # every request of the replica drafts on its own drafter
            done = replica.gpu.run(arrival, costs.draft(num))
        else:
            per_drafter: dict[int, int] = {}
            drafter_of = self.drafter_of
            for i in verified:
                d = drafter_of[i]
                per_drafter[d] = per_drafter.get(d, 0) + 1
            done = now
            for index in sorted(per_drafter):
                end = self.drafters[index].gpu.run(arrival, costs.draft(per_drafter[index]))
                if end > done:
                    done = end
        driver.draft_s = done - now
        self.queue.push(done + self.hop, _DRAFT_DONE, driver)

    def _verify(self, driver: RoundDriver, now: float) -> None:
        verified = driver.verified
        num = len(verified)
        if driver.drafting:
            assert self.trace is not None and driver.caps is not None
            row = self.row
            rows = driver.rows = [row[i] for i in verified]
            lengths = driver.policy.lengths(self.trace.confidences[rows], driver.caps).tolist()
            accepted = self._accepted
            driver.accepted = [a if a < n else n for a, n in zip(map(accepted.__getitem__, rows), lengths, strict=True)]
            tokens = num + sum(lengths)
        else:
            driver.accepted = None
            tokens = num
        inputs = self.inputs
        prompt = sum([inputs[i] for i in driver.admitted]) if driver.admitted else 0
        costs = self.costs
        step = costs.verify_s(max(num, 1), max(tokens, 1)) + costs.prefill_s(prompt)
        end = driver.replica.gpu.run(now + self.hop, step)
        driver.verify_s, driver.verify_tokens = step, tokens
        self.queue.push(end + self.hop + driver.host_s + costs.round_overhead_s, _ROUND_END, driver)

    def _end_round(self, driver: RoundDriver, now: float) -> None:
        self.total_rounds += 1
        self.drafted_rounds += driver.drafting
        verified = driver.verified
        emitted, outputs, rounds = self.emitted, self.output_tokens, self.rounds
        finished: list[int] = []
        accepted = driver.accepted
        moved_on: list[int] = []  # requests whose recorded prompt ran out this round
        if accepted is None:
            for i in verified:
                e = emitted[i] + 1  # at most what it still needs: a request in a round needs at least one more
                emitted[i] = e
                rounds[i] += 1
                if e >= outputs[i]:
                    finished.append(i)
        else:
            assert driver.rows is not None
            row, row_end = self.row, self.row_end
            for i, a, r in zip(verified, accepted, driver.rows, strict=True):
                e, o = emitted[i], outputs[i]
                e = e + a + 1 if e + a + 1 < o else o  # accepted + 1 tokens, at most what it still needs
                emitted[i] = e
                rounds[i] += 1
                r += 1  # the next recorded round of its prompt; one whose prompt ran out continues with another
                row[i] = r
                if r >= row_end[i]:
                    moved_on.append(i)
                if e >= o:
                    finished.append(i)
            if moved_on:
                starts, ends = self.trace.row_ranges(len(moved_on), self.rng)  # type: ignore[union-attr]
                for i, start, end in zip(moved_on, starts.tolist(), ends.tolist(), strict=True):
                    row[i], row_end[i] = start, end
        for i in driver.admitted:
            emitted[i] = 1
            self.first_s[i] = now
            if outputs[i] <= 1:
                finished.append(i)
        replica = driver.replica
        freed_drafter = self._finish(driver, finished, now) if finished else False
        observe = driver.observe
        if observe is not None and verified:
            observe(
                len(verified), driver.drafting, driver.draft_s, driver.host_s, driver.verify_s, driver.verify_tokens
            )
        self._start_round(driver, now)
        if finished:
            for other in replica.drivers:
                if other.idle:
                    self._start_round(other, now)
            if freed_drafter and self._starved:
                self._wake_starved(now)

    def _finish(self, driver: RoundDriver, finished: list[int], now: float) -> bool:
        """Requests of ``driver``'s round that ended at ``now`` with their last token: they leave the system and
        free their slots. Returns whether a drafter slot freed."""
        replica = driver.replica
        freed_drafter = False
        self._advance(now)
        self._in_system -= len(finished)
        gone = set(finished)
        before = len(driver.members)
        driver.members = [m for m in driver.members if m not in gone]
        if self.batched:
            row = self._member_table[replica.index]
            row[: len(driver.members)] = driver.members
            row[len(driver.members) : before] = len(self.arrival)
        for i in finished:
            self.finish_s[i] = now
            self._release(now)
            self.router.left(replica)
            d = self.drafter_of[i]
            if d >= 0:
                drafter = self.drafters[d]
                drafter.held -= 1
                freed_drafter = True
                self._remove_if_done(drafter, now)
        replica.running -= len(finished)
        self._remove_if_done(replica, now)
        return freed_drafter

    # ------------------------------------------------------------------------------------- batched rounds
    def _batched_start(self, driver: RoundDriver, now: float) -> None:
        """:meth:`_start_round` of a batched run: the same admission, and the round joins the pending ones,
        whose lengths, timings and outcomes :meth:`_flush` decides together."""
        verified = driver.members
        replica = driver.replica
        joined = self.router.admit(driver) if replica.waiting else None
        if joined:
            self._advance(now)
            self._waiting -= len(joined)
            admit_s, drafter_of = self.admit_s, self.drafter_of
            for i, drafter in joined:
                admit_s[i] = now
                if drafter is not None:
                    drafter_of[i] = drafter.index
            replica.running += len(joined)
            admitted = [i for i, _ in joined]
            driver.members = verified + admitted  # (the member table gets them once the round is decided)
        elif not verified:
            driver.idle = True
            return
        else:
            admitted = _NONE
        driver.idle = False
        self._pend(driver, now, verified, admitted, False)

    def _pend(self, driver: RoundDriver, start: float, verified: list[int], admitted: list[int], ahead: bool) -> None:
        drafting = self.uses_drafter and bool(verified)
        key = (len(verified), drafting)
        lower = self._lower_s.get(key)
        if lower is None:
            lower = self._lower_s[key] = self._lower_bound(*key)
        deadline = start + lower
        self._pending.append((driver, start, verified, admitted, drafting, ahead, deadline, driver.replica.index))
        if deadline < self._deadline:
            self._deadline = deadline

    def _lower_bound(self, count: int, drafting: bool) -> float:
        """A lower bound on a round's duration (its steps and hops), less a margin far above the rounding of its
        end time: no pending round can end before its start plus this."""
        costs, requests = self.costs, max(count, 1)
        lower = 2 * self.hop + costs.round_overhead_s + costs.verify_s(requests, requests)
        if drafting:
            lower += 2 * self.hop + costs.draft(count)
        return lower * _SAFE

    def _run_ahead_stops(self, driver: RoundDriver, now: float) -> None:
        """A request arrived at ``now`` for the replica of ``driver``, whose next round pends undecided from
        ``driver.ahead``. If that round has not started yet it will admit the request: the last round's end
        becomes an event again (at its time, still to come). If it has, it runs as pending (the request joins
        the round after)."""
        start = driver.ahead
        assert start is not None
        driver.ahead = None
        if start >= now:  # at the same instant too: arrivals come before a round end of their time
            self._cancelled.add(driver)
            self.queue.push(start, _ROUND_END, driver)

    def _flush(self, upcoming: float) -> None:
        """Decide the pending rounds that can be: their lengths (the policy's ``lengths_of_rounds``, one
        vectorised walk for all of them), accepted tokens, GPU steps and end times, and what their ends will do.

        Why this is the same run as round by round: a pending round's outcome depends only on its own requests'
        state at its start (recorded rows, emitted tokens; the policy learns nothing from earlier rounds, and the
        replica's GPU runs no one else's steps), which nothing changes before the round ends; its state updates
        touch only its own requests, read by nothing but their next round. The run loop flushes before it
        handles any event at or after the earliest time a pending round could end (``_deadline``), so every
        round end is on the queue before its time comes, and events happen in the same order. Every number is
        computed by the same operations in the same order as round by round (a table of a cost is the cost
        function's own values).

        A round whose end changes nothing outside its replica (no request finishes or needs a new recorded
        prompt, none waits to join) puts no event on the queue: its next round, with the same requests, pends
        from its end time (``ahead``), and is decided once the run has handled every event before that time
        (``upcoming``: the next one), unless a request arrives for the replica first (:meth:`_run_ahead_stops`).
        What such an end does, counting the round and the first tokens of its joiners, is done here."""
        pending = self._pending
        cancelled = self._cancelled
        take = []
        keep = []
        for entry in pending:
            if entry[5]:
                if cancelled and entry[0] in cancelled:
                    continue
                if entry[1] >= upcoming:
                    keep.append(entry)
                    continue
            take.append(entry)
        cancelled.clear()
        self._pending = keep
        deadline = min([entry[6] for entry in keep], default=math.inf)
        if not take:
            self._deadline = deadline
            return
        drivers, starts, verifieds, admitteds, draftings, _, _, slots = zip(*take, strict=True)
        costs, hop = self.costs, self.hop
        state, outputs, inputs = self._state, self.output_tokens, self.inputs
        size = len(drivers)
        sizes = list(map(len, verifieds))
        counts = np.fromiter(sizes, np.int64, size)
        every = all(draftings)  # every round drafts (the usual case: no plain round)
        drafted = range(size) if every else [k for k in range(size) if draftings[k]]
        self.total_rounds += size
        self.drafted_rounds += len(drafted)
        tokens = counts.copy()  # verify batch: anchors + drafts
        gpus = np.fromiter(slots, np.int64, size)
        if drafted:
            count_array = counts if every else counts[drafted]
            width = max(sizes) if every else max([sizes[k] for k in drafted])
            members = self._member_table[gpus if every else gpus[drafted], :width]  # past a round's requests: padding
            rows_state = self._records[members].view(np.int64).reshape(*members.shape, 6)  # [rounds, R, columns]
            e = rows_state[:, :, _E]
            o = rows_state[:, :, _OUT]
            rows = rows_state[:, :, _ROW]
            caps = draft_caps(o - e, rows_state[:, :, _INP] + e - 1, self.spec.max_seq_len, self.block)
            lengths = self._rounds_policy.lengths_of_recorded_rounds(self._recorded, rows, caps, count_array)
            accepted = np.minimum(self._accepted_rows[rows], lengths)
            if every:
                tokens += lengths @ self._ones[:width]
            else:
                tokens[drafted] += lengths @ self._ones[:width]
            e += accepted  # accepted + 1 tokens, at most what it still needs
            e += 1
            np.minimum(e, o, out=e)
            rows += 1  # the next recorded round of its prompt; one whose prompt ran out continues with another
            rows_state[:, :, _ROUNDS] += 1
            self._records[members] = rows_state.view(self._record).reshape(members.shape)
            state[-1] = self._padding
            done_k, done_r = np.nonzero(e >= o)
            if done_k.size:
                for k, i in zip(done_k.tolist(), members[done_k, done_r].tolist(), strict=True):  # in member order
                    driver = drivers[drafted[k]]
                    if driver.finishing is None:
                        driver.finishing = []
                    driver.finishing.append(i)
            out_k, out_r = np.nonzero(rows >= rows_state[:, :, _ROW_END])
            if out_k.size:
                for k, i in zip(out_k.tolist(), members[out_k, out_r].tolist(), strict=True):
                    driver = drivers[drafted[k]]
                    if driver.moving is None:
                        driver.moving = []
                    driver.moving.append(i)
        if not every:
            for k in range(size):  # plain rounds: one token each
                if draftings[k]:
                    continue
                driver = drivers[k]
                for i in verifieds[k]:
                    e_i = int(state[i, _E]) + 1
                    state[i, _E] = e_i
                    state[i, _ROUNDS] += 1
                    if e_i >= outputs[i]:
                        if driver.finishing is None:
                            driver.finishing = []
                        driver.finishing.append(i)
        totals = counts.copy()  # requests in the round, joiners included
        step = self._verify_table(counts, tokens, max(sizes))
        prefill = self._prefill
        member_table = self._member_table
        for k, admitted in enumerate(admitteds) if any(admitteds) else ():
            if admitted:
                driver = drivers[k]
                member_table[slots[k], sizes[k] : sizes[k] + len(admitted)] = admitted  # members from the next round
                totals[k] += len(admitted)
                prompt = sum([inputs[i] for i in admitted])
                seconds = prefill.get(prompt)
                if seconds is None:
                    seconds = prefill[prompt] = costs.prefill_s(prompt)
                step[k] += seconds
                for i in admitted:
                    state[i, _E] = 1
                    if outputs[i] <= 1:
                        if driver.finishing is None:
                            driver.finishing = []
                        driver.finishing.append(i)
        # Gpu.run on the replica's own GPU as the round's steps reach it: the draft step, then the verify step two
        # hops after the draft ends (a plain round: the verify step at once). They never wait for the GPU: it ran
        # nothing since the replica's last round, whose end (its last step's end, plus hops, host and overhead
        # times, all >= 0) is no later than this round's start; so each step starts when it arrives.
        busy = self._gpu_busy[gpus]
        end = np.fromiter(starts, np.float64, size)
        end += hop
        if every:
            draft = self._draft_by_count[counts]
            end += draft
            end += hop
            end += hop
            busy += draft
            host = self._host_drafted_by_count[totals]
        else:
            drafting = np.array(draftings, dtype=bool)
            draft = self._draft_by_count[counts]
            end = np.where(drafting, ((end + draft) + hop) + hop, end)
            busy = np.where(drafting, busy + draft, busy)
            host = np.where(drafting, self._host_drafted_by_count[totals], self._host_plain_by_count[totals])
        end += step
        busy += step
        self._gpu_busy[gpus] = busy
        end += hop
        end += host
        end += costs.round_overhead_s  # the round's end: ((verify end + hop) + host) + overhead, as round by round
        if _minimum(end) < self._clock:
            raise RuntimeError("a batched round ends before an event already handled (a bound on round times is wrong)")
        events: list[float] = []
        ending: list[RoundDriver] = []
        first_s, uses_drafter = self.first_s, self.uses_drafter
        # The next rounds' deadlines, by their request counts (for a round that admits nobody and sees no one
        # finish: the same requests); those of rounds whose end is an event only make the deadline earlier.
        dues = end + self._lower_by_count[totals]
        due_min = float(_minimum(dues))
        if due_min < deadline:
            deadline = due_min
        for driver, admitted, at, due, slot in zip(drivers, admitteds, end.tolist(), dues.tolist(), slots, strict=True):
            if driver.finishing is None and driver.moving is None and not driver.replica.waiting:
                for i in admitted:
                    first_s[i] = at
                driver.ahead = at
                keep.append((driver, at, driver.members, _NONE, uses_drafter, True, due, slot))
            else:
                driver.admitted = admitted
                events.append(at)
                ending.append(driver)
        self._deadline = deadline
        self.queue.push_all(events, _ROUND_END, ending)

    def _batched_end(self, driver: RoundDriver, now: float) -> None:
        """:meth:`_end_round` of a batched run: the round was counted and its tokens emitted when it was
        decided; what is left happens now, in event order (a new recorded prompt for requests whose prompt ran
        out, first tokens, finished requests), then the next round starts."""
        moving = driver.moving
        if moving:
            driver.moving = None
            starts, ends = self.trace.row_ranges(len(moving), self.rng)  # type: ignore[union-attr]
            self._state[moving, _ROW] = starts
            self._state[moving, _ROW_END] = ends
        if driver.admitted:
            first_s = self.first_s
            for i in driver.admitted:
                first_s[i] = now
            driver.admitted = _NONE
        finished = driver.finishing
        if finished:
            driver.finishing = None
            self._finish(driver, finished, now)
        self._batched_start(driver, now)
        if finished:
            for other in driver.replica.drivers:
                if other.idle:
                    self._batched_start(other, now)

    # ---------------------------------------------------------------------------------------- autoscaling
    def _tick(self, now: float) -> None:
        verifiers = [v for v in self.verifiers if v.removed_s is None]
        drafter_count = 0 if self.colocated else sum(d.removed_s is None for d in self.drafters)
        self.timeline.append((now, len(verifiers), drafter_count, self._in_system))
        scaler = self._scalers.get("verifier")
        if scaler is not None:
            ready_verifiers = [v for v in verifiers if v.ready_s <= now and not v.draining]
            held = {v.name: float(v.running) for v in verifiers if v.ready_s <= now}
            target = scaler.tick(now, held, len(ready_verifiers))
            self._resize(target, [v for v in verifiers if not v.draining], now, self.costs.verifier_start_s, True)
        scaler = self._scalers.get("drafter")
        if scaler is not None:
            drafters = [d for d in self.drafters if d.removed_s is None]
            ready_drafters = [d for d in drafters if d.ready_s <= now and not d.draining]
            held = {d.name: float(d.held) for d in drafters if d.ready_s <= now}
            target = scaler.tick(now, held, len(ready_drafters), self._waiting)
            self._resize(target, [d for d in drafters if not d.draining], now, self.costs.drafter_start_s, False)

    def _resize(
        self,
        target: int,
        serving: Sequence[VerifierReplica | DrafterReplica],
        now: float,
        start_s: float,
        verifier: bool,
    ) -> None:
        """Start or drain replicas so that ``target`` of them serve or are starting; the ones still starting
        go first, then the newest."""
        for _ in range(target - len(serving)):
            if verifier:
                self._start_verifier(now, now + start_s)
            else:
                self._start_drafter(now, now + start_s)
        surplus = len(serving) - target
        if surplus <= 0:
            return
        order = sorted(serving, key=lambda r: (r.ready_s <= now, -r.created_s, -r.index))
        for replica in order[:surplus]:
            replica.draining = True
            if isinstance(replica, VerifierReplica):
                self.router.stop_routing_to(replica)  # a colocated drafter goes with its replica
            else:
                self.router.stop_placing_on(replica)
            self._remove_if_done(replica, now)

    # ------------------------------------------------------------------------------------------------ loop
    def run(self, progress: bool = False) -> SimResult:
        arrival = self.arrival
        n = len(arrival)
        queue = self.queue
        nxt = 0
        horizon = float(arrival[-1]) if n and self.closed_loop is None else 0.0
        if self._scalers or progress:
            queue.push(0.0, _TICK, None)
        bar = tqdm(total=max(1, math.ceil(horizon)), unit="sim s", disable=not progress, desc="simulate")
        shown = 0
        now = 0.0
        batched = self.batched
        end_round = self._batched_end if batched else self._end_round
        start_round = self._batched_start if batched else self._start_round
        while nxt < n or len(queue) or self._pending:
            upcoming = queue.next_time()
            if nxt < n and arrival[nxt] <= upcoming:
                if batched and arrival[nxt] >= self._deadline and self._pending:  # a pending round may end first
                    self._flush(arrival[nxt])
                    continue
                now = self._clock = arrival[nxt]
                self._arrive(nxt, now)
                nxt += 1
                continue
            if batched and upcoming >= self._deadline and self._pending:  # decide the pending rounds now
                self._flush(upcoming)
                continue
            now, kind, payload = queue.pop()
            self._clock = now
            if kind == _ROUND_END:
                end_round(payload, now)
            elif kind == _DRAFT_DONE:
                self._verify(payload, now)
            elif kind == _WAKE:
                start_round(payload, now)
            elif kind == _TICK:
                self._tick(now)
                if nxt < n or self._in_system:
                    queue.push(now + self.spec.control_interval_s, _TICK, None)
                if now >= shown + 1 and shown < bar.total:
                    step = min(int(now) - shown, bar.total - shown)
                    bar.update(step)
                    shown += step
            else:
                self._ready(payload, now)
        bar.close()
        self._advance(now)
        end = now
        if batched:
            self.emitted = self._state[:n, _E].tolist()
            self.rounds = self._state[:n, _ROUNDS].tolist()
            for replica in self.verifiers:  # (its free_at is not kept: a batched round never waits for its GPU)
                replica.gpu.busy_s = float(self._gpu_busy[replica.index])

        def held(replicas: list[VerifierReplica] | list[DrafterReplica]) -> float:
            return sum((r.removed_s if r.removed_s is not None else end) - r.created_s for r in replicas)

        return SimResult(
            arrival_s=np.array(self.arrival, dtype=np.float64),
            admit_s=np.array(self.admit_s, dtype=np.float64),
            first_token_s=np.array(self.first_s, dtype=np.float64),
            finish_s=np.array(self.finish_s, dtype=np.float64),
            output_tokens=np.array(self.output_tokens, dtype=np.int64),
            emitted=np.array(self.emitted, dtype=np.int64),
            rounds=np.array(self.rounds, dtype=np.int64),
            rejected=np.array(self.rejected, dtype=bool),
            end_s=end,
            total_rounds=self.total_rounds,
            drafted_rounds=self.drafted_rounds,
            verifier_busy_s=sum(v.gpu.busy_s for v in self.verifiers),
            drafter_busy_s=0.0 if self.colocated else sum(d.gpu.busy_s for d in self.drafters),
            verifier_gpu_s=held(self.verifiers),
            drafter_gpu_s=0.0 if self.colocated else held(self.drafters),
            in_system_area=self.in_system_area,
            waiting_area=self.waiting_area,
            running_area=self.running_area,
            timeline=self.timeline,
        )


def simulate(
    workload: Workload,
    costs: Costs,
    trace: AcceptanceTrace | None,
    spec: ClusterSpec,
    *,
    seed: int = 0,
    progress: bool = False,
    replay_in_order: bool = False,
    closed_loop: ClosedLoop | None = None,
) -> SimResult:
    """Run ``workload`` on the cluster ``spec`` until every request has finished (or was rejected).

    ``replay_in_order``: request i replays recorded prompt i (modulo their number) instead of a random one, to
    replay a recorded run request by request. ``closed_loop``: send the requests as a closed loop of users
    (:class:`ClosedLoop`) instead of at their arrival times; ``arrival_s`` of the result holds when each
    request reached the scheduler."""
    return Simulation(workload, costs, trace, spec, seed, replay_in_order, closed_loop).run(progress)
