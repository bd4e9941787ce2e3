"""Settings of drafter training and the draft config derived from the target's (no torch import here).

Three drafter kinds are trained the same way so that they can be compared (issue 7, paper Table 1):

- ``vanilla``: DSpark, the vanilla Markov head (rank-r bigram bias) and a confidence head reading
  [h_k ; W1[x_{k-1}]];
- ``rnn``: DSpark with the RNN head (a GRU-like state over the drafted prefix) and the same confidence head;
- ``none``: the DFlash-style baseline, no sequential head at all (every position is drafted from the parallel
  backbone alone), with a confidence head on h_k only so thresholds and Algorithm 1 still apply to it.

The draft config is built as DeepSpec's ``build_draft_config`` builds it: a copy of the target's HF config
with the DSpark keys added and ``num_hidden_layers`` set to the number of DRAFT layers, so the saved folder
loads with :func:`draft_service.checkpoint.load_draft_model` and with DeepSpec itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

HEADS = ("vanilla", "rnn", "none")


@dataclass
class ResponseConfig:
    """How many responses to generate and how (defaults: the H200 recipe, a few tens of seconds there)."""

    device: str = "cpu"
    num_train: int = 8192
    num_val: int = 512
    batch_size: int = 512
    #: Held-out prompts come in smaller equal-length batches, so the few of them still cover many lengths.
    val_batch_size: int = 32
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256
    greedy_fraction: float = 0.25
    temperature: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.num_train < 1 or self.num_val < 0 or min(self.batch_size, self.val_batch_size) < 1:
            raise ValueError("need num_train >= 1, num_val >= 0 and batch sizes >= 1")
        if not 1 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(
                f"need 1 <= min_prompt_tokens <= max_prompt_tokens, got {self.min_prompt_tokens}, "
                f"{self.max_prompt_tokens}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.greedy_fraction <= 1.0:
            raise ValueError(f"greedy_fraction must be in [0, 1], got {self.greedy_fraction}")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (the non-greedy share samples), got {self.temperature}"
            )


@dataclass
class DrafterShape:
    """Architecture of a drafter for a given target (hidden size, heads, MLP width come from the target)."""

    head: str = "vanilla"
    num_draft_layers: int = 2
    block_size: int = 7
    #: Target layers whose outputs form the context features; never the last one (HF stores it normed).
    target_layer_ids: tuple[int, ...] = (1, 4, 6)
    markov_rank: int = 128
    #: None: the last vocabulary id (the demo tokenizer's ``<|mask|>``, as Qwen3 drafters use a reserved id).
    mask_token_id: int | None = None

    def validate(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.num_draft_layers < 1 or self.block_size < 1:
            raise ValueError("num_draft_layers and block_size must be >= 1")
        if self.head != "none" and self.markov_rank < 1:
            raise ValueError(f"the {self.head} head needs markov_rank >= 1, got {self.markov_rank}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")


@dataclass
class DrafterTrainConfig:
    """Optimisation settings; defaults are the H200 recipe (models/README.md says why).

    One step = ``batch_size`` response sequences x ``num_anchors`` random anchors each, i.e.
    batch_size * num_anchors blocks of ``block_size`` predictions. Limits: wall-clock minutes, optimizer
    steps, epochs over the response sequences; the cosine schedule follows the largest fraction, so it always
    ends decayed whichever limit binds (the same rule as the target's pre-training).
    """

    device: str = "cpu"
    batch_size: int = 32
    num_anchors: int = 64
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_minutes: float | None = 4.0
    max_steps: int | None = None
    max_epochs: float | None = None
    #: Loss = ce_weight * CE + tv_weight * TV + confidence_weight * BCE(c, c*), each term weighted per
    #: position k (1-based) by exp(-(k-1)/loss_decay). The paper writes the decay as gamma (= block size, 7);
    #: DeepSpec's shipped configs use 4.
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    loss_decay: float = 7.0
    eval_every: int = 100
    eval_sequences: int = 64
    log_every: int = 10
    seed: int = 0
    #: STS calibration after training: held-out prompts decoded at T=1 with full-block verification (0: skip).
    sts_prompts: int = 256
    sts_max_new_tokens: int = 128

    def validate(self) -> None:
        if self.max_minutes is None and self.max_steps is None and self.max_epochs is None:
            raise ValueError("set at least one of max_minutes, max_steps, max_epochs")
        for name in ("max_minutes", "max_steps", "max_epochs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("batch_size", "num_anchors", "eval_every", "eval_sequences", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1 and warmup_steps >= 0")
        if min(self.ce_weight, self.tv_weight, self.confidence_weight) < 0 or not self.loss_decay > 0:
            raise ValueError("loss weights must be >= 0 and loss_decay > 0")
        if self.sts_prompts < 0 or self.sts_max_new_tokens < 1:
            raise ValueError("sts_prompts must be >= 0 and sts_max_new_tokens >= 1")


def draft_config_dict(
    target_config: dict[str, Any], shape: DrafterShape, train: DrafterTrainConfig | None = None
) -> dict[str, Any]:
    """The drafter's config.json content for a target config.json (DeepSpec's key set)."""
    shape.validate()
    num_target_layers = int(target_config["num_hidden_layers"])
    vocab = int(target_config["vocab_size"])
    mask = vocab - 1 if shape.mask_token_id is None else shape.mask_token_id
    out = copy.deepcopy(target_config)
    for key in ("transformers_version", "dtype", "torch_dtype", "use_cache", "max_window_layers"):
        out.pop(key, None)
    out.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=num_target_layers,
        num_hidden_layers=shape.num_draft_layers,
        layer_types=["full_attention"] * shape.num_draft_layers,
        block_size=shape.block_size,
        tie_word_embeddings=False,
        mask_token_id=mask,
        target_layer_ids=list(shape.target_layer_ids),
        enable_confidence_head=True,
        dspark_head=shape.head,
    )
    if shape.head == "none":
        out.update(markov_rank=0, confidence_head_with_markov=False)
    else:
        out.update(
            markov_rank=shape.markov_rank, markov_head_type=shape.head, confidence_head_with_markov=True
        )
    if train is not None:
        out.update(
            num_anchors=train.num_anchors,
            loss_decay_gamma=train.loss_decay,
            ce_loss_alpha=train.ce_weight,
            tv_loss_alpha=train.tv_weight,  # DeepSpec's l1_loss_alpha weighs the L1 distance, 2 x TV
            confidence_head_alpha=train.confidence_weight,
        )
    return out
