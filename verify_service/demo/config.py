"""Settings of the demo models: corpus split, the target's architecture and its pre-training recipe.

Plain dataclasses with no torch import, so the ``dspark`` CLI can show their defaults without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from verify_service.demo.tokenizer import MODEL_MAX_LENGTH

#: Share of stdlib files held out for validation: with the split drawn by path hash, 5% of the files is a few
#: percent of the tokens, enough for a validation loss stable to about 0.01 nats.
DEFAULT_VAL_FRACTION = 0.05


class RunSchedule(Protocol):
    """What a wall-clock-bounded training loop needs to know (target pre-training, later drafter training)."""

    lr: float
    min_lr_ratio: float
    warmup_steps: int
    max_minutes: float | None
    max_steps: int | None
    max_epochs: float | None


@dataclass
class TargetShape:
    """Architecture of the demo target; defaults give 7.3M parameters with a 4096 vocab (tied embeddings)."""

    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = MODEL_MAX_LENGTH
    rope_theta: float = 10000.0


@dataclass
class PretrainConfig:
    """Optimisation settings; defaults are the H200 recipe (models/README.md says why).

    Windows span the full 2048-token context so that every position the config advertises is trained
    (prompts of the code evaluation sets reach ~600 tokens before generation starts). The corpus has ~3.1M
    train tokens, so the run is bounded in epochs: 40 epochs ~ 125M tokens ~ 17 tokens per parameter, near
    compute-optimal for 7.3M parameters, before memorising so small a corpus takes over (the weights with the
    best validation loss are kept).
    """

    device: str = "cpu"
    batch_size: int = 32
    seq_len: int = 2048
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_minutes: float | None = 7.0
    max_steps: int | None = None
    max_epochs: float | None = 40.0
    eval_every: int = 100
    eval_windows: int = 256
    log_every: int = 10
    seed: int = 0
    compile: bool = False
    keep: str = "best"
    copy_tokenizer: bool = True

    def validate(self) -> None:
        if self.max_minutes is None and self.max_steps is None and self.max_epochs is None:
            raise ValueError("set at least one of max_minutes, max_steps, max_epochs")
        for name in ("max_minutes", "max_steps", "max_epochs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("batch_size", "seq_len", "eval_every", "eval_windows", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1 and warmup_steps >= 0")
        if self.keep not in ("best", "last"):
            raise ValueError(f"keep must be 'best' or 'last', got {self.keep!r}")
