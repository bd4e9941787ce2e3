"""The target with the slot attention kernel (Triton on CUDA or through TRITON_INTERPRET=1 on CPU, and its torch
reference) gives the results of the torch attention path: same logits and features for a mixed prefill + verify
batch, same greedy decoding."""

from __future__ import annotations

import pytest
import torch
from model_factory import PairSpec, write_target

from verify_service.target import TargetModel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    spec = PairSpec(vocab=96, hidden=32, target_layers=2, heads=4, kv_heads=2, head_dim=8, seed=4)
    folder = write_target(tmp_path_factory.mktemp("t"), spec)
    return TargetModel.from_pretrained(folder, feature_layer_ids=(-1, 1), device=DEVICE)


def _mixed_batch_outputs(target: TargetModel, backend: str):
    target.attention_backend = backend
    try:
        cache = target.new_kv_cache(3, 64)
        slots = [cache.allocate() for _ in range(3)]
        first = target.prepare(cache, [(slots[0], list(range(20))), (slots[1], [5, 6, 7])])
        target.forward(cache, first)
        # A verify chunk, a decode step and a fresh prefill longer than one kernel tile in one pass.
        batch = target.prepare(cache, [(slots[0], [1, 2, 3, 4]), (slots[1], [9]), (slots[2], list(range(40)))])
        return target.forward(cache, batch)
    finally:
        target.attention_backend = None


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_kernel_backends_match_torch(target: TargetModel, backend: str) -> None:
    want = _mixed_batch_outputs(target, "torch")
    got = _mixed_batch_outputs(target, backend)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.features, want.features, atol=1e-5, rtol=1e-5)


def test_greedy_decoding_is_the_same_with_the_triton_kernel(target: TargetModel) -> None:
    prompts = [[3, 1, 4, 1, 5], list(range(10, 50))]
    want = target.generate(prompts, 6)
    target.attention_backend = "triton"
    try:
        assert target.generate(prompts, 6) == want
    finally:
        target.attention_backend = None


def test_default_backend_and_bad_name(target: TargetModel) -> None:
    assert target.attention_backend == ("triton" if DEVICE == "cuda" else "torch")
    with pytest.raises(ValueError, match="unknown attention backend"):
        target.attention_backend = "flash"
