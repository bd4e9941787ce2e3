"""The verifier's gRPC service: a thin adapter from msgpack messages to :class:`VerifyEngine` steps.

One ``Step`` message per round carries every prefill and verification of this replica as flat tensors (for a round
driver without a drafter, possibly several decoding steps: ``verify_steps``, :meth:`VerifyEngine.decode`). After the
target pass the service pushes each request's committed context features straight to the drafter replica that owns
it (``routes``: drafter address -> request ids), and only the small control data (tokens, counts) goes back to the
scheduler: the bulky features never pass through the central process. With the drafter's context projection loaded
(:mod:`draft_service.projection`) the verifier applies it first, on its own device, and sends the projected rows
(1/m of the bytes) stamped with the projection's fingerprint; ``feature_dtype`` is the dtype they travel in.
Projecting, casting and copying to the host run on the engine thread, right after the step, so the event loop only
sends.

The reply to the scheduler does not wait for the pushes: the drafters append while the scheduler commits the round
and sends the next ``Propose``, which each drafter holds until the request's rows are in (see
:mod:`draft_service.rpc_service`). A push that fails is logged; its requests' next ``Propose`` then fails (their
rows never arrive) and failover re-prefills them, the same path as a drafter lost mid-round. Each push also names
the requests' next anchors, so that the drafter drafts their next blocks at once (:mod:`draft_service.ahead`).
Pushes to a drafter are messages on one long-lived ``AppendContext`` stream (a round's push is on the critical
path of the drafter's next block, and a message on an open stream costs less than half a unary call), one at a
time and in the order of the steps that made them.

A ``Step`` that says ``relay_drafts`` asks each drafter, in its push, to return the next blocks; the verifier keeps
them (:mod:`verify_service.relay`). A relayed ``Step`` (``verify_lengths`` set: lengths the scheduler planned
before the drafts exist) verifies those blocks, after waiting for the pushes that bring them (at most
``RELAY_WAIT_S``; a request whose block does not come is verified with no drafts), and returns their confidences,
from which the scheduler plans the next round. The drafts then never pass through the scheduler, and the round is
one message each way between the scheduler and the verifier.

With ``feature_transport="collective"`` the rows themselves travel over a torch.distributed link to each drafter
(:mod:`cluster.feature_link`) and the push carries only their metadata; a drafter without a working link gets bytes
over gRPC as above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import torch

from cluster import contract
from cluster.engine_rpc import DEFAULT_IDLE_RECLAIM_S, DEFAULT_WEDGE_TIMEOUT_S, EngineThread, IdleSlots
from cluster.feature_link import DEFAULT_LINK_TIMEOUT_S, LinkSender
from cluster.rpc import HealthStatus, RoundStream, RpcClient, Service
from draft_service.projection import ContextProjection
from verify_service.engine import PrefillItem, StepResults, VerifyEngine, VerifyItem
from verify_service.relay import Relayed, RelayedDrafts

log = logging.getLogger(__name__)

#: How long a relayed ``Step`` waits for its drafters' blocks. Far above a draft's time on any device (ms): reached
#: only by a stuck or dying drafter, whose requests are then verified with no drafts (and the scheduler, told they
#: were missing, asks that drafter with ``Propose`` next, which fails over a dead one).
RELAY_WAIT_S = 2.0


class VerifierService:
    """Owns a VerifyEngine and exposes it as ``dspark.Verifier``."""

    def __init__(
        self,
        engine: VerifyEngine,
        token: str | None = None,
        timeout_s: float = 30.0,
        sps: dict[str, Any] | None = None,
        wedge_timeout_s: float = DEFAULT_WEDGE_TIMEOUT_S,
        projection: ContextProjection | None = None,
        feature_dtype: torch.dtype | None = None,
        draft_ahead: bool = True,
        feature_transport: str = "grpc",
        link_timeout_s: float = DEFAULT_LINK_TIMEOUT_S,
        idle_reclaim_s: float = DEFAULT_IDLE_RECLAIM_S,
    ) -> None:
        if feature_transport not in ("grpc", "collective"):
            raise ValueError(f"feature_transport must be grpc or collective, got {feature_transport!r}")
        if projection is not None:
            if projection.feature_size != engine.target.feature_dim:
                raise ValueError(
                    f"the context projection takes rows of width {projection.feature_size}, but the target gives "
                    f"{engine.target.feature_dim} (other target layers or another drafter)"
                )
            projection = projection.to(engine.target.device)
        self.engine = engine
        self.projection = projection
        self.feature_dtype = feature_dtype  # None: as computed (the projection's or the target's dtype)
        self.draft_ahead = draft_ahead  # pushes name each request's next anchor: the drafter drafts at once
        self.sps = sps  # this replica's SPS table (SPSTable.to_dict()), for schedulers that discover it via Info
        self._thread = EngineThread("verifier", wedge_timeout_s)
        self._idle = IdleSlots(idle_reclaim_s)  # slots no round loop drives, reclaimed when a prefill needs them
        self._token = token
        self._timeout_s = timeout_s
        self._drafters: dict[str, RpcClient] = {}
        # One long-lived AppendContext stream per drafter: a push per round is one message on it, in order.
        self._appends: dict[str, RoundStream] = {}
        self._pushes: set[asyncio.Task[dict[str, Any] | None]] = set()  # feature pushes in flight (strong references)
        self._relayed = RelayedDrafts()  # the blocks drafters returned with relaying pushes (event loop only)
        self._relaying: dict[str, asyncio.Task[dict[str, Any] | None]] = {}  # req id -> the push bringing its block
        # collective: the rows go over torch.distributed links to the drafters, only metadata over gRPC.
        self.links = None if feature_transport == "grpc" else LinkSender(engine.target.device, link_timeout_s)

    def info(self) -> dict[str, Any]:
        target = self.engine.target
        return {
            "vocab_size": target.vocab_size,
            "max_seq_len": self.engine.max_seq_len,
            "max_requests": self.engine.cache.num_slots,
            "free_slots": self.engine.num_free_slots,
            "feature_dim": target.feature_dim,
            "context_projection": None if self.projection is None else self.projection.fingerprint,
            "feature_dtype": None if self.feature_dtype is None else str(self.feature_dtype).removeprefix("torch."),
            "eos_token_ids": list(target.eos_token_ids),
            "sps": self.sps,
            "feature_bytes_sent": sum(c.bytes_sent for c in (*self._drafters.values(), *self._appends.values())),
            "feature_bytes_collective": 0 if self.links is None else self.links.bytes_sent,
            "feature_links": 0 if self.links is None else self.links.num_links,
            "running": self.engine.running,  # a restarted scheduler releases what nobody owns any more
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
            contract.VERIFIER,
            {contract.VERIFIER_INFO: self._info, contract.STEP: self._step, contract.VERIFIER_RELEASE: self._release},
        )

    async def _info(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.info()

    async def _step(self, request: dict[str, Any]) -> dict[str, Any]:
        prefills, items = contract.parse_step_request(request)
        verifies: Sequence[VerifyItem] = items
        self._idle.touch(request["verify_req_ids"])
        if len(prefills) > self.engine.num_free_slots:
            await self._reclaim_idle()
        self._idle.touch(request["prefill_req_ids"])
        routed = {req_id: address for address, ids in request["routes"].items() for req_id in ids}
        send_inline, relay = request["inline_features"], request["relay_drafts"] and self.draft_ahead
        relayed, wait_s = None, 0.0
        if request["verify_lengths"] is not None:
            relayed, wait_s = await self._take_relayed(request)
            verifies = relayed.batch
        (results, pushes, inline), engine_s = await self._thread.run_timed(
            self._step_and_pack, prefills, verifies, routed, send_inline, relay, request["verify_steps"]
        )
        tasks = self._push_features(pushes)
        if relay:
            for address, task in tasks.items():
                for req_id in pushes[address]["req_ids"]:
                    self._relaying[req_id] = task
        return contract.step_reply(
            results,
            inline,
            engine_s=engine_s,
            relayed_confidences=None if relayed is None else relayed.confidences,
            relay_missing=0 if relayed is None else relayed.missing,
            drafts_s=wait_s,
        )

    async def _take_relayed(self, request: dict[str, Any]) -> tuple[Relayed, float]:
        """A relayed step's verifications, once the pushes bringing their blocks have answered (or after
        ``RELAY_WAIT_S``), and how long that wait took."""
        req_ids = request["verify_req_ids"]
        pushes = [self._relaying.pop(req_id, None) for req_id in req_ids]
        pending = {task for task in pushes if task is not None and not task.done()}
        wait_s = 0.0
        if pending:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await asyncio.wait(pending, timeout=RELAY_WAIT_S)
            wait_s = loop.time() - started
        relayed = self._relayed.take(
            req_ids, request["verify_anchors"], request["verify_positions"], request["verify_lengths"]
        )
        return relayed, wait_s

    def _step_and_pack(
        self,
        prefills: list[PrefillItem],
        verifies: Sequence[VerifyItem],
        routed: dict[str, str],
        send_inline: bool,
        relay: bool,
        steps: list[int] | None = None,
    ) -> tuple[StepResults, dict[str, dict[str, Any]], contract.InlineFeatures | None]:
        """On the engine thread: the step (``steps``: several decoding steps, :meth:`VerifyEngine.decode`) as
        columns, then one AppendContext message per drafter and (``send_inline``) the unrouted features, all on
        the host. Here, not after the reply: the step's features may be views of its graph's output, which the
        engine's next step (another call on this thread) overwrites."""
        if steps is None:
            results = StepResults.of(self.engine.step(prefills, verifies))
        else:
            results = StepResults.of(self.engine.decode(prefills, verifies, steps))
        if results.features is None:
            return results, {}, None
        by_address: dict[str, list[int]] = {}
        unrouted: list[int] = []
        for i, req_id in enumerate(results.req_ids):
            address = routed.get(req_id)
            if address is None:
                unrouted.append(i)
            else:
                by_address.setdefault(address, []).append(i)
        projection = None if self.projection is None else self.projection.fingerprint
        req_ids, starts, counts = results.req_ids, results.feature_starts, results.feature_counts
        tokens = results.tokens
        messages = {}
        for address, rows in by_address.items():
            features, fresh = _feature_rows(results, rows)
            if self.projection is not None:
                features, fresh = self.projection(features), True
            if self.feature_dtype is not None and features.dtype != self.feature_dtype:
                features, fresh = features.to(self.feature_dtype), True
            messages[address] = contract.append_request(
                [req_ids[i] for i in rows],
                [starts[i] for i in rows],
                [counts[i] for i in rows],
                # collective: left on the device for the link; either way a tensor of its own (the step's rows
                # are the graph's output, which the next step overwrites).
                _own_copy(features, fresh, on_host=self.links is None),
                projection=projection,
                draft_anchors=[tokens[i][-1] if tokens[i] else -1 for i in rows] if self.draft_ahead else None,
                return_drafts=relay,
            )
        inline = None
        if unrouted and send_inline:
            features, fresh = _feature_rows(results, unrouted)
            inline = contract.InlineFeatures(
                [req_ids[i] for i in unrouted], [counts[i] for i in unrouted], _own_copy(features, fresh, on_host=True)
            )
        return results, messages, inline

    def _push_features(self, messages: dict[str, dict[str, Any]]) -> dict[str, asyncio.Task[dict[str, Any] | None]]:
        """Start one AppendContext per drafter (by address: its task, whose result is the drafter's reply or None
        when the push failed, the drafts it returned kept for a relayed step); they complete after the Step's
        reply has gone."""
        tasks = {}
        for address, message in messages.items():
            client = self._drafters.get(address)
            if client is None:
                client = self._drafters[address] = RpcClient(address, token=self._token, timeout_s=self._timeout_s)
                self._appends[address] = contract.APPEND_CONTEXT.round_stream(client)
            task = tasks[address] = asyncio.ensure_future(self._push(client, address, message))
            self._pushes.add(task)
            task.add_done_callback(self._pushes.discard)
        return tasks

    async def _push(self, client: RpcClient, address: str, message: dict[str, Any]) -> dict[str, Any] | None:
        """The drafter's reply, or None when the push failed (logged); the drafts it returned are kept."""
        reply = await self._send_push(client, address, message)
        if reply is not None and reply.get("drafts"):
            self._relayed.store(reply["drafts"])
        return reply

    async def _send_push(self, client: RpcClient, address: str, message: dict[str, Any]) -> dict[str, Any] | None:
        if self.links is not None:
            link = await self.links.link_for(address, client)
            if link is not None:
                reply = await self._push_over_link(client, address, message, link)
                if reply is not None:
                    return reply
            if message["features"].device.type != "cpu":
                message["features"] = await asyncio.to_thread(message["features"].cpu)
        try:
            return await self._appends[address].exchange(message)
        except Exception as exc:  # the drafter died or refused: its requests' next Propose fails, failover follows
            log.warning("context feature push to drafter %s failed: %s", address, exc)
            return None

    async def _push_over_link(
        self, client: RpcClient, address: str, message: dict[str, Any], link: Any
    ) -> dict[str, Any] | None:
        """Issue the send, then the metadata; the drafter's reply when it took the rows. Any failure ends the link
        (this and later pushes go as bytes over gRPC). Resending is safe: the drafter appends only after its
        receive succeeded, and an append rewrites rows from its start, so rows it did take are rewritten equal (a
        resend landing after a later push would shorten the context, which the next Propose refuses: failover)."""
        assert self.links is not None
        features: torch.Tensor = message["features"]
        metadata = {k: v for k, v in message.items() if k != "features"}
        try:
            seq, sending = self.links.send(link, features)
            metadata.update(
                link=link.link_id, seq=seq, shape=list(features.shape), dtype=str(features.dtype).removeprefix("torch.")
            )
            # Not one after the other: a send may only return once the drafter receives (NCCL), after the metadata.
            outcomes: tuple[Any, Any] = await asyncio.gather(
                sending, self._appends[address].exchange(metadata), return_exceptions=True
            )
            work, reply = outcomes
            for outcome in (reply, work):
                if isinstance(outcome, BaseException):
                    raise outcome
            await self.links.complete(link, work, features)
        except Exception as exc:
            await self.links.fail(address, link, exc, client)
            return None
        return reply

    async def drain_pushes(self) -> None:
        """Wait for the feature pushes in flight (before closing; tests that read drafter state)."""
        while self._pushes:
            await asyncio.gather(*list(self._pushes))

    async def _reclaim_idle(self) -> None:
        """Release the slots no call has named for ``idle_reclaim_s`` (see :class:`IdleSlots`)."""
        stale = self._idle.idle(await self._thread.run(lambda: self.engine.running))
        if stale:
            log.warning("reclaiming %d KV slots idle for over %.0f s: %s", len(stale), self._idle.idle_s, stale[:8])
            await self._thread.run(self.engine.release_many, stale)

    async def _release(self, request: dict[str, Any]) -> dict[str, Any]:
        self._relayed.drop(request["req_ids"])
        for req_id in request["req_ids"]:
            self._relaying.pop(req_id, None)

        def release() -> None:
            for req_id in request["req_ids"]:
                self.engine.release(req_id)

        await self._thread.run(release)
        return {}

    async def close(self) -> None:
        await self.drain_pushes()
        if self.links is not None:
            await self.links.close(self._drafters)
        for client in self._drafters.values():
            await client.close()
        self._thread.shutdown()



def _feature_rows(results: StepResults, rows: list[int]) -> tuple[torch.Tensor, bool]:
    """The context feature rows of results ``rows`` (ascending), back to back, and whether they are a tensor of
    their own (False: the step's own rows, when ``rows`` are all of them)."""
    features = results.features
    assert features is not None  # callers pack the features of steps that have them
    if len(rows) == len(results):
        return features, False
    index = torch.from_numpy(contract.row_index(results.feature_counts, rows))
    return features.index_select(0, index.to(features.device)), True


def _own_copy(features: torch.Tensor, fresh: bool, *, on_host: bool) -> torch.Tensor:
    """``features`` as a contiguous tensor nobody else writes (``fresh``: it is one already), on the host when
    ``on_host``."""
    if on_host and features.device.type != "cpu":
        return features.cpu()
    return features.contiguous() if fresh else features.clone(memory_format=torch.contiguous_format)
