"""Embed a DSpark drafter into the shape of its inflated target, function-preserving (CLI: inflate_cli.py).

The drafter's backbone layers are Qwen3 decoder layers with the same parameter names, so they are inflated by the
target's own code (:func:`verify_service.inflate.inflate_layer`, same plan, same rescalings, same eps and RoPE
base rules). What is specific to the drafter:
- ``fc`` [H', m*H'] maps the inflated target's context features: the real block of each feature layer is copied,
  columns of the features' extra dims (always 0) are FREE, and rows of the extra hidden dims are ZERO on the live
  columns (their output feeds ``hidden_norm``, whose statistics must not change).
- ``embed_tokens`` / ``lm_head`` are the inflated TARGET's tensors with the drafter's real block written in, so
  they equal the target's exactly whenever the small copies did (the checkpoint loader checks this).
- Markov W1 / W2 [V', r]: padded rows are FREE (a padded id is never the previous token, and its logit is -inf).
  Gated / RNN head and confidence head inputs [.., H' ..]: the extra hidden columns read zeros and are FREE.
- The mask token id and ``target_layer_ids`` are unchanged (extra target layers come after the originals), the
  draft layer count too; ``num_target_layers`` becomes the big target's, ``dspark_real_vocab_size`` is recorded.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3ForCausalLM

from draft_service.checkpoint import load_draft_model, save_draft_model
from draft_service.config import DraftConfig
from draft_service.model import DSparkDraftModel, RotaryEmbedding
from verify_service.inflate import (
    Filler,
    InflationPlan,
    Qwen3Shape,
    describe,
    inflate_layer,
    inflate_norm,
    inflate_target,
    load_small_target,
    place,
    resolve_dtype,
    save_target,
)
from verify_service.target import TargetModel, real_vocab_size


def _draft_shape(config: DraftConfig) -> Qwen3Shape:
    return Qwen3Shape(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_draft_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
    )


def _columns(segments: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Column maps of a concatenated input [seg_1 ; seg_2 ; ...]: each segment is (small width, big width,
    extra columns read zeros). Returns (big column of each small column, live big columns)."""
    dst, live, offset = [], [], 0
    for small_width, big_width, _ in segments:
        cols = offset + torch.arange(small_width)
        dst.append(cols)
        live.append(cols if small_width < big_width else offset + torch.arange(big_width))
        offset += big_width
    return torch.cat(dst), torch.cat(live)


