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

A plain round of a policy that never drafts runs ``ClusterSpec.decode_steps`` verify steps behind one hop each
way and one host time (the served ``scheduler.decode_steps``): a token per step for each request that still needs
one.

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
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from heapq import heappop
from typing import Literal, cast

import numpy as np
from tqdm import tqdm

from cluster.config import GPU_DECODE_STEPS
from cluster.simulator.autoscaler import PoolAutoscaler, PoolScaling
from cluster.simulator.clock import EventQueue
from cluster.simulator.costs import PLACEMENTS, Costs
from cluster.simulator.replicas import DrafterReplica, Gpu, RoundDriver, VerifierReplica
from cluster.simulator.router import Router
from cluster.simulator.traces import AcceptanceTrace
from cluster.simulator.workload import Workload
from scheduler.admission import draft_caps
from scheduler.algorithm import RecordedConfidences
from scheduler.chain_plan import ChainPlanners
from scheduler.policy import DecidesRoundsAlone, PlansInStacks, make_policy

_DRAFT_DONE, _ROUND_END, _TICK, _READY, _WAKE = 0, 1, 2, 3, 4
# Rows of a batch's time parts (Simulation._parts), in the order a round adds them to its start time.
_START, _DRAFT, _VERIFY, _HOST = 0, 2, 5, 7
_E, _ROUNDS, _ROW, _ROW_END, _OUT, _POS = range(6)  # columns of a batched run's request state
_HUGE = 1 << 62
_NONE: list[int] = []  # a round's joiners when none join (never changed)
_minimum, _maximum = np.minimum.reduce, np.maximum.reduce
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


class _Joins:
    """The requests joining a batch's rounds: ``admitted`` lists by replica (``slots``; every one of those rounds
    is in the batch), their rounds' positions in the batch (``rounds``), the requests already in each of them
    (``counts``), how many join each (``sizes``) and all of them in order (``requests``)."""

    def __init__(self, joining: dict[int, list[int]], take: list[int], counts: list[int]) -> None:
        self.slots = list(joining)
        self.admitted = list(joining.values())
        self.rounds = [bisect_left(take, slot) for slot in self.slots]
        self.counts = [counts[k] for k in self.rounds]
        self.sizes = [len(admitted) for admitted in self.admitted]
        self.requests = [i for admitted in self.admitted for i in admitted]


PLANNED_ROUNDS = ("auto", "chained", "relayed", "off")
#: The most plain decoding steps per round, as the served ``scheduler.decode_steps`` allows.
MAX_DECODE_STEPS = 64


class SimulationError(ValueError):
    """A cluster specification the simulator cannot run (message says which setting and why)."""


