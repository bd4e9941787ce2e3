"""The wire contract of the data plane: every gRPC service and method, the schema of its request and of its reply,
and the typed build / parse functions both ends of the per-round messages use.

Services (the built-in ``dspark.Health/Check`` of every server is the transport's, :mod:`cluster.rpc`):

- ``dspark.Verifier`` (verifier replicas): ``Info``, ``Step`` (one round: prefills and verifications), ``Release``;
- ``dspark.Drafter`` (drafter replicas): ``Info``, ``AddRequests``, ``AppendContext`` (context features, pushed by
  a verifier), ``Propose`` (a round's drafts), ``Release``, ``OpenLink`` / ``CloseLink`` (the direct feature path);
- ``dspark.Scheduler`` (the scheduler, for the HTTP ingress): ``Generate`` (a server stream of deltas), ``Abort``,
  ``Metrics``, ``Info``, ``ModelInfo``, and ``Route`` / ``Release`` of the colocated placement;
- ``dspark.Engine`` (an engine replica of the colocated placement): the request-level methods of the scheduler.

A server registers its handlers with :func:`service`, which takes each method's request schema from here, so a
request is validated before its handler runs (a bad one is INVALID_ARGUMENT). A client calls through the same
:class:`Method` (:meth:`Method.call`, :meth:`Method.acall`, :meth:`Method.stream`, :meth:`Method.round_stream`),
which validates the reply against the reply schema: a replica that answers something else fails the call with
:class:`~cluster.wire.WireError` instead of a ``KeyError`` somewhere later. The per-round messages are built and
read only by the functions below (``step_request`` / ``parse_step_request``, ``step_reply`` / ``parse_step_reply``,
``propose_request`` / ``parse_propose_request``, ``proposal_reply``, ``append_request``), so both ends agree on
every field by construction.

Messages are msgpack maps with tensors (:mod:`cluster.wire`); nothing crosses the wire with pickle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from cluster.backend import GenerateDelta, Resume
from cluster.messages import AnyValue, Bool, Float, Int, List, Map, Message, Opt, Str, Tensor, Type
from cluster.rpc import Handler, RoundStream, RpcClient, Service, StreamLane, SyncRpcClient
from draft_service.engine import DraftItem, Proposal
from kernels.sampling import SamplingParams
from verify_service.engine import PrefillItem, StepResult, StepResults, VerifyBatch, VerifyItem

VERIFIER = "dspark.Verifier"
DRAFTER = "dspark.Drafter"
SCHEDULER = "dspark.Scheduler"
ENGINE = "dspark.Engine"


@dataclass(frozen=True)
class Method:
    """One method as both ends know it: its service, its name, and the schemas of its request and reply (of each
    streamed message for a server-streaming method)."""

    service: str
    name: str
    request: Message
    reply: Type

    def call(self, client: SyncRpcClient, request: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """A blocking unary call; the reply validated."""
        return client.call(self.service, self.name, request, timeout_s=timeout_s, response_schema=self.reply)

    async def acall(self, client: RpcClient, request: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """An awaited unary call; the reply validated."""
        return await client.call(self.service, self.name, request, timeout_s=timeout_s, response_schema=self.reply)

    def stream(
        self, client: RpcClient, request: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> AsyncIterator[Any]:
        """A server stream; every message validated."""
        return client.stream(self.service, self.name, request, timeout_s=timeout_s, response_schema=self.reply)

    def round_stream(self, client: RpcClient) -> RoundStream:
        """A long-lived stream of this method's stream twin on ``client``'s channel (one message each way)."""
        return client.round_stream(self.service, self.name, response_schema=self.reply)

    def lane_stream(self, lane: StreamLane, target: str, **options: Any) -> RoundStream:
        """A long-lived stream of this method's stream twin at ``target``, driven by ``lane``'s thread."""
        return lane.stream(target, self.service, self.name, response_schema=self.reply, **options)


def service(name: str, handlers: Mapping[Method, Handler]) -> Service:
    """The :class:`~cluster.rpc.Service` ``name`` serving ``handlers`` with their methods' request schemas."""
    wrong = [f"{m.service}/{m.name}" for m in handlers if m.service != name]
    if wrong:
        raise ValueError(f"service {name} cannot serve {wrong}")
    return Service(name, {m.name: (handler, m.request) for m, handler in handlers.items()})


