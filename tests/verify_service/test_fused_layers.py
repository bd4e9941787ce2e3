"""The fused layer kernels (kernels/fused_layer_triton.py, Triton through the interpreter on CPU) give the
same forward as the HF-module path: logits, context features, K/V written, and greedy generation (fp32).

With CUDA the models live on the GPU: compiled Triton kernels only take device tensors, and that is the path
the product runs (``TargetModel.use_fused`` is on by default only there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_factory import PairSpec, write_pair

from verify_service.target import TargetModel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# cuBLAS may order the fused QKV / gate-up reductions differently from the separate projections
TOL = {"atol": 1e-4, "rtol": 1e-4} if DEVICE == "cuda" else {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> tuple[TargetModel, TargetModel]:
    spec = PairSpec(vocab=128, hidden=32, target_layers=3, block_size=5, target_layer_ids=(-1, 1), seed=7)
    target_dir, _ = write_pair(tmp_path_factory.mktemp("fused"), spec)
    plain = TargetModel.from_pretrained(Path(target_dir), feature_layer_ids=(-1, 0, 2), device=DEVICE)
    fused = TargetModel.from_pretrained(Path(target_dir), feature_layer_ids=(-1, 0, 2), device=DEVICE)
    plain.fused, fused.fused = False, True
    return plain, fused


def test_fused_forward_equals_the_module_path(targets: tuple[TargetModel, TargetModel]) -> None:
    plain, fused = targets
    assert not plain.use_fused and fused.use_fused
    caches = [t.new_kv_cache(3, 40) for t in targets]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 1, 14)]
    outs = []
    for target, cache in zip(targets, caches, strict=True):
        slots = [cache.allocate() for _ in prompts]
        first = target.forward(cache, target.prepare(cache, list(zip(slots, prompts, strict=True))))
        # then a ragged step: a verify chunk, a decode step and a second prefill chunk
        chunks = [(slots[0], [5, 6, 7, 8]), (slots[1], [9]), (slots[2], list(range(20, 31)))]
        second = target.forward(cache, target.prepare(cache, chunks))
        outs.append((first, second, cache, slots))
    (a1, a2, cache_a, slots_a), (b1, b2, cache_b, slots_b) = outs
    for x, y in ((a1, b1), (a2, b2)):
        torch.testing.assert_close(x.logits, y.logits, **TOL)
        torch.testing.assert_close(x.features, y.features, **TOL)
    for sa, sb in zip(slots_a, slots_b, strict=True):
        n = cache_a.length(sa)
        assert cache_b.length(sb) == n
        torch.testing.assert_close(cache_a.k[:, sa, :n], cache_b.k[:, sb, :n], **TOL)
        torch.testing.assert_close(cache_a.v[:, sa, :n], cache_b.v[:, sb, :n], **TOL)


def test_fused_generate_equals_the_module_path(targets: tuple[TargetModel, TargetModel]) -> None:
    plain, fused = targets
    prompts = [[1, 2, 3], [7] * 11, [100, 3]]
    assert fused.generate(prompts, 12) == plain.generate(prompts, 12)
    # the projections are views into the fused weights: the HF modules still compute the same
    layer = fused.hf_model.model.layers[0]
    assert layer.self_attn.q_proj.weight.data_ptr() == fused._fused()[0].qkv.data_ptr()
