"""The drafter's fused layer path (draft_service/fused.py: the fused layer kernels, Triton through the interpreter
on CPU) gives the module path's context cache, block hidden states and drafts (fp32), for ragged contexts,
eagerly and through the bucketed graph layout; with its weight GEMMs and LM head on cuBLAS and on the skinny
Triton GEMMs (kernels/skinny_gemm_triton.py: passes of at most FASTER_ROWS block rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from draft_service.checkpoint import load_draft_model
from draft_service.context_cache import DraftContextCache
from draft_service.engine import ContextItem, DraftEngine, DraftItem
from draft_service.model import DSparkDraftModel
from kernels.sampling import SamplingParams

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if DEVICE == "cuda" else "reference"
TOL = {"atol": 1e-4, "rtol": 1e-4} if DEVICE == "cuda" else {"atol": 2e-5, "rtol": 2e-5}
LENGTHS = [9, 1, 23]


def _load(fused: bool, skinny: bool = False) -> DSparkDraftModel:
    model = load_draft_model(FIXTURE / "draft", device=DEVICE)
    model.attention_backend = BACKEND
    model.fused = fused
    model.skinny_gemm = skinny
    return model


@pytest.fixture(scope="module")
def drafters() -> tuple[DSparkDraftModel, DSparkDraftModel]:
    """The module path and the fused one with cuBLAS projections (the skinny GEMMs are tested below)."""
    return _load(False), _load(True)


@pytest.fixture(scope="module")
def skinny_drafter() -> DSparkDraftModel:
    model = load_draft_model(FIXTURE / "draft", device=DEVICE)
    assert model.skinny_gemm  # on by default (the fused path's passes of <= FASTER_ROWS rows, tuned_for GPUs)
    model.attention_backend = BACKEND
    model.fused = True
    return model


def _features(model: DSparkDraftModel) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, model.config.context_feature_size, generator=gen).to(DEVICE) for n in LENGTHS]


def _context_and_blocks(model: DSparkDraftModel) -> tuple[list[torch.Tensor], DraftContextCache, list[int]]:
    """A ragged append of all three requests in one call, then a second append for the first request; the blocks
    of the three requests in one pass (21 rows), of the first two (14 rows) and of the second alone (7 rows)."""
    cache = model.new_context_cache(4, 40)
    slots = [cache.allocate() for _ in LENGTHS]
    features = _features(model)
    model.append_context(cache, slots, torch.cat(features), [0, 9, 10, 33])
    model.append_context(cache, [slots[0]], features[0][:4], [0, 4])
    anchors, positions = torch.tensor([5, 77, 300]), torch.tensor([13, 1, 23])
    hidden = [model.draft_block(anchors[r], positions[r], [slots[i] for i in range(3)[r]], cache)
              for r in (slice(None), slice(0, 2), slice(1, 2))]  # fmt: skip
    return hidden, cache, slots


def _assert_same_context(a: tuple[DraftContextCache, list[int]], b: tuple[DraftContextCache, list[int]]) -> None:
    (cache_a, slots_a), (cache_b, slots_b) = a, b
    for slot_a, slot_b, n in zip(slots_a, slots_b, [13, 1, 23], strict=True):
        torch.testing.assert_close(cache_b.k[:, slot_b, :n], cache_a.k[:, slot_a, :n], **TOL)
        torch.testing.assert_close(cache_b.v[:, slot_b, :n], cache_a.v[:, slot_a, :n], **TOL)


def test_fused_context_and_block_equal_the_module_path(drafters: tuple[DSparkDraftModel, DSparkDraftModel]) -> None:
    plain, fused = drafters
    assert not plain.use_fused and fused.use_fused
    hidden_a, *context_a = _context_and_blocks(plain)
    hidden_b, *context_b = _context_and_blocks(fused)
    for a, b in zip(hidden_a, hidden_b, strict=True):
        torch.testing.assert_close(b, a, **TOL)
    _assert_same_context(context_a, context_b)
    assert fused.fused_drafter()._skinny_counters is None  # skinny_gemm off: cuBLAS throughout


@pytest.mark.parametrize("split", [1, 2])
def test_skinny_gemms_give_the_module_path(
    drafters: tuple[DSparkDraftModel, DSparkDraftModel],
    skinny_drafter: DSparkDraftModel,
    split: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The skinny GEMMs (the block's QKV, o_proj and down_proj with the residual add in the epilogue, gate/up +
    silu * up) give the module path's block hidden states, with and without splitting K (16-wide K steps: the
    tiny model's K is 64 or 128); the 21-row pass falls back to cuBLAS; the context append stays on cuBLAS; the
    LM head (the drafting paths' ``project_vocab``) gives the module's logits; the arrival counters end zeroed."""
    import kernels.skinny_gemm_triton as skinny_module

    config = skinny_module.SkinnyConfig(block_n=16, block_k=16, split=split)
    monkeypatch.setattr(skinny_module, "default_config", lambda *args: config)
    plain = drafters[0]
    hidden_a, *context_a = _context_and_blocks(plain)
    hidden_b, *context_b = _context_and_blocks(skinny_drafter)
    counters = skinny_drafter.fused_drafter()._skinny_counters
    assert counters is not None and int(counters.abs().sum()) == 0
    for a, b in zip(hidden_a, hidden_b, strict=True):
        torch.testing.assert_close(b, a, **TOL)
    _assert_same_context(context_a, context_b)
    block = hidden_a[1]  # 14 rows: the skinny LM head
    with torch.no_grad():
        torch.testing.assert_close(skinny_drafter.project_vocab(block), plain.lm_head(block), **TOL)
        torch.testing.assert_close(skinny_drafter.base_logits(block, drafting=True), plain.base_logits(block), **TOL)
        skinny_drafter.skinny_lm_head = False  # the LM head on torch's matmul, the layers still skinny
        try:
            assert torch.equal(skinny_drafter.project_vocab(block), skinny_drafter.lm_head(block))
        finally:
            skinny_drafter.skinny_lm_head = True
    assert int(counters.abs().sum()) == 0


