"""The drafter's fused layer path (draft_service/fused.py: the fused layer kernels, Triton through the interpreter
on CPU) gives the module path's context cache, block hidden states and drafts (fp32), for ragged contexts,
eagerly and through the bucketed graph layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.sampling import SamplingParams
from draft_service.checkpoint import load_draft_model
from draft_service.engine import ContextItem, DraftEngine, DraftItem
from draft_service.model import DSparkDraftModel

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if DEVICE == "cuda" else "reference"
TOL = {"atol": 1e-4, "rtol": 1e-4} if DEVICE == "cuda" else {"atol": 2e-5, "rtol": 2e-5}
LENGTHS = [9, 1, 23]


@pytest.fixture(scope="module")
def drafters() -> tuple[DSparkDraftModel, DSparkDraftModel]:
    plain, fused = (load_draft_model(FIXTURE / "draft", device=DEVICE) for _ in range(2))
    for model, flag in ((plain, False), (fused, True)):
        model.attention_backend = BACKEND
        model.fused = flag
    return plain, fused


def _features(model: DSparkDraftModel) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, model.config.context_feature_size, generator=gen).to(DEVICE) for n in LENGTHS]


def test_fused_context_and_block_equal_the_module_path(drafters: tuple[DSparkDraftModel, DSparkDraftModel]) -> None:
    plain, fused = drafters
    assert not plain.use_fused and fused.use_fused
    hidden, caches = [], []
    for model in drafters:
        cache = model.new_context_cache(4, 40)
        slots = [cache.allocate() for _ in LENGTHS]
        features = _features(model)
        # ragged append of all three requests in one call, then a second append for the first request
        model.append_context(cache, slots, torch.cat(features), [0, 9, 10, 33])
        model.append_context(cache, [slots[0]], features[0][:4], [0, 4])
        positions = torch.tensor([13, 1, 23])
        hidden.append(model.draft_block(torch.tensor([5, 77, 300]), positions, slots, cache))
        caches.append((cache, slots))
    torch.testing.assert_close(hidden[1], hidden[0], **TOL)
    (cache_a, slots_a), (cache_b, _) = caches
    for slot, n in zip(slots_a, [13, 1, 23], strict=True):
        torch.testing.assert_close(cache_b.k[:, slot, :n], cache_a.k[:, slot, :n], **TOL)
        torch.testing.assert_close(cache_b.v[:, slot, :n], cache_a.v[:, slot, :n], **TOL)


def test_fused_path_matches_the_cache_free_definition(drafters: tuple[DSparkDraftModel, DSparkDraftModel]) -> None:
    _, fused = drafters
    cache = fused.new_context_cache(2, 40)
    slot = cache.allocate()
    rows = _features(fused)[2]
    fused.append_context(cache, [slot], rows, [0, rows.shape[0]])
    got = fused.draft_block(torch.tensor([42]), torch.tensor([rows.shape[0]]), [slot], cache)
    torch.testing.assert_close(got[0], fused.draft_block_uncached(rows, 42), **TOL)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_bucketed_drafts_equal_the_module_path(
    drafters: tuple[DSparkDraftModel, DSparkDraftModel], temperature: float
) -> None:
    """The bucketed (CUDA-graph layout) engine with the fused layers drafts what the module path drafts, with
    the staged per-round append inside the step."""
    graphs = "capture" if DEVICE == "cuda" else "static"
    drafts = []
    for model in drafters:
        engine = DraftEngine(model, 4, 64, draft_top_k=4, graphs=graphs)
        features = _features(model)
        ids = [f"r{i}" for i in range(len(LENGTHS))]
        for i, req_id in enumerate(ids):
            engine.add_request(req_id, SamplingParams(temperature=temperature, seed=11 + i))
        engine.append_context([ContextItem(r, 0, f) for r, f in zip(ids, features, strict=True)])
        rounds = []
        positions = list(LENGTHS)
        for step in range(3):
            proposal = engine.propose([DraftItem(r, 3 + step, p) for r, p in zip(ids, positions, strict=True)])
            rounds.append((proposal.tokens.numpy().copy(), proposal.topk_probs.cpu().numpy().copy()))
            # commit two rows per request (staged, appended inside the next step)
            commits = features[2]
            engine.append_context(
                [
                    ContextItem(r, p, commits[2 * i : 2 * i + 2])
                    for i, (r, p) in enumerate(zip(ids, positions, strict=True))
                ]
            )
            positions = [p + 2 for p in positions]
        drafts.append(rounds)
    for (tokens_a, probs_a), (tokens_b, probs_b) in zip(*drafts, strict=True):
        np.testing.assert_array_equal(tokens_b, tokens_a)
        np.testing.assert_allclose(probs_b, probs_a, **TOL)
