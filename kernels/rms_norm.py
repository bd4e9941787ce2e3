"""RMSNorm as a module: the parameters that checkpoints hold and the pure-torch reference of
:func:`kernels.fused_layer_triton.add_rms_norm`.

Contract: the numerics and attribute names of transformers' ``Qwen3RMSNorm`` (normalised in float32, cast back to
the input dtype, then scaled; the epsilon as ``variance_epsilon``), so that the engines' fused paths read the same
attributes from these modules and from transformers' own, and a module tree built from a checkpoint computes
what transformers' would, op for op. The one RMSNorm of the drafter and of the target's transformers-free loader.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * normalise(x)`` over the last dimension, normalised in float32 (see the module doc)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)
