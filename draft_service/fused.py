"""The drafter's layers through the fused layer kernels (:mod:`kernels.fused_layer_triton`): its CUDA path.

A draft step at 1-32 requests is a few hundred tiny kernels when every RMSNorm (~7 PyTorch kernels), rotary
embedding (~6) and activation runs as separate ops; replayed as a CUDA graph each still costs a few
microseconds, more than the drafter's weights take to stream. The same kernels as the target's fused path fold
them: per layer add+RMSNorm, one QKV matmul, q/k RMSNorm + rotary (block K/V written to a scratch the slot
attention kernel reads as the block's own keys), attention, o_proj, add+RMSNorm, one gate/up matmul, silu*up,
down_proj. The context append becomes one K|V matmul plus one kernel that normalises, rotates and stores the
keys and stores the values straight into the context cache, per layer. Numerics follow the module path op by op
(:mod:`kernels.fused_layer_triton`), so drafts agree with it up to the last bit in almost every element.

The stacked projections are built once; the modules' weights become views of them (nothing is held twice;
training, which uses the module path, still sees ordinary parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.fused_layer_triton import add_rms_norm, qk_norm_rope_store, silu_mul, stack_into_views

if TYPE_CHECKING:
    from draft_service.context_cache import DraftContextCache
    from draft_service.model import DraftLayer, DSparkDraftModel


@dataclass(frozen=True)
class FusedDraftLayer:
    """One layer's stacked weights: q|k|v rows (the k|v rows are the context append's projection), gate|up rows,
    and the q / k norm weights as one [2, D] buffer."""

    qkv: torch.Tensor
    kv: torch.Tensor
    gate_up: torch.Tensor
    qk_norm: torch.Tensor

    @classmethod
    def of(cls, layer: DraftLayer) -> FusedDraftLayer:
        attn, mlp = layer.self_attn, layer.mlp
        linears: tuple[nn.Linear, ...] = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
        if any(linear.bias is not None for linear in linears):
            raise ValueError("fused draft layers need bias-free projections")
        qkv = stack_into_views([attn.q_proj, attn.k_proj, attn.v_proj])
        q_rows = attn.q_proj.weight.shape[0]
        gate_up = stack_into_views([mlp.gate_proj, mlp.up_proj])
        qk_norm = torch.stack([attn.q_norm.weight.detach(), attn.k_norm.weight.detach()])
        return cls(qkv=qkv, kv=qkv[q_rows:], gate_up=gate_up, qk_norm=qk_norm)


class FusedDrafter:
    """The fused forward pieces of one DSparkDraftModel (see the module docstring)."""

    def __init__(self, model: DSparkDraftModel) -> None:
        self.model = model
        self.layers = [FusedDraftLayer.of(layer) for layer in model.layers]
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(features)) for rows [n, m*H] -> [n, H]: the norm as one kernel."""
        model = self.model
        projected = model.fc(features.to(model.dtype))
        return add_rms_norm(projected, None, model.hidden_norm.weight, model.hidden_norm.eps)

    def write_context(
        self, cache: DraftContextCache, projected: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Every layer's K/V of projected context rows [n, H] into ``cache`` at (slots[i], positions[i])."""
        cos, sin = self.model.rotary(positions, self.model.dtype)
        for index, (layer, fused) in enumerate(zip(self.model.layers, self.layers, strict=True)):
            kv = torch.nn.functional.linear(projected, fused.kv)
            qk_norm_rope_store(
                kv,
                fused.qk_norm,
                cos,
                sin,
                layer.self_attn.k_norm.eps,
                cache.k[index],
                cache.v[index],
                slots,
                positions,
                0,  # no query heads: the kernel normalises and rotates the keys and stores keys and values
                self.num_kv_heads,
            )

    def backbone_slots(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftContextCache,
        slots: torch.Tensor,
        context_lens: torch.Tensor,
        attention: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """:meth:`DSparkDraftModel.backbone_slots` through the fused kernels: x [R, bs, H] -> [R, bs, H] (final
        norm applied). ``attention`` is the slot attention implementation (block mode)."""
        model = self.model
        R, bs, H = x.shape
        rows = R * bs
        D, HQ, HKV = self.head_dim, self.num_heads, self.num_kv_heads
        dtype = cache.k.dtype
        x = x.reshape(rows, H).contiguous()  # the residual stream, updated in place from here on
        cos, sin = cos.reshape(rows, D), sin.reshape(rows, D)
        # The block's own K/V, written by the norm/rotary kernel as a cache of `rows` slots of one position.
        k_block = torch.empty((rows, 1, HKV, D), dtype=dtype, device=x.device)
        v_block = torch.empty_like(k_block)
        block_slots = torch.arange(rows, device=x.device)
        block_positions = torch.zeros(rows, dtype=torch.int64, device=x.device)
        starts = torch.arange(R, device=x.device) * bs
        lengths = torch.full((R,), bs, dtype=torch.int64, device=x.device)
        delta = None
        for index, (layer, fused) in enumerate(zip(model.layers, self.layers, strict=True)):
            attn = layer.self_attn
            norm = layer.input_layernorm
            h = add_rms_norm(x, delta, norm.weight, norm.eps)  # x += the previous layer's MLP output
            qkv = torch.nn.functional.linear(h, fused.qkv)
            q = qk_norm_rope_store(
                qkv, fused.qk_norm, cos, sin, attn.q_norm.eps, k_block, v_block, block_slots, block_positions,
                HQ, HKV,
            )  # fmt: skip
            out = attention(
                q.to(dtype),
                cache.k[index],
                cache.v[index],
                slots,
                context_lens,
                starts,
                lengths,
                D**-0.5,
                max_query_len=bs,
                k_block=k_block.view(rows, HKV, D),
                v_block=v_block.view(rows, HKV, D),
                causal=False,
                validate=False,
            )
            norm = layer.post_attention_layernorm
            h = add_rms_norm(x, attn.o_proj(out.to(x.dtype).reshape(rows, HQ * D)), norm.weight, norm.eps)
            delta = layer.mlp.down_proj(silu_mul(torch.nn.functional.linear(h, fused.gate_up)))
        h = add_rms_norm(x, delta, model.norm.weight, model.norm.eps)
        return h.view(R, bs, H)
