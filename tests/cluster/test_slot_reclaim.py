"""Slot exhaustion by one caller is bounded: KV slots (verifier) and context-cache slots (drafter) that no call has
named for ``idle_reclaim_s`` are reclaimed when a new request needs them, while the slots of requests a round loop
drives are never touched.

Real verifier and drafter services behind real gRPC servers on loopback (an open data plane, as with
``grpc_insecure``: the token is what keeps strangers out by default; this is what bounds a caller that got in)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from model_factory import PairSpec, write_pair

from cluster.rpc import ServerThread, SyncRpcClient
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SLOTS = 4
IDLE_S = 1.0


@pytest.fixture
def verifier(tmp_path: Path) -> Iterator[tuple[VerifierService, str]]:
    target_dir, _ = write_pair(tmp_path, PairSpec(vocab=64, block_size=3, seed=4))
    service = VerifierService(
        VerifyEngine(TargetModel.from_pretrained(target_dir), SLOTS, 64), idle_reclaim_s=IDLE_S
    )
    server = ServerThread([service.service()])
    yield service, server.address
    server.stop()


def _step(prefill: tuple[str, ...] | list[str] = (), verify: dict[str, int] | None = None) -> dict[str, Any]:
    """A Step prefilling ``prefill`` (3-token prompts) and verifying ``verify`` (req id -> anchor, no drafts)."""
    verify = verify or {}
    return {
        "prefill_req_ids": list(prefill), "prefill_params": [{"max_tokens": 8}] * len(prefill),
        "prefill_counts": [3] * len(prefill),
        "prefill_tokens": torch.tensor([1, 2, 3] * len(prefill), dtype=torch.int64),
        "prefill_anchors": [-1] * len(prefill), "verify_req_ids": list(verify),
        "verify_anchors": list(verify.values()), "verify_counts": [0] * len(verify),
        "verify_tokens": torch.zeros(0, dtype=torch.int64), "inline_features": False,
    }


def _anchors(reply: dict[str, Any]) -> dict[str, int]:
    """The next anchor of each request of a Step reply (its last new token)."""
    out, offset = {}, 0
    for req_id, count in zip(reply["req_ids"], reply["token_counts"], strict=True):
        offset += count
        out[req_id] = reply["tokens"][offset - 1]
    return out


def test_slots_a_caller_took_and_left_are_reclaimed_for_a_prefill_that_needs_them(
    verifier: tuple[VerifierService, str],
) -> None:
    service, address = verifier
    with SyncRpcClient(address, timeout_s=60) as client:
        driven = _anchors(client.call("dspark.Verifier", "Step", _step(["driven"])))
        client.call("dspark.Verifier", "Step", _step([f"hostile{i}" for i in range(SLOTS - 1)]))  # ... and leaves
        assert service.engine.num_free_slots == 0
        with pytest.raises(grpc.RpcError) as error:  # not idle long enough yet: refused, nothing reclaimed
            client.call("dspark.Verifier", "Step", _step(["new"], driven))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "free KV slots" in error.value.details()
        deadline = time.monotonic() + 120
        while True:  # the round loop keeps driving its request; the hostile slots age
            driven = _anchors(client.call("dspark.Verifier", "Step", _step((), driven)))
            if time.monotonic() > deadline:
                raise AssertionError("the hostile slots never became reclaimable")
            if service._idle.idle(service.engine.running):
                break
            time.sleep(0.05)
        reply = client.call("dspark.Verifier", "Step", _step(["new"], driven))
        assert set(reply["req_ids"]) == {"new", "driven"}
        assert sorted(service.engine.running) == ["driven", "new"]  # the driven request kept its slot


@pytest.fixture
def drafter(tmp_path: Path) -> Iterator[tuple[DrafterService, str]]:
    target_dir, draft_dir = write_pair(tmp_path, PairSpec(vocab=64, block_size=3, seed=4))
    engine = DraftEngine(load_draft_model(draft_dir, target_dir=target_dir), max_requests=SLOTS, max_seq_len=256)
    service = DrafterService(engine, idle_reclaim_s=IDLE_S)
    server = ServerThread([service.service()])
    yield service, server.address
    server.stop()
    service.close()


def _add(req_ids: list[str]) -> dict[str, Any]:
    return {"req_ids": req_ids, "params": [{"max_tokens": 8}] * len(req_ids)}


def test_context_slots_a_caller_took_and_left_are_reclaimed_for_new_requests(
    drafter: tuple[DrafterService, str],
) -> None:
    service, address = drafter
    width = service.info()["context_feature_size"]
    with SyncRpcClient(address, timeout_s=60) as client:
        client.call("dspark.Drafter", "AddRequests", _add(["driven"]))
        client.call("dspark.Drafter", "AddRequests", _add([f"hostile{i}" for i in range(SLOTS - 1)]))  # ... leaves
        assert service.engine.num_free_slots == 0
        with pytest.raises(grpc.RpcError) as error:  # not idle long enough yet: refused, nothing reclaimed
            client.call("dspark.Drafter", "AddRequests", _add(["new"]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "slots are in use" in error.value.details()
        deadline, rows = time.monotonic() + 120, 0
        while True:  # the verifier keeps pushing the driven request's context rows; the hostile slots age
            client.call("dspark.Drafter", "AppendContext", {
                "req_ids": ["driven"], "starts": [rows], "counts": [1], "features": torch.randn(1, width)})
            rows += 1
            if time.monotonic() > deadline:
                raise AssertionError("the hostile slots never became reclaimable")
            if service._idle.idle(service.engine.running):
                break
            time.sleep(0.05)
        client.call("dspark.Drafter", "AddRequests", _add(["new"]))
        assert sorted(service.engine.running) == ["driven", "new"]  # the driven request kept its slot and rows
        assert service.engine.context_length("driven") == rows