# ------------------------------------------------------------------------------------------- field types
MAX_BATCH = 4096
REQ_ID = Str(min_len=1, max_len=128)
REQ_IDS = List(REQ_ID, max_len=MAX_BATCH)
COUNTS = List(Int(min=0, max=1 << 20), max_len=MAX_BATCH)
TOKENS = List(Int(min=0, max=(1 << 31) - 1), max_len=MAX_BATCH)
INTS = List(Int(), max_len=MAX_BATCH)
INT_DTYPES = ("int64", "int32")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
CONFIDENCE_DTYPES = ("float64", "float32")
MILLISECONDS = Float(min=0.0)
EMPTY = Message("Empty", {})
PARAMS = List(AnyValue(), max_len=MAX_BATCH)  # SamplingParams.to_dict() maps, checked by SamplingParams.from_dict

# ---------------------------------------------------------------------------------------- dspark.Drafter
LINK_ID = Str(min_len=1, max_len=64)
#: A drafter's proposal for R requests, as ``Propose`` replies it (and an ``AppendContext`` that returns drafts).
#: ``distribution_rows``: the rows whose draft distribution travels (the others are greedy; None: every row).
PROPOSAL_FIELDS: dict[str, Type] = {
    "tokens": Tensor(INT_DTYPES, rank=2),
    "confidences": Opt(Tensor(CONFIDENCE_DTYPES, rank=2)),
    "confidence_logits": Opt(Tensor(CONFIDENCE_DTYPES, rank=2)),
    "distribution_rows": Opt(List(Int(min=0), max_len=MAX_BATCH)),
    "topk_ids": Tensor(INT_DTYPES, rank=3),
    "topk_probs": Tensor(("float32",), rank=3),
}
PROPOSE_REPLY = Message(
    "ProposeReply",
    {
        **PROPOSAL_FIELDS,
        # The drafter's engine-thread time of the call (0 when the drafts were made ahead) and its wait for
        # context rows still on their way: the caller counts both as drafting, the rest as transfer.
        "engine_ms": MILLISECONDS,
        "wait_ms": MILLISECONDS,
    },
)
#: Drafts made ahead and returned with a feature push: the proposal and what it was drafted for.
DRAFTED = Message(
    "Drafted",
    {**PROPOSAL_FIELDS, "req_ids": REQ_IDS, "anchors": TOKENS, "positions": List(Int(min=0), max_len=MAX_BATCH)},
)
DRAFTER_INFO = Method(
    DRAFTER,
    "Info",
    EMPTY,
    Message(
        "DrafterInfo",
        {
            "block_size": Int(min=1),
            "has_confidence_head": Bool(),
            "vocab_size": Int(min=1),
            "context_feature_size": Int(min=1),
            "hidden_size": Int(min=1),
            "context_projection": Str(min_len=1, max_len=64),
            "target_layer_ids": List(Int(min=-1), max_len=1024),  # -1: the embedding output (DeepSpec)
            "max_requests": Int(min=1),
            "free_slots": Int(min=0),
            "running": List(REQ_ID),  # a restarted scheduler releases what nobody owns any more
            "proposals_ahead": Int(min=0),
            "proposals_returned": Int(min=0),
            "feature_link_port": Opt(Int(min=0, max=65535)),
            "feature_links": Int(min=0),
            "engine_busy_s": Float(min=0.0),
        },
    ),
)
ADD_REQUESTS = Method(DRAFTER, "AddRequests", Message("AddRequests", {"req_ids": REQ_IDS, "params": PARAMS}), EMPTY)
APPEND_CONTEXT = Method(
    DRAFTER,
    "AppendContext",
    Message(
        "AppendContext",
        {
            "req_ids": REQ_IDS,
            "starts": COUNTS,
            "counts": COUNTS,
            # Absent when the rows come over a feature link: then link, seq, shape and dtype describe them.
            "features": Opt(Tensor(FLOAT_DTYPES, rank=2)),
            "link": Opt(LINK_ID),
            "seq": Opt(Int(min=0)),
            "shape": Opt(List(Int(min=0, max=1 << 24), min_len=2, max_len=2)),
            "dtype": Opt(Str(choices=FLOAT_DTYPES)),
            # Absent: raw features. Else the fingerprint of the context projection the sender applied.
            "projection": Opt(Str(min_len=1, max_len=64)),
            # Each request's next anchor (-1: none), drafted from at once at position start + count.
            "draft_anchors": Opt(List(Int(min=-1, max=(1 << 31) - 1), max_len=MAX_BATCH)),
            # True: the reply carries the blocks drafted from draft_anchors (the verifier relays them).
            "return_drafts": Opt(Bool(), default=False),
        },
    ),
    Message("AppendContextReply", {"drafts": Opt(DRAFTED)}),
)
PROPOSE = Method(
    DRAFTER,
    "Propose",
    Message("Propose", {"req_ids": REQ_IDS, "anchors": TOKENS, "positions": List(Int(min=0), max_len=MAX_BATCH)}),
    PROPOSE_REPLY,
)
DRAFTER_RELEASE = Method(DRAFTER, "Release", Message("Release", {"req_ids": REQ_IDS}), EMPTY)
OPEN_LINK = Method(
    DRAFTER,
    "OpenLink",
    Message(
        "OpenLink",
        {"link_id": LINK_ID, "backend": Str(choices=("gloo", "nccl")), "peer_host": Str(min_len=1, max_len=256)},
    ),
    Message("OpenLinkReply", {"store_host": Str(min_len=1, max_len=256), "store_port": Int(min=0, max=65535)}),
)
CLOSE_LINK = Method(DRAFTER, "CloseLink", Message("CloseLink", {"link_id": LINK_ID}), EMPTY)

