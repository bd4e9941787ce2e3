"""The drafter's gRPC service: a thin adapter from msgpack messages to :class:`DraftEngine` calls.

Per-round messages are batched and flat (one tensor per field with a count per request), because a map per
request costs milliseconds of Python work at a few hundred requests (docs/benchmarks/data_plane.md). Context features
arrive directly from the verifier (``AppendContext``), not through the scheduler: raw [n, m*H], or already projected
[n, H] by a verifier holding this drafter's projection, in which case the message names the projection's
fingerprint and rows projected by any other weights are refused (``INVALID_ARGUMENT``).

The verifier answers the scheduler without waiting for its feature push, so the next round's ``Propose`` may
overtake the ``AppendContext`` of the last one: ``Propose`` first waits (at most ``context_wait_s``) until every
request holds its context rows up to its anchor position and no append of it is still running, and the engine's
own check then names any rows still missing. For the same reason a push for a request the scheduler released
meanwhile (it finished in that round) is skipped, not an error. A push that names the requests' next anchors
(``draft_anchors``) also drafts their next blocks at once (:mod:`draft_service.ahead`), which ``Propose`` collects;
a push that also says ``return_drafts`` gets those drafts in its reply (in ``Propose``'s reply format, with the
anchors and positions they were drafted for), so that the verifier hands them to the scheduler with its ``Step``
reply and the round needs no ``Propose`` message (:mod:`verify_service.rpc_service`).

With ``link_host`` set (``engine.feature_transport: collective``) the drafter also hosts the direct feature path
(:mod:`cluster.feature_link`): verifiers open a link with ``OpenLink``, and an ``AppendContext`` naming a link
carries only metadata; its rows are received from that link, in the link's sequence order, before the append.

Context-cache slots that no call has named for ``idle_reclaim_s`` are reclaimed when an ``AddRequests`` needs
more slots than are free (:class:`~cluster.engine_rpc.IdleSlots`, as the verifier's KV slots): the scheduler
names each request it runs in every round's ``Propose`` and the verifier in every push, so such a slot belongs
to a caller that allocated and left, and one caller cannot keep the others out for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import torch

from cluster import contract
from cluster.contract import row_index
from cluster.engine_rpc import DEFAULT_IDLE_RECLAIM_S, DEFAULT_WEDGE_TIMEOUT_S, EngineThread, IdleSlots
from cluster.feature_link import DEFAULT_LINK_TIMEOUT_S, LinkHost
from cluster.rpc import HealthStatus, Service
from cluster.wire import DEFAULT_LIMITS, WIRE_DTYPES
from draft_service.ahead import DraftAhead
from draft_service.engine import ContextBatch, DraftEngine, DraftItem, Proposal
from draft_service.projection import model_fingerprint
from kernels.sampling import SamplingParams

log = logging.getLogger(__name__)

#: How long a Propose waits for context rows still in flight from the verifier. Far above a push's transit (ms;
#: a long prefill's features take seconds at worst); only reached when a push was lost (its verifier died).
DEFAULT_CONTEXT_WAIT_S = 10.0
#: Released request ids remembered so that a late feature push for them is skipped (bounded memory).
_RELEASED_MEMORY = 1 << 16


class DrafterService:
    """Owns a DraftEngine and exposes it as ``dspark.Drafter``."""

    def __init__(
        self,
        engine: DraftEngine,
        wedge_timeout_s: float = DEFAULT_WEDGE_TIMEOUT_S,
        context_wait_s: float = DEFAULT_CONTEXT_WAIT_S,
        link_host: str | None = None,
        link_timeout_s: float = DEFAULT_LINK_TIMEOUT_S,
        link_advertise: str | None = None,
        idle_reclaim_s: float = DEFAULT_IDLE_RECLAIM_S,
    ) -> None:
        self.engine = engine
        # The direct feature path's store and links (None: features only arrive as bytes over gRPC).
        self.links = None
        if link_host is not None:
            self.links = LinkHost(link_host, engine.model.device, link_timeout_s, advertise=link_advertise)
        self.projection = model_fingerprint(engine.model)
        self.context_wait_s = context_wait_s
        self._thread = EngineThread("drafter", wedge_timeout_s)
        self._idle = IdleSlots(idle_reclaim_s)  # slots nobody drives, reclaimed when an AddRequests needs them
        self._context_arrived = asyncio.Condition()
        self._appending: dict[str, int] = {}  # request -> appends submitted and not finished (loop thread only)
        self._ahead = DraftAhead()  # engine thread only
        self.proposals_ahead = 0  # Propose calls answered from drafts made ahead
        self.proposals_returned = 0  # AppendContext replies that carried the drafts made ahead
        self._released: OrderedDict[str, None] = OrderedDict()  # touched on the engine thread only
        self._greedy: set[str] = set()  # requests whose drafts the verifier checks without their distribution

    def info(self) -> dict[str, Any]:
        config = self.engine.model.config
        return {
            "block_size": self.engine.block_size,
            "has_confidence_head": self.engine.has_confidence_head,
            "vocab_size": config.vocab_size,
            "context_feature_size": config.context_feature_size,
            "hidden_size": config.hidden_size,
            "context_projection": self.projection,
            "target_layer_ids": list(config.target_layer_ids),
            "max_requests": self.engine.cache.num_slots,
            "free_slots": self.engine.num_free_slots,
            "running": self.engine.running,  # a restarted scheduler releases what nobody owns any more
            "proposals_ahead": self.proposals_ahead,
            "proposals_returned": self.proposals_returned,
            "feature_link_port": None if self.links is None else self.links.port,
            "feature_links": 0 if self.links is None else self.links.num_links,
            "engine_busy_s": self._thread.busy_total_s,
        }

    def health(self) -> HealthStatus:
        """NOT_SERVING when the engine thread is stuck inside one call (a wedged engine)."""
        busy = self._thread.busy_s
        return HealthStatus(
            busy <= self._thread.wedge_timeout_s, {"free_slots": self.engine.num_free_slots, "busy_s": busy}
        )

    def service(self) -> Service:
        return contract.service(
            contract.DRAFTER,
            {
                contract.DRAFTER_INFO: self._info,
                contract.ADD_REQUESTS: self._add,
                contract.APPEND_CONTEXT: self._append,
                contract.PROPOSE: self._propose,
                contract.DRAFTER_RELEASE: self._release,
                contract.OPEN_LINK: self._open_link,
                contract.CLOSE_LINK: self._close_link,
            },
        )

    async def _info(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.info()

    async def _add(self, request: dict[str, Any]) -> dict[str, Any]:
        if len(request["params"]) != len(request["req_ids"]):
            raise ValueError("AddRequests: one params map per request id is required")
        params = [SamplingParams.from_dict(p) if isinstance(p, dict) else _bad_params(p) for p in request["params"]]
        if len(request["req_ids"]) > self.engine.num_free_slots:
            await self._reclaim_idle()
        self._idle.touch(request["req_ids"])

        def add() -> None:
            added = []
            try:
                for req_id, p in zip(request["req_ids"], params, strict=True):
                    if self.engine.has(req_id):  # a replayed AddRequests is harmless
                        continue
                    self.engine.add_request(req_id, p)
                    self._released.pop(req_id, None)
                    self._ahead.drop(req_id)
                    if p.greedy:
                        self._greedy.add(req_id)
                    added.append(req_id)
            except Exception:
                for req_id in added:
                    self.engine.release(req_id)
                raise

        await self._thread.run(add)
        return {}

    async def _open_link(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.links is None:
            raise ValueError("OpenLink: this drafter takes context features over gRPC only (feature_transport grpc)")
        port = self.links.open(request["link_id"], request["backend"], request["peer_host"])
        return {"store_host": self.links.advertised_host, "store_port": port}

    async def _close_link(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.links is not None:
            self.links.close_link(request["link_id"])
        return {}

    async def _features(self, request: dict[str, Any]) -> torch.Tensor:
        """The message's rows: inline bytes, or received from the feature link it names."""
        link = request["link"]
        if link is None:
            if request["features"] is None:
                raise ValueError("AppendContext: features or a feature link is required")
            return request["features"]
        if request["features"] is not None:
            raise ValueError("AppendContext: features come inline or over a feature link, not both")
        seq, shape, dtype = request["seq"], request["shape"], request["dtype"]
        if seq is None or shape is None or dtype is None:
            raise ValueError("AppendContext: a feature link push needs seq, shape and dtype")
        if self.links is None:
            raise ValueError(f"AppendContext: unknown feature link {link} (this drafter hosts none)")
        if shape[0] * shape[1] * WIRE_DTYPES[dtype].itemsize > DEFAULT_LIMITS.max_message_bytes:
            raise ValueError(f"AppendContext: {shape} rows of {dtype} exceed the message size limit")
        return await self.links.receive(link, seq, shape, dtype)

    async def _append(self, request: dict[str, Any]) -> dict[str, Any]:
        features = await self._features(request)
        req_ids, starts, counts = request["req_ids"], request["starts"], request["counts"]
        if sum(counts) != int(features.shape[0]):
            raise ValueError(f"AppendContext: counts add up to {sum(counts)} but {features.shape[0]} rows were sent")
        if not len(starts) == len(counts) == len(req_ids):
            raise ValueError("AppendContext: one start and one count per request id are required")
        projection = request["projection"]
        if projection is not None and projection != self.projection:
            raise ValueError(
                f"AppendContext: features projected by context projection {projection}, but this drafter's is "
                f"{self.projection}: the verifier loaded other drafter weights (or another dtype) than this drafter"
            )
        self._idle.touch(req_ids)
        anchors = request["draft_anchors"]
        if anchors is not None and len(anchors) != len(req_ids):
            raise ValueError("AppendContext: one draft anchor per request id is required")

        drafts: dict[str, Any] = {}

        def append() -> None:
            keep = [i for i, req_id in enumerate(req_ids) if req_id not in self._released or self.engine.has(req_id)]
            for i in keep:
                self._ahead.drop(req_ids[i])
            self.engine.append_context(_context_batch(req_ids, starts, counts, features, keep), projection is not None)
            if anchors is not None:
                ahead = [DraftItem(req_ids[i], anchors[i], starts[i] + counts[i]) for i in keep if anchors[i] >= 0]
                proposal = self._draft_ahead(ahead) if ahead else None
                if proposal is not None and request["return_drafts"]:
                    # Built here, on the engine thread: the copies to the host wait for the device.
                    drafts.update(
                        contract.proposal_reply(proposal, self._greedy),
                        req_ids=[i.req_id for i in ahead],
                        anchors=[i.anchor for i in ahead],
                        positions=[i.position for i in ahead],
                    )

        for req_id in req_ids:
            self._appending[req_id] = self._appending.get(req_id, 0) + 1
        try:
            await self._thread.run(append)
        finally:
            for req_id in req_ids:
                left = self._appending.pop(req_id) - 1
                if left:
                    self._appending[req_id] = left
            async with self._context_arrived:
                self._context_arrived.notify_all()
        if not drafts:
            return {}
        self.proposals_returned += 1
        return {"drafts": drafts}

    def _draft_ahead(self, items: list[DraftItem]) -> Proposal | None:
        """On the engine thread, right after the append: a failure only means Propose drafts afresh."""
        try:
            proposal = self.engine.propose(items)
        except Exception as exc:
            log.warning("drafting ahead failed (Propose will draft afresh): %s", exc)
            return None
        self._ahead.store(items, proposal)
        return proposal

    async def _wait_for_context(self, items: list[DraftItem]) -> None:
        """Until every held request has its context rows up to its anchor position, or ``context_wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.context_wait_s
        async with self._context_arrived:
            while self._not_ready(items):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return  # the engine refuses the round, naming the missing rows
                try:
                    await asyncio.wait_for(self._context_arrived.wait(), remaining)
                except TimeoutError:
                    return

    def _not_ready(self, items: list[DraftItem]) -> bool:
        """Some request's append is still running, or its rows up to the anchor position are not all there."""
        engine, appending = self.engine, self._appending
        return any(
            i.req_id in appending or (engine.has(i.req_id) and engine.context_length(i.req_id) < i.position)
            for i in items
        )

    async def _propose(self, request: dict[str, Any]) -> dict[str, Any]:
        items = contract.parse_propose_request(request)
        self._idle.touch(request["req_ids"])
        waited = 0.0
        if self._not_ready(items):
            loop = asyncio.get_running_loop()
            started = loop.time()
            await self._wait_for_context(items)
            waited = loop.time() - started
        # Drafts made ahead are taken here on the loop: no hand-off to the engine thread and back on the round's
        # critical path. Safe: this request's append (which stored them) has ended, and nothing else touches its
        # entry until this Propose is answered.
        ahead, engine_s = self._ahead.take(items), 0.0
        if ahead is not None:
            self.proposals_ahead += 1
            proposal = ahead
        else:
            proposal, engine_s = await self._thread.run_timed(self.engine.propose, items)
        return {
            **contract.proposal_reply(proposal, self._greedy),
            # Engine-thread time of this call (0 when the drafts were made ahead), and how long it waited for
            # context rows still on their way from the verifier (or being appended): the caller counts both as
            # the drafter's time and the rest of its round trip as transfer.
            "engine_ms": 1e3 * engine_s,
            "wait_ms": 1e3 * waited,
        }

    async def _release(self, request: dict[str, Any]) -> dict[str, Any]:
        await self._thread.run(self._release_now, request["req_ids"])
        return {}

    def _release_now(self, req_ids: list[str]) -> None:
        """On the engine thread: free the requests' slots and forget their drafts (unknown ids: no-op)."""
        for req_id in req_ids:
            self._greedy.discard(req_id)
            self._ahead.drop(req_id)
            if self.engine.has(req_id):
                self._released[req_id] = None
                if len(self._released) > _RELEASED_MEMORY:
                    self._released.popitem(last=False)
            self.engine.release(req_id)

    async def _reclaim_idle(self) -> None:
        """Release the slots no call has named for ``idle_reclaim_s`` (see :class:`IdleSlots`)."""
        stale = self._idle.idle(await self._thread.run(lambda: self.engine.running))
        if stale:
            log.warning("reclaiming %d context slots idle for over %.0f s: %s", len(stale), self._idle.idle_s,
                        stale[:8])
            await self._thread.run(self._release_now, stale)

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        self._thread.shutdown()


def _context_batch(
    req_ids: list[str], starts: list[int], counts: list[int], features: torch.Tensor, keep: list[int]
) -> ContextBatch:
    """The rows of requests ``keep`` (ascending indices) of a push as one batch: the push's tensor whole when it
    keeps them all, else their rows gathered at once (no view per request)."""
    if len(keep) == len(req_ids):
        return ContextBatch(req_ids, starts, counts, features)
    index = torch.from_numpy(row_index(counts, keep))
    return ContextBatch(
        [req_ids[i] for i in keep],
        [starts[i] for i in keep],
        [counts[i] for i in keep],
        features.index_select(0, index.to(features.device)),
    )


def _bad_params(value: object) -> SamplingParams:
    raise ValueError(f"params: expected a map, got {type(value).__name__}")