def test_fused_path_matches_the_cache_free_definition(drafters: tuple[DSparkDraftModel, DSparkDraftModel]) -> None:
    _, fused = drafters
    cache = fused.new_context_cache(2, 40)
    slot = cache.allocate()
    rows = _features(fused)[2]
    fused.append_context(cache, [slot], rows, [0, rows.shape[0]])
    got = fused.draft_block(torch.tensor([42]), torch.tensor([rows.shape[0]]), [slot], cache)
    torch.testing.assert_close(got[0], fused.draft_block_uncached(rows, 42), **TOL)


def _bucketed_drafts(model: DSparkDraftModel, temperature: float, requests: int) -> list[tuple[np.ndarray, ...]]:
    """Three rounds of the bucketed (CUDA-graph layout) engine for the first ``requests`` of LENGTHS, with the
    staged per-round append inside the step."""
    graphs = "capture" if DEVICE == "cuda" else "static"
    engine = DraftEngine(model, 4, 64, draft_top_k=4, graphs=graphs)
    features = _features(model)[:requests]
    ids = [f"r{i}" for i in range(requests)]
    for i, req_id in enumerate(ids):
        engine.add_request(req_id, SamplingParams(temperature=temperature, seed=11 + i))
    engine.append_context([ContextItem(r, 0, f) for r, f in zip(ids, features, strict=True)])
    rounds = []
    positions = LENGTHS[:requests]
    commits = _features(model)[2]
    for step in range(3):
        proposal = engine.propose([DraftItem(r, 3 + step, p) for r, p in zip(ids, positions, strict=True)])
        rounds.append((proposal.tokens.numpy().copy(), proposal.topk_probs.cpu().numpy().copy()))
        # commit two rows per request (staged, appended inside the next step)
        engine.append_context(
            [ContextItem(r, p, commits[2 * i : 2 * i + 2]) for i, (r, p) in enumerate(zip(ids, positions, strict=True))]
        )
        positions = [p + 2 for p in positions]
    return rounds


def _assert_same_drafts(a: list[tuple[np.ndarray, ...]], b: list[tuple[np.ndarray, ...]]) -> None:
    for (tokens_a, probs_a), (tokens_b, probs_b) in zip(a, b, strict=True):
        np.testing.assert_array_equal(tokens_b, tokens_a)
        np.testing.assert_allclose(probs_b, probs_a, **TOL)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_bucketed_drafts_equal_the_module_path(
    drafters: tuple[DSparkDraftModel, DSparkDraftModel], temperature: float
) -> None:
    """The bucketed engine with the fused layers drafts what the module path drafts."""
    plain, fused = drafters
    _assert_same_drafts(_bucketed_drafts(plain, temperature, 3), _bucketed_drafts(fused, temperature, 3))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_skinny_bucketed_drafts_equal_the_module_path(
    drafters: tuple[DSparkDraftModel, DSparkDraftModel], skinny_drafter: DSparkDraftModel, temperature: float
) -> None:
    """The same with the skinny GEMMs: two requests, a bucket of 14 block rows (layers and LM head on the
    skinny GEMMs; on a GPU they are captured in the graph, the counters made by the eager warm-up)."""
    plain = drafters[0]
    _assert_same_drafts(_bucketed_drafts(plain, temperature, 2), _bucketed_drafts(skinny_drafter, temperature, 2))
    counters = skinny_drafter.fused_drafter()._skinny_counters
    assert counters is not None and int(counters.abs().sum()) == 0
