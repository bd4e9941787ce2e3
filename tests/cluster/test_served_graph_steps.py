"""The served engines with bucketed steps (``engine.graphs``): the services the Ray deployments and the standalone
servers build from an AppConfig, over real gRPC servers and the scheduler hub. On CPU ``static`` runs the graph
path's bucketed steps eagerly (``capture`` replays the same steps as CUDA graphs on a GPU), so the layout, the
StepResults columns and the per-R SPS profile are the ones a GPU replica uses; greedy output stays the target's."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_client import generate_all
from model_factory import PairSpec, write_pair

from cluster.config import AppConfig
from cluster.loading import build_drafter_service, build_verifier_service, graph_mode, profiled_request_counts
from cluster.rpc import ServerThread
from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub
from scheduler.sps import BY_REQUESTS_FORMAT, FORMAT, load_sps
from verify_service.target import TargetModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _config(target: Path, draft: Path, graphs: str, policy: str = "dspark") -> AppConfig:
    return AppConfig.from_args(
        {
            "models": {"target": str(target), "draft": str(draft), "device": "cpu", "dtype": "float32"},
            "engine": {"max_requests": 6, "max_seq_len": 96, "graphs": graphs, "graph_prefill_rows": 32},
            "scheduler": {"policy": policy, "draft_cost": "measured"},
        }
    )


def test_graph_mode_resolves_auto_by_device_and_capture_needs_cuda(tmp_path: Path) -> None:
    target, draft = write_pair(tmp_path, PairSpec(vocab=64, block_size=4, seed=3))
    assert graph_mode(_config(target, draft, "auto")) == "off"  # CPU
    assert graph_mode(_config(target, draft, "static")) == "static"
    with pytest.raises(ValueError, match="'capture' needs a CUDA device"):
        build_verifier_service(_config(target, draft, "capture"))
    with pytest.raises(ValueError, match="graphs"):
        _config(target, draft, "sometimes")
    assert profiled_request_counts(6) == [1, 2, 4, 6]
    assert profiled_request_counts(8) == [1, 2, 4, 8]
    assert profiled_request_counts(1) == [1]


@pytest.mark.parametrize("policy", ["dspark", "full"])
def test_bucketed_services_over_grpc_decode_the_targets_greedy_output(tmp_path: Path, policy: str) -> None:
    target_dir, draft_dir = write_pair(tmp_path, PairSpec(vocab=128, block_size=4, seed=5))
    config = _config(target_dir, draft_dir, "static", policy)
    verifier = build_verifier_service(config)
    drafter = build_drafter_service(config, "127.0.0.1")
    sps = verifier.sps
    if policy == "full":  # a fixed-length policy prices nothing with SPS: none is profiled
        assert sps is None
    else:
        assert sps["format"] == BY_REQUESTS_FORMAT  # profiled by request count on the bucketed step
        assert [t["requests"] for t in sps["tables"]] == [1, 2, 4, 6]
        assert all(t["sps"]["format"] == FORMAT for t in sps["tables"])
        load_sps(sps)  # what the hub reads from the registration
    servers = [ServerThread([drafter.service()]), ServerThread([verifier.service()])]
    hub = SchedulerHub(model_name="tiny", policy=policy, draft_cost="measured", decode=None)
    try:
        hub.register_drafter("d0", servers[0].address)
        hub.register_verifier("v0", servers[1].address, sps)
        prompts = [[1 + i, 2 * i + 3, 7, 11 + i, 5 * i % 17 + 1][: 3 + i % 3] for i in range(6)]
        got = generate_all(hub, prompts, GREEDY)
        model = TargetModel.from_pretrained(target_dir)
        expected = model.generate(prompts, max_new_tokens=GREEDY.max_tokens)
        assert got == [e[: GREEDY.max_tokens] for e in expected]
        assert verifier.engine.graphs is not None and verifier.engine.graphs.replays > 0  # the bucketed path ran
    finally:
        hub.close()
        for server in servers:
            server.stop()
        drafter.close()
