"""Slot attention: the Triton kernel (on CUDA, or through TRITON_INTERPRET=1 on CPU), in one pass and with its
keys split across programs (the last to arrive combining them), with and without ``ordered_rows`` (the kernel
writing the zeros of rows no request covers), equals its torch reference, and all equal a naive float64 loop, for
verify chunks, long prefill chunks, drafter blocks, GQA, padded layouts and empty splits; split launches are
deterministic and leave their arrival counters zeroed."""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.slot_attention import slot_attention_reference
from kernels.slot_attention_triton import (
    MAX_KV_SPLITS,
    default_kv_splits,
    launch_kv_splits,
    new_counters,
    slot_attention_triton,
)

# The Triton kernel in one pass (kv_splits=1) and with its keys split across 3 programs, each from a zero-filled
# output and (ordered: every layout below has its requests' rows in order) writing the zeros itself.
IMPLS = [slot_attention_reference, functools.partial(slot_attention_triton, kv_splits=1),
         functools.partial(slot_attention_triton, kv_splits=3),
         functools.partial(slot_attention_triton, kv_splits=1, ordered_rows=True),
         functools.partial(slot_attention_triton, kv_splits=3, ordered_rows=True)]  # fmt: skip
IDS = ["reference", "triton", "triton-split3", "triton-ordered", "triton-split3-ordered"]
ROOT = Path(__file__).resolve().parents[2]
TRITON_MODULE = importlib.import_module("kernels.slot_attention_triton")  # the package exports the function
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 8


