"""A :class:`GenerateBackend` that streams from the scheduler over gRPC (what the HTTP ingress replicas use)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from cluster.backend import BackendUnavailableError, GenerateDelta
from cluster.rpc import RpcClient
from cluster.sampling import SamplingParams
from scheduler.hub import SERVICE, snapshot_from_dict
from scheduler.metrics import MetricsSnapshot


class RemoteBackend:
    """Each request is one server stream of deltas; the first message or an INVALID_ARGUMENT arrives at once."""

    def __init__(
        self,
        address: str,
        *,
        model_name: str,
        max_context: int,
        token: str | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        self.address = address
        self.model_name = model_name
        self.max_context = max_context
        self._token = token
        self._timeout_s = timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, RpcClient] = {}

    def _client(self) -> RpcClient:
        # grpc.aio channels belong to the event loop that created them.
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = RpcClient(self.address, token=self._token, timeout_s=self._timeout_s)
        return client

    async def generate(
        self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerateDelta]:
        request = {"req_id": req_id, "prompt_ids": [int(t) for t in prompt_ids], "params": params.to_dict()}
        try:
            async for message in self._client().stream(SERVICE, "Generate", request):
                yield GenerateDelta(
                    token_ids=tuple(message["token_ids"]),
                    text=message["text"],
                    finished=message["finished"],
                    finish_reason=message["finish_reason"],
                    num_prompt_tokens=message["num_prompt_tokens"],
                    num_output_tokens=message["num_output_tokens"],
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                raise BackendUnavailableError(exc.details() or str(exc.code())) from None
            raise

    async def abort(self, req_id: str) -> None:
        await self._client().call(SERVICE, "Abort", {"req_id": req_id}, timeout_s=10.0)

    async def metrics(self) -> MetricsSnapshot:
        return snapshot_from_dict(await self._client().call(SERVICE, "Metrics", {}, timeout_s=10.0))

    async def health(self) -> None:
        try:
            info = await self._client().call(SERVICE, "Info", {}, timeout_s=5.0)
        except grpc.aio.AioRpcError as exc:
            raise BackendUnavailableError(f"scheduler unreachable: {exc.code()}") from None
        if not info["verifiers"]:
            raise BackendUnavailableError("no verifier replica is registered yet")
