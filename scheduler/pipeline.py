"""Request groups pipelined through the drafter and the verifier (measured in docs/benchmarks/data_plane.md).

With the drafter and the verifier in different processes or on different devices, a plain round leaves each idle
while the other works: draft, verify, draft, verify. :class:`PipelinedEngine` splits its requests into ``groups``
and verifies one group while the drafter drafts the next group's block::

    tick 1:  verify A(k)   |  draft B(k)
    tick 2:  verify B(k)   |  draft A(k+1)    (A's context from tick 1 was appended first)
    tick 3:  verify A(k+1) |  draft B(k+1)

Each :meth:`PipelinedEngine.step` is one tick: it verifies one group with the block drafted during the previous
tick and meanwhile drafts for the next group on the drafter thread. A group's round is exactly a round of
:class:`SpeculativeEngine` over that group: the same count caps, the same policy (its decision to draft is taken
when the block is requested, from counts and past rounds only), the same single target pass with rejection
sampling. Only another group's drafting overlaps it, so decoding stays lossless, as in the plain engine.

Each group has its own copy of the policy: what a policy learns from past rounds (the draft gate's confidence
curve, a measured draft cost, ``dspark-async``'s capacity plan for a later round) describes that group's rounds,
as it would in a plain engine over the group; :attr:`PipelinedEngine.policy` is the policy of the group at hand.

Every drafter call (admission, ``propose``, context append, release) goes through ONE thread in submission order:
the draft engine never sees two calls at once, and a group's context is appended before its next block is drafted.
The verifier is called from the stepping thread only. Worth it where drafting and verifying can really run at the
same time (separate drafter and verifier replicas, or a CPU with a core for each); on one GPU with both engines in
one process the two would share the device's stream.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from draft_service.engine import ContextItem, DraftItem, Proposal
from kernels.sampling import SamplingParams
from scheduler.admission import group_share
from scheduler.engine import NO_TRANSFER, DetachedRequest, RequestOutput, RequestState, SpeculativeEngine
from scheduler.interfaces import Drafter, Verifier
from scheduler.policy import VerifyPolicy
from scheduler.service_levels import ServiceLevels

T = TypeVar("T")


class SerialDrafter:
    """A draft engine behind one worker thread: calls run one at a time, in the order they were made.

    Every method waits for its call except :meth:`propose_async`, which returns the future of the proposal; calls
    made meanwhile queue behind it. Attribute reads (the slot count, introspection) go to the engine directly: they
    are not ordered with the calls in flight.
    """

    def __init__(self, engine: Drafter) -> None:
        self.engine = engine
        self.block_size: int = engine.block_size
        self.has_confidence_head: bool = engine.has_confidence_head
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipelined-drafter")

    @property
    def num_free_slots(self) -> int:
        return self.engine.num_free_slots

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return self._thread.submit(fn, *args).result()

    def add_requests(self, requests: Sequence[tuple[str, SamplingParams]]) -> int:
        return self._call(self.engine.add_requests, requests)

    def release_many(self, req_ids: Sequence[str]) -> None:
        self._call(self.engine.release_many, req_ids)

    def append_context(self, items: Sequence[ContextItem]) -> None:
        # Waited for: the verifier's next step may overwrite the buffers these features live in. Nothing to
        # append (features pushed by a remote verifier straight to its drafter) must not wait for a draft.
        if len(items):
            self._call(self.engine.append_context, items)

    def propose(self, items: Sequence[DraftItem]) -> Proposal:
        return self._call(self.engine.propose, items)

    def propose_async(self, items: Sequence[DraftItem]) -> Future[Proposal]:
        return self._thread.submit(self.engine.propose, items)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


@dataclass
class _Pending:
    """A group's next round, decided (and, when drafting, its block requested) during the previous tick."""

    req_ids: list[str]
    caps: np.ndarray
    proposal: Future[Proposal] | None  # None: the policy skipped the drafter for this round
    schedule_s: float  # host time of the decision