def inflate_draft(
    small: DSparkDraftModel,
    target: Qwen3ForCausalLM,
    *,
    fill: str = "random",
    seed: int = 1,
) -> DSparkDraftModel:
    """The small drafter embedded into the shape of ``target`` (an INFLATED target, e.g. from ``inflate_target``),
    on the target's device and in its dtype."""
    c = small.config
    if c.attention_bias:
        raise ValueError("inflate_draft: attention bias is not supported")
    target_config = target.config
    big_target = Qwen3Shape.of(target_config)
    big = dataclasses.replace(big_target, num_hidden_layers=c.num_draft_layers)
    plan = InflationPlan.build(_draft_shape(c), big)
    real_vocab = real_vocab_size(target_config)
    if (c.real_vocab_size or c.vocab_size) != real_vocab:
        raise ValueError(
            f"inflate_draft: the drafter's vocabulary has {c.real_vocab_size or c.vocab_size} real ids, the "
            f"target's {real_vocab}"
        )
    embed_big = target.model.embed_tokens.weight  # get_input_embeddings(), typed as the nn.Embedding it is
    dtype, device = embed_big.dtype, embed_big.device
    filler = Filler(fill, float(c.raw.get("initializer_range") or 0.02), dtype, device, seed)
    weights = small.state_dict()
    H, Hb, m = c.hidden_size, big.hidden_size, c.num_context_layers
    state: dict[str, torch.Tensor] = {}

    # Embedding copies: the target's big tensors (padding included) with the drafter's own real block.
    real_rows = torch.arange(c.vocab_size)
    state["embed_tokens.weight"] = place(
        embed_big.detach().clone(), weights["embed_tokens.weight"], rows=None, cols=None, fixed_rows=real_rows
    )
    state["lm_head.weight"] = place(
        target.get_output_embeddings().weight.detach().clone(),
        weights["lm_head.weight"],
        rows=None,
        cols=None,
        fixed_rows=real_rows,
        live_cols=torch.arange(H),
    )
    fc_cols, fc_live = _columns([(H, Hb, True)] * m)
    state["fc.weight"] = place(
        filler.tensor(Hb, m * Hb), weights["fc.weight"], rows=None, cols=fc_cols, fixed_rows=None, live_cols=fc_live
    )
    for key in ("hidden_norm.weight", "norm.weight"):
        state[key] = inflate_norm(weights[key], plan, filler)
    for index in range(c.num_draft_layers):
        prefix = f"layers.{index}."
        layer = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        for key, value in inflate_layer(layer, plan, filler).items():
            state[prefix + key] = value

    r = c.markov_rank
    if small.markov_head is not None:
        for key in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
            big_w = filler.tensor(big.vocab_size, r)
            state[key] = place(big_w, weights[key], rows=None, cols=None, fixed_rows=real_rows)
        if c.markov_head_type == "gated":  # input [h ; W1[x]]
            cols, live = _columns([(H, Hb, True), (r, r, False)])
            state["markov_head.gate_proj.weight"] = place(
                filler.tensor(r, Hb + r), weights["markov_head.gate_proj.weight"], rows=None, cols=cols, live_cols=live
            )
            state["markov_head.gate_proj.bias"] = weights["markov_head.gate_proj.bias"].to(device, dtype)
        if c.markov_head_type == "rnn":  # input [s ; W1[x] ; h]
            cols, live = _columns([(r, r, False), (r, r, False), (H, Hb, True)])
            state["markov_head.joint_proj.weight"] = place(
                filler.tensor(3 * r, 2 * r + Hb),
                weights["markov_head.joint_proj.weight"],
                rows=None,
                cols=cols,
                live_cols=live,
            )
            state["markov_head.joint_proj.bias"] = weights["markov_head.joint_proj.bias"].to(device, dtype)
    if small.confidence_head is not None:  # input [h] or [h ; W1[x]]
        segments = [(H, Hb, True)] + ([(r, r, False)] if c.confidence_head_with_markov else [])
        cols, live = _columns(segments)
        width = Hb + (r if c.confidence_head_with_markov else 0)
        state["confidence_head.proj.weight"] = place(
            filler.tensor(1, width), weights["confidence_head.proj.weight"], rows=None, cols=cols, live_cols=live
        )
        state["confidence_head.proj.bias"] = weights["confidence_head.proj.bias"].to(device, dtype)

    raw = dict(c.raw)
    raw.pop("rope_theta", None)
    config = dataclasses.replace(
        c,
        vocab_size=big.vocab_size,
        hidden_size=Hb,
        num_attention_heads=big.num_attention_heads,
        num_key_value_heads=big.num_key_value_heads,
        head_dim=big.head_dim,
        intermediate_size=big.intermediate_size,
        rms_norm_eps=plan.eps(c.rms_norm_eps),
        rope_theta=plan.rope_theta(c.rope_theta),
        num_target_layers=big_target.num_hidden_layers,
        real_vocab_size=real_vocab,
        raw=raw,
    )
    config = DraftConfig.from_dict(config.to_dict(), source="inflate_draft")  # re-validated like a loaded one
    with torch.device("meta"):
        model = DSparkDraftModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    return model.eval().requires_grad_(False)


