"""A :class:`~cluster.backend.GenerateBackend` served over gRPC: the request-level methods every stream source
offers (``Generate``, ``Abort``, ``Metrics``, ``Info``, ``ModelInfo``).

Two servers speak it: the scheduler (``dspark.Scheduler``, over the hub's round loops) and, in the
``colocated`` placement, each engine replica (``dspark.Engine``, over its in-process round pipeline), so the
ingress's :class:`~cluster.remote_backend.RemoteBackend` streams from either with the same code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from cluster.backend import GenerateBackend
from cluster.messages import AnyValue, Int, List, Message, Str
from cluster.rpc import RetryLaterError
from kernels.sampling import SamplingParams
from scheduler.metrics import snapshot_to_dict
from scheduler.service_levels import SLOUnattainableError

SCHEDULER = "dspark.Scheduler"
ENGINE = "dspark.Engine"
GENERATE = Message(
    "Generate",
    {"req_id": Str(min_len=1, max_len=128), "prompt_ids": List(Int(min=0), max_len=1 << 20), "params": AnyValue()},
)
REQUEST_ID = Message("RequestId", {"req_id": Str(min_len=1, max_len=128)})
EMPTY = Message("Empty", {})

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def backend_methods(
    backend: GenerateBackend, info: Callable[[], dict[str, Any]]
) -> dict[str, tuple[Callable[..., Any], Message]]:
    """The request-level methods over ``backend``; ``info`` answers ``Info`` (``ready`` and ``reason`` at
    least, which the ingress's health check reads). Merge more methods in before building the
    :class:`~cluster.rpc.Service`.

    A request refused at admission for its TPOT target (:class:`SLOUnattainableError`, a ``ValueError`` in
    process) leaves ``Generate`` as :class:`~cluster.rpc.RetryLaterError` (``RESOURCE_EXHAUSTED`` with its
    retry-after), not as INVALID_ARGUMENT, so the ingress answers it 429 + ``Retry-After``
    (:class:`~cluster.remote_backend.RemoteBackend` turns it back)."""

    async def generate(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        if not isinstance(request["params"], dict):
            raise ValueError("params: expected a map")
        params = SamplingParams.from_dict(request["params"])
        try:
            async for delta in backend.generate(request["req_id"], request["prompt_ids"], params):
                yield {
                    "token_ids": list(delta.token_ids),
                    "text": delta.text,
                    "finished": delta.finished,
                    "finish_reason": delta.finish_reason,
                    "num_prompt_tokens": delta.num_prompt_tokens,
                    "num_output_tokens": delta.num_output_tokens,
                }
        except SLOUnattainableError as error:  # raised at admission, before any delta
            raise RetryLaterError(str(error), error.retry_after_s) from None

    async def abort(request: dict[str, Any]) -> dict[str, Any]:
        await backend.abort(request["req_id"])
        return {}

    async def metrics(request: dict[str, Any]) -> dict[str, Any]:
        return snapshot_to_dict(await backend.metrics())

    async def info_method(request: dict[str, Any]) -> dict[str, Any]:
        return info()

    async def model_info(request: dict[str, Any]) -> dict[str, Any]:
        return await backend.model_info()

    return {
        "Generate": (generate, GENERATE),
        "Abort": (abort, REQUEST_ID),
        "Metrics": (metrics, EMPTY),
        "Info": (info_method, EMPTY),
        "ModelInfo": (model_info, EMPTY),
    }
