"""The served scheduler with ``draft_cost="measured"``: real drafter and verifier gRPC servers, so the estimate
includes the drafter's round trip; greedy output stays the target's while the estimate steers the policy."""

from __future__ import annotations

import pytest
from hub_client import generate_all
from model_factory import PairSpec, write_pair

from cluster.rpc import ServerThread
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.rpc_service import DrafterService
from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub
from scheduler.policy import DSparkScheduled
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.rpc_service import VerifierService
from verify_service.target import TargetModel

SPS = SPSTable([1, 16, 64], [1000, 900, 500]).to_dict()
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # >= 10 rounds: past the warm-up


def test_measured_draft_cost_over_grpc_is_lossless(tmp_path_factory: pytest.TempPathFactory) -> None:
    target_dir, draft_dir = write_pair(tmp_path_factory.mktemp("measured"), PairSpec(vocab=128, block_size=4, seed=5))
    model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=model.config.target_layer_ids)
    drafter = DrafterService(DraftEngine(model, max_requests=8, max_seq_len=128))
    verifier = VerifierService(VerifyEngine(target, max_requests=8, max_seq_len=128))
    servers = [ServerThread([drafter.service()]), ServerThread([verifier.service()])]
    hub = SchedulerHub(model_name="tiny", policy="dspark", draft_cost="measured", decode=None)
    try:
        hub.register_drafter("d0", servers[0].address)
        hub.register_verifier("v0", servers[1].address, SPS)
        prompts = [[1 + i, 2 * i + 3, 7, 11 + i] for i in range(6)]
        got = generate_all(hub, prompts, GREEDY)
        expected = target.generate(prompts, max_new_tokens=GREEDY.max_tokens)
        assert got == [e[: GREEDY.max_tokens] for e in expected]
        policy = hub._groups["v0"].backend.engine.policy
        assert isinstance(policy, DSparkScheduled) and policy.gate is not None
        assert policy.draft_cost is not None  # learned from the rounds over gRPC
        estimator = policy._cost.estimator
        assert estimator is not None and estimator.verify_rounds >= estimator.min_rounds  # verify times arrive
        assert estimator.verify_scale > 0
    finally:
        hub.close()
        for server in servers:
            server.stop()
