"""The light sequential heads of the drafter: Markov (vanilla, gated), RNN, and the confidence head.

The parallel backbone gives base logits U_k for every block position at once; these heads add a bias
B_k(x_{k-1}, ...) that depends on the token sampled just before, so drafting stays a cheap left-to-right loop
of small matmuls while every per-position distribution is still an exact softmax (what rejection sampling
needs).

Module and parameter names match DeepSpec's checkpoints (``markov_head.markov_w1.weight``,
``markov_head.gate_proj.{weight,bias}``, ``markov_head.joint_proj.{weight,bias}``,
``confidence_head.proj.{weight,bias}``), so a DeepSpec state dict loads without renaming.

Every head exposes the same step interface, batched over R requests:
``init_state(R) -> state | None`` and ``step(state, prev_ids [R], hidden [R, H]) -> (state, bias [R, V])``.
Only the RNN head has a state; it starts at zero at the anchor of every block.
"""

from __future__ import annotations

import torch
from torch import nn

from draft_service.config import DraftConfig


class MarkovHead(nn.Module):
    """Vanilla Markov head: B(x_{k-1}, .) = W1[x_{k-1}] @ W2, a rank-r bigram correction."""

    head_type = "vanilla"

    def __init__(self, vocab_size: int, markov_rank: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.markov_rank = markov_rank
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        # Stored as nn.Linear(r -> V), i.e. weight [V, r]: bias = W1[x] @ markov_w2.weight^T.
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [..., r]; also the Markov part of the confidence head's input."""
        return self.markov_w1(prev_ids.long())

    def init_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        del batch, like
        return None

    def latent(
        self, state: torch.Tensor | None, prev_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(new state, r-dim latent that W2 maps to the vocabulary bias)."""
        del hidden
        return state, self.prev_embedding(prev_ids)

    def step(
        self, state: torch.Tensor | None, prev_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        state, latent = self.latent(state, prev_ids, hidden)
        return state, self.markov_w2(latent)

    def block_bias(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias for a whole block: prev_ids [R, bs], hidden [R, bs, H] -> [R, bs, V].

        The RNN head unrolls its state over the block; the memoryless heads could do it in one shot, but one
        code path for all keeps them consistent with the sampling loop.
        """
        state = self.init_state(prev_ids.shape[0], hidden)
        biases = []
        for k in range(prev_ids.shape[1]):
            state, bias = self.step(state, prev_ids[:, k], hidden[:, k])
            biases.append(bias)
        return torch.stack(biases, dim=1)


class GatedMarkovHead(MarkovHead):
    """Gated Markov head: the embedding W1[x_{k-1}] is scaled by sigmoid(gate_proj([h_k ; W1[x_{k-1}]]))."""

    head_type = "gated"

    def __init__(self, vocab_size: int, markov_rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, markov_rank)
        self.gate_proj = nn.Linear(hidden_size + markov_rank, markov_rank)

    def latent(
        self, state: torch.Tensor | None, prev_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        emb = self.prev_embedding(prev_ids)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1)))
        return state, gate * emb


class RNNHead(MarkovHead):
    """RNN head: a GRU-like state s_k carries the whole prefix x_<k, not only x_{k-1}.

    z = [s_{k-1} ; W1[x_{k-1}] ; h_k]; one joint linear map gives (gate, candidate, output) in that order;
    s_k = g * s_{k-1} + (1 - g) * tanh(candidate), bias = W2 tanh(output). s_0 = 0.
    """

    head_type = "rnn"

    def __init__(self, vocab_size: int, markov_rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, markov_rank)
        self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)

    def init_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(batch, self.markov_rank, dtype=like.dtype, device=like.device)

    def latent(
        self, state: torch.Tensor | None, prev_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if state is None:
            raise ValueError("the RNN head needs its state: call init_state() at the anchor of every block")
        emb = self.prev_embedding(prev_ids)
        gate_raw, candidate_raw, output_raw = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(
            3, -1
        )
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(candidate_raw)
        return new_state, torch.tanh(output_raw)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k ; W1[x_{k-1}]])) (or proj(h_k) without Markov features); returns the raw logit.

    The logit is kept raw: thresholds, STS calibration and the scheduler's survival products apply sigmoid and
    temperatures downstream.
    """

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1).float()


def build_markov_head(config: DraftConfig) -> MarkovHead | None:
    if config.markov_rank == 0:
        return None
    if config.markov_head_type == "vanilla":
        return MarkovHead(config.vocab_size, config.markov_rank)
    if config.markov_head_type == "gated":
        return GatedMarkovHead(config.vocab_size, config.markov_rank, config.hidden_size)
    if config.markov_head_type == "rnn":
        return RNNHead(config.vocab_size, config.markov_rank, config.hidden_size)
    raise ValueError(f"unknown markov_head_type {config.markov_head_type!r}")
