"""draft_block reading the context in place with the slot attention kernel (block mode) equals the torch
gather path and the cache-free definition, for ragged context lengths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.checkpoint import load_draft_model
from draft_service.model import DSparkDraftModel

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def draft() -> DSparkDraftModel:
    return load_draft_model(FIXTURE / "draft", device=DEVICE)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_kernel_backends_match_torch_path(draft: DSparkDraftModel, backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 1, 23]
    cache = draft.new_context_cache(4, 32)
    slots = [cache.allocate() for _ in lengths]
    features = [torch.randn(n, draft.config.context_feature_size, generator=gen).to(DEVICE) for n in lengths]
    for slot, rows in zip(slots, features, strict=True):
        draft.append_context(cache, [slot], rows, [0, rows.shape[0]])
    anchors = torch.tensor([5, 77, 300])
    positions = torch.tensor(lengths)
    draft.attention_backend = "torch"
    want = draft.draft_block(anchors, positions, slots, cache)
    draft.attention_backend = backend
    try:
        got = draft.draft_block(anchors, positions, slots, cache)
    finally:
        draft.attention_backend = None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i, rows in enumerate(features):
        torch.testing.assert_close(got[i], draft.draft_block_uncached(rows, int(anchors[i])), atol=1e-5, rtol=1e-5)


def test_backbone_slots_refuses_the_torch_backend(draft: DSparkDraftModel) -> None:
    """Asked for explicitly, or as the model's backend (the default on CPU, but not on CUDA: set it), the
    gather-based 'torch' backend is refused before anything is read."""
    cache = draft.new_context_cache(2, 8)
    x, cos, sin = draft._block_inputs(torch.tensor([5]), torch.tensor([0]))
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="kernel attention backend"):
        draft.backbone_slots(x, cos, sin, cache, slots, slots, backend="torch")
    draft.attention_backend = "torch"
    try:
        with pytest.raises(ValueError, match="kernel attention backend"):
            draft.backbone_slots(x, cos, sin, cache, slots, slots)
    finally:
        draft.attention_backend = None
    with pytest.raises(ValueError, match="unknown attention backend"):
        draft.attention_backend = "sdpa"
