"""The shared-secret gRPC token on the real services: every method of the drafter, verifier and scheduler (and
their health endpoints, and the stream twin of every unary method) refuses a missing or wrong token with
UNAUTHENTICATED, and a deployment whose parts all carry the token works end to end (scheduler -> verifier,
scheduler -> drafter, verifier -> drafter feature push, ingress -> scheduler)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from model_factory import PairSpec, write_pair

from cluster.remote_backend import RemoteBackend
from cluster.rpc import HEALTH_METHOD, HEALTH_SERVICE, ServerThread, SyncRpcClient, stream_method
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    target_dir, draft_dir = write_pair(tmp_path_factory.mktemp("token"), PairSpec(vocab=64, block_size=3, seed=2))
    model = load_draft_model(draft_dir, target_dir=target_dir)
    drafter = DrafterService(DraftEngine(model, 2, 64))
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    verifier = VerifierService(VerifyEngine(target, 2, 64), token=TOKEN)  # its feature push carries the token
    servers = {
        "dspark.Drafter": ServerThread([drafter.service()], token=TOKEN, health=drafter.health),
        "dspark.Verifier": ServerThread([verifier.service()], token=TOKEN, health=verifier.health),
    }
    hub = SchedulerHub(model_name="m", policy="dspark", decode=None, token=TOKEN, timeout_s=10.0)
    hub.register_drafter("d", servers["dspark.Drafter"].address)
    hub.register_verifier("v", servers["dspark.Verifier"].address, SPSTable([1, 8], [1.0, 1.0]).to_dict())
    servers["dspark.Scheduler"] = ServerThread([hub.service()], token=TOKEN)
    methods = {"dspark.Drafter": drafter.service().methods, "dspark.Verifier": verifier.service().methods,
               "dspark.Scheduler": hub.service().methods}
    yield {"servers": servers, "target": target, "methods": {name: sorted(m) for name, m in methods.items()}}
    hub.close()
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("service", ["dspark.Drafter", "dspark.Verifier", "dspark.Scheduler"])
@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""], ids=["missing", "wrong", "longer", "empty"])
def test_every_method_refuses_a_missing_or_wrong_token(
    deployment: dict[str, Any], service: str, token: str | None
) -> None:
    address = deployment["servers"][service].address
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(address) as channel:
        for name, method in [(service, m) for m in deployment["methods"][service]] + [(HEALTH_SERVICE, HEALTH_METHOD)]:
            path = f"/{name}/{method}"
            call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)
            with pytest.raises(grpc.RpcError) as error:
                result = call(b"\x80", timeout=10, metadata=metadata)  # an empty msgpack map
                if method == "Generate":
                    list(result)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, path
            if method == "Generate" or name == HEALTH_SERVICE:
                continue
            twin = channel.stream_stream(f"/{name}/{stream_method(method)}")  # the per-round stream
            with pytest.raises(grpc.RpcError) as error:
                list(twin(iter([b"\x80"]), timeout=10, metadata=metadata))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, f"{path} stream"


def test_with_the_token_everything_works_end_to_end(deployment: dict[str, Any]) -> None:
    servers = deployment["servers"]
    for service in servers:
        with SyncRpcClient(servers[service].address, token=TOKEN) as client:
            assert client.health()["status"] == "SERVING"
    backend = RemoteBackend(servers["dspark.Scheduler"].address, model_name="m", max_context=63, token=TOKEN)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def run() -> list[int]:
        return [t async for delta in backend.generate("e2e", [1, 2, 3], params) for t in delta.token_ids]

    assert asyncio.run(run()) == deployment["target"].generate([[1, 2, 3]], max_new_tokens=10)[0]
    # The ingress without the token gets nothing.
    anonymous = RemoteBackend(servers["dspark.Scheduler"].address, model_name="m", max_context=63)

    async def refused() -> None:
        async for _ in anonymous.generate("anon", [1, 2, 3], params):
            pass

    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(refused())
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
