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
    fused.skinny_gemm = False  # cuBLAS projections here; the skinny GEMMs (on by default) are tested below
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
    layer = fused.modules.model.layers[0]
    assert layer.self_attn.q_proj.weight.data_ptr() == fused._fused()[0].qkv.data_ptr()


@pytest.fixture(scope="module")
def skinny(tmp_path_factory: pytest.TempPathFactory) -> tuple[TargetModel, TargetModel]:
    """The fused path with cuBLAS projections and with the skinny Triton GEMMs (kernels/skinny_gemm_triton.py)."""
    spec = PairSpec(vocab=128, hidden=32, target_layers=3, block_size=5, target_layer_ids=(-1, 1), seed=11)
    target_dir, _ = write_pair(tmp_path_factory.mktemp("skinny"), spec)
    off, on = (TargetModel.from_pretrained(Path(target_dir), feature_layer_ids=(0, 2), device=DEVICE) for _ in "ab")
    off.fused = on.fused = True
    assert on.skinny_gemm  # on by default (used by the fused path, i.e. on CUDA, for passes of <= FASTER_ROWS)
    off.skinny_gemm = False
    return off, on


@pytest.mark.parametrize("split", [1, 2])
def test_skinny_gemms_give_the_same_forward(
    skinny: tuple[TargetModel, TargetModel], split: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits, features and K/V of the switched-on path equal the switched-off one's (float32 on CPU: up to the
    order of the fp32 sums), with and without splitting K (the tiny model's K is one default K step); a pass of
    more than FASTER_ROWS tokens falls back to cuBLAS."""
    import kernels.skinny_gemm_triton as skinny_module

    config = skinny_module.SkinnyConfig(block_n=16, block_k=16, split=split)
    monkeypatch.setattr(skinny_module, "default_config", lambda *args: config)
    on = skinny[1]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 1, 70)]
    outs = []
    for target in skinny:
        cache = target.new_kv_cache(3, 90)
        slots = [cache.allocate() for _ in prompts]
        first = target.forward(cache, target.prepare(cache, list(zip(slots[:2], prompts[:2], strict=True))))
        long = target.forward(cache, target.prepare(cache, [(slots[2], prompts[2])]))  # 70 rows: cuBLAS
        chunks = [(slots[0], [5, 6, 7, 8]), (slots[1], [9]), (slots[2], [3, 4])]
        verify = target.forward(cache, target.prepare(cache, chunks), logits_rows=torch.tensor([0, 4, 6]))
        outs.append(((first, long, verify), cache, slots))
    assert on._skinny_counters is not None and int(on._skinny_counters.abs().sum()) == 0
    (steps_off, cache_off, slots_off), (steps_on, cache_on, slots_on) = outs
    for a, b in zip(steps_off, steps_on, strict=True):
        torch.testing.assert_close(a.logits, b.logits, **TOL)
        torch.testing.assert_close(a.features, b.features, **TOL)
    for sa, sb in zip(slots_off, slots_on, strict=True):
        n = cache_off.length(sa)
        torch.testing.assert_close(cache_off.k[:, sa, :n], cache_on.k[:, sb, :n], **TOL)
        torch.testing.assert_close(cache_off.v[:, sa, :n], cache_on.v[:, sb, :n], **TOL)


def test_skinny_gemms_give_the_same_greedy_generation(skinny: tuple[TargetModel, TargetModel]) -> None:
    off, on = skinny
    prompts = [[1, 2, 3], [7] * 11, [100, 3]]
    assert on.generate(prompts, 12) == off.generate(prompts, 12)