# --------------------------------------------------------------------------------------- dspark.Verifier
VERIFIER_INFO = Method(
    VERIFIER,
    "Info",
    EMPTY,
    Message(
        "VerifierInfo",
        {
            "vocab_size": Int(min=1),
            "max_seq_len": Int(min=1),
            "max_requests": Int(min=1),
            "free_slots": Int(min=0),
            # 0: the target exposes no feature layers (a verifier for plain decoding, with no drafter to feed).
            "feature_dim": Int(min=0),
            "context_projection": Opt(Str(min_len=1, max_len=64)),
            "feature_dtype": Opt(Str(choices=FLOAT_DTYPES)),
            "eos_token_ids": List(Int(min=0), max_len=64),
            "sps": Opt(Map(AnyValue(), max_len=64)),  # SPSTable.to_dict(), read by SPSTable.from_dict
            "feature_bytes_sent": Int(min=0),
            "feature_bytes_collective": Int(min=0),
            "feature_links": Int(min=0),
            "running": List(REQ_ID),
            "engine_busy_s": Float(min=0.0),
        },
    ),
)
STEP = Method(
    VERIFIER,
    "Step",
    Message(
        "Step",
        {
            "prefill_req_ids": REQ_IDS,
            "prefill_params": PARAMS,
            "prefill_counts": COUNTS,
            "prefill_tokens": Tensor(INT_DTYPES, rank=1),
            "prefill_anchors": List(Int(min=-1), max_len=MAX_BATCH),
            "verify_req_ids": REQ_IDS,
            "verify_anchors": TOKENS,
            # Where the scheduler believes each anchor sits (-1: unchecked): a replayed round is INVALID_ARGUMENT.
            "verify_positions": Opt(List(Int(min=-1, max=1 << 31), max_len=MAX_BATCH)),
            "verify_counts": COUNTS,
            "verify_tokens": Tensor(INT_DTYPES, rank=1),
            "draft_prob_ids": Opt(Tensor(INT_DTYPES, rank=2)),
            "draft_probs": Opt(Tensor(("float32",), rank=2)),
            # Drafter address -> the requests whose context features the verifier pushes to it directly.
            "routes": Opt(Map(List(REQ_ID, max_len=MAX_BATCH), max_len=1024), default={}),
            # False: the caller drives no drafter (plain decoding), so unrouted features are not sent back to it.
            "inline_features": Opt(Bool(), default=True),
            # True: this step's feature pushes ask the drafters to return the next blocks, which the verifier
            # keeps for a relayed step (one whose verify_lengths are set).
            "relay_drafts": Opt(Bool(), default=False),
            # Set: the verifications take their drafts from the blocks the drafters returned to the verifier
            # (relay_drafts of the step before): request i its first verify_lengths[i] drafts (fewer when its
            # block is shorter, none when it is missing); verify_counts are then 0 and verify_tokens empty.
            "verify_lengths": Opt(COUNTS),
            # Set: plain decoding of several tokens in one step (no drafts, no routes): request i decodes
            # verify_steps[i] >= 1 tokens, one target pass each (VerifyEngine.decode).
            "verify_steps": Opt(COUNTS),
        },
    ),
    Message(
        "StepReply",
        {
            "req_ids": REQ_IDS,
            "num_drafts": COUNTS,
            "num_accepted": COUNTS,
            "token_counts": COUNTS,
            "tokens": List(Int(min=0), max_len=1 << 20),
            "feature_starts": COUNTS,
            "inline_req_ids": REQ_IDS,
            "inline_counts": COUNTS,
            "features": Opt(Tensor(FLOAT_DTYPES, rank=2)),
            # The verifier's engine-thread time of the step: the caller's round trip minus this and the wait for
            # the drafts is what the message cost on the way (codec, transport, hand-offs).
            "engine_ms": MILLISECONDS,
            # A relayed step: the confidences of the drafts it verified ([R, gamma], one row per verification,
            # zeros for a missing block; None when the drafter has no confidence head), how many verifications
            # found no block, and how long the step waited for the blocks.
            "relayed_confidences": Opt(Tensor(CONFIDENCE_DTYPES, rank=2)),
            "relay_missing": Opt(Int(min=0), default=0),
            "drafts_ms": Opt(MILLISECONDS, default=0.0),
        },
    ),
)
VERIFIER_RELEASE = Method(VERIFIER, "Release", Message("Release", {"req_ids": REQ_IDS}), EMPTY)