def naive(q, k_cache, v_cache, layout, scale, k_block=None, v_block=None, causal=True) -> torch.Tensor:
    """Query by query in float64. layout: (slot, context_len, query_start, query_len) per request."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    k_block = None if k_block is None else k_block.cpu()
    v_block = None if v_block is None else v_block.cpu()
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for slot, ctx, start, n in layout:
        for i in range(n):
            for h in range(q.shape[1]):
                kv = h // group
                if k_block is None:
                    last = ctx + i + 1 if causal else ctx + n
                    keys, values = k_cache[slot, :last, kv], v_cache[slot, :last, kv]
                else:
                    seen = i + 1 if causal else n
                    keys = torch.cat([k_cache[slot, :ctx, kv], k_block[start : start + seen, kv]])
                    values = torch.cat([v_cache[slot, :ctx, kv], v_block[start : start + seen, kv]])
                weights = torch.softmax(keys.double() @ q[start + i, h].double() * scale, dim=0)
                out[start + i, h] = weights @ values.double()
    return out


def make(layout, num_rows, num_heads, num_kv_heads, num_slots=6, max_len=160, seed=0, dim=D):
    gen = torch.Generator().manual_seed(seed)
    # Large stale values everywhere: any key read past its bound spoils the result.
    k_cache = torch.randn(num_slots, max_len, num_kv_heads, dim, generator=gen) * 1e3
    v_cache = torch.randn(num_slots, max_len, num_kv_heads, dim, generator=gen) * 1e3
    for slot, ctx, _, n in layout:
        k_cache[slot, : ctx + n] = torch.randn(ctx + n, num_kv_heads, dim, generator=gen)
        v_cache[slot, : ctx + n] = torch.randn(ctx + n, num_kv_heads, dim, generator=gen)
    q = torch.randn(num_rows, num_heads, dim, generator=gen)
    control = [torch.tensor([entry[i] for entry in layout], dtype=torch.int64, device=DEVICE) for i in range(4)]
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), control


def test_conftest_selected_the_interpreter() -> None:
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_causal_cache_mode_mixed_chunks(impl, num_heads: int, num_kv_heads: int) -> None:
    # (slot, context, start row, length): verify chunks, an anchor-only decode step, a prefill longer than one
    # query tile and one key tile, a chunked-prefill continuation; rows 45..47 belong to no request.
    layout = [(0, 10, 0, 4), (3, 70, 4, 1), (1, 0, 5, 40), (5, 20, 48, 5)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 53, num_heads, num_kv_heads)
    out = impl(q, k_cache, v_cache, slots, ctx, starts, lens, D**-0.5, max_query_len=40)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double().cpu(), naive(q, k_cache, v_cache, layout, D**-0.5), atol=2e-5, rtol=2e-5)
    assert bool((out[45:48] == 0).all()), "rows of no request stay zero"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_block_mode_drafter_layout(impl, causal: bool) -> None:
    # The drafter: R blocks of bs rows at consecutive offsets, context only from the cache (0 allowed).
    bs = 5
    layout = [(2, 13, 0, bs), (0, 0, bs, bs), (4, 90, 2 * bs, bs)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 3 * bs, 4, 2, seed=1)
    gen = torch.Generator().manual_seed(7)
    k_block = torch.randn(3 * bs, 2, D, generator=gen).to(DEVICE)
    v_block = torch.randn(3 * bs, 2, D, generator=gen).to(DEVICE)
    out = impl(
        q,
        k_cache,
        v_cache,
        slots,
        ctx,
        starts,
        lens,
        0.3,
        max_query_len=bs,
        k_block=k_block,
        v_block=v_block,
        causal=causal,
    )
    expected = naive(q, k_cache, v_cache, layout, 0.3, k_block, v_block, causal)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_padded_bucket_layout(impl) -> None:
    """The CUDA-graph layout: every request owns gamma + 1 rows, only query_len of them are real."""
    width = 4
    layout = [(1, 7, 0, 3), (0, 30, width, 1), (3, 0, 2 * width, 4), (5, 2, 3 * width, 0)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 4 * width, 4, 1, seed=2)
    out = impl(q, k_cache, v_cache, slots, ctx, starts, lens, D**-0.5, max_query_len=width)
    torch.testing.assert_close(out.double().cpu(), naive(q, k_cache, v_cache, layout, D**-0.5), atol=2e-5, rtol=2e-5)
    real = torch.zeros(4 * width, dtype=torch.bool, device=DEVICE)
    for _, _, start, n in layout:
        real[start : start + n] = True
    assert bool((out[~real] == 0).all()), "padding rows and empty requests stay zero"


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_ragged_verify_layout(impl) -> None:
    """The verify graph step's layout (verify_service/graphs.py): chunks back to back, then one-row padding chunks
    of query_len 0 on a dummy slot, then the sink's rows, which no request of the attention covers: all zero."""
    layout = [(2, 9, 0, 3), (0, 40, 3, 5), (5, 0, 8, 0), (5, 0, 9, 0)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 16, 8, 2, seed=5)
    out = impl(q, k_cache, v_cache, slots, ctx, starts, lens, D**-0.5, max_query_len=6)
    torch.testing.assert_close(out.double().cpu(), naive(q, k_cache, v_cache, layout, D**-0.5), atol=2e-5, rtol=2e-5)
    assert bool((out[8:] == 0).all()), "padding chunks' and the sink's rows are zero"

@pytest.mark.parametrize("kv_splits", [1, 3])
def test_triton_equals_reference_on_a_float16_cache(kv_splits: int) -> None:
    layout = [(0, 17, 0, 5), (1, 3, 5, 2)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 7, 4, 2, seed=3)
    q, k_cache, v_cache = q.half(), k_cache.half(), v_cache.half()
    args = (q, k_cache, v_cache, slots, ctx, starts, lens, D**-0.5)
    got = slot_attention_triton(*args, max_query_len=5, kv_splits=kv_splits)
    want = slot_attention_reference(*args, max_query_len=5)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize(("mode", "kv_splits", "dim"), [
    ("cache", 2, D), ("cache", 3, D), ("cache", 8, D), ("cache", 3, 64), ("block-causal", 3, D),
    ("block-causal", 8, D), ("block", 2, D), ("block", 3, D), ("block", 3, 64), ("cache", 8, 64),
    ("block", 16, 64)])  # fmt: skip
