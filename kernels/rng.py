"""Counter-based random numbers shared by every sampler, identical in torch and Triton.

Why counter-based: a random number is a pure function of ``(request seed, absolute token position, stream,
index)``. A request therefore gets the same output whatever else shares its batch, whatever its row offset and
whichever implementation runs (torch reference or Triton kernel), and nothing has to carry generator state
between rounds or between the drafter and the verifier.

The hash is Chris Wellons' ``lowbias32`` 32-bit permutation (xorshift-multiply, constants from his
hash-prospector search), chained over the inputs like a Merkle-Damgard hash:

    key  = mix(mix(mix(mix(seed_lo ^ K0) ^ seed_hi) ^ position) ^ stream)     (one per row)
    bits = mix(mix(key ^ index) ^ K1)                                          (one per element)
    u    = ((bits >> 8) | 1) * 2**-24                                          in [2**-24, 1 - 2**-24]

``u`` is an odd multiple of 2**-24, so it is exact in float32, never 0 and never 1 (so ``-log(u)`` is finite
and positive), and symmetric around 1/2. The 23 bits of resolution bias any probability by at most ~1e-7.

The Triton half (``tl_row_key``, ``tl_uniform``) is :mod:`kernels.rng_triton`, so that the torch half imports
without Triton: the scheduler process uses these functions and never launches a kernel.

Bit-exactness: Triton computes in ``uint32`` (multiplication wraps modulo 2**32, shifts are logical). Torch
has no usable uint32 arithmetic, so it computes in int64 on values in [0, 2**32) and reduces modulo 2**32
after every multiplication; the multiplication is split into 16-bit halves of the constant so that no
intermediate overflows int64. Both produce the same bits, which the tests check.

Streams (purpose ids) keep the uses independent: the verifier's accept test (one number per draft token),
the verifier's residual / bonus draw (two numbers, for its two-level inverse CDF) and the drafter's sampling
(one per vocabulary entry) never share numbers. The drafter may redraw a position that a previous round drafted
but never verified; reusing those numbers is harmless because an unverified draft influenced nothing that was
observed. Positions are absolute token positions of the token being decided, so a position is decided once per
stream.
"""

from __future__ import annotations

import torch

STREAM_ACCEPT = 1
"""Verifier: uniform for the accept test min(1, p_t / p_d) of the draft token at a position (index 0)."""
STREAM_TARGET_SAMPLE = 2
"""Verifier: the residual or bonus draw at a position (index 0: the block, index 1: the token inside it)."""
STREAM_DRAFT_SAMPLE = 3
"""Drafter: per-vocabulary uniforms for the Markov head's draw at a position."""

_MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_K0 = 0x9E3779B9
_K1 = 0x85EBCA6B
_MAX_POSITION = 2**31 - 1


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 ``x`` in [0, 2**32) without int64 overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 permutation of 32-bit values held in an int64 tensor (values in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, _C1)
    x = x ^ (x >> 15)
    x = _mulmod32(x, _C2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """32-bit key of (seed, position, stream), broadcast over ``seeds`` and ``positions`` (int64 tensors)."""
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    key = mix32((seeds & _MASK32) ^ _K0)
    key = mix32(key ^ ((seeds >> 32) & _MASK32))
    key = mix32(key ^ (positions & _MASK32))
    return mix32(key ^ stream)


def uniform_from_keys(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Float32 uniforms in (0, 1) for element ``index`` of the rows whose keys are ``keys`` (broadcast)."""
    bits = mix32(mix32(keys ^ index.to(torch.int64)) ^ _K1)
    return ((bits >> 8) | 1).to(torch.float32) * (2.0**-24)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Float32 uniforms in (0, 1) as a pure function of (seed, position, stream, index), broadcast."""
    return uniform_from_keys(row_keys(seeds, positions, stream), index)


MAX_POSITION = _MAX_POSITION
"""Largest absolute position accepted by the samplers (positions enter the hash as 32-bit values)."""
