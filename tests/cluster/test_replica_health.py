"""Health checks detect a wedged engine: the gRPC event loop still answers, so the engine thread's busy time must
be what the check looks at (plain servers on loopback; the Serve ``check_health`` of the replicas calls exactly
this endpoint). Calls into the wedged engine end at their deadline instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from model_factory import PairSpec, write_pair

from cluster.backend import BackendUnavailableError, LocalBackend
from cluster.rpc import NOT_SERVING, SERVING, ServerThread, SyncRpcClient
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.failover import check_round_loops
from scheduler.policy import make_policy
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

WEDGE_S = 0.5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("health"), PairSpec(vocab=64, block_size=3, seed=3))


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def _wedge(obj: Any, method: str, returns: Any = None) -> threading.Event:
    """Replace ``obj.method`` by one that blocks its thread until the returned event is set."""
    release = threading.Event()

    def stuck(*_args: Any, **_kwargs: Any) -> Any:
        release.wait(60)
        return returns

    setattr(obj, method, stuck)
    return release


def _services(pair: tuple[Path, Path]) -> list[tuple[str, Any, str, dict[str, Any]]]:
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    drafter = DrafterService(DraftEngine(model, 2, 64), wedge_timeout_s=WEDGE_S)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    verifier = VerifierService(VerifyEngine(target, 2, 64), wedge_timeout_s=WEDGE_S)
    empty_step = {
        "prefill_req_ids": [], "prefill_params": [], "prefill_counts": [], "prefill_tokens": _ids([]),
        "prefill_anchors": [], "verify_req_ids": [], "verify_anchors": [], "verify_counts": [],
        "verify_tokens": _ids([]),
    }
    return [
        ("dspark.Drafter", drafter, "propose", {"method": "Propose", "request": {"req_ids": ["a"], "anchors": [1],
                                                                                 "positions": [0]}}),
        ("dspark.Verifier", verifier, "step", {"method": "Step", "request": empty_step}),
    ]


def _ids(values: list[int]) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.int64)


def test_a_wedged_engine_thread_fails_the_health_check_and_calls_hit_their_deadline(pair: tuple[Path, Path]) -> None:
    from cluster.app import _OwnHealth

    for service_name, service, engine_method, call in _services(pair):
        with ServerThread([service.service()], health=service.health) as server:
            client = SyncRpcClient(server.address, timeout_s=10)
            assert client.health()["status"] == SERVING
            own_health = _OwnHealth(server, None)
            own_health.check()  # the Serve check passes on a healthy replica
            release = _wedge(service.engine, engine_method)
            with pytest.raises(grpc.RpcError) as error:
                client.call(service_name, call["method"], call["request"], timeout_s=1.0)
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The event loop still answers; the engine thread's busy time gives the wedge away.
            _wait(lambda c=client: c.health()["status"] == NOT_SERVING, 30, f"{service_name} to report the wedge")
            assert client.health()["payload"]["busy_s"] > WEDGE_S
            with pytest.raises(RuntimeError, match="NOT_SERVING"):
                own_health.check()
            release.set()
            _wait(lambda c=client: c.health()["status"] == SERVING, 30, f"{service_name} to recover")
            client.close()
            own_health.close()


def test_a_wedged_round_loop_fails_the_scheduler_health_check(pair: tuple[Path, Path]) -> None:
    from scheduler.hub import SchedulerHub, _Group

    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    engine = SpeculativeEngine(
        VerifyEngine(target, 2, 64), DraftEngine(model, 2, 64),
        make_policy("dspark", SPSTable([1, 8], [1.0, 1.0]), model.block_size),
    )
    backend = LocalBackend(engine, "m", wedge_timeout_s=WEDGE_S)
    hub = SchedulerHub(model_name="m", policy="dspark", decode=None)
    hub._groups["v"] = _Group("unused", backend, None)  # type: ignore[arg-type]
    check_round_loops(hub)
    release = _wedge(engine, "step", returns=[])

    async def submit() -> None:
        stream = backend.generate("r", [1, 2], SamplingParams(temperature=0.0, max_tokens=4))
        task = asyncio.ensure_future(anext(stream))
        await asyncio.to_thread(
            _wait, lambda: backend._step_started is not None, 30, "the loop to enter the wedged round"
        )
        with pytest.raises(BackendUnavailableError, match="inside one round"):
            await asyncio.to_thread(_wait_raises, lambda: check_round_loops(hub))
        release.set()
        task.cancel()

    try:
        asyncio.run(submit())
    finally:
        release.set()
        backend.close()


def _wait_raises(check: Callable[[], None], timeout_s: float = 30.0) -> None:
    """Call ``check`` until it raises (re-raised), or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check()
        time.sleep(0.02)
    raise AssertionError("the check never failed")