# ----------------------------------------------------------------------- dspark.Scheduler / dspark.Engine
REQUEST_ID = Message("RequestId", {"req_id": REQ_ID})


def _emitted_within_the_prompt(request: dict[str, Any]) -> str | None:
    if request["emitted"] and request["emitted"] >= len(request["prompt_ids"]):
        return "emitted: the output already streamed must leave a prompt before it"
    return None


#: ``emitted`` > 0 makes the request a continuation of one whose stream was cut (its scheduler was lost): the last
#: ``emitted`` ids of ``prompt_ids`` are the output already streamed, ``emitted_chars`` the characters of its text
#: the client received, ``params.max_tokens`` the tokens still to come (:class:`cluster.backend.Resume`).
GENERATE_REQUEST = Message(
    "Generate",
    {
        "req_id": REQ_ID,
        "prompt_ids": List(Int(min=0), max_len=1 << 20),
        "params": AnyValue(),
        "emitted": Opt(Int(min=0), default=0),
        "emitted_chars": Opt(Int(min=0), default=0),
    },
    checks=[_emitted_within_the_prompt],
)
DELTA = Message(
    "Delta",
    {
        "token_ids": List(Int(min=0), max_len=1 << 20),
        "text": Str(),
        "finished": Bool(),
        "finish_reason": Opt(Str(max_len=64)),
        "num_prompt_tokens": Int(min=0),
        "num_output_tokens": Int(min=0),
    },
)
#: ``ready`` and ``reason`` are what the ingress reads; the rest is diagnostics, which differ by server.
BACKEND_INFO = Message("BackendInfo", {"ready": Bool(), "reason": Opt(Str(), default="")}, allow_extra=True)
#: A metrics snapshot (scheduler.metrics.snapshot_to_dict, read back by snapshot_from_dict) or the model card.
ANY_MAP = Map(AnyValue(), max_len=4096)


class BackendMethods(NamedTuple):
    """The request-level methods of a GenerateBackend served over gRPC."""

    generate: Method
    abort: Method
    metrics: Method
    info: Method
    model_info: Method


def _backend_methods(service_name: str) -> BackendMethods:
    return BackendMethods(
        Method(service_name, "Generate", GENERATE_REQUEST, DELTA),
        Method(service_name, "Abort", REQUEST_ID, EMPTY),
        Method(service_name, "Metrics", EMPTY, ANY_MAP),
        Method(service_name, "Info", EMPTY, BACKEND_INFO),
        Method(service_name, "ModelInfo", EMPTY, ANY_MAP),
    )


SCHEDULER_METHODS = _backend_methods(SCHEDULER)
ENGINE_METHODS = _backend_methods(ENGINE)
#: The request-level methods of each server of a GenerateBackend: the scheduler, a colocated engine replica.
BACKEND_METHODS: dict[str, BackendMethods] = {SCHEDULER: SCHEDULER_METHODS, ENGINE: ENGINE_METHODS}
ROUTE = Method(SCHEDULER, "Route", REQUEST_ID, Message("RouteReply", {"address": Opt(Str(min_len=1, max_len=256))}))
SCHEDULER_RELEASE = Method(SCHEDULER, "Release", Message("Release", {"req_id": REQ_ID, "lost": Bool()}), EMPTY)


