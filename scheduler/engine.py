"""The in-process speculative decoding engine: continuous batching over a draft engine and a verify engine.

Every call to :meth:`SpeculativeEngine.step` is one round:

1. admit waiting requests while both engines have free slots (they are prefilled in this round's target pass);
2. unless the policy skips the drafter this round (a plain target round, see :mod:`scheduler.draft_gate`), the
   drafter proposes a block for every running request (one batched pass + the sequential head);
3. the verification policy (Algorithm 1 by default) picks how many drafts each request verifies (a policy that
   can fix the lengths before the drafts exist lets a ``chain_verify`` engine queue step 4 right behind the
   drafter on the device: a chained round, see :meth:`SpeculativeEngine._chained_round`);
4. ONE target pass verifies all running requests and prefills the new ones; rejection sampling keeps a prefix;
5. committed context features go to the drafter (a ``chain_draft`` engine's chained round queues the next round's
   draft step behind its verify step on the device, which appends them there: see :meth:`_launch_behind`), new
   tokens are checked against stop conditions and returned;
6. a policy with ``observe_round`` gets the round's timings (a measured draft cost learns from them).

Lossless by construction: drafts are only ever proposals; what a request emits is decided by rejection sampling
against the target, the policy is causal (see :mod:`scheduler.policy`), and caps on the number of drafts only
depend on counts. The engine knows nothing of Ray or gRPC; the serving layer drives the same round with remote
engines.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple

import numpy as np
import torch

from draft_service.ahead import gather_rows
from draft_service.engine import ContextBatch, ContextItem, DraftBatch, PendingProposal, Proposal
from kernels.graphs import DeviceVerified
from kernels.sampling import SamplingParams
from scheduler.admission import draft_caps, free_slots
from scheduler.interfaces import (
    ChainingVerifier,
    DecodingVerifier,
    DetachingDrafter,
    Drafter,
    LaunchingDrafter,
    RelayingVerifier,
    RemoteTimed,
    Verifier,
)
from scheduler.metrics import EngineMetrics, MetricsSnapshot, RequestMetrics
from scheduler.policy import VerifyPolicy
from scheduler.service_levels import (
    BUDGET_SHARE,
    PLAIN_LEVEL,
    PaceTracker,
    RequestLevel,
    ServiceLevels,
    SLOUnattainableError,
    TierMetrics,
    admission_order,
    behind_target,
    holds_joiners,
    join_slack_s,
    joiners_allowed,
    late_lengths,
    lateness_weights,
    next_pause_count,
    pause_candidates,
    paused,
    predicted_tpot_s,
)
from scheduler.stopping import IncrementalDetokenizer, StopStringMatcher, first_stop_token
from verify_service.engine import PrefillItem, StepResult, StepResults, VerifyBatch, VerifyItem

logger = logging.getLogger(__name__)
_NEW_TOKENS = operator.attrgetter("new_token_ids")
_ANCHOR = operator.attrgetter("anchor")
_POSITION = operator.attrgetter("position")
_GREEDY = operator.attrgetter("greedy")
_PLAIN = operator.attrgetter("plain")
_PRIORITY = operator.attrgetter("level.priority")
#: ``Retry-After`` of a request refused for its TPOT target: the load a round sees changes within seconds.
SLO_RETRY_AFTER_S = 1
#: Rounds whose median time the service-level rules take as the current round time: few enough to follow the
#: load as requests join and leave, enough that one slow round (a long prefill) does not decide alone.
ROUND_TIME_WINDOW = 16
#: Weight of the newest round in the moving averages of rounds with and without joining prompts.
JOIN_ROUND_ALPHA = 0.2


class Transfer(NamedTuple):
    """The part of a phase spent outside the replicas' engines, and of that the part inside their processes;
    ``drafts_s``: of the replicas' time, a relayed step's wait for its drafts (drafting inside a verify phase)."""

    total_s: float
    in_replica_s: float
    drafts_s: float = 0.0


NO_TRANSFER = Transfer(0.0, 0.0)


def _transfer(engine: object, phase_s: float) -> Transfer:
    """Of a phase of ``phase_s`` seconds: the time outside the engine's replicas' engines (the phase minus the
    replicas' time of the engine's last call: a :class:`RemoteTimed` engine's; nothing for an in-process one),
    and of that the time their processes held the call around the engine (``last_held_s`` minus it: decoding,
    validation, thread hand-offs); the rest is the wire and this side's codec."""
    if not isinstance(engine, RemoteTimed):
        return NO_TRANSFER
    server_s = engine.last_server_s
    total = min(max(phase_s - server_s, 0.0), phase_s)
    drafts = min(max(engine.last_drafts_s, 0.0), phase_s - total)
    return Transfer(total, min(max(engine.last_held_s - server_s, 0.0), total), drafts)


class RequestRejectedError(ValueError):
    """A request can never be served as given (e.g. longer than the context limit); nothing was queued."""


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class RequestOutput:
    """What a request produced in one step (a delta), and whether it is finished."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics | None = None  # set once finished


@dataclass
class RequestState:
    """A request in a round driver: its prompt, settings, output so far, detokenizer and stop-string state and
    metrics (the drivers of this module and :mod:`scheduler.pipeline` keep one per running request)."""

    req_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    output: list[int] = field(default_factory=list)
    anchor: int = -1
    position: int = 0  # absolute position of the anchor = committed context length
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    rehomed: int = 0  # times this request was moved to another replica after a failure
    level: RequestLevel = PLAIN_LEVEL  # its service level (scheduler.service_levels)
    # Copies of params fields read every round (an attribute chain per request and round adds up).
    max_tokens: int = field(init=False)
    greedy: bool = field(init=False)
    plain: bool = field(init=False)  # speculation auto and no TPOT target: the round needs no service-level rule

    def __post_init__(self) -> None:
        self.max_tokens = self.params.max_tokens
        self.greedy = self.params.greedy
        self.plain = self.level.speculative == "auto" and self.level.tpot_slo_s is None

    def tpot_s(self) -> float | None:
        """Time per output token after the first (None before two tokens or without a first-token time)."""
        metrics = self.metrics
        if metrics.first_token_time is None or metrics.finish_time is None or len(self.output) < 2:
            return None
        return (metrics.finish_time - metrics.first_token_time) / (len(self.output) - 1)

    def prefill_item(self) -> PrefillItem:
        """A fresh request samples its first token; one that already emitted tokens (moved here after a replica
        failure) reloads prompt + output[:-1] with its last token as the anchor, so nothing is sampled twice."""
        if not self.output:
            return PrefillItem(self.req_id, self.prompt, self.params)
        return PrefillItem(self.req_id, [*self.prompt, *self.output[:-1]], self.params, anchor=self.output[-1])


@dataclass
class _Ahead:
    """The next round's drafts, launched before a round's commit (``draft_ahead``): for these requests (in
    running order) at these anchors and positions, with the policy's decision to draft."""

    requests: list[RequestState]
    batch: DraftBatch
    pending: PendingProposal | None
    drafting: bool

    def drop(self) -> None:
        """Wait for drafts nobody will use (the draft engine's buffers are theirs until then)."""
        if self.pending is not None:
            self.pending.result()


class _Decided(NamedTuple):
    """The next round's drafting, decided before a round's commit: whether it drafts, and its drafts when they
    were launched already (behind the round's verify step, :meth:`SpeculativeEngine._launch_behind`)."""

    drafting: bool
    pending: PendingProposal | None


class _AheadTaken(NamedTuple):
    """What a round takes from the drafts launched ahead: its caps and draft decision, and when drafting the
    launched drafts with the batch they answer (``rows``: the launched rows of this round's requests, in its
    order, when some launched request finished; None: all of them)."""

    caps: np.ndarray
    drafting: bool
    pending: PendingProposal | None
    batch: DraftBatch | None
    rows: list[int] | None


#: A request taken out of one engine with everything it carries (output so far, detokenizer and stop-string
#: state, metrics), to be adopted by another engine: see :meth:`SpeculativeEngine.detach`.
DetachedRequest = RequestState


@dataclass
class FinishedRequest:
    """Final result of :meth:`SpeculativeEngine.generate`."""

    req_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    metrics: RequestMetrics


class SpeculativeEngine:
    """Continuous-batching speculative decoding in one process."""

    def __init__(
        self,
        verify: Verifier,
        draft: Drafter | None,
        policy: VerifyPolicy,
        *,
        decode: Callable[[Sequence[int]], str] | None = None,
        eos_token_ids: Iterable[int] = (),
        max_running: int | None = None,
        draft_ahead: bool = False,
        chain_verify: bool = False,
        chain_draft: bool = False,
        service_levels: ServiceLevels | None = None,
        decode_steps: int = 1,
    ) -> None:
        """``decode_steps``: without a drafter (plain decoding), a round decodes up to this many tokens per
        request in one call of a verifier that can (:class:`DecodingVerifier`: a replica then costs one message
        each way per that many tokens), capped by each request's ``max_tokens`` and slot; a request that stops
        earlier (stop token or string) drops the rest. Joining prompts wait for the round, so it trades their
        first token's latency against every other token's.

        ``service_levels``: the defaults and admission rule of per-request service levels (speculation on or
        off, priority tiers, TPOT targets: :mod:`scheduler.service_levels`); rounds in which every request is
        ``auto`` without a target run exactly as without them.

        ``draft_ahead``: launch the next round's drafting right after a round's context append, before its
        commit, so that the host commits while the device drafts (a drafter with ``propose_start``: the
        in-process draft engine; rounds without joining requests on a local verifier's bucketed (graph) path,
        whose results come as one StepResults; see :meth:`_launch_ahead`).

        ``chain_verify``: when the policy fixes a round's lengths before the drafts exist (``planned_lengths``:
        the fixed-length policies always, DSpark when a uniform length gives up little of Algorithm 1's
        objective on its last round of as many requests, e.g. the whole block on a flat SPS curve, its
        asynchronous variant when the capacity it planned rounds earlier holds every draft), queue the
        verify step right behind the draft step on the device, reading the drafts where the drafter wrote them,
        instead of waiting for them on the host first (an in-process drafter and verifier on one device, graph
        path, greedy requests, no joining prompt; any other round runs as usual; see :meth:`_chained_round`).

        ``chain_draft`` (with ``chain_verify``): a chained round also queues the next round's draft step right
        behind its verify step, which appends the committed context rows and takes the target's last token as
        the anchor on the device (:meth:`DraftEngine.propose_behind`), so the device goes on drafting while the
        host waits for and commits the results: the chained round's other half (see :meth:`_launch_behind`).

        A verifier replica that relays its drafters' blocks (:class:`RelayingVerifier` with ``relay``) runs the
        rounds whose lengths the policy plans before the drafts exist as relayed rounds (:meth:`_relayed_round`)."""
        if policy.uses_drafter and draft is None:
            raise ValueError(f"policy {policy.name!r} needs a drafter")
        if policy.name.startswith("dspark") and draft is not None and not draft.has_confidence_head:
            raise ValueError(f"policy {policy.name!r} needs a drafter with a confidence head")
        self.verify = verify
        self.draft: Drafter | None = draft if policy.uses_drafter else None
        self.policy = policy
        # Past rounds' wall-clock timings only (never token values): feeding them back keeps the policy causal.
        self._observe_round: Callable[[int, bool, float, float, float, int], None] | None = getattr(
            policy, "observe_round", None
        )
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        # Plain decoding several tokens per verifier call (None: one step per round).
        self._decoding = verify if draft is None and decode_steps > 1 and isinstance(verify, DecodingVerifier) else None
        self._decode_steps = decode_steps
        self.decode = decode
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_running = max_running
        self.block_size = draft.block_size if draft is not None else 0
        self.metrics = EngineMetrics(max(self.block_size, 1))
        self._waiting: deque[RequestState] = deque()
        self._running: dict[str, RequestState] = {}
        self._finished: list[str] = []  # requests finished this round: released together at its end
        self._ids = itertools.count()
        # The overlaps need an in-process pair's capabilities (scheduler.interfaces); other engines run plain rounds.
        self._launching = self.draft if isinstance(self.draft, LaunchingDrafter) else None
        self._chaining = verify if isinstance(verify, ChainingVerifier) else None
        self._draft_ahead = draft_ahead and self._launching is not None
        self._ahead: _Ahead | None = None  # the next round's drafts, launched before this round's commit
        relaying = isinstance(verify, RelayingVerifier) and verify.relay and self.draft is not None
        self._relaying = verify if relaying and isinstance(verify, RelayingVerifier) else None
        self._relay_ok = True  # False after a relayed step missed blocks: the next round asks the drafters
        chaining = chain_verify and self._launching is not None and self._chaining is not None
        self._planned_lengths: Callable[[np.ndarray, int], np.ndarray | None] | None = None
        if chaining or self._relaying is not None:
            self._planned_lengths = getattr(policy, "planned_lengths", None)
        if self._planned_lengths is None:  # a policy that plans no lengths decides every round on its drafts
            self._relaying = None
        self._chain_verify = chaining and self._planned_lengths is not None
        self._chain_draft = chain_draft and self._chain_verify
        self._observe_drafts: Callable[[np.ndarray, np.ndarray], None] | None = getattr(policy, "observe_drafts", None)
        # The round split (scheduler.metrics): when the round began, and the part of its draft phase spent
        # outside the drafters. A remote engine reports the replicas' time of its last call (``last_server_s``,
        # scheduler.remote); an in-process engine has no transfer.
        self._round_started = 0.0
        self._round_planned = False  # this round's lengths were planned before its drafts (metrics)
        self._draft_transfer = NO_TRANSFER
        # A drafter pool that lost every replica runs its requests detached (scheduler.remote, degraded mode).
        self._is_detached = self.draft.is_detached if isinstance(self.draft, DetachingDrafter) else None
        self.service_levels = service_levels if service_levels is not None else ServiceLevels()
        self.tiers = TierMetrics()
        # Per tier, the factor on TPOT targets that lateness and join slack judge requests by (read-only outside).
        self.pace = PaceTracker(self.service_levels.slo_attainment)
        # Lower-tier requests that sit out a round with a late request (scheduler.service_levels.next_pause_count).
        self._pause_count = 0
        self._off: set[str] = set()  # running requests with speculation off (verified with no drafts)
        self._no_drafter: set[str] = set()  # running requests that hold no drafter slot (off, plain round driver)
        self._plain_round_s = 0.0  # moving average of rounds no prompt joined (0: none yet)
        self._join_cost_s = 0.0  # moving average of what one joining prompt adds to a round (0: not known yet)

    # ----------------------------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        req_id: str | None = None,
        *,
        emitted: int = 0,
        emitted_chars: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; it joins at the next round with free capacity. Raises RequestRejectedError on bad input.

        ``arrival_time`` (``time.perf_counter``; default: now): when the caller received the request. A caller
        that hands requests over between rounds passes the time of the hand-over, so the wait for the round in
        flight counts as queueing (the TTFT split, the join hold and TPOT pacing all start there).

        A continuation (``emitted`` > 0) resumes a request that an earlier run streamed part of (its scheduler was
        lost): the last ``emitted`` ids of ``prompt`` are that output, ``emitted_chars`` the characters of its text
        the client received, and ``params.max_tokens`` counts the tokens still to come. The request then holds
        the original prompt and the emitted output, as one moved here after a replica failure: its prefill reloads
        them with the last emitted token as the anchor (nothing sampled twice), usage counts the original prompt
        and the whole output, and its text and stop strings continue across the seam."""
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self._running or any(r.req_id == req_id for r in self._waiting):
            raise RequestRejectedError(f"request id {req_id!r} is already in use")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestRejectedError("the prompt is empty")
        vocab = self.verify.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        # Room for prompt + at least one new token + one verified block (the anchor and up to gamma drafts).
        limit = self.verify.max_seq_len - self.block_size - 1
        if len(prompt) >= limit:
            raise RequestRejectedError(
                f"the prompt has {len(prompt)} tokens; this deployment accepts at most {limit - 1}"
            )
        params = params.with_seed()
        level = RequestLevel.resolve(params.speculative, params.priority, params.tpot_slo_ms, self.service_levels)
        if level.tpot_slo_s is not None and self.service_levels.slo_admission == "refuse":
            predicted = self._predicted_tpot_s(level)
            if predicted > level.tpot_slo_s:
                self.tiers.refused(level.priority)
                raise SLOUnattainableError(
                    f"tpot_slo_ms: a target of {level.tpot_slo_s * 1000:.1f} ms per token cannot be met now "
                    f"(predicted {predicted * 1000:.1f} ms at the current load); retry later",
                    SLO_RETRY_AFTER_S,
                )
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.stop and self.decode is None:
            raise RequestRejectedError("stop strings need a tokenizer; none is configured")
        if not 0 <= emitted < len(prompt) or emitted_chars < 0:
            raise RequestRejectedError(
                f"emitted: {emitted} tokens of a {len(prompt)}-token context cannot be output already streamed"
            )
        output = prompt[len(prompt) - emitted :]
        if emitted:
            prompt = prompt[: len(prompt) - emitted]
            params = replace(params, max_tokens=params.max_tokens + emitted)
        detok = None
        if self.decode is not None:
            detok = IncrementalDetokenizer.resumed(self.decode, output, emitted_chars)
        req = RequestState(
            req_id=req_id,
            prompt=prompt,
            params=params,
            stop_ids=stop_ids,
            detok=detok,
            stops=StopStringMatcher(params.stop) if params.stop else None,
            output=output,
            anchor=output[-1] if output else -1,
            level=level,
        )
        req.metrics.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self._waiting.append(req)
        return req_id

    def abort(self, req_id: str) -> bool:
        """Stop a request now and free its memory on both engines. Returns whether it was known."""
        for req in self._waiting:
            if req.req_id == req_id:
                self._waiting.remove(req)
                return True
        if self._running.pop(req_id, None) is None:
            return False
        self._free(req_id)
        return True

    def detach(self, req_ids: Iterable[str] | None = None) -> list[DetachedRequest]:
        """Take requests (default: all) out of this engine WITHOUT releasing their caches on the replicas.

        For failover: the replica holding a request's cache may be gone, so the caller releases what is still
        reachable. The state returned is exactly what the client has seen (a failed round commits nothing), so a
        request adopted elsewhere continues without a duplicated or missing token.
        """
        wanted = None if req_ids is None else set(req_ids)
        taken = [r for r in self._running.values() if wanted is None or r.req_id in wanted]
        taken += [r for r in self._waiting if wanted is None or r.req_id in wanted]
        for req in taken:
            self._running.pop(req.req_id, None)
            self._off.discard(req.req_id)
            self._no_drafter.discard(req.req_id)
        self._waiting = deque(r for r in self._waiting if wanted is not None and r.req_id not in wanted)
        return taken

    def adopt(self, req: DetachedRequest) -> None:
        """Queue a detached request ahead of new ones; its next prefill reloads prompt + output (no sampling)."""
        if req.req_id in self._running or any(r.req_id == req.req_id for r in self._waiting):
            raise RequestRejectedError(f"request id {req.req_id!r} is already in use")
        needed = len(req.prompt) + len(req.output) + 1  # the reloaded context, the anchor, one new token
        if needed > self.verify.max_seq_len:
            raise RequestRejectedError(
                f"request {req.req_id!r} needs {needed} context positions; this verifier has {self.verify.max_seq_len}"
            )
        self._waiting.appendleft(req)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        """Free what the round driver itself holds (the engines it drives are their owner's): drafts launched
        ahead are waited for; a pipelined driver stops its drafter thread."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.drop()

    def snapshot(self) -> MetricsSnapshot:
        snap = self.metrics.snapshot(running=len(self._running), waiting=len(self._waiting))
        return replace(snap, tiers=self.tiers.snapshot())

    def _free(self, req_id: str) -> None:
        self._free_many([req_id])

    def _release_finished(self) -> None:
        if self._finished:
            finished, self._finished = self._finished, []
            self._free_many(finished)

    def _free_many(self, req_ids: list[str]) -> None:
        """Release requests on both engines, in one call each (over gRPC: one round trip per replica, not per
        request). A release that fails (the replica died) must not fail the round: the finished requests'
        tokens are committed already, and the dead replica's cache went with it."""
        if self._off or self._no_drafter:
            self._off.difference_update(req_ids)
            self._no_drafter.difference_update(req_ids)
        for engine in (self.verify, self.draft):
            if engine is None:
                continue
            try:
                engine.release_many(req_ids)
            except Exception as error:
                logger.warning("releasing %s failed (%s); its replica's failover cleans up", req_ids, error)

    # --------------------------------------------------------------------------------------------- the round
    def step(self) -> list[RequestOutput]:
        """Run one round; returns the deltas of every request that emitted tokens or finished."""
        self._round_started = time.perf_counter()
        self._round_planned = False
        self._draft_transfer = NO_TRANSFER
        admitted = self._admit()
        # Admitted requests were inserted last into the (insertion-ordered) running dict.
        running = list(self._running.values())
        verified = running[: len(running) - len(admitted)]
        late = None
        if verified and not all(map(_PLAIN, verified)):
            late = self._late(verified)
            if late is not None and self.service_levels.pause_lower_tiers:
                verified, late = self._unpaused(verified, late)
            elif self._pause_count:
                self._pause_count -= 1
            if any(r.level.speculative != "auto" for r in verified):
                return self._leveled_round(admitted, verified, late)
            # Speculation auto everywhere: a plain round (drafts ahead, chains), whose lengths favour the requests
            # behind their targets (``late``): planned lengths give them whole blocks (late_lengths), Algorithm 1
            # weighs their drafts above the others' (lateness_weights).

        t0 = time.perf_counter()
        ahead = self._take_ahead(verified)
        if ahead is None:
            caps, drafting = self._plan(verified)
        else:
            caps, drafting = ahead.caps, ahead.drafting
        t_decided = time.perf_counter()
        if drafting and self._relaying is not None and self._relay_ok and not self._any_detached(verified):
            assert self._planned_lengths is not None  # relaying is enabled only with planned lengths
            lengths = self._planned_lengths(caps, self.block_size)
            if lengths is not None:
                lengths = late_lengths(lengths, caps, late, self.block_size)
                return self._relayed_round(admitted, verified, caps, lengths, t_decided - t0, t_decided)
        elif (
            drafting
            and not admitted
            and self._chain_verify
            and (ahead is None or ahead.rows is None)
            and all(map(_GREEDY, verified))  # a sampled round cannot chain: Algorithm 1 decides it
        ):
            assert self._planned_lengths is not None  # chaining is enabled only with planned lengths
            lengths = self._planned_lengths(caps, self.block_size)
            if lengths is not None:
                lengths = late_lengths(lengths, caps, late, self.block_size)
                return self._chained_round(verified, caps, lengths, ahead, t_decided - t0, t_decided)
        proposal = batch = None
        if ahead is not None and ahead.pending is not None:
            proposal, batch = ahead.pending.result(), ahead.batch
            if ahead.rows is not None:  # some launched rows finished meanwhile: this round's rows of the block
                proposal = gather_rows([(proposal, row) for row in ahead.rows])
        elif drafting and self.draft is not None:
            num = len(verified)
            batch = DraftBatch(
                [r.req_id for r in verified],
                np.fromiter(map(_ANCHOR, verified), dtype=np.int64, count=num),
                np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num),
            )
            proposal = self.draft.propose(batch)
            self._relay_ok = True  # every drafter answered: relayed rounds may follow again
        t1 = time.perf_counter()
        if proposal is not None and ahead is None:
            self._draft_transfer = _transfer(self.draft, t1 - t_decided)
        lengths = self._lengths(caps, proposal, self._lateness_weights(late))
        t2 = time.perf_counter()
        verifies = self._verify_items(verified, lengths, proposal, batch)
        return self._verify_and_commit(
            admitted, verified, verifies, drafting, t1 - t_decided, (t_decided - t0) + (t2 - t1), t2
        )

    def _leveled_round(
        self, admitted: list[RequestState], verified: list[RequestState], late: np.ndarray | None
    ) -> list[RequestOutput]:
        """A round in which some request has speculation off or on (``late``: which requests are behind their
        TPOT targets, None when none is): never chained. It drops the drafts launched ahead and drafts eagerly
        for the requests that draft: ``off`` rows get no drafter row and length 0; the round drafts whenever a
        request is ``on``, else when the policy would. Lengths come from the policy on confidences weighted by
        lateness (:func:`scheduler.service_levels.lateness_weights`), and an ``on`` request verifies at least one
        draft its cap allows. Every rule reads settings, counts and timings only: lossless."""
        t0 = time.perf_counter()
        num = len(verified)
        modes = [r.level.speculative for r in verified]
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.drop()
        drafts = np.fromiter((m != "off" for m in modes), dtype=bool, count=num)
        forced = np.fromiter((m == "on" for m in modes), dtype=bool, count=num)
        caps = self._caps(verified) if self.draft is not None else np.zeros(num, dtype=np.int64)
        drafting = self.draft is not None and bool(drafts.any()) and (
            bool(forced.any()) or self.policy.should_draft(caps)
        )
        t_decided = time.perf_counter()
        proposal = None
        if drafting:
            rows = np.flatnonzero(drafts)
            drafters = [verified[i] for i in rows]
            count = len(drafters)
            proposal = self.draft.propose(  # type: ignore[union-attr]
                DraftBatch(
                    [r.req_id for r in drafters],
                    np.fromiter(map(_ANCHOR, drafters), dtype=np.int64, count=count),
                    np.fromiter(map(_POSITION, drafters), dtype=np.int64, count=count),
                )
            )
            if count < num:
                proposal = _scatter_rows(proposal, rows, [r.req_id for r in verified])
        t1 = time.perf_counter()
        lengths = self._lengths(caps, proposal, self._lateness_weights(late))
        if proposal is not None and forced.any():
            lengths = np.maximum(lengths, np.minimum(forced.astype(np.int64), caps))
        t2 = time.perf_counter()
        verifies = self._verify_items(verified, lengths, proposal, None)
        return self._verify_and_commit(
            admitted, verified, verifies, drafting, t1 - t_decided, (t_decided - t0) + (t2 - t1), t2
        )

    def _lateness_weights(self, late: np.ndarray | None) -> np.ndarray | None:
        """The factors on the requests' survival probabilities in Algorithm 1 this round (None: no request is
        late, or the weights reorder nothing)."""
        return None if late is None else lateness_weights(late, self.service_levels.on_target_weight)

    def _round_s(self) -> float:
        """The median time of the last few rounds (0 before the first round): the load a request meets now."""
        return self.metrics.last_rounds_s(ROUND_TIME_WINDOW)

    def _tau(self) -> float:
        """Tokens per request-round so far, bonus included (1 before any round)."""
        metrics = self.metrics
        return (metrics.num_accepted_tokens + metrics.num_drafts) / metrics.num_drafts if metrics.num_drafts else 1.0

    def _predicted_tpot_s(self, level: RequestLevel) -> float:
        """The TPOT a request of ``level`` joining now is predicted to get (see :func:`predicted_tpot_s`)."""
        return predicted_tpot_s(self._round_s(), self._tau(), level.speculative)

    def _slacks(self) -> list[tuple[int, float]]:
        """(tier, slack) of every running request with a target that can still meet it: the seconds of rounds
        that prefill joining prompts it can absorb (:func:`join_slack_s` of its paced target, :meth:`_paced_target_s`,
        at the pace of rounds without a joining prompt and its own tokens per round so far, the server's before its
        first verify round)."""
        running = [r for r in self._running.values() if r.level.tpot_slo_s is not None]
        if not running:
            return []
        now = time.perf_counter()
        round_s = self._plain_round_s or self._round_s()
        tau = self._tau()
        out = []
        for r in running:
            first, rounds = r.metrics.first_token_time, len(r.metrics.verified)
            if first is None:
                continue
            per_round = (len(r.output) - 1) / rounds if rounds else tau
            args = (now - first, len(r.output), r.max_tokens, per_round, round_s)
            # Judged by the paced target while that budget lasts, then by the target itself until it is spent.
            slack = join_slack_s(self._paced_target_s(r.level), *args)
            if slack is None:
                slack = join_slack_s(r.level.tpot_slo_s, *args)  # type: ignore[arg-type]  # running with a target
            if slack is not None:
                out.append((r.level.priority, slack))
        return out

    def _behind(self, requests: list[RequestState]) -> np.ndarray:
        """Per request, whether it is behind its TPOT target (False without one) after a round of the current
        round time: timings and counts only."""
        now = time.perf_counter()
        round_s = self._round_s()
        out = np.zeros(len(requests), dtype=bool)
        for i, r in enumerate(requests):
            if r.level.tpot_slo_s is not None:
                target = self._paced_target_s(r.level)
                first = r.metrics.first_token_time
                started = first if first is not None else r.metrics.arrival_time
                out[i] = behind_target(target, now - started, len(r.output), round_s)
        return out

    def _paced_target_s(self, level: RequestLevel) -> float:
        """The TPOT the rules hold a request of ``level`` (which has a target) to: its target times its tier's
        pace factor (:class:`PaceTracker`)."""
        return level.tpot_slo_s * self.pace.factor(level.priority)  # type: ignore[operator]

    def _late(self, verified: list[RequestState]) -> np.ndarray | None:
        """Per request of ``verified``, whether it is behind its TPOT target this round; None when none is."""
        if all(r.level.tpot_slo_s is None for r in verified):
            return None
        late = self._behind(verified)
        return late if late.any() else None

    def _unpaused(self, verified: list[RequestState], late: np.ndarray) -> tuple[list[RequestState], np.ndarray]:
        """``verified`` and ``late`` without the requests that sit this round out (:func:`paused`, as many as
        :func:`next_pause_count` says): they stay running and rejoin a later round at their committed anchors
        and positions."""
        priorities = np.fromiter((r.level.priority for r in verified), dtype=np.int64, count=len(verified))
        candidates = pause_candidates(priorities, late)
        if not candidates.any():
            return verified, late
        self._pause_count = next_pause_count(self._pause_count, int(np.count_nonzero(candidates)))
        out = paused(priorities, candidates, self._pause_count)
        self.metrics.paused_request_rounds += int(np.count_nonzero(out))
        keep = np.flatnonzero(~out)
        return [verified[i] for i in keep], late[keep]

    def _chained_round(
        self,
        verified: list[RequestState],
        caps: np.ndarray,
        lengths: np.ndarray,
        ahead: _AheadTaken | None,
        schedule_s: float,
        t_decided: float,
    ) -> list[RequestOutput]:
        """A drafted round whose lengths were fixed before the drafts exist: the verify step is queued right
        behind the draft step on the device (the verifier reads the drafts there), so the device runs both
        without the host in between; meanwhile the host takes the drafts' confidences for the policy. When the
        verifier cannot chain the step (:meth:`VerifyEngine.start_chained` says None) the drafts are verified
        the usual way, with the same lengths. The draft time runs to the drafts' arrival on the host (the
        verify step starts on the device then), the verify time from there to its results."""
        draft, chaining = self._launching, self._chaining
        assert draft is not None and chaining is not None  # chained rounds are enabled only with both
        self._round_planned = True
        if ahead is not None and ahead.pending is not None and ahead.batch is not None:
            pending, batch = ahead.pending, ahead.batch
        else:
            num = len(verified)
            batch = DraftBatch(
                [r.req_id for r in verified],
                np.fromiter(map(_ANCHOR, verified), dtype=np.int64, count=num),
                np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num),
            )
            pending = draft.propose_start(batch)
        finish = None
        if pending.device_tokens is not None:
            finish = chaining.start_chained(
                batch.req_ids, batch.anchors, batch.positions, lengths, pending.device_tokens
            )
        proposal = pending.result()
        t_drafted = time.perf_counter()
        if self._observe_drafts is not None and proposal.confidences is not None:
            self._observe_drafts(np.asarray(proposal.confidences, dtype=np.float64), caps)
        draft_s = t_drafted - t_decided
        if finish is None:
            verifies = self._verify_items(verified, lengths, proposal, batch)
            return self._verify_and_commit([], verified, verifies, True, draft_s, schedule_s, t_drafted)
        behind = None
        if self._chain_draft and finish.on_device is not None:
            behind = self._launch_behind(verified, batch, lengths, finish.on_device)
        return self._commit_round([], verified, finish.results(), True, draft_s, schedule_s, t_drafted, behind)

    def _relayed_round(
        self,
        admitted: list[RequestState],
        verified: list[RequestState],
        caps: np.ndarray,
        lengths: np.ndarray,
        schedule_s: float,
        t_decided: float,
    ) -> list[RequestOutput]:
        """A drafted round whose lengths were planned before its drafts exist, on a verifier replica whose
        drafters returned their blocks to it: one ``Step`` (with any joining prompts), verifying the blocks there,
        and no ``Propose``. The drafters drafted those blocks while the last step's reply travelled here and was
        committed. The drafts' confidences come back to plan the next round of as many requests; when some block
        was missing (its drafter late or gone) the next round asks the drafters (``Propose``), which fails over
        a dead one. The wait for the blocks counts as drafting, the rest as verifying."""
        relaying = self._relaying
        assert relaying is not None  # relayed rounds run only on a relaying verifier
        self._round_planned = True
        num = len(verified)
        outcome = relaying.step_relayed(
            [r.prefill_item() for r in admitted],
            [r.req_id for r in verified],
            np.fromiter(map(_ANCHOR, verified), dtype=np.int64, count=num),
            np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num),
            lengths,
        )
        t_replied = time.perf_counter()
        if outcome.missing:
            self._relay_ok = False
        elif outcome.confidences is not None and self._observe_drafts is not None:
            self._observe_drafts(np.asarray(outcome.confidences, dtype=np.float64), caps)
        observe_s = time.perf_counter() - t_replied  # planning the next round: scheduling, not verifying
        return self._commit_round(
            admitted, verified, outcome.results, True, 0.0, schedule_s + observe_s, t_decided + observe_s
        )

    def _any_detached(self, verified: list[RequestState]) -> bool:
        """Whether some request runs detached (no drafter replica holds it): its round asks the pool."""
        detached = self._is_detached
        return detached is not None and any(detached(r.req_id) for r in verified)

    def _launch_behind(
        self, verified: list[RequestState], batch: DraftBatch, lengths: np.ndarray, on_device: DeviceVerified
    ) -> _Decided:
        """Decide the next round's drafting now and, when it drafts, queue its draft step behind this round's
        verify step (on the device, from its outcome there). The policy decides as it does for drafts launched
        ahead, from the rounds before this one, on the caps the next round has if this one accepts every
        draft (lower bounds of its real caps: they only depend on counts). A decision to draft whose step the
        drafter cannot launch so is launched after the commit (:meth:`_launch_ahead`)."""
        num = len(verified)
        emitted = lengths + 1  # at most: every draft accepted and the target's own token
        left = np.fromiter((r.max_tokens - len(r.output) for r in verified), dtype=np.int64, count=num)
        if not self.policy.should_draft(self._caps_from(left - emitted, batch.positions + emitted)):
            return _Decided(False, None)
        assert self._launching is not None  # chain_draft is enabled only with a launching drafter
        pending = self._launching.propose_behind(
            batch.req_ids, batch.positions, on_device, self.verify.vocab_size
        )
        return _Decided(True, pending)

    def _plan(self, verified: list[RequestState]) -> tuple[np.ndarray, bool]:
        """The count caps of the requests to verify, and whether the drafter drafts for them this round.

        The policy may skip the drafter (a plain target round) from counts and past rounds only; the committed
        context is still appended, so any later round can draft. A round whose requests all run detached (no
        drafter replica holds any of them) does not draft either: the pool could only return placeholder drafts
        of confidence 0, so it is a plain target round and counted as one (``rounds_without_draft``).
        """
        drafting = self.draft is not None and bool(verified)
        if drafting and self._is_detached is not None:
            drafting = not all(self._is_detached(r.req_id) for r in verified)
        caps = self._caps(verified) if drafting else np.zeros(len(verified), dtype=np.int64)
        return caps, drafting and self.policy.should_draft(caps)

    def _take_ahead(self, verified: list[RequestState]) -> _AheadTaken | None:
        """This round's caps, draft decision and drafts from the drafts launched ahead, when they were launched
        for exactly this round's requests at their committed anchors and positions (or for a superset, when some
        finished: then the policy decides again and the rows are taken); None otherwise (drafts launched for
        another set are waited for and dropped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if not verified:
            ahead.drop()
            return None
        same = len(verified) == len(ahead.requests) and all(map(operator.is_, verified, ahead.requests))
        rows: list[int] | None = None
        if not same:
            index = {id(r): i for i, r in enumerate(ahead.requests)}
            found = [index.get(id(r)) for r in verified]
            if any(i is None for i in found):
                ahead.drop()
                return None
            rows = found  # type: ignore[assignment]
        batch = ahead.batch
        num = len(verified)
        anchors = np.fromiter(map(_ANCHOR, verified), dtype=np.int64, count=num)
        positions = np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num)
        launched_anchors = batch.anchors if rows is None else batch.anchors[rows]
        launched_positions = batch.positions if rows is None else batch.positions[rows]
        if not (np.array_equal(anchors, launched_anchors) and np.array_equal(positions, launched_positions)):
            ahead.drop()
            return None
        caps = self._caps(verified)
        if rows is None:
            return _AheadTaken(caps, ahead.drafting, ahead.pending, batch, None)
        drafting = self.policy.should_draft(caps)
        if not drafting or ahead.pending is None:
            ahead.drop()
            return _AheadTaken(caps, drafting, None, None, None)
        subset = DraftBatch([r.req_id for r in verified], anchors, positions)
        return _AheadTaken(caps, True, ahead.pending, subset, rows)

    def _launch_ahead(
        self,
        verified: list[RequestState],
        tokens: Sequence[Sequence[int]],
        accepted: Sequence[int],
        decided: _Decided | None = None,
    ) -> None:
        """Draft the next round now, for every request of this verify-only round at its committed anchor and
        position (taken from the step's results before the commit; a request that finishes in the commit
        wastes its row), if the policy drafts at the next round's caps; the commit then runs while the device
        drafts. The drafts are what the next round would draft: the same context (appended before), anchor and
        position, and randomness keyed by request and position. The policy decides from the rounds before this
        one (this round's timings reach it after its commit), as a pipelined scheduler does; ``decided``: it
        decided before the results already, and the drafts may be launched (behind the verify step)."""
        num = len(verified)
        anchors = np.fromiter((t[-1] for t in tokens), dtype=np.int64, count=num)
        positions = np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num) + 1
        positions += np.asarray(accepted, dtype=np.int64)
        left = np.fromiter((r.max_tokens - len(r.output) for r in verified), dtype=np.int64, count=num)
        left -= np.fromiter(map(len, tokens), dtype=np.int64, count=num)
        batch = DraftBatch([r.req_id for r in verified], anchors, positions)
        if decided is None:
            drafting, pending = self.policy.should_draft(self._caps_from(left, positions)), None
        else:
            drafting, pending = decided
        if drafting and pending is None:
            assert self._launching is not None  # drafts are launched ahead only by a launching drafter
            pending = self._launching.propose_start(batch)
        self._ahead = _Ahead(list(verified), batch, pending, drafting)

    def _verify_and_commit(
        self,
        admitted: list[RequestState],
        verified: list[RequestState],
        verifies: Sequence[VerifyItem],
        drafting: bool,
        draft_s: float,
        schedule_s: float,
        t2: float,
    ) -> list[RequestOutput]:
        """One target pass (prefill ``admitted``, verify ``verified``), then commit, context append and metrics.

        ``t2`` is when the verification phase began (its items built from the proposal: the verify time counts
        from there, as the items' construction is part of handing the block to the verifier).
        """
        prefills = [r.prefill_item() for r in admitted]
        if self._decoding is not None and verified:
            num = len(verified)
            left = np.fromiter((r.max_tokens - len(r.output) for r in verified), dtype=np.int64, count=num)
            positions = np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num)
            steps = np.minimum(np.minimum(left, self.verify.max_seq_len - positions), self._decode_steps)
            results = self._decoding.decode(prefills, verifies, np.maximum(steps, 1).tolist())
        else:
            results = self.verify.step(prefills, verifies)
        return self._commit_round(admitted, verified, results, drafting, draft_s, schedule_s, t2)

    def _commit_round(
        self,
        admitted: list[RequestState],
        verified: list[RequestState],
        results: Sequence[StepResult] | StepResults,
        drafting: bool,
        draft_s: float,
        schedule_s: float,
        t2: float,
        decided: _Decided | None = None,
    ) -> list[RequestOutput]:
        """Commit a target pass's results (prefills of ``admitted``, then verifies of ``verified``), release the
        finished requests and record the round; ``t2``: when the verification phase began; ``decided``: the
        next round's drafting, decided before the results (:meth:`_launch_behind`)."""
        t3 = time.perf_counter()
        if len(results) != len(admitted) + len(verified):
            if decided is not None and decided.pending is not None:
                decided.pending.result()  # the drafter's buffers are the launched step's until it is waited for
            raise RuntimeError(
                f"the verifier returned {len(results)} results for {len(admitted) + len(verified)} requests"
            )
        try:
            outputs, verified_counts, accepted_counts = self._commit_results(admitted, verified, results, decided)
        finally:  # the finished requests' slots, also when a commit failed part-way
            self._release_finished()
        if admitted:
            self.metrics.record_joins(len(admitted), bool(verified))
        if len(verified_counts):
            num_out = sum(map(len, map(_NEW_TOKENS, outputs)))
            verify_s = t3 - t2
            host_s = time.perf_counter() - self._round_started - draft_s - schedule_s - verify_s
            verify_transfer = _transfer(self.verify, verify_s)
            # A relayed step's wait for its drafters' blocks is drafting inside its phase: counted as drafting.
            collected = verify_transfer.drafts_s
            self.metrics.record_round(
                verified_counts,
                accepted_counts,
                draft_s + collected,
                schedule_s,
                verify_s - collected,
                num_out,
                drafted=drafting,
                draft_transfer=self._draft_transfer[:2],
                verify_transfer=verify_transfer[:2],
                host_s=max(host_s, 0.0),
                planned=self._round_planned,
                joined=bool(admitted),
            )
            seconds = draft_s + schedule_s + t3 - t2
            plain = self._plain_round_s
            if not admitted:
                self._plain_round_s = seconds if plain == 0.0 else plain + JOIN_ROUND_ALPHA * (seconds - plain)
            elif plain > 0.0:  # what one joining prompt costs the running requests, against a round without
                cost, join = max(seconds - plain, 0.0) / len(admitted), self._join_cost_s
                self._join_cost_s = cost if join == 0.0 else join + JOIN_ROUND_ALPHA * (cost - join)
            if self._observe_round is not None:  # other host time: schedule + commit (all but draft and verify)
                other_s = schedule_s + time.perf_counter() - t3
                verify_tokens = len(verified) + int(np.add.reduce(verified_counts))  # anchors + drafts
                self._observe_round(len(verified), drafting, draft_s, other_s, t3 - t2, verify_tokens)
        return outputs

    def _commit_results(
        self,
        admitted: list[RequestState],
        verified: list[RequestState],
        results: Sequence[StepResult] | StepResults,
        decided: _Decided | None = None,
    ) -> tuple[list[RequestOutput], Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]:
        """Append the step's context features to the drafter and commit every request's tokens; returns the
        outputs and the verified / accepted draft counts of the verify items. ``decided``: the next round's
        drafting, decided before the results (only with a chained round's results: a verify-only bucketed step's)."""
        no_drafter = self._no_drafter
        if isinstance(results, StepResults) and not admitted and not no_drafter:  # columns: no item per request
            expected = [r.req_id for r in verified]
            if results.req_ids != expected:
                raise RuntimeError(f"the verifier answered for {results.req_ids} where {expected} were expected")
            if self.draft is not None and results.features is not None:
                self.draft.append_context(
                    ContextBatch(
                        results.req_ids,
                        results.feature_starts,
                        results.feature_counts,
                        results.features,
                        results.arrays,
                    )
                )
            if decided is not None or (self._draft_ahead and verified):
                self._launch_ahead(verified, results.tokens, results.num_accepted, decided)
            commit = self._commit
            outputs = list(map(commit, verified, results.tokens, results.num_drafts, results.num_accepted))
            # The step's own lists (made for this round, changed by nobody): the metrics keep them as they are.
            verified_counts: Sequence[int] | np.ndarray = results.num_drafts
            accepted_counts: Sequence[int] | np.ndarray = results.num_accepted
        else:
            if self.draft is not None:
                contexts = [
                    ContextItem(r.req_id, r.feature_start, r.features)
                    for r in results
                    if r.features is not None and r.req_id not in no_drafter
                ]
                self.draft.append_context(contexts)
            for req, res in zip([*admitted, *verified], results, strict=True):  # prefills first, then verifies
                if res.req_id != req.req_id:
                    raise RuntimeError(f"the verifier answered for {res.req_id!r} where {req.req_id!r} was expected")
            commit = self._commit
            outputs = [
                commit(r, res.tokens, res.num_drafts, res.num_accepted, True)
                for r, res in zip(admitted, results[: len(admitted)], strict=True)
            ]
            verified_results = results[len(admitted) :]
            outputs += [
                commit(r, res.tokens, res.num_drafts, res.num_accepted)
                for r, res in zip(verified, verified_results, strict=True)
            ]
            count = len(verified_results)
            verified_counts = np.fromiter((res.num_drafts for res in verified_results), np.int64, count)
            accepted_counts = np.fromiter((res.num_accepted for res in verified_results), np.int64, count)
        return outputs, verified_counts, accepted_counts

    def _verify_items(
        self, verified: list[RequestState], lengths: np.ndarray, proposal: object, drafted: DraftBatch | None = None
    ) -> Sequence[VerifyItem]:
        """Each running request's anchor and its first lengths[r] drafts (with their distribution if sampled):
        a :class:`VerifyBatch` (arrays, no item per request) when there is a proposal; ``drafted``: the
        requests' ids, anchors and positions as the drafter got them, if known (the same arrays)."""
        if proposal is None:
            return [VerifyItem(r.req_id, r.anchor, (), None, None, r.position) for r in verified]
        num = len(verified)
        if drafted is None:
            drafted = DraftBatch(
                [r.req_id for r in verified],
                np.fromiter(map(_ANCHOR, verified), dtype=np.int64, count=num),
                np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num),
            )
        num_drafts = np.array(lengths, dtype=np.int64)  # a copy: the items outlive the policy's call
        sampled = [i for i, r in enumerate(verified) if not r.greedy and num_drafts[i]]
        return VerifyBatch(
            drafted.req_ids,
            drafted.anchors,
            drafted.positions,
            np.asarray(proposal.tokens.numpy(), dtype=np.int64),  # type: ignore[attr-defined]
            num_drafts,
            sampled,
            proposal.topk_ids,  # type: ignore[attr-defined]
            proposal.topk_probs,  # type: ignore[attr-defined]
        )

    #: Whether ``off`` requests join without a drafter slot (the plain round driver drafts only for the others;
    #: a pipelined driver drafts whole groups, so there they hold a slot and are verified with no drafts).
    _OFF_WITHOUT_DRAFTER = True

    def _admit(self, limit: int | None = None) -> list[RequestState]:
        """Move waiting requests (at most ``limit``) into the running set while both engines have free slots.

        Waiting requests go in tier order, FIFO within a tier (:func:`admission_order`), as far as the running
        requests' targets leave room and the queued targets let them (:meth:`_eligible`). ``off`` requests need
        no drafter slot. The admitted requests are a prefix of that order (the first that does not fit ends it)."""
        admitted: list[RequestState] = []
        if not self._waiting or self._holding_joiners():
            return admitted
        waiting = list(self._waiting)
        if (
            not all(map(_PLAIN, waiting))
            or not all(map(_PLAIN, self._running.values()))
            or any(r.level.priority != waiting[0].level.priority for r in waiting)
        ):
            waiting = [waiting[i] for i in admission_order(list(map(_PRIORITY, waiting)))]
            waiting = self._eligible(waiting)
        free = free_slots(self.verify.num_free_slots, None, len(self._running), self.max_running, limit)
        draft_free = self.draft.num_free_slots if self.draft is not None else 0
        candidates: list[RequestState] = []
        drafted: list[RequestState] = []
        for req in waiting:
            if len(candidates) >= free:
                break
            if self.draft is not None and not (self._OFF_WITHOUT_DRAFTER and req.level.speculative == "off"):
                if len(drafted) >= draft_free:
                    break
                drafted.append(req)
            candidates.append(req)
        if drafted:
            # One call for the round's joiners (over gRPC: one AddRequests per drafter replica); a drafter shared
            # with other verifier groups may have filled up meanwhile: it takes a prefix, the rest retry next round.
            added = self.draft.add_requests([(r.req_id, r.params) for r in drafted])  # type: ignore[union-attr]
            if added < len(drafted):
                candidates = candidates[: candidates.index(drafted[added])]
        if not candidates:
            return admitted
        drafted_ids = {id(r) for r in drafted}
        taken = {id(r) for r in candidates}
        self._waiting = deque(r for r in self._waiting if id(r) not in taken)
        now = time.perf_counter()
        for req in candidates:
            req.metrics.admission_time = now
            self._running[req.req_id] = req
            if req.level.speculative == "off":
                self._off.add(req.req_id)

            if self.draft is not None and id(req) not in drafted_ids:
                self._no_drafter.add(req.req_id)
            admitted.append(req)
        return admitted

    def _holding_joiners(self) -> bool:
        """Whether this round admits nobody so that waiting prompts join a later round together
        (:func:`holds_joiners`); only where rounds without a joining prompt are chained (a pipeline that chains,
        greedy requests), the rounds that holding buys (relayed rounds take joining prompts as they are)."""
        hold_s = self.service_levels.join_hold_ms / 1000.0
        running = self._running.values()
        if hold_s <= 0.0 or not self._chain_verify or not all(map(_GREEDY, running)):
            return False
        targets = any(r.level.tpot_slo_s is not None for r in running)
        oldest = min(r.metrics.arrival_time for r in self._waiting)
        return holds_joiners(hold_s, time.perf_counter() - oldest, targets)

    def _eligible(self, waiting: list[RequestState]) -> list[RequestState]:
        """The waiting requests (in admission order) that may join now.

        Joining prompts are prefilled in the round, which lengthens it for every running request: a request
        of tier p joins only while the running requests of tier p or higher (smaller value) with a target
        can absorb one more joining prompt's cost and still meet their targets (:func:`joiners_allowed`);
        the first that cannot join ends the list (everyone after it is of its tier or lower, held by the
        same requests). With ``slo_admission: queue`` a request whose predicted TPOT leaves less than
        :data:`BUDGET_SHARE` of its target room (the share admissions plan with) waits while others run, and so
        does every request of a lower tier: nobody overtakes a higher tier."""
        slacks = self._slacks()
        queue = self.service_levels.slo_admission == "queue" and bool(self._running)
        cost = self._join_cost_s
        out: list[RequestState] = []
        queued_tier: int | None = None
        for req in waiting:
            level = req.level
            if queued_tier is not None and level.priority > queued_tier:
                break
            allowed = joiners_allowed([s for p, s in slacks if p <= level.priority], cost)
            if 0 <= allowed <= len(out):
                break
            target = level.tpot_slo_s
            if queue and target is not None and self._predicted_tpot_s(level) > BUDGET_SHARE * target:
                queued_tier = level.priority if queued_tier is None else queued_tier
                continue
            out.append(req)
        return out

    def _caps(self, verified: list[RequestState]) -> np.ndarray:
        """Caps that only depend on counts and settings: never verify past max_tokens or past the KV slot, no
        drafts for a request with speculation off."""
        num = len(verified)
        tokens_left = np.fromiter((r.max_tokens - len(r.output) for r in verified), dtype=np.int64, count=num)
        caps = self._caps_from(tokens_left, np.fromiter(map(_POSITION, verified), dtype=np.int64, count=num))
        if self._off:
            off = self._off
            caps[np.fromiter((r.req_id in off for r in verified), dtype=bool, count=num)] = 0
        return caps

    def _caps_from(self, tokens_left: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """:meth:`_caps` from arrays: the tokens each request may still emit and its anchor position."""
        return draft_caps(tokens_left, positions, self.verify.max_seq_len, self.block_size)

    def _lengths(self, caps: np.ndarray, proposal: Proposal | None, weights: np.ndarray | None = None) -> np.ndarray:
        """The policy's lengths for ``proposal`` under ``caps``; ``weights``: lateness weights of the requests
        (:mod:`scheduler.service_levels`), for the policies that take them."""
        if proposal is None:
            return np.zeros(len(caps), dtype=np.int64)
        confidences = proposal.confidences
        if confidences is None:
            confidences = np.ones((len(caps), self.block_size))
        confidences = np.asarray(confidences, dtype=np.float64)
        if weights is None:
            return self.policy.lengths(confidences, caps)
        return self.policy.lengths(confidences, caps, weights=weights)

    def _commit(
        self, req: RequestState, tokens: list[int], num_drafts: int, num_accepted: int, prefill: bool = False
    ) -> RequestOutput:
        """Append a step's tokens to the request, apply stop conditions, finish and free it if done."""
        output = req.output
        if (
            not prefill
            and len(tokens) < req.max_tokens - len(output)
            and req.detok is None
            and (not req.stop_ids or req.stop_ids.isdisjoint(tokens))
        ):
            # The common case, kept cheap: a verify round that neither finishes the request nor has text to make.
            req.position += len(tokens)  # accepted drafts + 1 (or the tokens of several decoding steps)
            if tokens:
                req.anchor = tokens[-1]
            metrics = req.metrics
            metrics.verified.append(num_drafts)
            metrics.accepted.append(num_accepted)
            # A step's token lists are made for this round and nobody else keeps them: no copy of a list.
            new = tokens if type(tokens) is list else list(tokens)
            output.extend(new)
            num_output = metrics.num_output_tokens = len(output)
            return RequestOutput(req.req_id, new, "", False, None, len(req.prompt), num_output)
        # The anchor's position is the committed context length: the prompt after a prefill (plus the output
        # but its last token after a re-prefill), then +1 per verified anchor and per accepted draft.
        resumed = prefill and bool(req.output)
        if prefill:
            req.position = len(req.prompt) + max(len(req.output) - 1, 0)
        else:
            req.position += len(tokens)
        if tokens:
            req.anchor = tokens[-1]
        finish: FinishReason | None = None
        room = req.max_tokens - len(req.output)
        new = list(tokens[:room])
        if len(tokens) >= room:
            finish = FinishReason.LENGTH
        cut = -1
        if req.stop_ids and not req.stop_ids.isdisjoint(new):
            cut = first_stop_token(new, req.stop_ids)
            new = new[: cut + 1]
            finish = FinishReason.STOP
        metrics = req.metrics
        if prefill and not resumed:
            first = metrics.first_token_time = time.perf_counter()
            admitted = metrics.admission_time
            self.metrics.record_first_token(admitted - metrics.arrival_time, first - admitted)
        else:
            metrics.verified.append(num_drafts)
            metrics.accepted.append(num_accepted)
        req.output.extend(new)
        text = ""
        if req.detok is not None:
            visible = new[:-1] if finish is FinishReason.STOP and cut >= 0 else new
            text = req.detok.push(visible)
            if finish is not None:
                text += req.detok.flush()
            if req.stops is not None:
                text, hit = req.stops.feed(text)
                if hit:
                    finish = FinishReason.STOP
                elif finish is not None:
                    text += req.stops.flush()
        num_output = len(req.output)
        metrics.num_output_tokens = num_output
        if finish is None:
            return RequestOutput(req.req_id, new, text, False, None, len(req.prompt), num_output)
        metrics.finish_time = time.perf_counter()
        tpot_s = req.tpot_s()
        self.tiers.finished(req.level, num_output, tpot_s, metrics.verified)
        if req.level.tpot_slo_s is not None and tpot_s is not None:
            self.pace.finished(req.level.priority, tpot_s <= req.level.tpot_slo_s)

        self._running.pop(req.req_id, None)
        self._finished.append(req.req_id)  # released with the round's other finishers (_release_finished)
        return RequestOutput(req.req_id, new, text, True, finish, len(req.prompt), num_output, metrics)

    # ------------------------------------------------------------------------------------------ convenience
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[FinishedRequest]:
        """Run prompts to completion (batch API for tests, evaluation and benchmarks)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, FinishedRequest] = {}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.req_id].extend(out.new_token_ids)
                texts[out.req_id].append(out.new_text)
                if out.finished:
                    assert out.finish_reason is not None and out.metrics is not None
                    done[out.req_id] = FinishedRequest(
                        out.req_id, tokens[out.req_id], "".join(texts[out.req_id]), out.finish_reason, out.metrics
                    )
        return [done[i] for i in ids]


def _scatter_rows(proposal: Proposal, rows: np.ndarray, req_ids: list[str]) -> Proposal:
    """A proposal for ``req_ids`` holding ``proposal``'s rows at ``rows`` and empty rows elsewhere (requests
    drafted for nobody: speculation off). Empty rows have zero confidence, so no policy admits their drafts."""
    num, index = len(req_ids), torch.as_tensor(rows, dtype=torch.long)

    def spread(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((num, *t.shape[1:]))
        out[index.to(t.device)] = t
        return out

    def spread_np(a: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        out = np.zeros((num, *a.shape[1:]), dtype=a.dtype)
        out[rows] = a
        return out

    return Proposal(
        req_ids=list(req_ids),
        tokens=spread(proposal.tokens),
        confidences=spread_np(proposal.confidences),
        confidence_logits=spread_np(proposal.confidence_logits),
        topk_ids=spread(proposal.topk_ids),
        topk_probs=spread(proposal.topk_probs),
    )
