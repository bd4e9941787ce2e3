"""The SwiGLU MLP as a module: the parameters that checkpoints hold and the pure-torch reference of the fused
gate/up paths (:func:`kernels.fused_layer_triton.silu_mul`, :func:`kernels.skinny_gemm_triton.skinny_gate_up_silu`).

Contract: the numerics and attribute names of transformers' ``Qwen3MLP`` with ``hidden_act: silu``
(``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases), so that the engines' fused paths read the same
attributes from these modules and from transformers' own, checkpoints load by these names, and a module tree built
from a checkpoint computes what transformers' would, op for op. The one MLP of the drafter and of the target's
transformers-free loader.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (see the module doc)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
