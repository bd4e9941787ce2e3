"""Skinny GEMMs (kernels/skinny_gemm_triton.py, Triton on CUDA or through TRITON_INTERPRET=1 on CPU) equal their
torch references and a float64 product: plain, with the in-place residual add, and gate/up + silu * up; split
along K or not, uneven N / K tails, several M tiles; the split launches are deterministic and leave their
arrival counters zeroed for the next launch."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from kernels import skinny_gemm_triton
from kernels.skinny_gemm_triton import (
    SkinnyConfig,
    default_config,
    load_tuning,
    new_counters,
    skinny_gate_up_silu,
    skinny_gate_up_silu_reference,
    skinny_linear,
    skinny_linear_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, N, K, config): one split, a split with a short last K range, uneven N, several M tiles (M > 64)
CASES = [
    (8, 64, 128, SkinnyConfig(block_n=32, block_k=64, split=1)),
    (5, 96, 200, SkinnyConfig(block_n=32, block_k=64, split=3)),
    (16, 40, 256, SkinnyConfig(block_n=16, block_k=32, split=4)),
    (70, 48, 96, SkinnyConfig(block_n=16, block_k=32, split=2)),
    (5, 96, 200, SkinnyConfig(block_n=32, block_k=64, split=3, tma=True)),  # W through a tensor descriptor
]
IDS = [f"m{m}-n{n}-k{k}-split{c.split}" + "-tma" * c.tma for m, n, k, c in CASES]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, rows: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) / k**0.5
    w = torch.randn(rows or n, k, generator=gen)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


@pytest.mark.parametrize(("m", "n", "k", "config"), CASES, ids=IDS)
def test_linear_equals_reference_and_float64(m: int, n: int, k: int, config: SkinnyConfig) -> None:
    x, w = _inputs(m, n, k, torch.float32)
    exact = (x.double() @ w.double().T).float()
    got = skinny_linear(x, w, config=config)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(skinny_linear_reference(x, w), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("m", "n", "k", "config"), CASES, ids=IDS)
def test_residual_is_added_in_place(m: int, n: int, k: int, config: SkinnyConfig) -> None:
    x, w = _inputs(m, n, k, torch.float32, seed=1)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = skinny_linear_reference(x, w, residual.clone())
    target = residual.clone()
    out = skinny_linear(x, w, target, config=config)
    assert out.data_ptr() == target.data_ptr()
    torch.testing.assert_close(target, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("m", "n", "k", "config"), CASES, ids=IDS)
def test_gate_up_silu_equals_reference(m: int, n: int, k: int, config: SkinnyConfig) -> None:
    x, w = _inputs(m, n, k, torch.float32, rows=2 * n, seed=3)
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    exact = (gate * torch.sigmoid(gate) * up).float()
    got = skinny_gate_up_silu(x, w, config=config)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(skinny_gate_up_silu_reference(x, w), exact, atol=1e-5, rtol=1e-5)


def test_bfloat16_rounds_like_the_modules() -> None:
    """bf16 inputs: the product is rounded to bf16 as linear returns it, then each epilogue op rounds; against
    the references only the fp32 sum order differs (an ulp or two; the interpreter's bf16 conversions are not
    torch's, hence its wider bound)."""
    m, n, k = 8, 64, 256
    x, w = _inputs(m, n, k, torch.bfloat16, rows=2 * n, seed=4)
    config = SkinnyConfig(block_n=32, block_k=64, split=2)
    ulp = {"atol": 1e-2, "rtol": 1e-2} if DEVICE == "cuda" else {"atol": 7e-2, "rtol": 3e-2}
    torch.testing.assert_close(skinny_linear(x, w[:n], config=config), skinny_linear_reference(x, w[:n]), **ulp)
    torch.testing.assert_close(skinny_gate_up_silu(x, w, config=config), skinny_gate_up_silu_reference(x, w), **ulp)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    expected = skinny_linear_reference(x, w[:n], residual.clone())
    torch.testing.assert_close(skinny_linear(x, w[:n], residual, config=config), expected, **ulp)
    assert skinny_linear(x, w[:n], config=config).dtype == torch.bfloat16


def test_split_launches_are_deterministic_and_reset_their_counters() -> None:
    m, n, k = 5, 96, 200
    x, w = _inputs(m, n, k, torch.float32, rows=2 * n, seed=6)
    counters = new_counters(DEVICE)
    config = SkinnyConfig(block_n=32, block_k=64, split=4)
    first = skinny_gate_up_silu(x, w, counters=counters, config=config)
    assert int(counters.abs().sum()) == 0
    again = skinny_gate_up_silu(x, w, counters=counters, config=config)
    assert torch.equal(first, again)
    plain = skinny_linear(x, w, counters=counters, config=config)
    assert torch.equal(plain, skinny_linear(x, w, counters=counters, config=config))
    assert int(counters.abs().sum()) == 0


def test_empty_rows_and_bad_shapes() -> None:
    x, w = _inputs(1, 32, 64, torch.float32)
    assert skinny_linear(x[:0], w).shape == (0, 32)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear(x[:, :32].contiguous(), w)
    with pytest.raises(ValueError, match="even row count"):
        skinny_gate_up_silu(x, w[:31])


@pytest.mark.parametrize(("n", "k", "gated"), [(6144, 2560, False), (2560, 4096, False), (9728, 2560, True),
                                               (2560, 9728, False)])  # fmt: skip
@pytest.mark.parametrize("m", [8, 64])
def test_default_launch_fills_the_sms(n: int, k: int, gated: bool, m: int) -> None:
    """The Qwen3-4B shapes get at least a program per SM of an H200 (132), none with an empty K range."""
    config = default_config(m, n, k, gated, num_sms=132)
    k_blocks = -(-k // config.block_k)
    assert -(-n // config.block_n) * config.split >= 132
    assert (config.split - 1) * -(-k_blocks // config.split) < k_blocks


def test_swept_launches_load_from_the_benchmark_json(tmp_path, monkeypatch) -> None:
    """A sweep's JSON (bench/bench_skinny_gemm.py --out) fills TUNING, and a tuned shape launches with its entry:
    the result still equals the reference."""
    monkeypatch.setattr(skinny_gemm_triton, "TUNING", {})
    config = SkinnyConfig(block_n=16, block_k=32, split=2, warps=2, stages=2)
    sweep = {"tuning": [{"case": "o_proj", "m": 8, "key": [48, 96, False, 16], "config": asdict(config), "ms": 0.1}]}
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps(sweep))
    assert load_tuning(path) == 1
    assert {(48, 96, False, 16): config} == skinny_gemm_triton.TUNING
    x, w = _inputs(8, 48, 96, torch.bfloat16)
    tuned = skinny_linear(x, w)
    assert torch.equal(tuned, skinny_linear(x, w, config=config))  # same launch, same sum order
    torch.testing.assert_close(tuned, skinny_linear_reference(x, w), atol=7e-2, rtol=3e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="the arrival counters' memory ordering only matters on a GPU")
@pytest.mark.parametrize(("n", "k", "gated", "residual"), [(2560, 9728, False, True), (9728, 2560, True, False)])
def test_gpu_split_reduction_is_race_free(n: int, k: int, gated: bool, residual: bool) -> None:
    """Qwen3-4B down_proj (+ residual) and gate_up + silu at 8 rows with their default K splits (hundreds of
    programs racing for the last arrival): 20 launches bit-identical, and within bf16 rounding of torch. A last
    program that read a partial before it was visible would make repeats differ."""
    x, w = _inputs(8, n, k, torch.bfloat16, rows=2 * n if gated else n, seed=7)
    base = torch.randn(8, n, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.bfloat16)

    def call() -> torch.Tensor:
        if gated:
            return skinny_gate_up_silu(x, w)
        return skinny_linear(x, w, base.clone())

    expected = skinny_gate_up_silu_reference(x, w) if gated else skinny_linear_reference(x, w, base.clone())
    first = call()
    torch.testing.assert_close(first, expected, atol=2e-2, rtol=2e-2)
    for _ in range(20):
        assert torch.equal(call(), first)