def test_split_keys_over_many_tiles(mode: str, kv_splits: int, dim: int, ordered: bool) -> None:
    """Key splits over contexts of several 64-key tiles: splits of several tiles, a split whose tiles a query
    only partly sees, a request with context 0 and fewer key tiles than splits (empty splits), GQA groups of 3,
    in drafter mode the block's keys merged with the cache splits, and (dim 64 over 8, 16 splits) the last program
    combining the partials in 2, 4 chunks of head dims."""
    # 8 tiles (3 splits: 3 + 3 + 2), 4 tiles, a one-tile request (context 0), a decode step after 383 keys
    layout = [(1, 500, 0, 6), (0, 200, 6, 3), (4, 0, 9, 7), (2, 383, 20, 1)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 24, 6, 2, max_len=520, seed=4, dim=dim)
    block = mode != "cache"
    gen = torch.Generator().manual_seed(8)
    k_block = torch.randn(24, 2, dim, generator=gen).to(DEVICE) if block else None
    v_block = torch.randn(24, 2, dim, generator=gen).to(DEVICE) if block else None
    causal = mode != "block"
    out = slot_attention_triton(q, k_cache, v_cache, slots, ctx, starts, lens, 0.25, max_query_len=7,
                                k_block=k_block, v_block=v_block, causal=causal, kv_splits=kv_splits,
                                ordered_rows=ordered)  # fmt: skip
    expected = naive(q, k_cache, v_cache, layout, 0.25, k_block, v_block, causal)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)
    assert bool((out[16:20] == 0).all()) and bool((out[21:] == 0).all()), "rows of no request stay zero"


def _split_problem(block: bool, seed: int = 9, dim: int = D):
    """Several 64-key tiles per request (empty splits for the short ones at high S), padding rows inside a
    request's rows (max_query_len 6), a query_len-0 request, rows of no request between and after them, GQA 3."""
    # (slot, context, start, length): 5 tiles, a query_len-0 request, one tile (context 0), a decode step,
    # 3 tiles; rows 10..11, 16..17 and 22..23 belong to no request
    layout = [(1, 300, 0, 6), (3, 50, 6, 0), (4, 0, 6, 4), (0, 130, 12, 1), (2, 190, 13, 3)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 24, 6, 2, max_len=320, seed=seed, dim=dim)
    gen = torch.Generator().manual_seed(seed + 1)
    k_block = torch.randn(24, 2, dim, generator=gen).to(DEVICE) if block else None
    v_block = torch.randn(24, 2, dim, generator=gen).to(DEVICE) if block else None
    args = (q, k_cache, v_cache, slots, ctx, starts, lens, 0.3)
    kwargs = dict(max_query_len=6, k_block=k_block, v_block=v_block, causal=not block)
    return args, kwargs