@dataclass
class InflatedPair:
    """An inflated target (HF model) and, when a drafter was given, its inflated drafter; both on one device."""

    target: Qwen3ForCausalLM
    draft: DSparkDraftModel | None
    info: dict[str, Any]

    def target_model(self) -> TargetModel:
        """The verifier's TargetModel over the inflated target, exposing the drafter's context-feature layers."""
        ids = self.draft.config.target_layer_ids if self.draft is not None else ()
        return TargetModel(self.target, feature_layer_ids=ids)


def inflate_pair(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    shape: str | Qwen3Shape,
    *,
    dtype: str | torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    fill: str = "random",
    seed: int = 0,
    out_dir: str | Path | None = None,
) -> InflatedPair:
    """Load a small target (and drafter) from local folders, inflate both in memory on ``device``; with
    ``out_dir`` also save them to ``out_dir/target`` and ``out_dir/draft`` (HF and DeepSpec layouts)."""
    dtype = resolve_dtype(dtype)
    started = time.perf_counter()
    small_target = load_small_target(target_dir)
    target = inflate_target(small_target, shape, dtype=dtype, device=device, fill=fill, seed=seed)
    draft = None
    if draft_dir is not None:
        small_draft = load_draft_model(draft_dir, target_dir=target_dir)
        draft = inflate_draft(small_draft, target, fill=fill, seed=seed + 1)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    info: dict[str, Any] = {"target": describe(target), "build_s": time.perf_counter() - started}
    if draft is not None:
        info["draft"] = describe(draft)
    if out_dir is not None:
        saved = time.perf_counter()
        save_target(target, Path(out_dir) / "target", tokenizer_from=target_dir)
        if draft is not None:
            save_draft_model(draft, Path(out_dir) / "draft", max_shard_bytes=4 * 2**30)
        info["save_s"] = time.perf_counter() - saved
    return InflatedPair(target=target, draft=draft, info=info)


@torch.no_grad()
def compare_drafts(
    small_target: Qwen3ForCausalLM,
    small_draft: DSparkDraftModel,
    pair: InflatedPair,
    token_ids: torch.Tensor,
) -> dict[str, float]:
    """One block after ``token_ids`` [B, T] (context = the first T-1 tokens, anchor = the last), drafted by the
    small drafter on the small target's features and by the inflated drafter on the inflated target's (plain HF
    forwards): max |diff| of the real-vocabulary base logits and of the confidence logits."""
    if pair.draft is None:
        raise ValueError("compare_drafts: the pair has no drafter")
    block_size = small_draft.block_size
    if token_ids.shape[1] < block_size + 1:
        raise ValueError(f"compare_drafts: need at least {block_size + 1} tokens, got {token_ids.shape[1]}")
    layer_ids = small_draft.config.target_layer_ids
    vocab = small_draft.config.vocab_size
    device = pair.draft.device
    prev = token_ids[:, :block_size].clone()  # any real previous-token path will do for the heads
    prev[:, 0] = token_ids[:, -1]

    def run(hf: Qwen3ForCausalLM, draft: DSparkDraftModel) -> tuple[torch.Tensor, torch.Tensor | None]:
        states = hf(token_ids[:, :-1].to(device), output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1] for i in layer_ids], dim=-1)
        hidden = draft.forward_blocks(features.to(draft.dtype), token_ids[:, -1].to(device))
        logits = draft.base_logits(hidden)[..., :vocab].float().cpu()
        confidence = draft.confidence_logits(hidden, prev.to(device))
        return logits, None if confidence is None else confidence.float().cpu()

    # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads (self as the argument).
    small_hf = copy.deepcopy(small_target).to(device, torch.float32)  # type: ignore[arg-type]
    small_logits, small_conf = run(small_hf, copy.deepcopy(small_draft).to(device, torch.float32))
    big_logits, big_conf = run(pair.target, pair.draft)
    out = {"draft_max_abs_logit_diff": float((big_logits - small_logits).abs().max())}
    if small_conf is not None and big_conf is not None:
        out["draft_max_abs_confidence_diff"] = float((big_conf - small_conf).abs().max())
    return out
