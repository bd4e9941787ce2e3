"""Random model pairs of any shape for generality tests: an HF Qwen3 target folder and a DeepSpec-layout
draft.

The target is a real ``transformers.Qwen3ForCausalLM`` with random weights saved by ``save_pretrained``; the
draft config is built the way DeepSpec's ``build_draft_config`` builds it (a copy of the target's config.json
plus the DSpark keys, ``num_hidden_layers`` = draft layers), its weights are random except the embedding and
LM head, which are copies of the target's (as DeepSpec's ``initialize_embeddings_and_head`` does).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from draft_service.checkpoint import save_draft_model
from draft_service.config import DraftConfig
from draft_service.model import DSparkDraftModel


@dataclass(frozen=True)
class PairSpec:
    """Shape of a random target/draft pair."""

    vocab: int = 96
    hidden: int = 32
    target_layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    intermediate: int = 64
    tie_embeddings: bool = True
    block_size: int = 4
    draft_layers: int = 1
    target_layer_ids: tuple[int, ...] = (0, 2)
    markov_rank: int = 8
    markov_head_type: str | None = "vanilla"
    confidence: bool = True
    confidence_with_markov: bool = True
    seed: int = 0

    @property
    def name(self) -> str:
        head = self.markov_head_type if self.markov_rank else "nomarkov"
        conf = ("conf+m" if self.confidence_with_markov else "conf") if self.confidence else "noconf"
        tie = "tied" if self.tie_embeddings else "untied"
        ids = "_".join(str(i) for i in self.target_layer_ids)
        return (
            f"q{self.heads}kv{self.kv_heads}-bs{self.block_size}-L{self.draft_layers}-r{self.markov_rank}"
            f"-{head}-{conf}-{tie}-ids{ids}"
        )


def write_target(path: Path, spec: PairSpec) -> Path:
    """A random Qwen3 target saved with save_pretrained (initializer_range 0.1 so greedy output is varied)."""
    config = Qwen3Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.target_layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_embeddings,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(spec.seed)
    Qwen3ForCausalLM(config).save_pretrained(str(path))
    return path


def draft_config_dict(target_config: dict[str, Any], spec: PairSpec) -> dict[str, Any]:
    """DeepSpec-style draft config: the target's config.json plus the DSpark keys."""
    out = copy.deepcopy(target_config)
    out.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=target_config["num_hidden_layers"],
        num_hidden_layers=spec.draft_layers,
        block_size=spec.block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * spec.draft_layers,
        mask_token_id=spec.vocab - 1,
        target_layer_ids=list(spec.target_layer_ids),
        num_anchors=32,
        enable_confidence_head=spec.confidence,
        markov_rank=spec.markov_rank,
    )
    if spec.confidence:
        out["confidence_head_with_markov"] = spec.confidence_with_markov
    if spec.markov_rank > 0:
        out["markov_head_type"] = spec.markov_head_type
    return out


def random_draft(target_dir: Path, spec: PairSpec) -> DSparkDraftModel:
    """A draft with random weights and the target's embedding / LM head copied in."""
    target_config = json.loads((target_dir / "config.json").read_text())
    config = DraftConfig.from_dict(draft_config_dict(target_config, spec), source="model_factory")
    torch.manual_seed(spec.seed + 1)
    model = DSparkDraftModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1 if param.ndim > 1 else 0.05)
        target = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return model.eval()


def write_pair(
    root: Path, spec: PairSpec, *, dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None
) -> tuple[Path, Path]:
    """Write <root>/target and <root>/draft; returns both folders."""
    target_dir = write_target(root / "target", spec)
    draft_dir = root / "draft"
    save_draft_model(random_draft(target_dir, spec), draft_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return target_dir, draft_dir