class PipelinedEngine(SpeculativeEngine):
    """:class:`SpeculativeEngine` with its requests in ``groups`` whose drafting and verification overlap."""

    _OFF_WITHOUT_DRAFTER = False  # a group's round drafts every member

    def __init__(
        self,
        verify: Verifier,
        draft: Drafter | None,
        policy: VerifyPolicy,
        *,
        groups: int = 2,
        decode: Callable[[Sequence[int]], str] | None = None,
        eos_token_ids: Iterable[int] = (),
        max_running: int | None = None,
        service_levels: ServiceLevels | None = None,
    ) -> None:
        """``service_levels``: as for :class:`SpeculativeEngine`, except that a group's round drafts the whole
        group, so ``off`` requests hold a drafter slot here (verified with no drafts all the same), and rounds
        are neither weighted by lateness, nor paused for it, nor drafted for ``on`` against the gate (admission
        order, holds and refusals apply)."""
        if groups < 2:
            raise ValueError(f"a pipelined engine needs at least 2 request groups, got {groups}")
        super().__init__(
            verify,
            draft,
            policy,
            decode=decode,
            eos_token_ids=eos_token_ids,
            max_running=max_running,
            service_levels=service_levels,
        )
        # Every drafter call goes through one thread, in submission order (module doc).
        self._serial = SerialDrafter(self.draft) if self.draft is not None else None
        self.draft = self._serial
        self.num_groups = groups
        # The policy given serves group 0; the others get copies (their learned state starts empty, as it is).
        self.policies: list[VerifyPolicy] = [policy, *(copy.deepcopy(policy) for _ in range(groups - 1))]
        self._members: list[dict[str, RequestState]] = [{} for _ in range(groups)]
        self._group_of: dict[str, int] = {}
        self._pending: dict[int, _Pending] = {}
        self._turn = 0
        self.blocks_ahead = 0  # blocks drafted while another group was being verified

    # ------------------------------------------------------------------------------------------ the tick
    def step(self) -> list[RequestOutput]:
        """One tick: verify one group (prefilling requests admitted into it) while the next group drafts."""
        self._round_started = time.perf_counter()
        self._round_planned = False  # a pipelined group's lengths are Algorithm 1's on its drafts
        self._draft_transfer = NO_TRANSFER  # drafting overlaps the tick on the drafter thread: not split
        g = self._next_group()
        if g is None:
            return []
        self._turn = (g + 1) % self.num_groups
        self._use_policy(g)
        t0 = time.perf_counter()
        pending = self._pending.pop(g, None)
        proposal, draft_s, schedule_s = None, 0.0, 0.0
        if pending is not None:
            schedule_s = pending.schedule_s
            if pending.proposal is not None:
                proposal = pending.proposal.result()
            draft_s = time.perf_counter() - t0  # only what the drafting of this group left exposed
        members = self._members[g]
        admitted = self._admit_into(g)
        joined = {r.req_id for r in admitted}
        verified = [r for r in members.values() if r.req_id not in joined]
        drafting = pending is not None and pending.proposal is not None
        t1 = time.perf_counter()
        if pending is None:  # nothing decided ahead (a group's first round, or no other group to overlap)
            caps, drafting = self._plan(verified)
            t_decided = time.perf_counter()
            if drafting and self.draft is not None:
                proposal = self.draft.propose([DraftItem(r.req_id, r.anchor, r.position) for r in verified])
            draft_s += time.perf_counter() - t_decided
            schedule_s += t_decided - t1
        else:
            caps = pending.caps
            ids = [r.req_id for r in verified]
            if ids != pending.req_ids:  # requests aborted since the round was decided drop out
                row_of = {req_id: row for row, req_id in enumerate(pending.req_ids)}
                index = [row_of[req_id] for req_id in ids]
                caps = caps[index]
                if proposal is not None:
                    proposal = _rows_of(proposal, index, ids)
        t2 = time.perf_counter()
        lengths = self._lengths(caps, proposal) if drafting else np.zeros(len(verified), dtype=np.int64)
        t3 = time.perf_counter()
        schedule_s += t3 - t2
        # The items hold what the verifier needs of the block BEFORE the next block is drafted: a proposal's
        # tensors may be views of the drafter's static outputs, which the next propose overwrites.
        verifies = self._verify_items(verified, lengths, proposal)
        self._request_next_block(g)
        self._use_policy(g)
        return self._verify_and_commit(admitted, verified, verifies, drafting, draft_s, schedule_s, t3)

    def _use_policy(self, g: int) -> None:
        """Make group ``g``'s policy the one the round methods of the base engine consult."""
        self.policy = self.policies[g]
        self._observe_round = getattr(self.policy, "observe_round", None)

    def _next_group(self) -> int | None:
        """The first group from the turn on that has requests, or could admit a waiting one."""
        for i in range(self.num_groups):
            g = (self._turn + i) % self.num_groups
            if self._members[g] or (self._waiting and self._share(g) > 0 and self._has_free_slot()):
                return g
        return None

    def _has_free_slot(self) -> bool:
        if self.verify.num_free_slots <= 0 or (self.draft is not None and self.draft.num_free_slots <= 0):
            return False
        return self.max_running is None or len(self._running) < self.max_running

    def _share(self, g: int) -> int:
        """How many waiting requests group ``g`` may take now: it fills up to an even split of all requests."""
        return group_share(len(self._running) + len(self._waiting), self.num_groups, len(self._members[g]))

    def _admit_into(self, g: int) -> list[RequestState]:
        admitted = self._admit(limit=max(self._share(g), 0))
        for req in admitted:
            self._members[g][req.req_id] = req
            self._group_of[req.req_id] = g
        return admitted

    def _request_next_block(self, verifying: int) -> None:
        """Decide the next group's round and start drafting its block, to overlap the verification now due.

        The next group is the following one (in turn order) that has requests and no round decided yet; the group
        being verified is never it (its context is not committed yet).
        """
        for i in range(1, self.num_groups):
            h = (verifying + i) % self.num_groups
            members = self._members[h]
            if not members or h in self._pending:
                continue
            t0 = time.perf_counter()
            verified = list(members.values())
            self._use_policy(h)
            caps, drafting = self._plan(verified)
            future = None
            if drafting and self._serial is not None:
                future = self._serial.propose_async(
                    [DraftItem(r.req_id, r.anchor, r.position) for r in verified]
                )
                self.blocks_ahead += 1
            self._pending[h] = _Pending([r.req_id for r in verified], caps, future, time.perf_counter() - t0)
            return

    # --------------------------------------------------------------------------------- request bookkeeping
    def _leave_group(self, req_id: str) -> None:
        g = self._group_of.pop(req_id, None)
        if g is not None:
            self._members[g].pop(req_id, None)

    def _free_many(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._leave_group(req_id)
        super()._free_many(req_ids)

    def detach(self, req_ids: Iterable[str] | None = None) -> list[DetachedRequest]:
        """As :meth:`SpeculativeEngine.detach`; rounds decided ahead are dropped (their blocks finish first)."""
        for pending in self._pending.values():
            if pending.proposal is not None:
                pending.proposal.exception()  # wait; a failed draft only matters to the round that is dropped
        self._pending.clear()
        taken = super().detach(req_ids)
        for req in taken:
            self._leave_group(req.req_id)
        return taken

    def close(self) -> None:
        if self._serial is not None:
            self._serial.close()
        super().close()


def _rows_of(proposal: Proposal, index: list[int], req_ids: list[str]) -> Proposal:
    """Rows ``index`` of a proposal, for ``req_ids``."""

    def rows(value: Any) -> Any:
        return None if value is None else value[index]

    return Proposal(
        req_ids=req_ids,
        tokens=proposal.tokens[index],
        confidences=rows(proposal.confidences),
        confidence_logits=rows(proposal.confidence_logits),
        topk_ids=rows(proposal.topk_ids),
        topk_probs=rows(proposal.topk_probs),
    )
