"""The frozen target as the drafter's teacher: context features and target logits for a training batch.

One no-grad forward of the whole (prompt + response) sequence gives everything a step needs: the context
features of every position (hidden states of ``target_layer_ids``, concatenated: exactly what the verifier
ships to the drafter at serving time) and the final normed hidden state, from which the target logits of just
the rows the loss needs are computed (the full [B, S, V] logits would be mostly wasted memory).

Sequences are right-padded; attention is causal, so padding never changes a real position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from scheduler.evaluation.reference_loop import context_features

if TYPE_CHECKING:
    from transformers import Qwen3ForCausalLM


class Teacher:
    """Wraps a transformers Qwen3ForCausalLM (frozen, eval mode)."""

    def __init__(self, hf_model: Qwen3ForCausalLM, target_layer_ids: Sequence[int]) -> None:
        self.model = hf_model.eval().requires_grad_(False)
        self.target_layer_ids = tuple(target_layer_ids)

    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, S] -> (context features [B, S, m*H], final normed hidden states [B, S, H])."""
        out = self.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        return context_features(out.hidden_states, self.target_layer_ids), out.last_hidden_state

    @torch.no_grad()
    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Target logits (fp32) of selected final hidden states [..., H] -> [..., V]."""
        return self.model.lm_head(final_hidden).float()
