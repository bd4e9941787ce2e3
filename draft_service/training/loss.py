"""The DSpark training loss (DeepSpec recipe) and its teacher-forced acceptance statistics.

For every block position k = 1..bs (the Markov / RNN bias teacher-forced along the target's own tokens):

- CE: cross entropy of the draft distribution p_d,k against the token the target produced;
- TV: total variation 0.5 * ||p_d,k - p_t,k||_1 between draft and target distributions (temperature 1). At
  temperature 1 the probability that speculative sampling accepts x_k is exactly 1 - TV, so this term is the
  acceptance rate itself;
- BCE: binary cross entropy of the confidence c_k = sigmoid(z_k) against the soft label c*_k = 1 - TV
  (the label is a constant: no gradient flows through it into the draft distribution).

Loss = ce_weight * CE + tv_weight * TV + confidence_weight * BCE, each term a weighted mean over positions
with w_k = exp(-(k-1)/decay): early positions matter more, since a block is only as good as its accepted
prefix. DeepSpec's code weighs the full L1 distance (2 x TV) with its ``l1_loss_alpha``; we follow the paper's
statement in TV.

The teacher-forced acceptance alpha_k = 1 - TV_k also gives DeepSpec's "probabilistic tau", the expected
accepted length of a block if positions were accepted independently with these rates: 1 + sum_k prod_{i<=k}
alpha_i. It is a cheap held-out proxy of the real tau measured by ``dspark eval``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0
    decay: float = 7.0


@dataclass
class LossOutput:
    """The differentiable loss and detached statistics of one batch of blocks."""

    loss: torch.Tensor
    ce: torch.Tensor  # position-weighted means (detached)
    tv: torch.Tensor
    bce: torch.Tensor
    acceptance: torch.Tensor  # [bs] mean teacher-forced acceptance 1 - TV per position
    tau_proxy: torch.Tensor  # mean of 1 + sum_k prod_{i<=k} alpha_i over blocks
    confidence_error: torch.Tensor  # mean |sigmoid(z_k) - c*_k| (NaN without a confidence head)


def position_weights(block_size: int, decay: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..block_size."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    weights: LossWeights,
) -> LossOutput:
    """draft_logits / target_logits [N, bs, V] (fp32), labels [N, bs], confidence_logits [N, bs] or None."""
    N, bs, V = draft_logits.shape
    if target_logits.shape != draft_logits.shape or labels.shape != (N, bs):
        raise ValueError(
            f"shapes disagree: draft {tuple(draft_logits.shape)}, target {tuple(target_logits.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    w = position_weights(bs, weights.decay, draft_logits.device)
    w = w / w.sum()
    log_p_draft = torch.log_softmax(draft_logits.float(), dim=-1)
    p_draft = log_p_draft.exp()
    p_target = torch.softmax(target_logits.float(), dim=-1)
    ce = F.nll_loss(log_p_draft.reshape(N * bs, V), labels.reshape(-1), reduction="none").view(N, bs)
    tv = 0.5 * (p_draft - p_target).abs().sum(dim=-1)  # [N, bs]
    acceptance = (1.0 - tv).clamp(0.0, 1.0)
    ce_term = (ce.mean(0) * w).sum()
    tv_term = (tv.mean(0) * w).sum()
    loss = weights.ce * ce_term + weights.tv * tv_term
    bce_term = torch.zeros((), device=draft_logits.device)
    confidence_error = torch.full((), float("nan"), device=draft_logits.device)
    label = acceptance.detach()
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), label, reduction="none")
        bce_term = (bce.mean(0) * w).sum()
        loss = loss + weights.confidence * bce_term
        confidence_error = (torch.sigmoid(confidence_logits.detach().float()) - label).abs().mean()
    tau_proxy = 1.0 + label.cumprod(dim=-1).sum(dim=-1).mean()
    return LossOutput(
        loss=loss,
        ce=ce_term.detach(),
        tv=tv_term.detach(),
        bce=bce_term.detach(),
        acceptance=label.mean(0),
        tau_proxy=tau_proxy,
        confidence_error=confidence_error,
    )
