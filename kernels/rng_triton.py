"""The counter-based RNG of :mod:`kernels.rng` for Triton kernels: the same bits as its torch functions.

A module of its own so that the torch half imports without Triton (:mod:`kernels.rng` describes the hash, the
streams and why both sides agree bit for bit).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The same functions for Triton kernels, in uint32 (wrapping multiplication, logical shifts). The lowbias32
# rounds are written out instead of calling a helper: under TRITON_INTERPRET every device-function call
# re-patches triton.language, which would dominate the CPU tests.


@triton.jit
def tl_row_key(seed, position, stream: tl.constexpr):
    """uint32 key of (seed, position, stream id); ``seed``/``position`` int64 (scalars or tensors)."""
    x = seed.to(tl.uint32) ^ 0x9E3779B9
    for word in tl.static_range(3):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        if word == 0:
            x = x ^ (seed >> 32).to(tl.uint32)
        elif word == 1:
            x = x ^ position.to(tl.uint32)
        else:
            x = x ^ stream
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def tl_uniform(key, index):
    """Float32 uniforms in (0, 1) for integer ``index`` (any shape) under row ``key`` (uint32)."""
    x = key ^ index.to(tl.uint32)
    for rnd in tl.static_range(2):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        if rnd == 0:
            x = x ^ 0x85EBCA6B
    return ((x >> 8) | 1).to(tl.float32) * (1.0 / 16777216.0)
