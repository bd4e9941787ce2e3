"""Order-preserving integer keys of float32 values, identical in torch and Triton.

Why: exact selections (the k-th largest logit, the top-p boundary, a top-K set with a deterministic tie rule)
are searched or sorted on integers, where comparisons are exact and ties are explicit. The key of a float32 is
its bit pattern read as int32 with the 31 low bits flipped for negative numbers, so that float order equals
signed-integer order. -0.0 is first canonicalised to +0.0 so that the two zeros get one key, as they compare
equal as floats. Packing the key with the token id into one int64 (key in the high half, ``2**31 - 1 - id``
in the low half) orders by value first and by smaller id second, which gives top-K selections a unique answer.

The Triton functions (``tl_*``) are :mod:`kernels.float_keys_triton`, so that these import without Triton.
"""

from __future__ import annotations

import torch

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
