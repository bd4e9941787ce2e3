"""The drafter's gRPC service: a thin adapter from msgpack messages to :class:`DraftEngine` calls.

Per-round messages are batched and flat (one tensor per field with a count per request), because a map per
request costs milliseconds of Python work at a few hundred requests (docs/benchmarks/wire.md). Context features
arrive directly from the verifier (``AppendContext``), not through the scheduler: raw [n, m*H], or already projected
[n, H] by a verifier holding this drafter's projection, in which case the message names the projection's
fingerprint and rows projected by any other weights are refused (``INVALID_ARGUMENT``).
"""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine_rpc import COUNTS, DEFAULT_WEDGE_TIMEOUT_S, REQ_IDS, TOKENS, EngineThread, split_rows
from cluster.messages import AnyValue, Int, List, Message, Opt, Str, Tensor
from cluster.rpc import HealthStatus, Service
from cluster.sampling import SamplingParams
from draft_service.engine import ContextItem, DraftEngine, DraftItem
from draft_service.projection import model_fingerprint

SERVICE = "dspark.Drafter"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

INFO = Message("DrafterInfo", {})
ADD = Message("AddRequests", {"req_ids": REQ_IDS, "params": List(AnyValue(), max_len=4096)})
APPEND = Message(
    "AppendContext",
    {
        "req_ids": REQ_IDS,
        "starts": COUNTS,
        "counts": COUNTS,
        "features": Tensor(FLOAT_DTYPES, rank=2),
        # Absent: raw features. Else the fingerprint of the context projection the sender applied.
        "projection": Opt(Str(min_len=1, max_len=64)),
    },
)
PROPOSE = Message("Propose", {"req_ids": REQ_IDS, "anchors": TOKENS, "positions": List(Int(min=0), max_len=4096)})
RELEASE = Message("Release", {"req_ids": REQ_IDS})


class DrafterService:
    """Owns a DraftEngine and exposes it as ``dspark.Drafter``."""

    def __init__(self, engine: DraftEngine, wedge_timeout_s: float = DEFAULT_WEDGE_TIMEOUT_S) -> None:
        self.engine = engine
        self.projection = model_fingerprint(engine.model)
        self._thread = EngineThread("drafter", wedge_timeout_s)

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
        }

    def health(self) -> HealthStatus:
        """NOT_SERVING when the engine thread is stuck inside one call (a wedged engine)."""
        busy = self._thread.busy_s
        return HealthStatus(
            busy <= self._thread.wedge_timeout_s, {"free_slots": self.engine.num_free_slots, "busy_s": busy}
        )

    def service(self) -> Service:
        return Service(
            SERVICE,
            {
                "Info": (self._info, INFO),
                "AddRequests": (self._add, ADD),
                "AppendContext": (self._append, APPEND),
                "Propose": (self._propose, PROPOSE),
                "Release": (self._release, RELEASE),
            },
        )

    async def _info(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.info()

    async def _add(self, request: dict[str, Any]) -> dict[str, Any]:
        if len(request["params"]) != len(request["req_ids"]):
            raise ValueError("AddRequests: one params map per request id is required")
        params = [SamplingParams.from_dict(p) if isinstance(p, dict) else _bad_params(p) for p in request["params"]]

        def add() -> None:
            added = []
            try:
                for req_id, p in zip(request["req_ids"], params, strict=True):
                    if self.engine.has(req_id):  # a replayed AddRequests is harmless
                        continue
                    self.engine.add_request(req_id, p)
                    added.append(req_id)
            except Exception:
                for req_id in added:
                    self.engine.release(req_id)
                raise

        await self._thread.run(add)
        return {}

    async def _append(self, request: dict[str, Any]) -> dict[str, Any]:
        features: torch.Tensor = request["features"]
        ranges = split_rows(request["counts"], int(features.shape[0]), "AppendContext")
        if len(request["starts"]) != len(request["req_ids"]):
            raise ValueError("AppendContext: one start per request id is required")
        projection = request["projection"]
        if projection is not None and projection != self.projection:
            raise ValueError(
                f"AppendContext: features projected by context projection {projection}, but this drafter's is "
                f"{self.projection}: the verifier loaded other drafter weights (or another dtype) than this drafter"
            )
        items = [
            ContextItem(req_id, start, features[a:b])
            for req_id, start, (a, b) in zip(request["req_ids"], request["starts"], ranges, strict=True)
        ]
        await self._thread.run(self.engine.append_context, items, projection is not None)
        return {}

    async def _propose(self, request: dict[str, Any]) -> dict[str, Any]:
        n = len(request["req_ids"])
        if not len(request["anchors"]) == len(request["positions"]) == n:
            raise ValueError("Propose: req_ids, anchors and positions must have the same length")
        items = [DraftItem(r, a, p) for r, a, p in zip(request["req_ids"], request["anchors"], request["positions"],
                                                          strict=True)]
        proposal = await self._thread.run(self.engine.propose, items)
        return {
            "tokens": proposal.tokens.cpu(),
            "confidences": None if proposal.confidences is None else torch.from_numpy(proposal.confidences),
            "confidence_logits": (
                None if proposal.confidence_logits is None else torch.from_numpy(proposal.confidence_logits)
            ),
            "topk_ids": proposal.topk_ids.to(torch.int32).cpu(),
            "topk_probs": proposal.topk_probs.to(torch.float32).cpu(),
        }

    async def _release(self, request: dict[str, Any]) -> dict[str, Any]:
        def release() -> None:
            for req_id in request["req_ids"]:
                self.engine.release(req_id)

        await self._thread.run(release)
        return {}

    def close(self) -> None:
        self._thread.shutdown()


def _bad_params(value: object) -> SamplingParams:
    raise ValueError(f"params: expected a map, got {type(value).__name__}")
