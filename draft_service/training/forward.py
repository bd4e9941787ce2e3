"""Batched training forward of the drafter: many anchor blocks of one sequence in a single pass.

``DSparkDraftModel.forward_blocks`` is the plain definition (one row per anchor, its context prefix padded):
with A anchors per sequence it would project the same context A times. Here the context of a sequence is
projected once, every draft layer computes its context K/V once, and the A blocks of the sequence attend
through one mask (DeepSpec's training layout):

- query rows are the A blocks concatenated, [anchor_a, mask, ..., mask] at positions p_a .. p_a + bs - 1;
- a query of block a sees context rows j < p_a (the target features of everything before its anchor) and the
  bs rows of its own block (bidirectional), nothing of the other blocks.

Row for row this is the same computation as ``forward_blocks`` (tests/draft_service/test_train_forward.py
checks it), built from the model's own modules, so the trained weights are what inference runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draft_service.model import DraftAttention, DSparkDraftModel, apply_rope


def block_attention_mask(anchor_positions: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [B, 1, A*bs, context_len + A*bs]: True where a block query may attend to a key."""
    B, A = anchor_positions.shape
    device = anchor_positions.device
    query_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [B, Q]
    context_visible = torch.arange(context_len, device=device)[None, None, :] < query_anchor[:, :, None]
    block_of = torch.arange(A * block_size, device=device) // block_size
    same_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
    return torch.cat([context_visible, same_block], dim=-1)[:, None]


def _masked_attention(
    attn: DraftAttention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """DraftAttention with a per-query mask.

    x [B, Q, H] (normed block rows), ctx_k / ctx_v [B, T, KVH, D], mask [B, 1, Q, T+Q].
    """
    B, Q, _ = x.shape
    q = apply_rope(attn.q_norm(attn.q_proj(x).view(B, Q, attn.num_heads, attn.head_dim)), cos, sin)
    k_blk, v_blk = attn.key_value(x, cos, sin)
    k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=1).transpose(1, 2)
    v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=1).transpose(1, 2)
    groups = attn.num_heads // attn.num_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=attn.head_dim**-0.5)
    return attn.o_proj(out.transpose(1, 2).reshape(B, Q, attn.num_heads * attn.head_dim))


def multi_block_hidden(
    model: DSparkDraftModel,
    context_features: torch.Tensor,
    anchor_positions: torch.Tensor,
    anchor_ids: torch.Tensor,
) -> torch.Tensor:
    """Block hidden states [B, A, bs, H] (after the final norm) for A anchors in each of B sequences.

    context_features [B, S, m*H]: target features of every position; anchor_positions [B, A] in [1, S]: the
    anchor of block a sits at p_a and sees context rows 0..p_a-1; anchor_ids [B, A]: the anchor tokens.
    """
    B, S, _ = context_features.shape
    A = anchor_positions.shape[1]
    bs = model.block_size
    device = model.device
    if anchor_positions.shape != anchor_ids.shape or anchor_positions.ndim != 2:
        raise ValueError(
            f"anchor_positions and anchor_ids must both be [B, A], got {tuple(anchor_positions.shape)} and "
            f"{tuple(anchor_ids.shape)}"
        )
    if bool((anchor_positions < 1).any()) or bool((anchor_positions > S).any()):
        raise ValueError(f"anchor positions must lie in [1, {S}] (at least one context row)")
    ctx = model.project_context(context_features)
    context_kv = model.context_key_values(ctx, torch.arange(S, device=device).expand(B, S))
    block_ids = torch.full((B, A, bs), model.config.mask_token_id, dtype=torch.int64, device=device)
    block_ids[:, :, 0] = anchor_ids
    positions = (anchor_positions[:, :, None] + torch.arange(bs, device=device)).reshape(B, A * bs)
    cos, sin = model.rotary(positions, model.dtype)
    mask = block_attention_mask(anchor_positions, S, bs)
    x = model.embed_tokens(block_ids.reshape(B, A * bs))
    for layer, (ctx_k, ctx_v) in zip(model.draft_layers, context_kv, strict=True):
        x = x + _masked_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).view(B, A, bs, -1)
