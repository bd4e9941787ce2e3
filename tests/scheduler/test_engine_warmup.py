"""Start-up warm-up of the verify and draft engines (verify_service.warmup, draft_service.warmup): every step
kind runs once on scratch requests and leaves nothing behind, so the requests served after it decode exactly
as on engines that never warmed up (greedy and seeded sampling), with graphs off and with the bucketed layout."""

from __future__ import annotations

from pathlib import Path

import pytest
from model_factory import PairSpec, write_pair

from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.warmup import warm_up_draft
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel
from verify_service.warmup import warm_up_verify

PROMPTS = [[3, 4, 5, 6], [9, 8]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.9, top_k=20, max_tokens=12,
                                                                          seed=3)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("warmup"), PairSpec(vocab=96, block_size=4, seed=9))


def _engine(pair: tuple[Path, Path], graphs: str, warm: bool) -> tuple[SpeculativeEngine, list[int]]:
    target_dir, draft_dir = pair
    draft_model = load_draft_model(draft_dir, target_dir=target_dir)
    target = TargetModel.from_pretrained(target_dir, feature_layer_ids=draft_model.config.target_layer_ids)
    bucketed = {} if graphs == "off" else {"graphs": graphs, "max_drafts": 4, "draft_top_k": 8}
    verify = VerifyEngine(target, max_requests=3, max_seq_len=96, **bucketed)
    draft = DraftEngine(draft_model, max_requests=3, max_seq_len=96, draft_top_k=8, graphs=graphs)
    steps = []
    if warm:
        steps = [warm_up_verify(verify, 4), warm_up_draft(draft, projected=False)]
        assert verify.num_free_slots == 3 and draft.num_free_slots == 3 and not verify.running
    sps = SPSTable([1, 8, 32], [1000, 950, 700])
    return SpeculativeEngine(verify, draft, make_policy("dspark", sps, 4)), steps


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_warm_up_runs_every_step_kind_and_changes_no_output(pair: tuple[Path, Path], graphs: str) -> None:
    warm, steps = _engine(pair, graphs, warm=True)
    # prefill, greedy verify, verify with a distribution, verify without drafts; static: the eager long prefill
    # and the eager prefill of 3 prompts together (16 need more slots than these 3); the drafter: 2 proposals
    # and a wave of 3
    assert steps == [4 if graphs == "off" else 6, 3]
    cold, _ = _engine(pair, graphs, warm=False)
    got = [r.token_ids for r in warm.generate(PROMPTS, PARAMS)]
    assert got == [r.token_ids for r in cold.generate(PROMPTS, PARAMS)]
    assert got[0] == warm.verify.target.generate([PROMPTS[0]], max_new_tokens=12)[0]