@dataclass(frozen=True)
class ClusterSpec:
    """What is deployed: placement, pool sizes (initial sizes when autoscaled), engine limits, policy.

    ``drafters`` counts the disaggregated drafter pool; colocated replicas hold their own drafter.
    ``verifier_scaling`` / ``drafter_scaling``: the pools' autoscaling_config (None: fixed size; colocated
    replicas scale as one pool with ``verifier_scaling``). ``control_interval_s``: how often the autoscaler
    decides. ``planned_rounds``: how the served engine runs the drafted rounds whose lengths the policy plans before
    their drafts exist (its ``planned_lengths``; Algorithm 1 decides the others on their confidences): ``chained``
    (the in-process round driver: only rounds no prompt joins, whose drafts were not launched for requests that
    finished since), ``relayed`` (a verifier relaying its drafters' blocks: every drafted round, joiners too),
    ``off`` (the default: none, Algorithm 1 decides every drafted round on its confidences; the fastest, and what
    the pool plans of docs/DEPLOYMENT.md used), or ``auto``, what the served defaults do for the placement
    (``chain_rounds``, ``relay_drafts``): colocated chained, disaggregated relayed with one request group, else off.
    A planning dspark's plans learn from its earlier rounds, and batched runs (colocated, one request group) decide
    its rounds with every replica's planner as a row of one :class:`scheduler.chain_plan.ChainPlanners`.

    ``decode_steps``: with a policy that never drafts (``autoregressive``), the plain decoding steps one round
    runs (the served ``scheduler.decode_steps``, one ``Step`` to the verifier): the round pays its hops, host time
    and overhead once and runs that many verify steps back to back on the verifier's GPU, each request emitting
    one token per step until it has its output (a request that finishes mid-round emits no more; the round's
    later steps verify only the requests still decoding); waiting requests join only at the next round.
    ``auto`` resolves as the served default on a GPU verifier (:meth:`cluster.config.SchedulerConfig.decode_steps_on`
    with a CUDA device): :data:`cluster.config.GPU_DECODE_STEPS` in the disaggregated placement, whose rounds go
    to the verifier replica over the data plane, 1 colocated, where the in-process engine decodes one token per
    round. An explicit count applies in either placement (a disaggregated deployment whose pools share one GPU is
    simulated colocated: the calibration sets its served count). Policies that draft decode one token per plain
    round, as the served engine does.
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
    planned_rounds: str = "off"
    decode_steps: int | Literal["auto"] = "auto"

    def check(self, uses_drafter: bool) -> None:
        if self.placement not in PLACEMENTS:
            raise SimulationError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.planned_rounds not in PLANNED_ROUNDS:
            raise SimulationError(f"planned_rounds must be one of {PLANNED_ROUNDS}, got {self.planned_rounds!r}")
        if self.verifiers < 1 or self.verifier_slots < 1 or self.drafter_slots < 1 or self.groups < 1:
            raise SimulationError("need >= 1 verifier, >= 1 slot per replica and >= 1 request group")
        if uses_drafter and self.placement == "disaggregated" and self.drafters < 1:
            raise SimulationError(f"policy {self.policy!r} drafts: a disaggregated cluster needs >= 1 drafter")
        if not self.control_interval_s > 0:
            raise SimulationError("control_interval_s must be > 0")
        if self.decode_steps != "auto" and not (
            isinstance(self.decode_steps, int) and 1 <= self.decode_steps <= MAX_DECODE_STEPS
        ):
            raise SimulationError(f"decode_steps must be auto or 1-{MAX_DECODE_STEPS}, got {self.decode_steps!r}")

    def plain_decode_steps(self, uses_drafter: bool) -> int:
        """Tokens a plain round decodes per request (``decode_steps`` with ``auto`` resolved; 1 for a policy
        that drafts, whose plain rounds are single target passes in the served engine too)."""
        if uses_drafter:
            return 1
        if self.decode_steps == "auto":
            return GPU_DECODE_STEPS if self.placement == "disaggregated" else 1
        return self.decode_steps

    @property
    def planning(self) -> str:
        """``planned_rounds`` with ``auto`` resolved: ``chained``, ``relayed`` or ``off``."""
        if self.planned_rounds != "auto":
            return self.planned_rounds
        if self.placement == "colocated":
            return "chained"
        return "relayed" if self.groups == 1 else "off"

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
    # Drafted rounds whose lengths the policy planned before the drafts (ClusterSpec.planned_rounds).
    planned_rounds: int = 0
    # Per round (in no particular order): when it ended, the requests it verified and the prompts that joined it;
    # empty unless the run logged its rounds (simulate's ``log_rounds``).
    round_end_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    round_requests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    round_joins: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
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
        log_rounds: bool = False,
    ) -> None:
        self.costs = costs
        self.spec = spec
        try:
            prototype = make_policy(spec.policy, costs.sps, costs.block_size, spec.draft_cost)
        except ValueError as error:
            raise SimulationError(str(error)) from None
        self.uses_drafter = prototype.uses_drafter
        spec.check(self.uses_drafter)
        self.decode_steps = spec.plain_decode_steps(self.uses_drafter)
        if self.uses_drafter:
            if trace is None:
                raise SimulationError(
                    f"policy {spec.policy!r} drafts: give decoding traces (`dspark eval --save-traces` writes them)"
                )
            if trace.gamma != costs.block_size:
                raise SimulationError(f"the traces have gamma {trace.gamma}, the cost file block {costs.block_size}")
        self._prototype = prototype
        # Planned rounds as the served engine runs them (ClusterSpec.planned_rounds), for a policy that plans.
        self.planning = spec.planning if getattr(prototype, "planned_lengths", None) is not None else "off"
        self.planned_rounds = 0
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
        # A planning policy whose plans depend on its planner's state alone (dspark with a fixed draft cost, no
        # gate) is batched too: every round driver's planner is a row of one ChainPlanners.
        plans_in_stacks = self.planning != "off" and bool(getattr(prototype, "plans_in_stacks", False))
        self.batched = (
            self.colocated
            and spec.groups == 1
            and (plans_in_stacks or self._decides_rounds_alone(prototype, costs.block_size))
            and 2 * self.hop + costs.round_overhead_s > 0
        )
        # The round pending on each verifier replica (at most one: one request group), undecided: when it starts,
        # how many requests it verifies, its deadline (the earliest it could end; infinite: none pends) and its
        # gate: -infinity for a started round (the next batch decides it), its start for a round pending from the
        # end of a round that was no event (decided once the run is past that time), infinity for none.
        slots = max(1, spec.verifiers)
        self._start = np.zeros(slots)
        self._count = np.zeros(slots, dtype=np.int64)
        self._due = np.full(slots, math.inf)
        self._gate = np.full(slots, math.inf)
        self._waits = np.zeros(slots, dtype=bool)  # whether requests wait for the replica's next round
        self._joining: dict[int, list[int]] = {}  # the requests joining started rounds, by replica
        self._driver_at: list[RoundDriver] = []  # each verifier replica's round driver
        self._gpu_busy = np.zeros(slots)  # Gpu.busy_s of each verifier replica
        # Each verifier replica's requests (its one round driver's members, in order), padded with the padding
        # row of the request state: a batch gathers its rounds' requests in one step.
        self._member_table = np.full((slots, spec.verifier_slots), workload.size, dtype=np.int64)
        self._deadline = math.inf  # the earliest deadline of a pending round (no earlier)
        self._clock = 0.0
        # Planned rounds in a batched run: the planners of a policy that plans in stacks (None: the policy decides
        # every round alone, and plans, when asked, the lengths it decides), and whether each replica's last round
        # ended with a finished request and no joiner (RoundDriver.thinned).
        self._planners: ChainPlanners | None = None
        self._thinned = np.zeros(slots, dtype=bool)
        if self.batched:
            # The policy decides each round alone, or plans from its planner's state alone: one object decides for
            # every round driver (theirs are copies), with every driver's planner in one ChainPlanners.
            self._rounds_policy = cast(DecidesRoundsAlone, prototype)
            if plans_in_stacks:
                self._stack_policy = cast(PlansInStacks, prototype)
                self._planners = ChainPlanners(slots, spec.verifier_slots, self._stack_policy.chain_tolerance)
            # Per request, one row: emitted tokens, trace row, rounds, end of its recorded prompt's rows, output
            # tokens and prompt tokens less one (its position then is that plus its emitted tokens) (a round reads
            # and writes them in one gather and one scatter); the last row is the padding of a batch (never
            # finishes, never runs out of rows).
            self._state = np.zeros((n + 1, 6), dtype=np.int64)
            self._state[:n, _OUT] = self.output_tokens
            self._state[:n, _POS] = self.inputs
            self._state[:n, _POS] -= 1
            if trace is not None:
                self._state[:n, _ROW] = self.row
                self._state[:n, _ROW_END] = self.row_end
                self._recorded = RecordedConfidences(trace.confidences)
                self._accepted_rows = trace.accepted.astype(np.int64)
            self._record = np.dtype((np.void, self._state.itemsize * 6))  # one request's row, as one value
            self._records = self._state.view(self._record).reshape(n + 1)
            self._padding = np.zeros(6, dtype=np.int64)
            self._padding[[_ROW_END, _OUT]] = _HUGE
            self._state[n] = self._padding
            # Costs by request count, as arrays (the cost functions' own values, bit for bit).
            counts = range(spec.verifier_slots + 1)
            self._draft_by_count = np.array([costs.draft(c) if c else 0.0 for c in counts])
            self._host_drafted_by_count = np.array([costs.host_drafted(c) for c in counts])
            self._host_plain_by_count = np.array([costs.host_plain(c) for c in counts])
            self._verify_table = _VerifyTable(costs, spec.verifier_slots)
            self._prefill: dict[int, float] = {}
            self._ones = np.ones(spec.verifier_slots + 1, dtype=np.int64)
            self._parts = np.zeros((9, 0))
            self._grow_parts(slots)
            # What a round adds to each of its requests' rows (tiled for a batch's rows): drafted, one token, one
            # round and the next recorded row; plain, one token and one round.
            self._drafted_step = self._plain_step = np.zeros(0, dtype=np.int64)
            self._tile_steps(slots)
            # A lower bound on the duration of a round of R requests that drafts (a round after one that changed
            # nothing outside its replica always does, when the policy drafts).
            self._lower_by_count = np.array([self._lower_bound(c, self.uses_drafter and c > 0) for c in counts])
            self._lower_list: list[float] = self._lower_by_count.tolist()
        self.router = Router(self.colocated, self.uses_drafter, spec.groups)
        self.verifiers: list[VerifierReplica] = []
        self.drafters: list[DrafterReplica] = []
        self._starved: set[VerifierReplica] = set()
        self.total_rounds = 0
        self.drafted_rounds = 0
        # SimResult.round_*, when asked (a long run has millions of rounds): a round by round run's rounds one by
        # one (_end_round), a batched run's a batch at a time (_flush: their ends, verified counts, and the batch
        # positions and sizes of their joins).
        self._round_log: list[tuple[float, int, int]] | None = [] if log_rounds else None
        self._batch_log: list[tuple[np.ndarray, np.ndarray, list[int], list[int]]] | None = (
            [] if log_rounds else None
        )
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

    def _decides_rounds_alone(self, prototype: object, block: int) -> bool:
        """Whether the policy decides every round alone also once a round driver asked it for planned lengths
        (a planning scheduled policy learns its plans from earlier rounds; fixed lengths plan what they decide):
        asked on a copy, as the first planned round will ask."""
        if self.planning != "off":
            prototype = copy.deepcopy(prototype)
            prototype.planned_lengths(np.full(1, block, dtype=np.int64), block)  # type: ignore[attr-defined]
        return bool(getattr(prototype, "decides_rounds_alone", False))

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
        if self.batched:
            self._driver_at.append(replica.drivers[0])
            if replica.index >= self._gpu_busy.size:
                self._grow_slots(max(replica.index + 1, 2 * self._gpu_busy.size))
        if ready <= now:
            self.router.add_verifier(replica)
        else:
            self.queue.push(ready, _READY, replica)

    def _grow_slots(self, slots: int) -> None:
        """Room for ``slots`` verifier replicas in the batched run's arrays (new ones: nothing pends, no request)."""

        def grown(values: np.ndarray, fill: float | bool) -> np.ndarray:
            more = np.full((slots - values.shape[0], *values.shape[1:]), fill, dtype=values.dtype)
            return np.concatenate([values, more])

        self._start, self._count = grown(self._start, 0.0), grown(self._count, 0)
        self._due, self._gate = grown(self._due, math.inf), grown(self._gate, math.inf)
        self._waits, self._gpu_busy = grown(self._waits, False), grown(self._gpu_busy, 0.0)
        self._thinned = grown(self._thinned, False)
        if self._planners is not None:
            self._planners.grow(slots)
        self._member_table = grown(self._member_table, len(self.arrival))
        self._grow_parts(slots)
        self._tile_steps(slots)

    def _grow_parts(self, slots: int) -> None:
        """The time parts of a batch of up to ``slots`` rounds (:meth:`_round_ends`), [9, slots]: rows start,
        hop, draft, hop, hop, verify, hop, host, overhead; the constant ones filled (the hops to and from the
        drafter: 0 without one)."""
        parts = np.zeros((9, slots))
        parts[[1, 6]] = self.hop
        parts[_DRAFT + 1 : _DRAFT + 3] = self.hop if self.uses_drafter else 0.0
        parts[8] = self.costs.round_overhead_s
        self._parts = parts

    def _tile_steps(self, slots: int) -> None:
        """The round steps tiled for a batch of ``slots`` rounds of ``verifier_slots`` requests."""
        rows = slots * self.spec.verifier_slots
        drafted, plain = np.zeros(6, dtype=np.int64), np.zeros(6, dtype=np.int64)
        drafted[[_E, _ROUNDS, _ROW]] = 1
        plain[[_E, _ROUNDS]] = 1
        self._drafted_step, self._plain_step = np.tile(drafted, rows), np.tile(plain, rows)

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
            in_system, waiting = self._in_system, self._waiting
            self.in_system_area += in_system * dt
            self.waiting_area += waiting * dt
            self.running_area += (in_system - waiting) * dt
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
        if self.batched:
            slot = replica.index
            self._waits[slot] = True
            if now <= self._gate.item(slot) < math.inf:
                self._cancel_ahead(slot)
        for driver in replica.drivers:
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
            confidences, caps = self.trace.confidences[rows], driver.caps
            planned = None
            # As SpeculativeEngine.step: a relaying verifier plans every drafted round, the in-process driver
            # (chained rounds) one no prompt joins whose drafts launched ahead hold no finished request (greedy).
            if self.planning != "off" and (self.planning == "relayed" or not (driver.admitted or driver.thinned)):
                assert driver.plans is not None  # planning is on only for a policy that plans
                planned = driver.plans(caps, self.block)
            if planned is None:
                lengths = driver.policy.lengths(confidences, caps).tolist()
            else:  # its drafts' confidences go back to the policy, as the engine's planned rounds do
                self.planned_rounds += 1
                if driver.observe_drafts is not None:
                    driver.observe_drafts(np.asarray(confidences, dtype=np.float64), caps)
                lengths = planned.tolist()
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
        if self.decode_steps > 1 and num:
            step += self._more_decode_steps(driver)
        end = driver.replica.gpu.run(now + self.hop, step)
        driver.verify_s, driver.verify_tokens = step, tokens
        self.queue.push(end + self.hop + driver.host_s + costs.round_overhead_s, _ROUND_END, driver)

    def _more_decode_steps(self, driver: RoundDriver) -> float:
        """A plain round of several decode steps (``decode_steps`` > 1): sets each verified request's tokens
        (``driver.steps``: the steps it takes part in, at most what it still needs, as the served engine caps
        them) and returns the time of the steps after the first, each a verify step of the requests still
        decoding (one token each), as the verifier runs them back to back (``VerifyEngine.decode``)."""
        emitted, outputs, cap = self.emitted, self.output_tokens, self.decode_steps
        steps = driver.steps = [min(outputs[i] - emitted[i], cap) for i in driver.verified]
        verify_s = self.costs.verify_s
        seconds = 0.0
        active = len(steps)
        for k in range(2, max(steps) + 1):
            active -= steps.count(k - 1)  # the requests whose last step was the one before
            seconds += verify_s(active, active)
        return seconds

    def _end_round(self, driver: RoundDriver, now: float) -> None:
        self.total_rounds += 1
        self.drafted_rounds += driver.drafting
        verified = driver.verified
        if self._round_log is not None:
            self._round_log.append((now, len(verified), len(driver.admitted)))
        emitted, outputs, rounds = self.emitted, self.output_tokens, self.rounds
        finished: list[int] = []
        accepted = driver.accepted
        moved_on: list[int] = []  # requests whose recorded prompt ran out this round
        if accepted is None and driver.steps is not None:  # several decode steps: each request's own count
            for i, n in zip(verified, driver.steps, strict=True):
                e = emitted[i] + n  # (at most what it still needs)
                emitted[i] = e
                rounds[i] += 1
                if e >= outputs[i]:
                    finished.append(i)
            driver.steps = None
        elif accepted is None:
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
        # The engine launches the next round's drafts ahead after a round no prompt joined, for all its requests.
        driver.thinned = bool(finished) and not driver.admitted
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
        """:meth:`_start_round` of a batched run: the same admission, and the round pends on its replica until
        :meth:`_flush` decides its lengths, timings and outcome together with the other pending rounds."""
        verified = driver.members
        replica = driver.replica
        slot = replica.index
        if replica.waiting:
            joined = self.router.admit(driver)
            self._waits[slot] = bool(replica.waiting)
            if joined:
                self._join_now(driver, joined, now)
            elif not verified:
                driver.idle = True
                return
        elif not verified:
            driver.idle = True
            return
        driver.idle = False
        count = len(verified)
        self._gate[slot] = -math.inf
        self._start[slot] = now
        self._count[slot] = count
        due = self._due[slot] = now + self._lower_list[count]
        if due < self._deadline:
            self._deadline = due

    def _join_now(self, driver: RoundDriver, joined: list[tuple[int, DrafterReplica | None]], now: float) -> None:
        """Requests admitted at ``now`` into the round ``driver`` starts: members from the next round on (the
        member table gets them once the round is decided)."""
        replica = driver.replica
        self._advance(now)
        self._waiting -= len(joined)
        admit_s, drafter_of = self.admit_s, self.drafter_of
        for i, drafter in joined:
            admit_s[i] = now
            if drafter is not None:
                drafter_of[i] = drafter.index
        replica.running += len(joined)
        admitted = [i for i, _ in joined]
        driver.members = driver.members + admitted
        self._joining[replica.index] = admitted

    def _lower_bound(self, count: int, drafting: bool) -> float:
        """A lower bound on a round's duration (its steps and hops), less a margin far above the rounding of its
        end time: no pending round can end before its start plus this."""
        costs, requests = self.costs, max(count, 1)
        lower = 2 * self.hop + costs.round_overhead_s + costs.verify_s(requests, requests)
        if drafting:
            lower += 2 * self.hop + costs.draft(count)
        return lower * _SAFE

    def _cancel_ahead(self, slot: int) -> None:
        """A request arrived for replica ``slot`` while its next round pends from the end of a round that was no
        event (gate: its start, finite) and has not started yet (:meth:`_arrive` checks; at the same instant too:
        arrivals come before a round end of their time). That round will admit the request: the last round's end
        becomes an event again (at its time, still to come) and the round no longer pends. (Had it started, it
        would run as pending, and the request join the round after.)"""
        start = self._gate.item(slot)
        self._gate[slot] = self._due[slot] = math.inf
        self.queue.push(start, _ROUND_END, self._driver_at[slot])

    def _flush(self, upcoming: float) -> None:
        """Decide the pending rounds that can be: their lengths (the policy's ``lengths_of_recorded_rounds``, one
        vectorised walk for all of them), accepted tokens, GPU steps and end times, and what their ends will do.

        Why this is the same run as round by round: a pending round's outcome depends only on its own requests'
        state at its start (recorded rows, emitted tokens; the policy learns nothing from earlier rounds, or only
        through its replica's planner, which only that replica's rounds change, one per batch; and the replica's
        GPU runs no one else's steps), which nothing changes before the round ends; its state updates
        touch only its own requests, read by nothing but their next round. The run loop flushes before it
        handles any event at or after the earliest time a pending round could end (``_deadline``), so every
        round end is on the queue before its time comes, and events happen in the same order. Every number is
        computed by the same operations in the same order as round by round (a table of a cost is the cost
        function's own values).

        A round whose end changes nothing outside its replica (no request finishes or needs a new recorded
        prompt, none waits to join) puts no event on the queue: its next round, with the same requests, pends
        from its end time, and is decided once the run has handled every event before that time (``upcoming``:
        the next one), unless a request arrives for the replica first (:meth:`_cancel_ahead`). What such an end
        does, counting the round and the first tokens of its joiners, is done here.

        Every step works on the batch's arrays (one numpy call for all its rounds); Python loops only over the
        few rounds with joiners and the few requests that finish or need a new recorded prompt."""
        take = (self._gate < upcoming).nonzero()[0]  # replicas whose pending round is decided now, in order
        if take.size:
            counts = self._count[take]
            count_list = counts.tolist()
            width = int(_maximum(counts))
            take_list = take.tolist()
            joins = _Joins(self._joining, take_list, count_list)
            self._joining = {}
            self.total_rounds += take.size
            if self.uses_drafter:  # every round that verifies a request drafts (only joiners: a prefill round)
                self.drafted_rounds += len(count_list) - count_list.count(0)
            tokens, events, more_steps = self._advance_requests(take, counts, width, joins)
            totals, step = self._join(counts, tokens, width, joins, events)
            if more_steps is not None:
                step += more_steps
            end = self._round_ends(take, counts, totals, step, 0 not in count_list)
            if self._batch_log is not None:
                self._batch_log.append((end, counts, joins.rounds, joins.sizes))
            self._schedule_ends(take, take_list, end, totals, joins, events)
        self._deadline = float(_minimum(self._due))

    def _advance_requests(
        self, take: np.ndarray, counts: np.ndarray, width: int, joins: _Joins
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The rounds' requests (of the replicas ``take``, ``counts`` each, at most ``width``) decide their lengths
        and emit their accepted tokens + 1 (plain rounds of several decode steps: a token per step, at most what
        each still needs). Returns each round's verify batch (anchors + drafts), whether its end is an event so far
        (requests wait for the replica; its requests that finish or run out of recorded rows are marked on its
        driver, in member order) and, with several decode steps, the time of each round's steps after the first
        (:meth:`_more_decode_steps` of each round: the same sums in the same order; else None)."""
        events = self._waits[take]
        more_steps = None
        if not width:  # prefill-only rounds
            if self.planning != "off":
                self._thinned[take] = False  # (every such round has joiners)
            return counts, events, more_steps
        members = self._member_table[:, :width].take(take, axis=0)  # past a round's requests: padding
        rows_state = self._state.take(members, axis=0)  # [rounds, R, columns]
        e = rows_state[:, :, _E]
        o = rows_state[:, :, _OUT]
        if self.uses_drafter:  # (a round of no request, only joiners, has only padding: nothing to draft)
            rows = rows_state[:, :, _ROW]
            caps = draft_caps(o - e, rows_state[:, :, _POS] + e, self.spec.max_seq_len, self.block)
            if self.planning == "off":
                lengths = self._rounds_policy.lengths_of_recorded_rounds(self._recorded, rows, caps, counts)
            else:
                lengths = self._planned_lengths(take, counts, rows, caps, joins)
            tokens = lengths @ self._ones[:width]
            tokens += counts
            e += np.minimum(self._accepted_rows[rows], lengths)  # accepted + 1 tokens, at most what it still needs
            self._count_round(rows_state, self._drafted_step)
            np.minimum(e, o, out=e)
        else:  # one token each (a request in a round still needs one)
            tokens = counts
            if self.decode_steps > 1:
                more_steps = self._more_decode_steps_batch(counts, width, e, o)
            self._count_round(rows_state, self._plain_step)
            if self.decode_steps > 1:  # the other steps' tokens, at most what each still needs
                e += np.minimum(o - e, self.decode_steps - 1)
        self._records.put(members, rows_state.view(self._record))
        self._state[-1] = self._padding
        if self.planning != "off":  # as _end_round sets RoundDriver.thinned (those with finished requests: _mark)
            self._thinned[take] = False
        self._mark(take, members, e >= o, events, True)
        if joins.slots and self.planning != "off":
            self._thinned[joins.slots] = False
        if self.uses_drafter:
            self._mark(take, members, rows >= rows_state[:, :, _ROW_END], events, False)
        return tokens, events, more_steps

    def _more_decode_steps_batch(self, counts: np.ndarray, width: int, e: np.ndarray, o: np.ndarray) -> np.ndarray:
        """:meth:`_more_decode_steps` for a batch of plain rounds (``counts`` requests each, emitted ``e`` and
        output ``o`` tokens [rounds, width] before the round, padding past each round's requests): per round, the
        steps after the first summed in step order from 0.0, a step no request of the round takes adding 0.0
        (which leaves a sum as it is), so each round's time is the round-by-round sum bit for bit."""
        members = np.arange(width) < counts[:, None]
        steps = np.where(members, np.minimum(o - e, self.decode_steps), 0)
        seconds = np.zeros(counts.size)
        for k in range(2, int(_maximum(steps, axis=None)) + 1):
            active = np.count_nonzero(steps >= k, axis=1)
            seconds += np.where(active > 0, self._verify_table(active, active, width), 0.0)
        return seconds

    def _planned_lengths(
        self, take: np.ndarray, counts: np.ndarray, rows: np.ndarray, caps: np.ndarray, joins: _Joins
    ) -> np.ndarray:
        """The lengths of a batch's drafted rounds where the policy plans (:meth:`_verify`'s ``planned`` branch for
        each round): the rounds the served engine plans ask for plans (relayed: every drafted one; chained: those
        no prompt joins and whose replica's last round ended with no finished request); a policy that plans in
        stacks decides them with every replica's planner, one that decides each round alone plans, when asked,
        the lengths it decides. Counts the planned rounds."""
        if self.planning == "chained":  # (False < True: a round of requests, not thinned)
            asking = np.less(self._thinned.take(take), counts > 0)
            if joins.slots:
                asking[joins.rounds] = False
        else:
            asking = counts > 0
        if self._planners is None:
            self.planned_rounds += int(np.count_nonzero(asking))
            return self._rounds_policy.lengths_of_recorded_rounds(self._recorded, rows, caps, counts)
        lengths, planned = self._stack_policy.plan_recorded_rounds(
            self._planners, take, self._recorded, rows, caps, counts, asking
        )
        self.planned_rounds += int(np.count_nonzero(planned))
        return lengths

    @staticmethod
    def _count_round(rows_state: np.ndarray, step: np.ndarray) -> None:
        """Add ``step`` (tiled: one value per column) to every request row of ``rows_state``, as one contiguous
        add: one more token emitted, one more round and, drafted, the next recorded round of its prompt (one whose
        prompt ran out continues with another)."""
        flat = rows_state.reshape(-1)
        flat += step[: flat.size]

    def _mark(self, take: np.ndarray, members: np.ndarray, hits: np.ndarray, events: np.ndarray, done: bool) -> None:
        """Requests ``hits`` [rounds, R] finish (``done``) or need a new recorded prompt at their round's end:
        onto their driver's list, in member order; those rounds' ends are events."""
        hit_k = hits.nonzero()[0]
        if not hit_k.size:
            return
        events[hit_k] = True
        if done and self.planning != "off":
            self._thinned[take[hit_k]] = True
        driver_at = self._driver_at
        for slot, i in zip(take[hit_k].tolist(), members[hits].tolist(), strict=True):
            driver = driver_at[slot]
            if done:
                if driver.finishing is None:
                    driver.finishing = []
                driver.finishing.append(i)
            else:
                if driver.moving is None:
                    driver.moving = []
                driver.moving.append(i)

    def _join(
        self,
        counts: np.ndarray,
        tokens: np.ndarray,
        width: int,
        joins: _Joins,
        events: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The rounds' verify steps, with the requests joining them (``joins``): prefilled in the step, members
        from the next round, one token each (finished if that is all they asked for). Returns the requests in
        each round, joiners included, and its verify step."""
        step = self._verify_table(counts, tokens, width)
        if not joins.slots:
            return counts, step
        totals = counts.copy()
        prefill, inputs, outputs = self._prefill, self.inputs, self.output_tokens
        for k, size, admitted in zip(joins.rounds, joins.sizes, joins.admitted, strict=True):
            totals[k] += size
            prompt = sum([inputs[i] for i in admitted])
            seconds = prefill.get(prompt)
            if seconds is None:
                seconds = prefill[prompt] = self.costs.prefill_s(prompt)
            step[k] += seconds
        row = self._member_table.shape[1]
        places = zip(joins.slots, joins.counts, joins.sizes, strict=True)
        self._member_table.put(
            [slot * row + count + j for slot, count, size in places for j in range(size)], joins.requests
        )
        self._state.put([6 * i + _E for i in joins.requests], 1)
        for k, slot, admitted in zip(joins.rounds, joins.slots, joins.admitted, strict=True):
            finished = [i for i in admitted if outputs[i] <= 1]
            if finished:
                events[k] = True
                driver = self._driver_at[slot]
                driver.finishing = (driver.finishing or []) + finished
        return totals, step

    def _round_ends(
        self, take: np.ndarray, counts: np.ndarray, totals: np.ndarray, step: np.ndarray, every: bool
    ) -> np.ndarray:
        """The rounds' end times, and their steps' time on their GPUs.

        Gpu.run on the replica's own GPU as the round's steps reach it: the draft step, then the verify step two
        hops after the draft ends (a plain round: the verify step at once). They never wait for the GPU: it ran
        nothing since the replica's last round, whose end (its last step's end, plus hops, host and overhead
        times, all >= 0) is no later than this round's start; so each step starts when it arrives. The end is
        start + hop + draft + hop + hop + verify + hop + host + overhead, added in that order as round by round:
        one cumulative sum down the rows of :attr:`_parts` (a plain round adds zeros for its draft and its hops
        to the drafter: adding 0.0 to a time >= 0 leaves it as it is). ``every``: every round verifies a request
        (none is a round of joiners only)."""
        parts = self._parts[:, : take.size]
        parts[_START] = self._start[take]
        parts[_VERIFY] = step
        if not self.uses_drafter:
            parts[_HOST] = self._host_plain_by_count[totals]
        elif every:  # every round drafts (the usual case; a round of only joiners does not)
            parts[_DRAFT] = self._draft_by_count[counts]
            parts[_HOST] = self._host_drafted_by_count[totals]
        else:
            drafting = counts.astype(bool)
            parts[_DRAFT] = self._draft_by_count[counts]  # (0 for a plain round)
            parts[_DRAFT + 1 : _DRAFT + 3] = np.where(drafting, self.hop, 0.0)
            parts[_HOST] = np.where(drafting, self._host_drafted_by_count[totals], self._host_plain_by_count[totals])
        end = np.add.accumulate(parts, axis=0)[-1]
        if self.uses_drafter and not every:
            parts[_DRAFT + 1 : _DRAFT + 3] = self.hop
        busy = self._gpu_busy[take]
        busy += parts[_DRAFT]
        busy += step
        self._gpu_busy[take] = busy
        if _minimum(end) < self._clock:
            raise RuntimeError("a batched round ends before an event already handled (a bound on round times is wrong)")
        return end

    def _schedule_ends(
        self,
        take: np.ndarray,
        take_list: list[int],
        end: np.ndarray,
        totals: np.ndarray,
        joins: _Joins,
        events: np.ndarray,
    ) -> None:
        """What the rounds' ends do: an end that is an event goes on the queue (its driver keeps its joiners for
        their first tokens then); after any other the next round, with the same requests, pends from it (its
        deadline by its request count), and its joiners' first tokens came at it. (``take_list``: ``take`` as a
        list.)"""
        self._start[take] = end
        self._count[take] = totals
        due = self._lower_by_count[totals]
        due += end
        gate = end.copy()
        at_events = events.nonzero()[0]
        if at_events.size:
            gate[at_events] = math.inf
            due[at_events] = math.inf
        self._gate[take] = gate
        self._due[take] = due
        if not (joins.slots or at_events.size):
            return
        ends = end.tolist()
        if joins.slots:
            first_s, driver_at = self.first_s, self._driver_at
            for k, slot, admitted in zip(joins.rounds, joins.slots, joins.admitted, strict=True):
                if events[k]:
                    driver_at[slot].admitted = admitted
                else:
                    at = ends[k]
                    for i in admitted:
                        first_s[i] = at
        if at_events.size:
            at_list, driver_at = at_events.tolist(), self._driver_at
            self.queue.push_all([ends[k] for k in at_list], _ROUND_END, [driver_at[take_list[k]] for k in at_list])

    def _batched_end(self, driver: RoundDriver, now: float) -> None:
        """:meth:`_end_round` of a batched run: the round was counted and its tokens emitted when it was
        decided; what is left happens now, in event order (a new recorded prompt for requests whose prompt ran
        out, first tokens, finished requests), then the next round starts (one request group: no other round
        driver of the replica to wake)."""
        moving = driver.moving
        if moving:
            driver.moving = None
            trace = cast(AcceptanceTrace, self.trace)
            if len(moving) == 1:  # (two numbers by index: far cheaper than an array and an index list of one)
                first, end = trace.prompt_bound(self.rng)
                state, i = self._state, moving[0]
                state[i, _ROW] = first
                state[i, _ROW_END] = end
            else:
                self._state[moving, _ROW : _ROW_END + 1] = trace.prompt_bounds(len(moving), self.rng)
        if driver.admitted:
            first_s = self.first_s
            for i in driver.admitted:
                first_s[i] = now
            driver.admitted = _NONE
        finished = driver.finishing
        if finished:
            driver.finishing = None
            self._batched_finish(driver, finished, now)
        self._batched_start(driver, now)

    def _batched_finish(self, driver: RoundDriver, finished: list[int], now: float) -> None:
        """:meth:`_finish` of a batched run, for all of ``finished`` at once (a colocated replica: each request's
        drafter is the replica's own, and its member table row follows its members)."""
        replica = driver.replica
        count = len(finished)
        self._advance(now)
        self._in_system -= count
        gone = set(finished)
        before = len(driver.members)
        members = driver.members = [m for m in driver.members if m not in gone]
        self._member_table[replica.index, :before] = members + [len(self.arrival)] * count  # (padding after them)
        finish_s = self.finish_s
        for i in finished:
            finish_s[i] = now
        if self.closed_loop is not None:
            for _ in finished:
                self._release(now)
        self.router.left(replica, count)
        drafter = replica.drafter
        if drafter is not None:
            drafter.held -= count
            if drafter.draining:
                self._remove_if_done(drafter, now)
        replica.running -= count
        if replica.draining:
            self._remove_if_done(replica, now)

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
    def _rounds_logged(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every round's end, verified requests and joined prompts (:attr:`SimResult.round_end_s` and the next;
        empty when the run did not log them)."""
        ends, requests, joins = [], [], []
        if self._round_log:
            one_by_one = np.array(self._round_log, dtype=np.float64).reshape(-1, 3)
            ends.append(one_by_one[:, 0])
            requests.append(one_by_one[:, 1].astype(np.int64))
            joins.append(one_by_one[:, 2].astype(np.int64))
        for end, counts, positions, sizes in self._batch_log or ():
            joined = np.zeros(end.size, dtype=np.int64)
            joined[positions] = sizes
            ends.append(end)
            requests.append(counts.astype(np.int64))
            joins.append(joined)
        if not ends:
            return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(ends), np.concatenate(requests), np.concatenate(joins)

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
        heap, inf = queue.heap, math.inf
        while nxt < n or heap or self._deadline < inf:
            upcoming = heap[0][0] if heap else inf
            if nxt < n and arrival[nxt] <= upcoming:
                if arrival[nxt] >= self._deadline:  # a pending round may end first
                    self._flush(arrival[nxt])
                    continue
                now = self._clock = arrival[nxt]
                self._arrive(nxt, now)
                nxt += 1
                continue
            if upcoming >= self._deadline:  # decide the pending rounds now
                self._flush(upcoming)
                continue
            now, _, kind, payload = heappop(heap)
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

        round_end, round_requests, round_joins = self._rounds_logged()

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
            planned_rounds=self.planned_rounds,
            round_end_s=round_end,
            round_requests=round_requests,
            round_joins=round_joins,
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
    log_rounds: bool = False,
) -> SimResult:
    """Run ``workload`` on the cluster ``spec`` until every request has finished (or was rejected).

    ``replay_in_order``: request i replays recorded prompt i (modulo their number) instead of a random one, to
    replay a recorded run request by request. ``closed_loop``: send the requests as a closed loop of users
    (:class:`ClosedLoop`) instead of at their arrival times; ``arrival_s`` of the result holds when each
    request reached the scheduler. ``log_rounds``: keep every round's end, verified requests and joins
    (``SimResult.round_end_s``, ``round_requests``, ``round_joins``; off by default: a long run has millions)."""
    return Simulation(workload, costs, trace, spec, seed, replay_in_order, closed_loop, log_rounds).run(progress)
