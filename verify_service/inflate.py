"""Embed a small Qwen3 target into a larger Qwen3 shape so that its logits stay exactly the small model's.

Why: the demo pair is tiny, so on a GPU its steps are launch-bound and say nothing about serving real models. An
inflated copy has the parameter count, matrix shapes, KV-cache size and vocabulary of e.g. Qwen3-4B, so every dense
kernel costs what it costs for the real model, while the function (and with it the drafter's acceptance) stays the
trained small model's. What that does and does not represent: docs/COST_REALISTIC.md.

The construction (exact in real arithmetic; in fp32 the logits agree to rounding noise):
- Extra hidden dims, heads, neurons and layers only ever read zeros or write zeros. The residual stream keeps its
  extra dims at exactly 0 because every write into them is 0 (embedding columns, o_proj / down_proj rows, ...).
- A weight entry is one of three kinds: COPIED (the small weight, possibly rescaled), ZERO (its row's output must
  be exact and its column's input can be non-zero), or FREE (the input is always 0, or the output never reaches the
  logits). With ``fill="random"`` FREE entries get N(0, initializer_range) values, so that more than 90% of an
  inflated matrix holds ordinary numbers: GPUs run matmuls on all-zero operands measurably faster (less switching
  power, higher clocks), which would flatter the timings. ``fill="zeros"`` zeroes them instead.
- Heads: small kv head j becomes big kv head(s) j*c .. j*c+c-1 (c = ceil(G/G') copies, G = query heads per kv head),
  small query head j*G + g becomes the big query head (j*c + g // G') * G' + g % G', so each keeps reading its own
  keys and values. Extra query heads are FREE (their o_proj columns are ZERO or read zero values), extra kv heads'
  keys are FREE and their values ZERO.
- Head dims: RoPE rotates pairs (t, t + d/2); small pair t sits at (t, t + D/2) of the big head, and the big RoPE
  base theta' = theta^(D/d) gives those pairs exactly the small frequencies (theta'^(-2t/D) = theta^(-2t/d); the
  fp32 inverse frequencies are bit-identical for D/d = 2, checked in the tests). The other dims of q and k are 0.
- RMSNorm over a wider vector divides by the wider count: with H small and H' big hidden dims the mean square
  shrinks by r_H = H/H'. One config value ``rms_norm_eps`` serves the hidden norms and the q/k norms, whose width
  also changes (d -> D, r_D = d/D). Exact for both: eps' = eps * r_H and hidden norm weights * sqrt(r_H); the q/k
  projections of real heads are scaled by c = sqrt(r_H / r_D) so that the q/k norms see c^2 r_D (ms + eps/...) =
  r_H (ms + eps) too, i.e. the same eps. The attention scale D^-0.5 instead of d^-0.5 and the norms' own sqrt(D/d)
  are compensated in the norm weights: q_norm * 1, k_norm * sqrt(r_D).
- Extra decoder layers come AFTER the originals (values and up_proj ZERO on the live inputs, so they add 0 to the
  residual): decoder layer l keeps index l, so a drafter's ``target_layer_ids`` keep their meaning. (The feature of
  the last ORIGINAL layer is no longer the final-normed one; drafters never use the last layer anyway.)
- Vocabulary: padded embedding rows are FREE (never looked up: TargetModel refuses those ids), padded LM-head rows
  are FREE too because their logits are masked: config.json records ``dspark_real_vocab_size`` and TargetModel /
  the drafter set logits past it to -inf; generation_config ``suppress_tokens`` does the same for HF ``generate``.
- Tied embeddings stay tied when the small model and the shape both tie them, else the big model is untied.

bf16 output: the rescaled tensors (hidden norm weights * sqrt(r_H), real q/k projection rows * c, k_norm *
sqrt(r_D)) are rounded to bf16 once more, a relative change of at most 2^-9 in those entries; every other copied
weight is bit-exact. ``compare_logits`` measures the effect against the small model's own bf16 rounding noise.

Everything is built with tensor ops directly on the chosen device (no Python loop over elements), so the ~4B
parameters of the qwen3-4b shape take seconds on a GPU.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from verify_service.target import REAL_VOCAB_KEY, real_vocab_size

INFLATION_KEY = "dspark_inflation"
"""config.json key: provenance of an inflated model (source shape, fill, seed)."""
FILLS = ("random", "zeros")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class Qwen3Shape:
    """The sizes that decide a Qwen3's cost (everything else comes from the small model's config)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True

    @classmethod
    def of(cls, config: Any) -> Qwen3Shape:
        """The shape of an HF Qwen3 config (object or dict)."""
        get: Callable[..., Any] = (
            config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
        )
        heads = int(get("num_attention_heads"))
        return cls(
            hidden_size=int(get("hidden_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )


SHAPES: dict[str, Qwen3Shape] = {
    "qwen3-0.6b": Qwen3Shape(1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": Qwen3Shape(2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": Qwen3Shape(2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": Qwen3Shape(4096, 36, 32, 8, 128, 12288, 151936, False),
}
"""Published Qwen3 dense shapes (config.json of the Qwen/Qwen3-* checkpoints)."""


def resolve_shape(shape: str | Path | Qwen3Shape) -> Qwen3Shape:
    """A Qwen3Shape, a preset name from SHAPES, or the path of an HF Qwen3 config.json (or of its folder)."""
    if isinstance(shape, Qwen3Shape):
        return shape
    if str(shape) in SHAPES:
        return SHAPES[str(shape)]
    path = Path(shape)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown shape {str(shape)!r}: expected one of {sorted(SHAPES)} or an HF config.json path")
    try:
        config = json.loads(path.read_text())
        if config.get("model_type") != "qwen3":
            raise ValueError(f"model_type is {config.get('model_type')!r}, expected 'qwen3'")
        return Qwen3Shape.of(config)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"shape file {path}: not a usable Qwen3 config ({exc})") from exc


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class InflationPlan:
    """Where every small dimension of a decoder layer goes in the big one, and the rescalings that keep it exact.

    Shared by target and drafter layers (same parameter names, same math). Index tensors live on the CPU; the
    helpers move them to the weights' device.
    """

    small: Qwen3Shape
    big: Qwen3Shape
    dim_index: torch.Tensor  # [d]: big head-dim position of each small head dim (RoPE pairs kept)
    q_heads: torch.Tensor  # [nq]: big query head of each small query head
    kv_heads: torch.Tensor  # [nkv, c]: big kv heads holding copies of each small kv head

    @classmethod
    def build(cls, small: Qwen3Shape, big: Qwen3Shape) -> InflationPlan:
        """Validate that ``small`` fits into ``big`` (ValueError naming the size otherwise) and map it."""
        for field in ("hidden_size", "head_dim", "intermediate_size", "vocab_size", "num_hidden_layers"):
            if getattr(big, field) < getattr(small, field):
                raise ValueError(
                    f"cannot inflate: {field} {getattr(small, field)} is larger than the shape's {getattr(big, field)}"
                )
        if small.head_dim % 2 or big.head_dim % 2:
            raise ValueError(f"RoPE needs even head dims, got {small.head_dim} -> {big.head_dim}")
        for shape in (small, big):
            if shape.num_attention_heads % shape.num_key_value_heads:
                raise ValueError(
                    f"{shape.num_attention_heads} query heads are not a multiple of "
                    f"{shape.num_key_value_heads} kv heads"
                )
        group = small.num_attention_heads // small.num_key_value_heads
        big_group = big.num_attention_heads // big.num_key_value_heads
        copies = -(-group // big_group)
        if small.num_key_value_heads * copies > big.num_key_value_heads:
            raise ValueError(
                f"cannot inflate attention {small.num_attention_heads}/{small.num_key_value_heads} heads into "
                f"{big.num_attention_heads}/{big.num_key_value_heads}: each of the {small.num_key_value_heads} kv "
                f"heads needs {copies} big kv heads for its {group} query heads"
            )
        half, big_half = small.head_dim // 2, big.head_dim // 2
        t = torch.arange(small.head_dim)
        dim_index = torch.where(t < half, t, t - half + big_half)
        q = torch.arange(small.num_attention_heads)
        kv_of_q, member = q // group, q % group
        q_heads = (kv_of_q * copies + member // big_group) * big_group + member % big_group
        kv_heads = torch.arange(small.num_key_value_heads)[:, None] * copies + torch.arange(copies)[None, :]
        return cls(small, big, dim_index, q_heads, kv_heads)

    # ---- rescalings ---------------------------------------------------------------------------------------
    @property
    def hidden_ratio(self) -> float:
        """r_H = H / H': the factor by which the mean square over the hidden width shrinks."""
        return self.small.hidden_size / self.big.hidden_size

    @property
    def head_ratio(self) -> float:
        """r_D = d / D for the q/k norms."""
        return self.small.head_dim / self.big.head_dim

    def eps(self, small_eps: float) -> float:
        """rms_norm_eps of the big model: eps * r_H keeps every hidden norm exact."""
        return small_eps * self.hidden_ratio

    def rope_theta(self, small_theta: float) -> float:
        """theta^(D/d): the big head's first d/2 RoPE pairs rotate at exactly the small frequencies."""
        return small_theta ** (self.big.head_dim / self.small.head_dim)

    @property
    def norm_scale(self) -> float:
        return math.sqrt(self.hidden_ratio)

    @property
    def qk_proj_scale(self) -> float:
        """c = sqrt(r_H / r_D): the q/k norms then see the same eps as the hidden norms, exactly."""
        return math.sqrt(self.hidden_ratio / self.head_ratio)

    # ---- index helpers ------------------------------------------------------------------------------------
    def head_rows(self, big_heads: torch.Tensor) -> torch.Tensor:
        """Big projection rows of the real dims of ``big_heads`` [n] -> [n * d] (head-major, like the small)."""
        return (big_heads[:, None] * self.big.head_dim + self.dim_index[None, :]).reshape(-1)

    def all_head_rows(self, big_heads: torch.Tensor) -> torch.Tensor:
        """Every big projection row (real and padded dims) of ``big_heads``."""
        return (big_heads[:, None] * self.big.head_dim + torch.arange(self.big.head_dim)[None, :]).reshape(-1)


class Filler:
    """Makes the big tensors: FREE entries random N(0, std) (or zero with fill='zeros'), reproducibly seeded."""

    def __init__(self, fill: str, std: float, dtype: torch.dtype, device: torch.device | str, seed: int) -> None:
        if fill not in FILLS:
            raise ValueError(f"unknown fill {fill!r}; expected one of {FILLS}")
        if not std > 0:
            raise ValueError(f"the fill standard deviation must be positive, got {std}")
        self.fill, self.std, self.dtype, self.device = fill, std, dtype, torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def tensor(self, *shape: int) -> torch.Tensor:
        if self.fill == "zeros":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        out = torch.randn(shape, dtype=self.dtype, device=self.device, generator=self.generator)
        return out.mul_(self.std)

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


def place(
    big: torch.Tensor,
    small: torch.Tensor | None,
    *,
    rows: torch.Tensor | None,
    cols: torch.Tensor | None,
    fixed_rows: torch.Tensor | None = None,
    live_cols: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Write a small matrix into a big one in place and return it.

    ``fixed_rows`` (None = all rows) are outputs that must be exact: their entries on ``live_cols`` (None = all
    columns: inputs that can be non-zero) are zeroed first. Then ``small * scale`` goes to (rows x cols) (None =
    the leading rows / columns). Everything else keeps the filler's values (FREE).
    """
    device = big.device
    out_size, in_size = big.shape
    row_mask = torch.ones(out_size, dtype=torch.bool, device=device)
    if fixed_rows is not None:
        row_mask = torch.zeros_like(row_mask).index_fill_(0, fixed_rows.to(device), True)
    col_mask = torch.ones(in_size, dtype=torch.bool, device=device)
    if live_cols is not None:
        col_mask = torch.zeros_like(col_mask).index_fill_(0, live_cols.to(device), True)
    big.masked_fill_(row_mask[:, None] & col_mask[None, :], 0)
    if small is not None:
        block = (small.to(device, torch.float32) * scale).to(big.dtype)
        r = torch.arange(small.shape[0], device=device) if rows is None else rows.to(device)
        c = torch.arange(small.shape[1], device=device) if cols is None else cols.to(device)
        big[r[:, None], c[None, :]] = block
    return big


def place_vector(
    big: torch.Tensor, small: torch.Tensor, index: torch.Tensor | None, scale: float = 1.0
) -> torch.Tensor:
    """Write ``small * scale`` into a vector at ``index`` (None = the leading entries)."""
    block = (small.to(big.device, torch.float32) * scale).to(big.dtype)
    if index is None:
        big[: small.shape[0]] = block
    else:
        big[index.to(big.device)] = block
    return big


LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
"""Parameters of one decoder layer, named alike in HF Qwen3 and in the DSpark drafter."""


def inflate_layer(
    small: Mapping[str, torch.Tensor] | None, plan: InflationPlan, filler: Filler
) -> dict[str, torch.Tensor]:
    """One big decoder layer: the small layer embedded (``small`` given) or an identity layer (``small`` None).

    Both kinds satisfy the invariant: with zeros in the residual's extra dims at the input, the output has zeros
    there, and the real dims are the small layer's output (or the input, for an identity layer).
    """
    if small is not None:
        extra = sorted(set(small) - set(LAYER_KEYS))
        if extra:
            raise ValueError(f"cannot inflate layer parameters {extra} (attention bias is not supported)")
    s, b = plan.small, plan.big
    H, Hb, Db = s.hidden_size, b.hidden_size, b.head_dim
    live_hidden = torch.arange(H)  # inputs read from a normed residual: its extra dims are 0
    real = small is not None
    q_heads = plan.q_heads if real else plan.q_heads[:0]
    kv_heads = plan.kv_heads.reshape(-1) if real else plan.kv_heads.reshape(-1)[:0]
    copies = plan.kv_heads.shape[1]

    def weight(key: str) -> torch.Tensor | None:
        # The small layer's parameter ``key``; None for an identity layer.
        return None if small is None else small[key]

    def kv_source(key: str) -> torch.Tensor | None:
        # The small layer's kv rows of ``key`` repeated for each big copy, in the order of kv_heads.reshape(-1).
        rows = weight(key)
        if rows is None:
            return None
        return rows.view(s.num_key_value_heads, 1, s.head_dim, H).expand(-1, copies, -1, -1).reshape(-1, H)

    out: dict[str, torch.Tensor] = {}
    for key in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        big = filler.zeros(Hb)
        if small is not None:
            place_vector(big, small[key], None, plan.norm_scale)
        else:
            big[:H] = 1.0  # reads only dead or zero-valued paths; any finite weight works
        out[key] = big

    q = filler.tensor(b.num_attention_heads * Db, Hb)
    out["self_attn.q_proj.weight"] = place(
        q,
        weight("self_attn.q_proj.weight"),
        rows=plan.head_rows(q_heads),
        cols=None,
        fixed_rows=plan.all_head_rows(q_heads),
        live_cols=live_hidden,
        scale=plan.qk_proj_scale,
    )
    k = filler.tensor(b.num_key_value_heads * Db, Hb)
    out["self_attn.k_proj.weight"] = place(
        k,
        kv_source("self_attn.k_proj.weight"),
        rows=plan.head_rows(kv_heads),
        cols=None,
        fixed_rows=plan.all_head_rows(kv_heads),
        live_cols=live_hidden,
        scale=plan.qk_proj_scale,
    )
    # Values: every row that is not a copy of a small value row is 0 on the live inputs, so attention outputs are
    # non-zero only in the real dims of query heads that read a real kv head.
    v = filler.tensor(b.num_key_value_heads * Db, Hb)
    out["self_attn.v_proj.weight"] = place(
        v,
        kv_source("self_attn.v_proj.weight"),
        rows=plan.head_rows(kv_heads),
        cols=None,
        fixed_rows=None,
        live_cols=live_hidden,
    )
    big_group = b.num_attention_heads // b.num_key_value_heads
    readers = torch.arange(b.num_attention_heads)
    readers = readers[torch.isin(readers // big_group, kv_heads)]
    o = filler.tensor(Hb, b.num_attention_heads * Db)
    out["self_attn.o_proj.weight"] = place(
        o,
        weight("self_attn.o_proj.weight"),
        rows=None,
        cols=plan.head_rows(q_heads),
        fixed_rows=None,
        live_cols=plan.head_rows(readers),
    )
    for key, scale in (("self_attn.q_norm.weight", 1.0), ("self_attn.k_norm.weight", math.sqrt(plan.head_ratio))):
        big = filler.zeros(Db)
        if small is not None:
            place_vector(big, small[key], plan.dim_index, scale)
        else:
            big[plan.dim_index] = 1.0
        out[key] = big

    # MLP: extra neurons have FREE gate rows and ZERO up rows, so silu(gate) * up = 0 and down reads zeros there.
    neurons = torch.arange(s.intermediate_size if real else 0)
    gate = filler.tensor(b.intermediate_size, Hb)
    out["mlp.gate_proj.weight"] = place(
        gate,
        weight("mlp.gate_proj.weight"),
        rows=None,
        cols=None,
        fixed_rows=neurons,
        live_cols=live_hidden,
    )
    up = filler.tensor(b.intermediate_size, Hb)
    out["mlp.up_proj.weight"] = place(
        up, weight("mlp.up_proj.weight"), rows=None, cols=None, fixed_rows=None, live_cols=live_hidden
    )
    down = filler.tensor(Hb, b.intermediate_size)
    out["mlp.down_proj.weight"] = place(
        down, weight("mlp.down_proj.weight"), rows=None, cols=None, fixed_rows=None, live_cols=neurons
    )
    return out


def inflate_embedding(small: torch.Tensor, big_vocab: int, big_hidden: int, filler: Filler) -> torch.Tensor:
    """[V', H'] input embedding: real rows are the small ones with zero extra columns (they write the residual);
    padded rows are FREE (never looked up). Also valid as a tied LM head."""
    big = filler.tensor(big_vocab, big_hidden)
    return place(big, small, rows=None, cols=None, fixed_rows=torch.arange(small.shape[0]), live_cols=None)


def inflate_lm_head(small: torch.Tensor, big_vocab: int, big_hidden: int, filler: Filler) -> torch.Tensor:
    """[V', H'] untied LM head: extra columns read zeros and padded rows are masked, so only the real block counts."""
    vocab, hidden = small.shape
    big = filler.tensor(big_vocab, big_hidden)
    return place(big, small, rows=None, cols=None, fixed_rows=torch.arange(vocab), live_cols=torch.arange(hidden))


def inflate_norm(small: torch.Tensor, plan: InflationPlan, filler: Filler) -> torch.Tensor:
    """[H'] hidden RMSNorm weight: small * sqrt(r_H), zero on the extra dims."""
    return place_vector(filler.zeros(plan.big.hidden_size), small, None, plan.norm_scale)


def inflated_config(
    small_config: Mapping[str, Any], plan: InflationPlan, *, tied: bool, dtype: torch.dtype, provenance: dict
) -> dict[str, Any]:
    """config.json of the big model: the small one's keys with the big sizes, eps', theta' and the real vocab."""
    out = dict(small_config)
    b = plan.big
    theta = _rope_theta(small_config)
    out.update(
        hidden_size=b.hidden_size,
        num_hidden_layers=b.num_hidden_layers,
        num_attention_heads=b.num_attention_heads,
        num_key_value_heads=b.num_key_value_heads,
        head_dim=b.head_dim,
        intermediate_size=b.intermediate_size,
        vocab_size=b.vocab_size,
        tie_word_embeddings=tied,
        rms_norm_eps=plan.eps(float(small_config["rms_norm_eps"])),
        layer_types=["full_attention"] * b.num_hidden_layers,
        max_window_layers=b.num_hidden_layers,
        rope_parameters={"rope_type": "default", "rope_theta": plan.rope_theta(theta)},
        dtype=next(name for name, value in DTYPES.items() if value == dtype),
    )
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    out.pop("torch_dtype", None)
    out[REAL_VOCAB_KEY] = int(small_config.get(REAL_VOCAB_KEY) or plan.small.vocab_size)
    out[INFLATION_KEY] = provenance
    return out


def _rope_theta(config: Mapping[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    scaling = config.get("rope_scaling")
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        raise ValueError(
            f"cannot inflate RoPE of type {rope_type!r} / {scaling!r}: only default RoPE keeps its frequencies"
        )
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def build_qwen3(
    config: Mapping[str, Any], state: Mapping[str, torch.Tensor], device: torch.device | str
) -> Qwen3ForCausalLM:
    """An HF Qwen3ForCausalLM holding ``state`` (no second copy, no random init), in eval mode on ``device``."""
    hf_config = Qwen3Config(**config)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(hf_config)
    model.load_state_dict(dict(state), strict=True, assign=True)
    if hf_config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The RoPE buffers were made on the meta device: rebuild them (on the CPU, as from_pretrained does, then move).
    model.model.rotary_emb = Qwen3RotaryEmbedding(hf_config).to(device)
    return model.eval().requires_grad_(False)


def inflate_target(
    small: Qwen3ForCausalLM,
    shape: str | Qwen3Shape,
    *,
    dtype: str | torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    fill: str = "random",
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """The small HF Qwen3 embedded into ``shape`` (see the module docstring), built directly on ``device``."""
    dtype = resolve_dtype(dtype)
    big_shape = resolve_shape(shape)
    small_config = small.config.to_dict()
    if small_config.get("model_type") != "qwen3":
        raise ValueError(f"inflate_target: expected a qwen3 model, got {small_config.get('model_type')!r}")
    if small_config.get("attention_bias"):
        raise ValueError("inflate_target: attention bias is not supported")
    small_shape = Qwen3Shape.of(small_config)
    plan = InflationPlan.build(small_shape, big_shape)
    tied = small_shape.tie_word_embeddings and big_shape.tie_word_embeddings
    filler = Filler(fill, float(small_config.get("initializer_range") or 0.02), dtype, device, seed)
    weights = small.state_dict()
    b = big_shape
    state: dict[str, torch.Tensor] = {}
    embed = inflate_embedding(weights["model.embed_tokens.weight"], b.vocab_size, b.hidden_size, filler)
    state["model.embed_tokens.weight"] = embed
    for index in range(b.num_hidden_layers):
        prefix = f"model.layers.{index}."
        layer = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)} or None
        for key, value in inflate_layer(layer, plan, filler).items():
            state[prefix + key] = value
    state["model.norm.weight"] = inflate_norm(weights["model.norm.weight"], plan, filler)
    state["lm_head.weight"] = (
        embed if tied else inflate_lm_head(weights["lm_head.weight"], b.vocab_size, b.hidden_size, filler)
    )
    provenance = {"from": asdict(small_shape), "shape": asdict(big_shape), "fill": fill, "seed": seed}
    config = inflated_config(small_config, plan, tied=tied, dtype=dtype, provenance=provenance)
    model = build_qwen3(config, state, device)
    model.generation_config = _generation_config(small, real_vocab_size(config), b.vocab_size)
    return model


def _generation_config(small: Qwen3ForCausalLM, real_vocab: int, vocab: int) -> GenerationConfig:
    """The small model's generation config; padded ids suppressed so that plain HF ``generate`` never emits them."""
    config = GenerationConfig.from_dict(small.generation_config.to_dict())
    if real_vocab < vocab:
        config.suppress_tokens = list(range(real_vocab, vocab))
    return config


def load_small_target(folder: str | Path) -> Qwen3ForCausalLM:
    """A local HF Qwen3 folder in float32 on the CPU (bf16 weights upcast exactly), the inflation's source."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path / 'config.json'} does not exist (expected a local HF Qwen3 folder)")
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def save_target(model: Qwen3ForCausalLM, out_dir: str | Path, *, tokenizer_from: str | Path | None = None) -> Path:
    """save_pretrained (sharded safetensors) plus the source folder's tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="4GB")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_from) / name
            if source.is_file():
                shutil.copyfile(source, out / name)
    return out


@torch.no_grad()
def compare_logits(small: Qwen3ForCausalLM, big: Qwen3ForCausalLM, token_ids: torch.Tensor) -> dict[str, float]:
    """Plain HF forward of both on ``token_ids`` [B, T] (real ids): how far the big model's real-vocabulary
    logits are from the small one's, next to the small model's own rounding noise in the big model's dtype.

    Returns max |diff| and greedy agreement for big vs small, and for small-in-big-dtype vs small (the noise
    floor: a bf16 copy of the small model differs from its fp32 self by about this much).
    """
    real = real_vocab_size(big.config)
    weight = next(big.parameters())
    ids = token_ids.to(weight.device)
    # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads (self as the argument).
    reference = copy.deepcopy(small).to(weight.device, torch.float32)(ids).logits.float()  # type: ignore[arg-type]
    inflated = big(ids).logits.float()[..., :real]
    noise = copy.deepcopy(small).to(weight.device, weight.dtype)(ids).logits.float()  # type: ignore[arg-type]
    argmax = reference.argmax(-1)
    return {
        "max_abs_logit_diff": float((inflated - reference).abs().max()),
        "greedy_agreement": float((inflated.argmax(-1) == argmax).float().mean()),
        "noise_max_abs_logit_diff": float((noise - reference).abs().max()),
        "noise_greedy_agreement": float((noise.argmax(-1) == argmax).float().mean()),
    }


def describe(model: torch.nn.Module) -> dict[str, Any]:
    """Sizes for reports: parameters, bytes, the fraction of weights that are exactly zero, shape (HF models)."""
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(p.numel() for p in params)
    info: dict[str, Any] = {
        "parameters": total,
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "zero_fraction": sum(int((p == 0).sum()) for p in params) / total,
    }
    if not isinstance(model, Qwen3ForCausalLM):
        return info
    return {
        **info,
        "shape": asdict(Qwen3Shape.of(model.config)),
        "real_vocab_size": real_vocab_size(model.config),
    }


def config_json(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    return json.loads(path.read_text())
