"""DraftConfig: the DSpark draft model's configuration, parsed from a DeepSpec draft ``config.json``.

DeepSpec writes the draft config as a deep copy of the target's HF config plus a few DSpark keys
(``block_size``, ``target_layer_ids``, ``mask_token_id``, ``markov_rank``, ...), with ``num_hidden_layers``
overwritten by the number of DRAFT layers. We parse only what inference needs, validate it eagerly (a wrong
checkpoint must fail at load time with the file and key named, not later with a shape error), and keep the raw
dictionary so that saving writes back every key DeepSpec wrote.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
REAL_VOCAB_KEY = "dspark_real_vocab_size"


class CheckpointError(ValueError):
    """A draft config or checkpoint is invalid; the message names the file and the key (or tensor name)."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        super().__init__(f"{source}: key '{key}': {message}")


def _get(
    raw: Mapping[str, Any], key: str, source: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    if key not in raw or raw[key] is None:
        if default is ...:
            raise CheckpointError(source, key, "missing")
        return default
    value = raw[key]
    # bool is a subclass of int: reject true/false where a number is expected, and 0/1 where a bool is.
    if kind is bool and not isinstance(value, bool):
        raise CheckpointError(source, key, f"expected true/false, got {value!r}")
    if kind is not bool and isinstance(value, bool):
        raise CheckpointError(source, key, f"expected a number, got {value!r}")
    if not isinstance(value, kind):
        raise CheckpointError(source, key, f"expected {kind}, got {value!r}")
    return value


def _rope_theta(raw: Mapping[str, Any], source: str) -> float:
    """RoPE base from transformers-5 ``rope_parameters`` or the older top-level ``rope_theta``."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping):
            raise CheckpointError(source, "rope_parameters", f"expected an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(
                source, "rope_parameters.rope_type", f"only 'default' RoPE is supported, got {rope_type!r}"
            )
        theta = params.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise CheckpointError(source, "rope_parameters.rope_theta", "missing")
    else:
        scaling = raw.get("rope_scaling")
        if scaling is not None:
            rope_type = (
                scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else scaling
            )
            if rope_type != "default":
                raise CheckpointError(
                    source, "rope_scaling", f"only default RoPE is supported, got {scaling!r}"
                )
        theta = raw.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(source, "rope_theta", f"expected a positive number, got {theta!r}")
    return float(theta)


@dataclass(frozen=True)
class DraftConfig:
    """Everything the draft model needs; ``num_draft_layers`` is DeepSpec's ``num_hidden_layers``."""

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    block_size: int
    num_draft_layers: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # ``dspark_real_vocab_size`` of an inflated pair (verify_service/inflate.py): ids from here on are padding whose
    # logits are masked to -inf; None = every id is real.
    real_vocab_size: int | None = None

    @property
    def num_context_layers(self) -> int:
        """m: how many target layers are concatenated into one context-feature row."""
        return len(self.target_layer_ids)

    @property
    def context_feature_size(self) -> int:
        """Width of a context-feature row, m * H (input of ``fc``)."""
        return self.num_context_layers * self.hidden_size

    @property
    def confidence_input_size(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @classmethod
    def from_json(cls, path: str | Path) -> DraftConfig:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(str(path), "<file>", "config file not found")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(str(path), "<file>", f"not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(str(path), "<file>", "expected a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "<draft config>") -> DraftConfig:
        raw = dict(raw)
        hidden = _get(raw, "hidden_size", source, int)
        heads = _get(raw, "num_attention_heads", source, int)
        kv_heads = _get(raw, "num_key_value_heads", source, int, heads)
        head_dim = _get(raw, "head_dim", source, int, hidden // heads if heads > 0 else 0)
        for key, value in (
            ("hidden_size", hidden),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise CheckpointError(source, key, f"must be positive, got {value}")
        if heads % kv_heads != 0:
            raise CheckpointError(
                source, "num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}"
            )
        if head_dim % 2 != 0:
            raise CheckpointError(source, "head_dim", f"RoPE needs an even head_dim, got {head_dim}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(source, "hidden_act", f"only 'silu' (SwiGLU) is supported, got {act!r}")

        num_draft_layers = _get(raw, "num_hidden_layers", source, int)
        if num_draft_layers <= 0:
            raise CheckpointError(source, "num_hidden_layers", f"must be positive, got {num_draft_layers}")
        layer_types = raw.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise CheckpointError(
                source, "layer_types", f"only 'full_attention' is supported, got {layer_types}"
            )
        num_target_layers = _get(raw, "num_target_layers", source, int)
        if num_target_layers <= 0:
            raise CheckpointError(source, "num_target_layers", f"must be positive, got {num_target_layers}")
        layer_ids = _get(raw, "target_layer_ids", source, list)
        if not layer_ids or any(isinstance(i, bool) or not isinstance(i, int) for i in layer_ids):
            raise CheckpointError(
                source, "target_layer_ids", f"expected a non-empty list of ints, got {layer_ids}"
            )
        validate_target_layer_ids(layer_ids, num_target_layers, source, "target_layer_ids")

        vocab = _get(raw, "vocab_size", source, int)
        if vocab <= 0:
            raise CheckpointError(source, "vocab_size", f"must be positive, got {vocab}")
        mask_token_id = _get(raw, "mask_token_id", source, int)
        if not 0 <= mask_token_id < vocab:
            raise CheckpointError(
                source, "mask_token_id", f"{mask_token_id} is outside the vocabulary [0, {vocab})"
            )
        block_size = _get(raw, "block_size", source, int)
        if block_size <= 0:
            raise CheckpointError(source, "block_size", f"must be positive, got {block_size}")

        markov_rank = _get(raw, "markov_rank", source, int)
        if markov_rank < 0:
            raise CheckpointError(source, "markov_rank", f"must be >= 0, got {markov_rank}")
        markov_head_type = None
        if markov_rank > 0:
            markov_head_type = _get(raw, "markov_head_type", source, str).lower()
            if markov_head_type not in MARKOV_HEAD_TYPES:
                raise CheckpointError(
                    source,
                    "markov_head_type",
                    f"unknown head type {raw['markov_head_type']!r}; expected one of {MARKOV_HEAD_TYPES}",
                )
        enable_confidence = _get(raw, "enable_confidence_head", source, bool)
        with_markov = False
        if enable_confidence:
            with_markov = _get(raw, "confidence_head_with_markov", source, bool)
            if with_markov and markov_rank == 0:
                raise CheckpointError(
                    source, "confidence_head_with_markov", "true needs a Markov head (markov_rank > 0)"
                )
        real_vocab = _get(raw, REAL_VOCAB_KEY, source, int, None)
        if real_vocab is not None:
            if not 0 < real_vocab <= vocab:
                raise CheckpointError(source, REAL_VOCAB_KEY, f"must be in [1, vocab_size={vocab}], got {real_vocab}")
            if mask_token_id >= real_vocab:
                raise CheckpointError(
                    source, "mask_token_id", f"{mask_token_id} is a padded id (real vocabulary: [0, {real_vocab}))"
                )
        eps = _get(raw, "rms_norm_eps", source, (int, float))
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_get(raw, "intermediate_size", source, int),
            rms_norm_eps=float(eps),
            rope_theta=_rope_theta(raw, source),
            attention_bias=_get(raw, "attention_bias", source, bool, False),
            block_size=block_size,
            num_draft_layers=num_draft_layers,
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(layer_ids),
            mask_token_id=mask_token_id,
            markov_rank=markov_rank,
            markov_head_type=markov_head_type,
            enable_confidence_head=enable_confidence,
            confidence_head_with_markov=with_markov,
            raw=raw,
            real_vocab_size=real_vocab,
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json content: the raw keys we were built from, with our parsed fields written over them.

        A config built in code (no raw dict) gets the minimal DeepSpec key set, so DeepSpec can load what we
        save.
        """
        out = dict(self.raw)
        out.update(
            {
                "architectures": out.get("architectures", ["Qwen3DSparkModel"]),
                "model_type": out.get("model_type", "qwen3"),
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size,
                "hidden_act": "silu",
                "rms_norm_eps": self.rms_norm_eps,
                "attention_bias": self.attention_bias,
                "block_size": self.block_size,
                "num_hidden_layers": self.num_draft_layers,
                "layer_types": ["full_attention"] * self.num_draft_layers,
                "num_target_layers": self.num_target_layers,
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "markov_rank": self.markov_rank,
                "enable_confidence_head": self.enable_confidence_head,
                "tie_word_embeddings": False,
            }
        )
        if "rope_theta" in out and "rope_parameters" not in out:
            out["rope_theta"] = self.rope_theta
        else:
            out["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        out.pop("markov_head_type", None)
        if self.markov_head_type is not None:
            out["markov_head_type"] = self.markov_head_type
        out.pop("confidence_head_with_markov", None)
        if self.enable_confidence_head:
            out["confidence_head_with_markov"] = self.confidence_head_with_markov
        out.pop(REAL_VOCAB_KEY, None)
        if self.real_vocab_size is not None:
            out[REAL_VOCAB_KEY] = self.real_vocab_size
        return out


def validate_target_layer_ids(layer_ids: list[int], num_target_layers: int, source: str, key: str) -> None:
    """DeepSpec's rule: ids in {-1} U [0, L-2], strictly increasing.

    The last target layer is excluded because HF's ``output_hidden_states`` stores the final NORMED state
    there, while the drafter was trained on raw decoder-layer outputs.
    """
    previous: int | None = None
    for layer_id in layer_ids:
        if not (layer_id == -1 or 0 <= layer_id <= num_target_layers - 2):
            raise CheckpointError(
                source,
                key,
                f"target layer id {layer_id} is out of range {{-1}} U [0, {num_target_layers - 2}] for a "
                f"target with {num_target_layers} layers (-1 = embedding output; the last layer is excluded)",
            )
        if previous is not None and layer_id <= previous:
            raise CheckpointError(source, key, f"ids must be strictly increasing, got {layer_ids}")
        previous = layer_id
