"""The fused q/k norm + rotary + K/V store kernel (kernels/fused_layer_triton.py, on CUDA or through
TRITON_INTERPRET=1 on CPU) equals HF Qwen3's own modules (``Qwen3RMSNorm``, ``apply_rotary_pos_emb``) applied head
by head, for head counts that fill its head groups, leave them partly masked, and have no query heads at all (a
drafter's context append); cache rows other than the written ones stay untouched."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from kernels.fused_layer_triton import QK_HEAD_GROUP, qk_norm_rope_store

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _reference(
    qkv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k and v [N, Hkv, D] as the HF attention module computes them from the fused projection."""
    q_norm, k_norm = Qwen3RMSNorm(d, eps=EPS).to(qkv), Qwen3RMSNorm(d, eps=EPS).to(qkv)
    q_norm.weight.data.copy_(weight[0])
    k_norm.weight.data.copy_(weight[1])
    n = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q_norm(q.reshape(n, hq, d)).transpose(0, 1)  # [heads, N, D]: HF rotates [batch, heads, seq, D]
    k = k_norm(k.reshape(n, hkv, d)).transpose(0, 1)
    q, k = apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None])
    return q[0].transpose(0, 1), k[0].transpose(0, 1), v.reshape(n, hkv, d)


@pytest.mark.parametrize(
    ("hq", "hkv"),
    [(32, 8), (4, 2), (6, 3), (0, 2), (2 * QK_HEAD_GROUP + 1, QK_HEAD_GROUP + 3)],
    ids=["qwen3-4b-heads", "small", "odd-counts", "keys-only", "groups-and-a-tail"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_store_equals_the_hf_modules(hq: int, hkv: int, dtype: torch.dtype) -> None:
    _check_against_hf(hq, hkv, dtype)


@pytest.mark.parametrize("head_group", [1, 2, 4, 16])
def test_every_head_group_equals_the_hf_modules(head_group: int) -> None:
    """The head groups bench/bench_qk_norm_rope.py times compute the same layer as the shipped one."""
    _check_against_hf(32, 8, torch.float32, head_group)


@pytest.mark.parametrize("head_group", [0, 3, 6])
def test_a_head_group_other_than_a_power_of_two_is_refused(head_group: int) -> None:
    qkv = torch.zeros((1, 3 * 16), device=DEVICE)
    cache = torch.zeros((1, 2, 1, 16), device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    trig = torch.ones((1, 16), device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        qk_norm_rope_store(qkv, torch.ones((2, 16), device=DEVICE), trig, trig, EPS, cache, cache, rows, rows, 1, 1,
                           head_group=head_group)  # fmt: skip


def _check_against_hf(hq: int, hkv: int, dtype: torch.dtype, head_group: int | None = None) -> None:
    d, n, slots, length = 16, 5, 3, 12
    gen = torch.Generator().manual_seed(hq * 100 + hkv)
    qkv = torch.randn((n, (hq + 2 * hkv) * d), generator=gen).to(dtype)
    weight = (1.0 + 0.1 * torch.randn((2, d), generator=gen)).to(dtype)
    positions = torch.tensor([0, 3, 7, 4, 11])
    token_slots = torch.tensor([0, 2, 2, 1, 0])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    sentinel = -7.0
    k_cache = torch.full((slots, length, hkv, d), sentinel, dtype=dtype)
    v_cache = torch.full((slots, length, hkv, d), sentinel, dtype=dtype)
    args = [t.to(DEVICE) for t in (qkv, weight, cos, sin)]
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    q = qk_norm_rope_store(*args, EPS, k_dev, v_dev, token_slots.to(DEVICE), positions.to(DEVICE), hq, hkv,
                           head_group=head_group)  # fmt: skip

    q_ref, k_ref, v_ref = _reference(qkv.float(), weight.float(), cos.float(), sin.float(), hq, hkv, d)
    # float32: the same operations (sums of squares in another order); bf16: every intermediate is rounded to
    # bf16 by both, so the two agree to a bf16 step of the rounded values.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-2, "rtol": 2e-2}
    assert q.shape == (n, hq, d)
    torch.testing.assert_close(q.float().cpu(), q_ref, **tol)
    written = torch.zeros((slots, length), dtype=torch.bool)
    written[token_slots, positions] = True
    k_out, v_out = k_dev.float().cpu(), v_dev.float().cpu()
    torch.testing.assert_close(k_out[token_slots, positions], k_ref, **tol)
    torch.testing.assert_close(v_out[token_slots, positions], v_ref.to(dtype).float(), atol=0, rtol=0)
    assert bool((k_out[~written] == sentinel).all()) and bool((v_out[~written] == sentinel).all())