# ------------------------------------------------------------------------------- build / parse: a round
def step_request(
    prefills: Sequence[PrefillItem],
    verifies: Sequence[VerifyItem],
    routes: Mapping[str, list[str]],
    *,
    inline_features: bool,
    relay_drafts: bool = False,
    steps: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A ``Step`` message: the prefills, the verifications with their draft distributions (one-hot rows for
    greedy requests that left theirs out), the drafter routes of the context features; ``steps``: plain decoding
    of that many tokens per verification (no drafts, no routes). A :class:`VerifyBatch` is read from its arrays,
    with no item per request."""
    verify = _batch_fields(verifies) if isinstance(verifies, VerifyBatch) else _item_fields(verifies)
    return {
        "prefill_req_ids": [p.req_id for p in prefills],
        "prefill_params": [p.params.to_dict() for p in prefills],
        "prefill_counts": [len(p.token_ids) for p in prefills],
        "prefill_tokens": torch.tensor([int(t) for p in prefills for t in p.token_ids], dtype=torch.int64),
        "prefill_anchors": [-1 if p.anchor is None else p.anchor for p in prefills],
        **verify,
        "routes": dict(routes),
        "inline_features": inline_features,
        "relay_drafts": relay_drafts,
        "verify_steps": None if steps is None else [int(n) for n in steps],
    }


def _item_fields(verifies: Sequence[VerifyItem]) -> dict[str, Any]:
    """The verify fields of a ``Step`` from a list of items."""
    prob_ids, probs = _stack_distributions(verifies)
    return {
        "verify_req_ids": [v.req_id for v in verifies],
        "verify_anchors": [int(v.anchor) for v in verifies],
        "verify_positions": [-1 if v.position is None else int(v.position) for v in verifies],
        "verify_counts": [len(v.draft_tokens) for v in verifies],
        "verify_tokens": torch.tensor([int(t) for v in verifies for t in v.draft_tokens], dtype=torch.int64),
        "draft_prob_ids": prob_ids,
        "draft_probs": probs,
    }


def _batch_fields(batch: VerifyBatch) -> dict[str, Any]:
    """The verify fields of a ``Step`` from a batch's arrays: the same message as :func:`_item_fields` makes from
    its items (the sampled requests' distribution rows, one-hot rows for the others when some request has one)."""
    counts = batch.num_drafts
    drafted = np.arange(batch.drafts.shape[1]) < counts[:, None]  # [R, gamma]: the drafts each request verifies
    prob_ids = probs = None
    sampled = [i for i in batch.sampled if counts[i]]
    if sampled:
        assert batch.topk_ids is not None and batch.topk_probs is not None  # VerifyBatch: sampled rows have them
        num, block = batch.drafts.shape
        width = int(batch.topk_ids.shape[-1])
        ids = torch.from_numpy(batch.drafts)[:, :, None].expand(num, block, width).clone()
        p = torch.zeros(num, block, width)
        p[:, :, 0] = 1.0
        rows = torch.tensor(sampled, dtype=torch.int64)
        ids[rows] = batch.topk_ids.index_select(0, rows.to(batch.topk_ids.device)).to(torch.int64).cpu()
        p[rows] = batch.topk_probs.index_select(0, rows.to(batch.topk_probs.device)).to(torch.float32).cpu()
        mask = torch.from_numpy(drafted)
        prob_ids, probs = ids[mask], p[mask]
    return {
        "verify_req_ids": list(batch.req_ids),
        "verify_anchors": batch.anchors.tolist(),
        "verify_positions": batch.positions.tolist(),
        "verify_counts": counts.tolist(),
        "verify_tokens": torch.from_numpy(batch.drafts[drafted]),
        "draft_prob_ids": prob_ids,
        "draft_probs": probs,
    }


def relayed_step_request(
    prefills: Sequence[PrefillItem],
    req_ids: Sequence[str],
    anchors: Sequence[int],
    positions: Sequence[int],
    lengths: Sequence[int],
    routes: Mapping[str, list[str]],
    *,
    inline_features: bool,
) -> dict[str, Any]:
    """A relayed ``Step``: the prefills, and verifications whose drafts are the blocks the drafters returned to
    the verifier (request i verifies ``lengths[i]`` of them at ``anchors[i]`` / ``positions[i]``); its pushes
    relay the next blocks again."""
    message = step_request(prefills, (), routes, inline_features=inline_features, relay_drafts=True)
    message.update(
        verify_req_ids=list(req_ids),
        verify_anchors=[int(a) for a in anchors],
        verify_positions=[int(p) for p in positions],
        verify_counts=[0] * len(req_ids),
        verify_lengths=[int(n) for n in lengths],
    )
    return message


def _stack_distributions(verifies: Sequence[VerifyItem]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Flat [N, K] draft distribution rows for every draft token (one-hot rows for greedy requests)."""
    with_dist = [v for v in verifies if v.draft_probs is not None and len(v.draft_tokens)]
    if not with_dist:
        return None, None
    width = max(int(v.draft_probs.shape[1]) for v in with_dist)  # type: ignore[union-attr]
    id_rows, prob_rows = [], []
    for v in verifies:
        n = len(v.draft_tokens)
        if not n:
            continue
        if v.draft_probs is None or v.draft_prob_ids is None:
            ids = torch.tensor([int(t) for t in v.draft_tokens], dtype=torch.int64)[:, None].expand(n, width)
            p = torch.zeros(n, width)
            p[:, 0] = 1.0
        else:
            ids, p = v.draft_prob_ids.to(torch.int64).cpu(), v.draft_probs.to(torch.float32).cpu()
            if ids.shape[1] < width:
                pad = width - ids.shape[1]
                ids = torch.cat([ids, ids[:, :1].expand(n, pad)], dim=1)
                p = torch.cat([p, torch.zeros(n, pad)], dim=1)
        id_rows.append(ids)
        prob_rows.append(p)
    return torch.cat(id_rows), torch.cat(prob_rows)


def split_rows(counts: list[int], total: int, what: str) -> list[tuple[int, int]]:
    """(start, end) row ranges of a flat batch from per-request counts; raises ValueError unless they add up to
    ``total`` (a message whose counts and rows disagree is refused, never guessed)."""
    if sum(counts) != total:
        raise ValueError(f"{what}: counts add up to {sum(counts)} but {total} rows were sent")
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def row_index(counts: Sequence[int], picked: Sequence[int]) -> np.ndarray:
    """The rows of requests ``picked`` (ascending) in a flat batch of ``counts[i]`` rows per request, back to back
    (int64): what ``index_select`` takes to gather their rows without a view per request."""
    sizes = np.asarray(counts, dtype=np.int64)
    taken = sizes[np.asarray(picked, dtype=np.int64)]
    firsts = (np.cumsum(sizes) - sizes)[np.asarray(picked, dtype=np.int64)]
    return np.repeat(firsts - (np.cumsum(taken) - taken), taken) + np.arange(int(taken.sum()), dtype=np.int64)


def parse_step_request(request: dict[str, Any]) -> tuple[list[PrefillItem], Sequence[VerifyItem]]:
    """The prefills and verifications of a validated ``Step`` (a :class:`VerifyBatch` when every verification
    names its position, as a round driver's do; else a list); ValueError names a field that disagrees with
    another (counts against rows, one entry per request)."""
    n_pre = len(request["prefill_req_ids"])
    if not len(request["prefill_params"]) == len(request["prefill_counts"]) == len(request["prefill_anchors"]) == n_pre:
        raise ValueError("Step: prefill fields must all have one entry per prefill request")
    tokens = request["prefill_tokens"].tolist()
    prefills = []
    for req_id, params, anchor, (a, b) in zip(
        request["prefill_req_ids"],
        request["prefill_params"],
        request["prefill_anchors"],
        split_rows(request["prefill_counts"], len(tokens), "Step prefill"),
        strict=True,
    ):
        if not isinstance(params, dict):
            raise ValueError("Step: prefill_params entries must be maps")
        anchor_or_none = None if anchor < 0 else anchor
        prefills.append(PrefillItem(req_id, tokens[a:b], SamplingParams.from_dict(params), anchor_or_none))
    n_ver = len(request["verify_req_ids"])
    if not len(request["verify_anchors"]) == len(request["verify_counts"]) == n_ver:
        raise ValueError("Step: verify fields must all have one entry per verify request")
    positions = request["verify_positions"]
    if positions is None:
        positions = [-1] * n_ver
    if len(positions) != n_ver:
        raise ValueError("Step: verify_positions needs one entry per verify request")
    lengths = request["verify_lengths"]
    if lengths is not None and (len(lengths) != n_ver or any(request["verify_counts"]) or -1 in positions):
        raise ValueError("Step: a relayed step needs one verify length and position per request and no draft tokens")
    steps = request["verify_steps"]
    if steps is not None and (
        len(steps) != n_ver or min(steps, default=1) < 1 or any(request["verify_counts"]) or request["routes"]
        or lengths is not None
    ):
        raise ValueError("Step: a decoding step needs one step count >= 1 per request, no drafts and no routes")
    counts, flat = request["verify_counts"], request["verify_tokens"]
    if sum(counts) != flat.numel():
        raise ValueError(f"Step verify: counts add up to {sum(counts)} but {flat.numel()} rows were sent")
    prob_ids, probs = request["draft_prob_ids"], request["draft_probs"]
    if (prob_ids is None) != (probs is None):
        raise ValueError("Step: draft_prob_ids and draft_probs come together")
    if prob_ids is not None and (prob_ids.shape != probs.shape or prob_ids.shape[0] != flat.numel()):
        raise ValueError("Step: the draft distribution needs one [K] row per draft token in both tensors")
    if -1 not in positions:
        return prefills, _verify_batch(request, positions)
    drafts = flat.tolist()
    ranges = split_rows(counts, len(drafts), "Step verify")
    verifies = []
    for req_id, anchor, position, (a, b) in zip(
        request["verify_req_ids"], request["verify_anchors"], positions, ranges, strict=True
    ):
        dist_ids = None if prob_ids is None or a == b else prob_ids[a:b]
        dist = None if probs is None or a == b else probs[a:b]
        verifies.append(VerifyItem(req_id, anchor, drafts[a:b], dist_ids, dist, None if position < 0 else position))
    return prefills, verifies


def _verify_batch(request: dict[str, Any], positions: list[int]) -> VerifyBatch:
    """The verifications of a checked ``Step`` whose every position is given, in array form: request i verifies
    its ``verify_counts[i]`` drafts with their distribution rows (every request that has drafts, when the message
    carries distributions: one-hot rows stand for a greedy request's)."""
    counts = np.asarray(request["verify_counts"], dtype=np.int64)
    num, block = len(counts), int(counts.max(initial=0))
    drafted = np.arange(block) < counts[:, None]
    drafts = np.zeros((num, block), dtype=np.int64)
    drafts[drafted] = request["verify_tokens"].numpy()
    prob_ids, probs = request["draft_prob_ids"], request["draft_probs"]
    sampled: list[int] = []
    topk_ids = topk_probs = None
    if prob_ids is not None and prob_ids.shape[0]:
        sampled = np.flatnonzero(counts).tolist()
        mask = torch.from_numpy(drafted)
        topk_ids = prob_ids.new_zeros((num, block, int(prob_ids.shape[1])))
        topk_probs = probs.new_zeros((num, block, int(probs.shape[1])))
        topk_ids[mask], topk_probs[mask] = prob_ids, probs
    return VerifyBatch(
        list(request["verify_req_ids"]),
        np.asarray(request["verify_anchors"], dtype=np.int64),
        np.asarray(positions, dtype=np.int64),
        drafts,
        counts,
        sampled,
        topk_ids,
        topk_probs,
    )


class InlineFeatures(NamedTuple):
    """The context features a ``Step`` reply carries back to the caller: ``counts[i]`` rows of ``features`` (on
    the host, back to back) for request ``req_ids[i]``."""

    req_ids: list[str]
    counts: list[int]
    features: torch.Tensor


def step_reply(
    results: StepResults,
    inline: InlineFeatures | None,
    *,
    engine_s: float,
    relayed_confidences: torch.Tensor | None = None,
    relay_missing: int = 0,
    drafts_s: float = 0.0,
) -> dict[str, Any]:
    """A ``Step`` reply: every request's result, from the columns of ``results``; ``inline``: the features that go
    back to the caller, not to a drafter. A relayed step also returns its drafts' confidences, how many
    verifications found no block and the wait for the blocks (``drafts_s``)."""
    reply = {
        "req_ids": results.req_ids,
        "num_drafts": results.num_drafts,
        "num_accepted": results.num_accepted,
        "token_counts": list(map(len, results.tokens)),
        "tokens": list(chain.from_iterable(results.tokens)),
        "feature_starts": results.feature_starts,
        "inline_req_ids": [] if inline is None else inline.req_ids,
        "inline_counts": [] if inline is None else inline.counts,
        "features": None if inline is None else inline.features,
        "engine_ms": 1e3 * engine_s,
    }
    if relayed_confidences is not None or relay_missing or drafts_s:  # a relayed step's (absent: the defaults)
        reply.update(relayed_confidences=relayed_confidences, relay_missing=relay_missing, drafts_ms=1e3 * drafts_s)
    return reply


def parse_step_reply(reply: dict[str, Any]) -> Sequence[StepResult]:
    """The results of a validated ``Step`` reply: columns (:class:`StepResults`, no features) when it carries no
    features, else a list whose inline results hold theirs as views of its tensor."""
    num = len(reply["req_ids"])
    if not num == len(reply["num_drafts"]) == len(reply["num_accepted"]) == len(reply["token_counts"]) == len(
        reply["feature_starts"]
    ):
        raise ValueError("Step reply: every per-request field needs one entry per request")
    tokens, offset = [], 0
    flat = reply["tokens"]
    for n in reply["token_counts"]:
        tokens.append(flat[offset : offset + n])
        offset += n
    if reply["features"] is None:
        return StepResults(
            reply["req_ids"], reply["num_drafts"], reply["num_accepted"], tokens, reply["feature_starts"], None
        )
    inline: dict[str, torch.Tensor] = {}
    start = 0
    for req_id, n in zip(reply["inline_req_ids"], reply["inline_counts"], strict=True):
        inline[req_id] = reply["features"][start : start + n]
        start += n
    return [
        StepResult(req_id, drafts, accepted, request_tokens, feature_start, inline.get(req_id))
        for req_id, drafts, accepted, request_tokens, feature_start in zip(
            reply["req_ids"], reply["num_drafts"], reply["num_accepted"], tokens, reply["feature_starts"],
            strict=True,
        )
    ]


def propose_request(items: Sequence[DraftItem]) -> dict[str, Any]:
    """A ``Propose`` message for ``items`` (one drafter's requests of a round)."""
    return {
        "req_ids": [i.req_id for i in items],
        "anchors": [int(i.anchor) for i in items],
        "positions": [int(i.position) for i in items],
    }


def parse_propose_request(request: dict[str, Any]) -> list[DraftItem]:
    """The draft items of a validated ``Propose``; ValueError when its lists differ in length."""
    if not len(request["anchors"]) == len(request["positions"]) == len(request["req_ids"]):
        raise ValueError("Propose: req_ids, anchors and positions must have the same length")
    return [
        DraftItem(r, a, p) for r, a, p in zip(request["req_ids"], request["anchors"], request["positions"], strict=True)
    ]


def proposal_reply(proposal: Proposal, greedy: set[str] | frozenset[str]) -> dict[str, Any]:
    """``proposal`` as ``Propose`` replies it, on the host (:data:`PROPOSAL_FIELDS`). Requests in ``greedy`` are
    verified without their draft distribution, so only the other rows' distributions travel."""
    topk_ids, topk_probs = proposal.topk_ids, proposal.topk_probs
    rows = None
    if greedy:
        rows = [i for i, req_id in enumerate(proposal.req_ids) if req_id not in greedy]
        index = torch.tensor(rows, dtype=torch.int64, device=topk_ids.device)
        topk_ids, topk_probs = topk_ids.index_select(0, index), topk_probs.index_select(0, index)
    return {
        "tokens": proposal.tokens.cpu(),
        "confidences": None if proposal.confidences is None else torch.from_numpy(proposal.confidences),
        "confidence_logits": (
            None if proposal.confidence_logits is None else torch.from_numpy(proposal.confidence_logits)
        ),
        "distribution_rows": rows,
        "topk_ids": topk_ids.to(torch.int32).cpu(),
        "topk_probs": topk_probs.to(torch.float32).cpu(),
    }


def append_request(
    req_ids: Sequence[str],
    starts: Sequence[int],
    counts: Sequence[int],
    features: torch.Tensor,
    *,
    projection: str | None = None,
    draft_anchors: Sequence[int] | None = None,
    return_drafts: bool = False,
) -> dict[str, Any]:
    """An ``AppendContext`` message: ``counts[i]`` rows of ``features`` for request i from position
    ``starts[i]``; ``projection``: the context projection applied (None: raw rows); ``draft_anchors``: each
    request's next anchor (-1: none), for the drafter to draft from at once (and, ``return_drafts``, to return)."""
    message: dict[str, Any] = {
        "req_ids": list(req_ids),
        "starts": [int(s) for s in starts],
        "counts": [int(n) for n in counts],
        "features": features,
    }
    if projection is not None:
        message["projection"] = projection
    if draft_anchors is not None:
        message["draft_anchors"] = list(draft_anchors)
        message["return_drafts"] = return_drafts
    return message


def generate_request(
    req_id: str, prompt_ids: Sequence[int], params: SamplingParams, resume: Resume | None = None
) -> dict[str, Any]:
    """A ``Generate`` message (a continuation with ``resume``)."""
    request: dict[str, Any] = {"req_id": req_id, "prompt_ids": [int(t) for t in prompt_ids], "params": params.to_dict()}
    if resume is not None:
        request.update(emitted=resume.tokens, emitted_chars=resume.chars)
    return request


def delta_message(delta: GenerateDelta) -> dict[str, Any]:
    """A ``Generate`` stream message."""
    return {
        "token_ids": list(delta.token_ids),
        "text": delta.text,
        "finished": delta.finished,
        "finish_reason": delta.finish_reason,
        "num_prompt_tokens": delta.num_prompt_tokens,
        "num_output_tokens": delta.num_output_tokens,
    }

