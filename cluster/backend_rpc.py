"""A :class:`~cluster.backend.GenerateBackend` served over gRPC: the request-level methods every stream source
offers (``Generate``, ``Abort``, ``Metrics``, ``Info``, ``ModelInfo``).

Two servers speak it: the scheduler (``dspark.Scheduler``, over the hub's round loops) and, in the
``colocated`` placement, each engine replica (``dspark.Engine``, over its in-process round pipeline), so the
ingress's :class:`~cluster.remote_backend.RemoteBackend` streams from either with the same code.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

from cluster import contract
from cluster.backend import GenerateBackend, Resume
from cluster.rpc import RetryLaterError
from kernels.sampling import SamplingParams
from scheduler.metrics import snapshot_to_dict
from scheduler.service_levels import SLOUnattainableError


def backend_methods(
    backend: GenerateBackend, info: Callable[[], dict[str, Any]], service_name: str
) -> dict[contract.Method, contract.Handler]:
    """The request-level methods over ``backend``, served as ``service_name`` (:data:`contract.SCHEDULER` or
    :data:`contract.ENGINE`); ``info`` answers ``Info`` (``ready`` and ``reason`` at least, which the ingress's
    health check reads). Add more methods before building the service with :func:`contract.service`.

    A request refused at admission for its TPOT target (:class:`SLOUnattainableError`, a ``ValueError`` in
    process) leaves ``Generate`` as :class:`~cluster.rpc.RetryLaterError` (``RESOURCE_EXHAUSTED`` with its
    retry-after), not as INVALID_ARGUMENT, so the ingress answers it 429 + ``Retry-After``
    (:class:`~cluster.remote_backend.RemoteBackend` turns it back)."""

    async def generate(request: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        if not isinstance(request["params"], dict):
            raise ValueError("params: expected a map")
        params = SamplingParams.from_dict(request["params"])
        resume = Resume(request["emitted"], request["emitted_chars"]) if request["emitted"] else None
        try:
            async for delta in backend.generate(request["req_id"], request["prompt_ids"], params, resume):
                yield contract.delta_message(delta)
        except SLOUnattainableError as error:  # raised at admission, before any delta
            raise RetryLaterError(str(error), error.retry_after_s) from None

    async def abort(request: dict[str, Any]) -> dict[str, Any]:
        await backend.abort(request["req_id"])
        return {}

    async def metrics(request: dict[str, Any]) -> dict[str, Any]:
        return snapshot_to_dict(await backend.metrics())

    async def answer_info(request: dict[str, Any]) -> dict[str, Any]:
        return info()

    async def model_info(request: dict[str, Any]) -> dict[str, Any]:
        return await backend.model_info()

    methods = contract.BACKEND_METHODS[service_name]
    return {
        methods.generate: generate,
        methods.abort: abort,
        methods.metrics: metrics,
        methods.info: answer_info,
        methods.model_info: model_info,
    }
