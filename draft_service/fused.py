"""The drafter's layers through the fused layer kernels (:mod:`kernels.fused_layer_triton`): its CUDA path.

A draft step at 1-32 requests is a few hundred tiny kernels when every RMSNorm (~7 PyTorch kernels), rotary
embedding (~6) and activation runs as separate ops; replayed as a CUDA graph each still costs a few
microseconds, more than the drafter's weights take to stream. The same kernels as the target's fused path fold
them: per layer add+RMSNorm, one QKV matmul, q/k RMSNorm + rotary (block K/V written to a scratch the slot
attention kernel reads as the block's own keys), attention, o_proj, add+RMSNorm, one gate/up matmul, silu*up,
down_proj. The context append becomes one K|V matmul plus one kernel that normalises, rotates and stores the
keys and stores the values straight into the context cache, per layer. Numerics follow the module path op by op
(:mod:`kernels.fused_layer_triton`), so drafts agree with it up to the last bit in almost every element.

Weight GEMMs: a propose step of R requests multiplies R * block_size rows by each weight once, which at R = 1 is
the time to stream the weights. With ``DSparkDraftModel.skinny_gemm`` on (the default) and at most FASTER_ROWS
rows on a GPU ``tuned_for`` says, the block's QKV, o_proj (its residual add in the epilogue), gate/up + silu * up,
down_proj (residual add too) and the LM head run the skinny Triton GEMMs of :mod:`kernels.skinny_gemm_triton`,
as the target's verify step does: the drafter's layer shapes are the target's, where the swept launches
(``TUNING``) and the LM head's default launch beat cuBLAS at 8 and 16 rows (docs/benchmarks/kernels.md, "Skinny
weight GEMMs"). They round like the module path op by op but sum in another
order than cuBLAS, so a draft may differ from the cuBLAS path's in a rare near-tie (lossless either way: the
drafter only proposes). The context append (``fc`` 2560 x 7680 and the K|V projection 2048 x 2560 for the
Qwen3-4B shape) stays on cuBLAS: those shapes were never swept, and the default launch they would get lost to
cuBLAS at 8 rows on most of the swept projections (docs/benchmarks/kernels.md).

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
from kernels.skinny_gemm_triton import model_counters, skinny_gate_up_silu, skinny_linear, takes_pass

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
        self.layers = [FusedDraftLayer.of(layer) for layer in model.draft_layers]
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self._skinny_counters: torch.Tensor | None = None

    def skinny_counters(self, rows: int) -> torch.Tensor | None:
        """The skinny GEMMs' arrival counters when a pass of ``rows`` rows runs them (the model's ``skinny_gemm``
        on and :func:`~kernels.skinny_gemm_triton.takes_pass`), else None: cuBLAS."""
        model = self.model
        if not (model.skinny_gemm and takes_pass(rows, model.device)):
            return None
        if self._skinny_counters is None:
            projections = [model.lm_head] + [m for layer in model.draft_layers for m in (layer.self_attn.o_proj,
                                                                                    layer.mlp.down_proj)]  # fmt: skip
            self._skinny_counters = model_counters("FusedDrafter", model.device, projections)
        return self._skinny_counters

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(hidden) for [..., H] -> [..., V] in the model dtype: the skinny GEMM when the rows take it."""
        weight = self.model.lm_head.weight
        rows = hidden.numel() // hidden.shape[-1]
        counters = self.skinny_counters(rows) if self.model.skinny_lm_head else None
        if counters is None:
            return self.model.lm_head(hidden)
        flat = hidden.reshape(rows, hidden.shape[-1]).contiguous()
        return skinny_linear(flat, weight, counters=counters).view(*hidden.shape[:-1], weight.shape[0])

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(features)) for rows [n, m*H] -> [n, H]: the norm as one kernel (fc on cuBLAS: see the
        module docstring)."""
        model = self.model
        projected = model.fc(features.to(model.dtype))
        return add_rms_norm(projected, None, model.hidden_norm.weight, model.hidden_norm.variance_epsilon)

    def write_context(
        self, cache: DraftContextCache, projected: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Every layer's K/V of projected context rows [n, H] into ``cache`` at (slots[i], positions[i]) (the K|V
        projection on cuBLAS: see the module docstring)."""
        cos, sin = self.model.rotary(positions, self.model.dtype)
        for index, (layer, fused) in enumerate(zip(self.model.draft_layers, self.layers, strict=True)):
            kv = torch.nn.functional.linear(projected, fused.kv)
            qk_norm_rope_store(
                kv,
                fused.qk_norm,
                cos,
                sin,
                layer.self_attn.k_norm.variance_epsilon,
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
        norm applied). ``attention`` is the slot attention implementation (block mode). With the skinny GEMMs
        the residual adds of o_proj and down_proj happen in their epilogues (x updated in place), so the norms
        after them add nothing."""
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
        counters = self.skinny_counters(rows)
        delta = None
        for index, (layer, fused) in enumerate(zip(model.draft_layers, self.layers, strict=True)):
            attn = layer.self_attn
            norm = layer.input_layernorm
            h = add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)  # x += the previous layer's MLP output
            if counters is None:
                qkv = torch.nn.functional.linear(h, fused.qkv)
            else:
                qkv = skinny_linear(h, fused.qkv, counters=counters)
            q = qk_norm_rope_store(
                qkv, fused.qk_norm, cos, sin, attn.q_norm.variance_epsilon, k_block, v_block, block_slots,
                block_positions, HQ, HKV,
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
                ordered_rows=True,  # request r's block: rows r * bs .. r * bs + bs - 1
            )
            norm = layer.post_attention_layernorm
            out = out.to(x.dtype).reshape(rows, HQ * D)
            if counters is None:
                h = add_rms_norm(x, attn.o_proj(out), norm.weight, norm.variance_epsilon)
                delta = layer.mlp.down_proj(silu_mul(torch.nn.functional.linear(h, fused.gate_up)))
            else:  # x += o_proj(out), then x += down_proj(silu(gate) * up), in the GEMMs' epilogues
                skinny_linear(out, attn.o_proj.weight, x, counters=counters)
                h = add_rms_norm(x, None, norm.weight, norm.variance_epsilon)
                act = skinny_gate_up_silu(h, fused.gate_up, counters=counters)
                skinny_linear(act, layer.mlp.down_proj.weight, x, counters=counters)
                delta = None
        h = add_rms_norm(x, delta, model.norm.weight, model.norm.variance_epsilon)
        return h.view(R, bs, H)