@pytest.mark.parametrize("block", [False, True], ids=["cache", "drafter-block"])
@pytest.mark.parametrize("kv_splits", [2, 3, 5, 8, 16])
def test_fused_combine_equals_one_pass_and_reference(kv_splits: int, block: bool) -> None:
    """The split launch (the last program to arrive combining the partials) equals the one-pass kernel and the
    torch reference: uneven splits (5 tiles over 2, 3), empty ones (1 tile over 8, 16), padding rows, a request
    without queries, drafter block mode; uncovered rows stay zero."""
    args, kwargs = _split_problem(block)
    one_pass = slot_attention_triton(*args, **kwargs, kv_splits=1)
    reference = slot_attention_reference(*args, **kwargs)
    for ordered in (False, True):
        counters = new_counters(DEVICE)
        split = slot_attention_triton(*args, **kwargs, kv_splits=kv_splits, ordered_rows=ordered, counters=counters)
        torch.testing.assert_close(split, one_pass, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(split, reference, atol=2e-5, rtol=2e-5)
        assert int(counters.abs().sum()) == 0, "the last arrivals reset their counters"
        for rows in (slice(10, 12), slice(16, 18), slice(22, 24)):
            assert bool((split[rows] == 0).all()), "rows of no request stay zero"


def test_split_launches_are_deterministic_and_leave_the_default_counters_zeroed() -> None:
    args, kwargs = _split_problem(block=False, seed=11)
    first = slot_attention_triton(*args, **kwargs, kv_splits=4, ordered_rows=True)
    for _ in range(3):
        assert torch.equal(slot_attention_triton(*args, **kwargs, kv_splits=4, ordered_rows=True), first)
    default = TRITON_MODULE.COUNTERS.defaults[first.device]
    assert default.shape == (TRITON_MODULE.COUNTER_SLOTS,) and int(default.abs().sum()) == 0


def test_ordered_rows_write_the_zeros_into_stale_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``ordered_rows`` the output is uninitialised memory: the rows no request covers (between requests,
    after the last, padding rows of a request, a query_len-0 request's) must be written as zeros by the kernel.
    ``torch.empty_like`` hands out NaN-filled memory here (what a reused allocator block may hold), so the check
    cannot pass on fresh zeroed pages, whatever the allocator does."""
    args, kwargs = _split_problem(block=False, seed=12)
    reference = slot_attention_reference(*args, **kwargs)
    stale_outputs = []

    def stale_like(tensor: torch.Tensor, **options: object) -> torch.Tensor:
        stale_outputs.append(torch.full_like(tensor, float("nan"), **options))
        return stale_outputs[-1]

    monkeypatch.setattr(torch, "empty_like", stale_like)
    for kv_splits in (1, 2, 3):
        out = slot_attention_triton(*args, **kwargs, kv_splits=kv_splits, ordered_rows=True, validate=False)
        assert out.data_ptr() == stale_outputs[-1].data_ptr()  # the output is the NaN-filled block
        torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)


def test_ordered_rows_are_checked() -> None:
    layout = [(0, 4, 2, 2), (1, 4, 0, 2)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 4, 4, 2, num_slots=2, max_len=8)
    args = (q, k_cache, v_cache, slots, ctx, starts, lens, 1.0)
    torch.testing.assert_close(slot_attention_triton(*args, max_query_len=2),
                               slot_attention_reference(*args, max_query_len=2))  # fmt: skip
    for impl in (slot_attention_triton, slot_attention_reference):
        with pytest.raises(ValueError, match="ordered_rows"):
            impl(*args, max_query_len=2, ordered_rows=True)
    with pytest.raises(ValueError, match="ordered_rows"):  # the first request must start at row 0
        slot_attention_triton(q, k_cache, v_cache, slots[:1], ctx[:1], starts[:1], lens[:1], 1.0, max_query_len=2,
                              ordered_rows=True)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture")
def test_split_launch_refuses_to_make_its_counters_inside_a_capture() -> None:
    args, kwargs = _split_problem(block=False, seed=13)
    device = args[0].device
    saved = TRITON_MODULE.COUNTERS.defaults.pop(device, None)
    try:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="before capturing"), torch.cuda.graph(graph):
            slot_attention_triton(*args, **kwargs, kv_splits=2, validate=False)
    finally:
        if saved is not None:
            TRITON_MODULE.COUNTERS.defaults[device] = saved
    counters = new_counters(device)
    static = slot_attention_triton(*args, **kwargs, kv_splits=2, counters=counters)  # compiled outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = slot_attention_triton(*args, **kwargs, kv_splits=2, validate=False, counters=counters)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, static) and int(counters.abs().sum()) == 0


def test_default_kv_splits_fill_the_sms_only_for_small_grids() -> None:
    # Qwen3-4B verify of 1 request: 8 query rows x 4 heads per kv head = one 32-row block, 8 kv heads, head_dim
    # 128 (32-key tiles), a 4096-position cache; 132 SMs (H200)
    tiles = 4096 // 32
    assert default_kv_splits(1 * 8 * 1, tiles, 132) == MAX_KV_SPLITS
    assert default_kv_splits(8 * 8 * 1, tiles, 132) == 2
    assert default_kv_splits(32 * 8 * 1, tiles, 132) == 1
    assert default_kv_splits(132, tiles, 132) == 1
    assert default_kv_splits(8, 3, 132) == 3, "no more splits than a slot has key tiles"
    assert default_kv_splits(100, tiles, 132) == 1
    assert launch_kv_splits(1, 8, 32, 128, 4096, torch.device("cpu")) == 1, "the interpreter runs one pass"


def test_kv_splits_must_be_positive() -> None:
    layout = [(0, 4, 0, 2)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 2, 4, 2, num_slots=2, max_len=8)
    with pytest.raises(ValueError, match="kv_splits must be >= 1"):
        slot_attention_triton(q, k_cache, v_cache, slots, ctx, starts, lens, 1.0, max_query_len=2, kv_splits=0)


@pytest.mark.parametrize("impl", IMPLS[:2], ids=IDS[:2])
def test_bad_input_is_a_clear_value_error(impl) -> None:
    layout = [(0, 4, 0, 2)]
    q, k_cache, v_cache, (slots, ctx, starts, lens) = make(layout, 2, 4, 2, num_slots=2, max_len=8)
    with pytest.raises(ValueError, match="longer than max_query_len"):
        impl(q, k_cache, v_cache, slots, ctx, starts, lens, 1.0, max_query_len=1)
    with pytest.raises(ValueError, match="past the cache length"):
        impl(q, k_cache, v_cache, slots, ctx + 7, starts, lens, 1.0, max_query_len=2)
    with pytest.raises(ValueError, match="slots must be in"):
        impl(q, k_cache, v_cache, slots + 2, ctx, starts, lens, 1.0, max_query_len=2)
    with pytest.raises(ValueError, match="query rows must lie"):
        impl(q, k_cache, v_cache, slots, ctx, starts + 1, lens, 1.0, max_query_len=2)
    with pytest.raises(ValueError, match="not a multiple"):
        impl(q[:, :3], k_cache, v_cache, slots, ctx, starts, lens, 1.0, max_query_len=2)
    with pytest.raises(ValueError, match="given together"):
        impl(q, k_cache, v_cache, slots, ctx, starts, lens, 1.0, max_query_len=2, k_block=q[:, :2])


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.slot_attention_triton import _combine_chunk, _slot_attention_kernel

pointers = ("q_ptr", "kc_ptr", "vc_ptr", "kb_ptr", "vb_ptr", "o_ptr")
partials = ("part_m_ptr", "part_l_ptr", "part_acc_ptr")
ints = ("stride_qn", "stride_qh", "stride_cs", "stride_ct", "stride_ch", "stride_bn", "stride_bh",
        "stride_on", "stride_oh", "D", "N")
controls = ("slots_ptr", "ctx_ptr", "qstart_ptr", "qlen_ptr")
target = GPUTarget("cuda", 90, 32)
# (dtype, drafter block, key splits, head_dim block, ordered rows): the last three, Qwen3-4B's verify (split, one
# pass) and drafter as the engines launch them (ordered rows, and as a dependent launch on Hopper: PDL)
for dtype, has_block, splits, block_d, ordered in (
        ("fp32", False, 1, 64, False), ("fp32", True, 1, 64, False), ("bf16", False, 1, 64, False),
        ("bf16", True, 1, 64, False), ("fp32", False, 3, 64, False), ("bf16", False, 8, 128, True),
        ("bf16", False, 1, 128, True), ("bf16", True, 3, 128, True)):
    partial_type = "*fp32" if splits > 1 else "*" + dtype
    signature = {name: "*" + dtype for name in pointers} | {name: partial_type for name in partials}
    signature |= {"count_ptr": "*i32" if splits > 1 else "*" + dtype}
    signature |= {name: "i32" for name in ints} | {name: "*i64" for name in controls} | {"scale": "fp32"}
    constants = dict(G=4, BLOCK_M=32, BLOCK_N=64 if block_d <= 64 else 32, BLOCK_D=block_d, HAS_BLOCK=has_block,
                     CAUSAL_CACHE=not has_block, CAUSAL_BLOCK=False, IEEE=dtype == "fp32", SPLITS=splits,
                     CHUNK_D=_combine_chunk(splits, 32, block_d), ORDERED=ordered, PDL=ordered)
    signature |= {name: "constexpr" for name in constants}
    source = ASTSource(fn=_slot_attention_kernel, signature=signature, constexprs=constants)
    assert triton.compile(source, target=target).asm["cubin"], (dtype, has_block, splits, ordered)
print("compiled")
"""


@pytest.mark.slow
def test_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """Triton lowers the kernel to a cubin for sm_90 (H100 / H200) on this CPU machine: GPU-only compile
    errors (dot shapes, dtypes, constexpr branches) surface here, not first on the lent GPU."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the kernel runs for real in the GPU tests")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
