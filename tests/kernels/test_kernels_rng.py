"""The counter-based RNG: bit-exact between torch and Triton, a true permutation, uniform and independent."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rng import STREAM_ACCEPT, STREAM_DRAFT_SAMPLE, STREAM_TARGET_SAMPLE, mix32, uniform
from kernels.rng_triton import tl_row_key, tl_uniform

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _lowbias32(x: int) -> int:
    """Plain-integer lowbias32 (Wellons), independent of the tensor implementation."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _uniform_grid_kernel(seeds_ptr, positions_ptr, out_ptr, N: tl.constexpr, STREAM: tl.constexpr):
    row = tl.program_id(0)
    key = tl_row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), STREAM)
    offs = tl.arange(0, N)
    tl.store(out_ptr + row * N + offs, tl_uniform(key, offs * 7919))


def test_mix32_matches_plain_integer_lowbias32() -> None:
    inputs = [0, 1, 2, 0xDEADBEEF, 0xFFFFFFFF, 0x80000000, 123456789]
    got = mix32(torch.tensor(inputs, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(x) for x in inputs]


def test_mix32_is_a_permutation_on_a_block_of_inputs() -> None:
    out = mix32(torch.arange(1 << 20, dtype=torch.int64) + 0xFFF00000)
    assert out.unique().numel() == 1 << 20
    assert int(out.min()) >= 0 and int(out.max()) <= 0xFFFFFFFF


def test_triton_uniforms_equal_torch_bit_for_bit() -> None:
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 987654321, 42], device=DEVICE)
    positions = torch.tensor([0, 5, 7, 2**31 - 2, 3, 100, 0, 65536], device=DEVICE)
    width = 128
    for stream in (STREAM_ACCEPT, STREAM_TARGET_SAMPLE, STREAM_DRAFT_SAMPLE):
        out = torch.empty((seeds.numel(), width), dtype=torch.float32, device=DEVICE)
        _uniform_grid_kernel[(seeds.numel(),)](seeds, positions, out, N=width, STREAM=stream)
        index = torch.arange(width, device=DEVICE)[None, :] * 7919
        expected = uniform(seeds[:, None], positions[:, None], stream, index)
        assert torch.equal(out, expected), f"stream {stream}"


def test_uniforms_are_odd_multiples_of_2_pow_minus_24_strictly_inside_0_1() -> None:
    u = uniform(torch.tensor([7]), torch.tensor([11]), STREAM_TARGET_SAMPLE, torch.arange(200_000))
    scaled = (u.double() * 2**24).round()
    assert torch.equal(scaled, u.double() * 2**24)
    assert bool((scaled.long() % 2 == 1).all())
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


def test_uniforms_are_uniform_and_pure() -> None:
    seeds = torch.arange(400)[:, None]
    u = uniform(seeds, torch.full_like(seeds, 3), STREAM_ACCEPT, torch.arange(250)[None, :]).flatten()
    counts = torch.histc(u, bins=50, min=0.0, max=1.0).double()
    expected = u.numel() / 50
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(49 / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)
        )
    )
    assert p_value > 1e-3, (chi2, p_value)
    assert abs(float(u.double().mean()) - 0.5) < 0.003
    again = uniform(seeds, torch.full_like(seeds, 3), STREAM_ACCEPT, torch.arange(250)[None, :]).flatten()
    assert torch.equal(u, again)


def test_neighbouring_counters_are_uncorrelated() -> None:
    index = torch.arange(100_000)
    seed, pos = torch.tensor([5]), torch.tensor([9])
    base = uniform(seed, pos, STREAM_TARGET_SAMPLE, index).double()
    neighbours = {
        "next index": uniform(seed, pos, STREAM_TARGET_SAMPLE, index + 1).double(),
        "next position": uniform(seed, pos + 1, STREAM_TARGET_SAMPLE, index).double(),
        "next seed": uniform(seed + 1, pos, STREAM_TARGET_SAMPLE, index).double(),
        "other stream": uniform(seed, pos, STREAM_DRAFT_SAMPLE, index).double(),
    }
    for name, other in neighbours.items():
        corr = float(torch.corrcoef(torch.stack([base, other]))[0, 1])
        assert abs(corr) < 0.015, (name, corr)
        assert not torch.equal(base, other), name
