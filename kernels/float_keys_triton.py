"""The order-preserving float32 keys of :mod:`kernels.float_keys` for Triton kernels: the same keys as its torch
functions, in a module of their own so that those import without Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tl_canonical(z):
    """Replace -0.0 by +0.0."""
    return tl.where(z == 0.0, 0.0, z)


@triton.jit
def tl_ordered_key(z):
    """int32 key with float order of canonical float32 ``z``."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def tl_key_to_float(key):
    """Inverse of :func:`tl_ordered_key` (int32 in, float32 out)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def tl_pack_value_id(z, ids):
    """int64 (key << 32) | (2**31 - 1 - id): sorted descending = value descending, then id ascending."""
    bits = z.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)


@triton.jit
def tl_unpack_value_id(packed):
    """(float32 values, int32 ids) of :func:`tl_pack_value_id` output."""
    key = (packed >> 32).to(tl.int32)
    values = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    ids = 0x7FFFFFFF - (packed & 0xFFFFFFFF).to(tl.int32)
    return values, ids
