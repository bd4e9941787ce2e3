"""A Qwen3 checkpoint as torch modules in transformers' layout, loaded without importing transformers.

Why: :class:`verify_service.target.TargetModel` runs its own forward and needs from the checkpoint only the module
tree (projections, norms, MLPs, rotary embedding, LM head) and its weights. Loading them through transformers'
``Qwen3ForCausalLM`` imports transformers, which on the CPU development VM took 2-5 s of a verifier replica's
restart (its Qwen3 model pulls in ``torch.distributed.tensor``, ``torch._dynamo``, the tokenizers); reading the
safetensors files directly takes 0.03-0.07 s for the demo target.

Contract: :func:`load_qwen3` returns modules whose parameters (names, shapes, values in the requested dtype,
the tied LM head as the embedding's own tensor) and whose per-module computations (:class:`RMSNorm`,
:class:`MLP`, :class:`RotaryEmbedding`, :func:`apply_rotary_pos_emb`) are those of
``transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype)``, op for op, so the target's logits are
bit-identical either way (``tests/verify_service/test_qwen3_modules.py``). It returns None for a configuration
it does not reproduce (a RoPE type other than ``default``, an activation other than ``silu``, sliding-window
layers, a shape key missing from ``config.json``); the caller then loads through transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernels.mlp import MLP
from kernels.rms_norm import RMSNorm
from kernels.uninitialised import uninitialised

_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps")
#: transformers' default RoPE base, for a checkpoint that names none.
_DEFAULT_ROPE_THETA = 10_000.0
#: Checkpoint entries that are not parameters: older exports saved the rotary buffer, transformers skips it too.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Qwen3Config:
    """What the target reads from ``config.json`` (attribute names as transformers' ``Qwen3Config``)."""

    name_or_path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    dspark_real_vocab_size: int | None  # verify_service/inflate.py's padded vocabulary (target.REAL_VOCAB_KEY)
    model_type: str = "qwen3"

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], name_or_path: str) -> Qwen3Config | None:
        """The config of a ``config.json``, or None when this module does not reproduce it (see the module doc)."""
        if raw.get("model_type") != "qwen3" or any(raw.get(key) is None for key in _SHAPE_KEYS):
            return None
        if raw.get("hidden_act", "silu") != "silu" or raw.get("use_sliding_window", False):
            return None
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default" or "partial_rotary_factor" in rope:
            return None
        layers = int(raw["num_hidden_layers"])
        layer_types = tuple(raw.get("layer_types") or ("full_attention",) * layers)
        if set(layer_types) != {"full_attention"}:
            return None
        return cls(
            name_or_path=name_or_path,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw["num_key_value_heads"]),
            head_dim=int(raw["head_dim"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rms_norm_eps=float(raw["rms_norm_eps"]),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=layer_types,
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            dspark_real_vocab_size=raw.get("dspark_real_vocab_size"),
        )


@dataclass(frozen=True)
class GenerationConfig:
    """The one entry of ``generation_config.json`` the target reads (None: absent or no such file)."""

    eos_token_id: int | list[int] | None


class Attention(nn.Module):
    """The projections and q/k norms of transformers' ``Qwen3Attention`` (the target computes attention itself)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)


class DecoderLayer(nn.Module):
    """One decoder layer's modules, named as in transformers' ``Qwen3DecoderLayer``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class RotaryEmbedding(nn.Module):
    """transformers' ``Qwen3RotaryEmbedding`` for ``rope_type: default``: fp32 frequencies, cos / sin in x's dtype."""

    inv_freq: torch.Tensor

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)  # attention scaling 1.0 for default RoPE


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` of Qwen3: cos / sin unsqueezed at ``unsqueeze_dim`` (the heads axis)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


class Backbone(nn.Module):
    """transformers' ``Qwen3Model`` modules: embedding, decoder layers, final norm, rotary embedding."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class Qwen3Modules(nn.Module):
    """transformers' ``Qwen3ForCausalLM`` modules (``model``, ``lm_head``), ``config`` and ``generation_config``;
    no forward of its own (:class:`verify_service.target.TargetModel` runs the model)."""

    def __init__(self, config: Qwen3Config, generation_config: GenerationConfig) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names when sharded, else every one in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    return sorted(folder.glob("*.safetensors"))


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        state.update(load_file(path))
    return {name: tensor for name, tensor in state.items() if not name.endswith(_IGNORED_SUFFIXES)}


def load_qwen3(folder: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> Qwen3Modules | None:
    """The checkpoint in ``folder`` (``config.json``, safetensors, optional ``generation_config.json``) as
    :class:`Qwen3Modules` in ``dtype`` on ``device``, evaluation mode, no gradients; None when the config is one
    this module does not reproduce (see the module doc). Every parameter must be in the files and every tensor
    of the files must be a parameter (a tied LM head may be absent; when present, the embedding wins, as in
    transformers); anything else is a ``ValueError``: weights that do not fit are never loaded halfway."""
    path = Path(folder)
    config = Qwen3Config.from_json(json.loads((path / "config.json").read_text()), str(folder))
    if config is None:
        return None
    generation_file = path / "generation_config.json"
    eos = json.loads(generation_file.read_text()).get("eos_token_id") if generation_file.is_file() else None
    with uninitialised():  # every parameter is assigned from the files below
        modules = Qwen3Modules(config, GenerationConfig(eos_token_id=eos))
    state = _read_weights(path)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shapes = {name: param.shape for name, param in modules.named_parameters()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    missing, unexpected = sorted(shapes.keys() - state.keys()), sorted(state.keys() - shapes.keys())
    misshapen = sorted(name for name in shapes.keys() & state.keys() if state[name].shape != shapes[name])
    if missing or unexpected or misshapen:
        raise ValueError(f"{path}: the weights do not fit a Qwen3 model of its config.json (missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}, other shapes {misshapen[:5]})")
    modules.load_state_dict({name: tensor.to(device=device, dtype=dtype) for name, tensor in state.items()},
                            strict=False, assign=True)
    if config.tie_word_embeddings:
        modules.lm_head.weight = modules.model.embed_tokens.weight
    modules.model.rotary_emb.inv_freq = modules.model.rotary_emb.inv_freq.to(device)
    return modules.eval().requires_grad_(False)
