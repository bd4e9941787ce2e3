"""Order-preserving integer keys of float32 values, identical in torch and Triton.

Why: exact selections (the k-th largest logit, the top-p boundary, a top-K set with a deterministic tie rule)
are searched or sorted on integers, where comparisons are exact and ties are explicit. The key of a float32 is
its bit pattern read as int32 with the 31 low bits flipped for negative numbers, so that float order equals
signed-integer order. -0.0 is first canonicalised to +0.0 so that the two zeros get one key, as they compare
equal as floats. Packing the key with the token id into one int64 (key in the high half, ``2**31 - 1 - id``
in the low half) orders by value first and by smaller id second, which gives top-K selections a unique answer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOW31 = 0x7FFFFFFF


def canonical(z: torch.Tensor) -> torch.Tensor:
    """Replace -0.0 by +0.0 (everything else unchanged)."""
    return torch.where(z == 0, torch.zeros_like(z), z)


def ordered_key(z: torch.Tensor) -> torch.Tensor:
    """int64 tensor (values in the int32 range) whose order is the float order of canonical float32 ``z``."""
    bits = z.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ _LOW31)


def key_to_float(key: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ordered_key`."""
    bits = torch.where(key >= 0, key, key ^ _LOW31).to(torch.int32)
    return bits.view(torch.float32)


def pack_value_id(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 packing ordered by (value descending, id ascending) when sorted descending."""
    return (ordered_key(z) << 32) | (_LOW31 - ids.to(torch.int64))


def unpack_value_id(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 values, int64 ids) of :func:`pack_value_id` output."""
    return key_to_float(packed >> 32), _LOW31 - (packed & 0xFFFFFFFF)


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
