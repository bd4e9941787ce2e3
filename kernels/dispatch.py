"""The kernels behind one call each: the Triton kernel for CUDA tensors, the torch reference otherwise."""

from __future__ import annotations

import torch

from kernels.markov import MarkovSample, markov_sample_reference
from kernels.markov_triton import markov_sample_triton
from kernels.rejection import RejectionOutput, rejection_sample_reference
from kernels.rejection_triton import rejection_sample_triton
from kernels.slot_attention import slot_attention_reference
from kernels.slot_attention_triton import slot_attention_triton

__all__ = [
    "MarkovSample",
    "RejectionOutput",
    "markov_sample",
    "markov_sample_reference",
    "markov_sample_triton",
    "rejection_sample",
    "rejection_sample_reference",
    "rejection_sample_triton",
    "slot_attention",
    "slot_attention_reference",
    "slot_attention_triton",
]


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_draft_lens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_prob_ids: torch.Tensor | None = None,
    validate: bool = True,
) -> RejectionOutput:
    """Verify a ragged batch of drafts (see :mod:`kernels.rejection`): Triton on CUDA, torch elsewhere."""
    impl = rejection_sample_triton if target_logits.is_cuda else rejection_sample_reference
    return impl(
        target_logits,
        draft_token_ids,
        draft_probs,
        cu_draft_lens,
        temperature,
        top_k,
        top_p,
        seeds,
        positions,
        draft_prob_ids=draft_prob_ids,
        validate=validate,
    )


def markov_sample(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: int = 0,
    return_logits: bool = False,
    validate: bool = True,
    k_eff: torch.Tensor | None = None,
) -> MarkovSample:
    """Draft gamma tokens with the Markov head (:mod:`kernels.markov`): Triton on CUDA, torch elsewhere."""
    impl = markov_sample_triton if base_logits.is_cuda else markov_sample_reference
    return impl(
        base_logits,
        anchor_ids,
        w1,
        w2,
        temperature,
        seeds,
        positions,
        top_k=top_k,
        return_logits=return_logits,
        validate=validate,
        k_eff=k_eff,
    )


def slot_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    k_block: torch.Tensor | None = None,
    v_block: torch.Tensor | None = None,
    causal: bool = True,
    validate: bool = True,
    ordered_rows: bool = False,
) -> torch.Tensor:
    """Varlen attention over slot caches (see :mod:`kernels.slot_attention`): Triton on CUDA, torch elsewhere."""
    impl = slot_attention_triton if q.is_cuda else slot_attention_reference
    return impl(
        q,
        k_cache,
        v_cache,
        slots,
        context_lens,
        query_starts,
        query_lens,
        scale,
        max_query_len=max_query_len,
        k_block=k_block,
        v_block=v_block,
        causal=causal,
        validate=validate,
        ordered_rows=ordered_rows,
    )
