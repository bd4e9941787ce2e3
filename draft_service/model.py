"""The DSpark draft model for Qwen3-family targets: parallel backbone with context-feature KV injection.

One block for a request whose anchor sits at absolute position ``start``:
1. context rows (positions 0..start-1): ``ctx = hidden_norm(fc(concat of target features))``;
2. block input ``embed([anchor, mask, ..., mask])`` at positions start..start+bs-1;
3. every draft layer attends from the bs block queries over [its own K/V of ctx ; K/V of the block] with NO
   mask (bidirectional inside the block, full view of the context): "KV injection";
4. final norm -> block hidden h_k; ``lm_head`` -> base logits U_k (row k predicts position start+k+1, so the
   anchor row is the first prediction).

The names of modules and parameters are DeepSpec's (``fc``, ``hidden_norm``, ``layers.{i}.self_attn.q_proj``,
...), so its checkpoints load as plain state dicts. Context K/V of every layer are cached per request in a
:class:`DraftContextCache`; ``draft_block`` drafts R requests with different context lengths in one batched
pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from draft_service.config import DraftConfig
from draft_service.context_cache import DraftContextCache
from draft_service.heads import ConfidenceHead, MarkovHead, build_markov_head
from kernels.mlp import MLP
from kernels.rms_norm import RMSNorm
from kernels.slot_attention import slot_attention_reference

if TYPE_CHECKING:
    from draft_service.fused import FusedDrafter

ATTENTION_BACKENDS = ("torch", "triton", "reference")


class RotaryEmbedding(nn.Module):
    """HF 'rotate-half' RoPE with ``inv_freq[i] = theta^(-2i/head_dim)`` at arbitrary absolute positions."""

    inv_freq: torch.Tensor  # a non-persistent buffer

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> (cos, sin) [..., head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, heads, D] with cos/sin [..., S, D]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = D
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, then RoPE) and values of rows x [..., S, H] -> two [..., S, KVH, D].

        Used for the projected context (cached) and for the block's own rows alike: DeepSpec applies the same
        k_proj / v_proj / k_norm to both.
        """
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def _block_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        R, bs, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(R, bs, self.num_heads, self.head_dim)), cos, sin)
        k_blk, v_blk = self.key_value(x, cos, sin)
        return q, k_blk, v_blk

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [R, bs, H] normed block rows; ctx_k/v [R, T, KVH, D]; key_mask [R, T+bs] (None: all valid)."""
        R, bs, _ = x.shape
        q, k_blk, v_blk = self._block_qkv(x, cos, sin)
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=1).transpose(1, 2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, is_causal=False, scale=self.head_dim**-0.5
        )
        return self.o_proj(out.transpose(1, 2).reshape(R, bs, self.num_heads * self.head_dim))

    def forward_slots(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        context_lens: torch.Tensor,
        backend: str,
    ) -> torch.Tensor:
        """The same attention reading the context K/V in place from one layer's slot cache [S, T, KVH, D]
        (the slot attention kernel's block mode: context rows 0..context_lens[r]-1, then the whole block,
        no mask). No gather, no host sync: what the CUDA-graph draft step captures."""
        R, bs, _ = x.shape
        q, k_blk, v_blk = self._block_qkv(x, cos, sin)
        dtype = k_cache.dtype
        impl = _slot_attention_impl(backend)
        out = impl(
            q.reshape(R * bs, self.num_heads, self.head_dim).to(dtype),
            k_cache,
            v_cache,
            slots,
            context_lens,
            torch.arange(R, device=x.device) * bs,
            torch.full((R,), bs, dtype=torch.int64, device=x.device),
            self.head_dim**-0.5,
            max_query_len=bs,
            k_block=k_blk.reshape(R * bs, self.num_kv_heads, self.head_dim).to(dtype),
            v_block=v_blk.reshape(R * bs, self.num_kv_heads, self.head_dim).to(dtype),
            causal=False,
            validate=False,
            ordered_rows=True,  # request r's block: rows r * bs .. r * bs + bs - 1
        )
        return self.o_proj(out.to(x.dtype).reshape(R, bs, self.num_heads * self.head_dim))


def _slot_attention_impl(backend: str):
    """'triton' (CUDA) or 'reference' (its torch twin, for CPU tests of the same layout)."""
    if backend == "triton":
        from kernels.slot_attention_triton import slot_attention_triton

        return slot_attention_triton
    if backend == "reference":
        return slot_attention_reference
    raise ValueError(f"slot attention backend must be 'triton' or 'reference', got {backend!r}")


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; input_layernorm applies to block rows only, never to the injected context."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, key_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_slots(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        context_lens: torch.Tensor,
        backend: str,
    ) -> torch.Tensor:
        attn = self.self_attn.forward_slots(
            self.input_layernorm(x), cos, sin, k_cache, v_cache, slots, context_lens, backend
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDraftModel(nn.Module):
    """DSpark drafter: backbone + Markov/gated/RNN head + confidence head, in DeepSpec's parameter layout."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(config.context_feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(config) for _ in range(config.num_draft_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.markov_head: MarkovHead | None = build_markov_head(config)
        self.confidence_head: ConfidenceHead | None = (
            ConfidenceHead(config.confidence_input_size) if config.enable_confidence_head else None
        )
        self._attention_backend: str | None = None
        self.fused: bool | None = None  # fused layer kernels for inference: None = on CUDA with the triton backend
        # The fused path's weight GEMMs (QKV, o_proj, gate/up, down_proj) and LM head run the skinny Triton GEMMs
        # (kernels/skinny_gemm_triton.py) for passes of at most FASTER_ROWS block rows (R * block_size) on the
        # GPUs they were swept on (tuned_for), as TargetModel.skinny_gemm does; False: cuBLAS always.
        self.skinny_gemm = True
        self.skinny_lm_head = True  # the LM head too, when skinny_gemm takes the pass (False: cuBLAS, to compare)
        self._fused: FusedDrafter | None = None

    @property
    def draft_layers(self) -> Sequence[DraftLayer]:
        """The backbone layers, typed (``layers`` is the ModuleList that registers their weights)."""
        return cast("Sequence[DraftLayer]", self.layers)

    @property
    def use_fused(self) -> bool:
        """Whether the inference paths (context append, ``backbone_slots``) run the fused layer kernels
        (:mod:`draft_service.fused`); training (``forward_blocks``) always runs the modules."""
        if self.fused is not None:
            return self.fused
        # the fused projections are bias-free (Qwen3's): a drafter with attention bias keeps the modules
        return self.device.type == "cuda" and self.attention_backend == "triton" and not self.config.attention_bias

    def fused_drafter(self) -> FusedDrafter:
        """Built at first use, on the model's device (the modules' projection weights become views of it)."""
        if self._fused is None:
            from draft_service.fused import FusedDrafter

            self._fused = FusedDrafter(self)
        return self._fused

    @property
    def attention_backend(self) -> str:
        """How ``draft_block`` attends over the context cache: 'triton' (the slot attention kernel, reading
        the cache in place) on CUDA, 'torch' (gather + scaled_dot_product_attention) elsewhere, unless set;
        'reference' is the kernel's torch twin (the kernel's layout on CPU)."""
        if self._attention_backend is not None:
            return self._attention_backend
        return "triton" if self.device.type == "cuda" else "torch"

    @attention_backend.setter
    def attention_backend(self, backend: str | None) -> None:
        if backend is not None and backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; use one of {ATTENTION_BACKENDS}")
        self._attention_backend = backend

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def real_vocab_size(self) -> int:
        """The ids the drafter may read or emit: ``config.real_vocab_size`` of an inflated pair, else the whole
        vocabulary (the rows past it are padding that ``base_logits`` masks)."""
        return self.config.real_vocab_size or self.config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_context_cache(
        self, num_slots: int, max_seq_len: int, dtype: torch.dtype | None = None
    ) -> DraftContextCache:
        """A slot cache shaped for this model, on its device."""
        c = self.config
        return DraftContextCache(
            num_layers=c.num_draft_layers,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            dtype=dtype or self.dtype,
            device=self.device,
        )

    # ---- context ------------------------------------------------------------------------------------------

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Context features [..., m*H] -> projected context [..., H] = hidden_norm(fc(features)).

        Exposed separately because the verifier may apply it before shipping (1/m of the bytes on the wire).
        """
        self._check_feature_width(features)
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def _check_feature_width(self, features: torch.Tensor) -> None:
        if features.shape[-1] != self.config.context_feature_size:
            raise ValueError(
                f"context features have width {features.shape[-1]}, expected m*H = "
                f"{self.config.context_feature_size} (target_layer_ids={list(self.config.target_layer_ids)}, "
                f"hidden_size={self.config.hidden_size})"
            )

    def write_context(
        self,
        cache: DraftContextCache,
        rows: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        *,
        projected: bool = False,
    ) -> None:
        """Every draft layer's K/V of context rows [n, m*H] (or [n, H] already projected) into ``cache`` at
        (slots[i], positions[i]) (device tensors [n]); lengths are the caller's. Unchecked and free of host
        syncs: the CUDA-graph draft step captures it."""
        if self.use_fused:
            fused = self.fused_drafter()
            context = rows.to(self.dtype) if projected else fused.project_context(rows)
            fused.write_context(cache, context, slots, positions)
            return
        context = rows.to(self.dtype) if projected else self.project_context(rows)
        for layer_idx, (k, v) in enumerate(self.context_key_values(context, positions)):
            cache.k[layer_idx, slots, positions] = k.to(cache.k.dtype)
            cache.v[layer_idx, slots, positions] = v.to(cache.v.dtype)

    def context_key_values(
        self, projected: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, K/V of projected context rows [..., S, H] at absolute positions [..., S]."""
        cos, sin = self.rotary(positions, self.dtype)
        return [layer.self_attn.key_value(projected, cos, sin) for layer in self.draft_layers]

    @torch.no_grad()
    def append_context(
        self,
        cache: DraftContextCache,
        slots: Sequence[int] | torch.Tensor,
        rows: torch.Tensor,
        cu_seqlens: Sequence[int] | torch.Tensor,
        *,
        projected: bool = False,
    ) -> None:
        """Append context rows of R requests (ragged, flattened) to their slots.

        rows: [N, m*H] context features, or [N, H] already-projected context with ``projected=True``;
        cu_seqlens [R+1]: request r owns rows cu[r]:cu[r+1], placed at positions length(slot_r) onward.
        """
        slots_t = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).cpu()
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).reshape(-1).cpu()
        cache.check_slots(slots_t)
        if cu.numel() != slots_t.numel() + 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(
                f"cu_seqlens must be non-decreasing offsets [R+1] starting at 0, got {cu.tolist()}"
            )
        if rows.ndim != 2 or rows.shape[0] != int(cu[-1]):
            raise ValueError(f"context rows must be [N={int(cu[-1])}, width], got {tuple(rows.shape)}")
        counts = cu[1:] - cu[:-1]
        new_lengths = cache.lengths[slots_t] + counts
        if bool((new_lengths > cache.max_seq_len).any()):
            raise ValueError(
                f"context cache overflow: lengths {new_lengths.tolist()} exceed max_seq_len "
                f"{cache.max_seq_len}"
            )
        if rows.shape[0] == 0:
            return
        if projected and rows.shape[-1] != self.config.hidden_size:
            raise ValueError(f"projected context has width {rows.shape[-1]}, expected {self.config.hidden_size}")
        if not projected:
            self._check_feature_width(rows)
        row_req = torch.repeat_interleave(torch.arange(slots_t.numel()), counts)
        positions = cache.lengths[slots_t][row_req] + (torch.arange(rows.shape[0]) - cu[:-1][row_req])
        dev = cache.device
        self.write_context(cache, rows.to(dev), slots_t[row_req].to(dev), positions.to(dev), projected=projected)
        cache.lengths[slots_t] = new_lengths

    # ---- backbone -----------------------------------------------------------------------------------------

    def _block_inputs(
        self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        R, bs = anchor_ids.shape[0], self.block_size
        block_ids = torch.full((R, bs), self.config.mask_token_id, dtype=torch.int64, device=self.device)
        block_ids[:, 0] = anchor_ids.to(self.device)
        positions = anchor_positions.to(self.device)[:, None] + torch.arange(bs, device=self.device)
        cos, sin = self.rotary(positions, self.dtype)
        return self.embed_tokens(block_ids), cos, sin

    @torch.no_grad()
    def draft_block(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        slots: Sequence[int] | torch.Tensor,
        cache: DraftContextCache,
    ) -> torch.Tensor:
        """Backbone for R requests in one pass -> block hidden [R, bs, H] (after the final norm).

        anchor_ids [R], anchor_positions [R]; each slot must hold exactly the context rows
        0..anchor_position-1 (DeepSpec's invariant: the draft cache is cropped back to ``start`` every round).
        With the 'torch' backend ragged lengths are padded to the longest and masked and each layer gathers
        its slots' K/V (a copy: fine for short contexts on CPU); the kernel backends read the slots in place
        (:meth:`backbone_slots`).
        """
        anchor_ids = torch.as_tensor(anchor_ids, dtype=torch.int64).reshape(-1)
        anchor_positions = torch.as_tensor(anchor_positions, dtype=torch.int64).reshape(-1)
        slots_t = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).cpu()
        if not anchor_ids.numel() == anchor_positions.numel() == slots_t.numel() > 0:
            raise ValueError(
                f"anchor_ids, anchor_positions and slots must be non-empty and equally long, got "
                f"{anchor_ids.numel()}, {anchor_positions.numel()}, {slots_t.numel()}"
            )
        self._check_token_ids(anchor_ids, "anchor_ids")
        cache.check_slots(slots_t)
        lengths = cache.lengths[slots_t]
        if not torch.equal(lengths, anchor_positions.cpu()):
            raise ValueError(
                f"context cache lengths {lengths.tolist()} must equal anchor positions "
                f"{anchor_positions.tolist()}: append the context rows 0..start-1 before drafting"
            )
        x, cos, sin = self._block_inputs(anchor_ids, anchor_positions)
        if self.attention_backend != "torch":
            dev = self.device
            return self.backbone_slots(x, cos, sin, cache, slots_t.to(dev), lengths.to(dev))
        T = int(lengths.max())
        key_mask = None
        if bool((lengths != T).any()):
            dev = self.device
            ctx_valid = torch.arange(T, device=dev)[None, :] < lengths.to(dev)[:, None]
            key_mask = torch.cat(
                [ctx_valid, torch.ones(len(slots_t), self.block_size, dtype=torch.bool, device=dev)], dim=1
            )
        slot_idx = slots_t.to(cache.device)
        for layer_idx, layer in enumerate(self.layers):
            x = layer(
                x, cos, sin, cache.k[layer_idx, slot_idx, :T], cache.v[layer_idx, slot_idx, :T], key_mask
            )
        return self.norm(x)

    def backbone_slots(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftContextCache,
        slots: torch.Tensor,
        context_lens: torch.Tensor,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Backbone layers over block inputs x [R, bs, H] (from ``_block_inputs``) with the context read in
        place from ``cache`` (slots / context_lens: device tensors [R]) -> [R, bs, H]. Unchecked and free of
        host syncs: ``draft_block`` validates first, the CUDA-graph runner captures this. ``backend``:
        'triton' or 'reference' (default: the model's)."""
        backend = backend or self.attention_backend
        if backend == "torch":
            raise ValueError("backbone_slots needs a kernel attention backend ('triton' or 'reference')")
        if self.use_fused:
            return self.fused_drafter().backbone_slots(
                x, cos, sin, cache, slots, context_lens, _slot_attention_impl(backend)
            )
        for layer_idx, layer in enumerate(self.draft_layers):
            x = layer.forward_slots(
                x, cos, sin, cache.k[layer_idx], cache.v[layer_idx], slots, context_lens, backend
            )
        return self.norm(x)

    def forward_blocks(
        self,
        context_features: torch.Tensor,
        anchor_ids: torch.Tensor,
        context_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cache-free, differentiable backbone: context features [R, T, m*H] (request r uses its first
        ``context_lengths[r]`` rows, default all T, at positions 0..len-1) and anchors [R] -> [R, bs, H].

        Anchor r sits at position ``context_lengths[r]``. The plain definition of the model: the oracle for
        ``draft_block`` and a training forward (one row per sampled anchor, its context prefix padded).
        """
        R, T, _ = context_features.shape
        lengths = torch.full((R,), T) if context_lengths is None else torch.as_tensor(context_lengths).cpu()
        if lengths.numel() != R or bool((lengths < 1).any()) or bool((lengths > T).any()):
            raise ValueError(f"context_lengths must be [R={R}] values in [1, {T}], got {lengths.tolist()}")
        anchor_ids = torch.as_tensor(anchor_ids, dtype=torch.int64).reshape(-1)
        self._check_token_ids(anchor_ids, "anchor_ids")
        ctx = self.project_context(context_features)
        kv = self.context_key_values(ctx, torch.arange(T, device=self.device).expand(R, T))
        x, cos, sin = self._block_inputs(anchor_ids, lengths)
        key_mask = None
        if bool((lengths != T).any()):
            ctx_valid = torch.arange(T, device=self.device)[None, :] < lengths.to(self.device)[:, None]
            block_valid = torch.ones(R, self.block_size, dtype=torch.bool, device=self.device)
            key_mask = torch.cat([ctx_valid, block_valid], dim=1)
        for layer, (k, v) in zip(self.layers, kv, strict=True):
            x = layer(x, cos, sin, k, v, key_mask)
        return self.norm(x)

    @torch.no_grad()
    def draft_block_uncached(self, context_features: torch.Tensor, anchor_id: int) -> torch.Tensor:
        """One request from scratch: context features [start, m*H] (positions 0..start-1) -> [bs, H]."""
        if context_features.shape[0] == 0:
            raise ValueError("drafting needs at least one context row (the prompt is never empty)")
        return self.forward_blocks(context_features[None], torch.tensor([anchor_id]))[0]

    # ---- heads --------------------------------------------------------------------------------------------

    def base_logits(self, block_hidden: torch.Tensor, *, drafting: bool = False) -> torch.Tensor:
        """U_k = lm_head(h_k): [..., H] -> [..., V] (float32); -inf past ``config.real_vocab_size`` (padding of an
        inflated pair), so no head, sampler or verifier ever gives a padded id probability. ``drafting``: the
        samplers' LM head (:meth:`project_vocab`); otherwise the module, which training differentiates."""
        logits = (self.project_vocab(block_hidden) if drafting else self.lm_head(block_hidden)).float()
        real = self.config.real_vocab_size
        if real is not None and real < logits.shape[-1]:
            logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= real, float("-inf"))
        return logits

    def project_vocab(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """The drafting paths' LM head: lm_head(h) [..., H] -> [..., V] in the model dtype, through the fused
        drafter on the fused path (the skinny GEMM for a few rows). Not differentiable there: training calls the
        module (``base_logits``)."""
        if self.use_fused:
            return self.fused_drafter().lm_head(block_hidden)
        return self.lm_head(block_hidden)

    def markov_logits(
        self, base_logits: torch.Tensor, prev_ids: torch.Tensor, block_hidden: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced corrected logits U_k + B_k(prev_ids[:, k]) for a fixed previous-token path [R,
        bs]."""
        if self.markov_head is None:
            return base_logits
        return base_logits + self.markov_head.block_bias(prev_ids.to(self.device), block_hidden).float()

    def confidence_logits(self, block_hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Raw confidence logits [...] for hidden [..., H] and the previous tokens [...] (None without a
        head)."""
        if self.confidence_head is None:
            return None
        emb = None
        if self.config.confidence_head_with_markov:
            assert self.markov_head is not None
            emb = self.markov_head.prev_embedding(prev_ids.to(self.device))
        return self.confidence_from_embedding(block_hidden, emb)

    def confidence_from_embedding(
        self, block_hidden: torch.Tensor, prev_embedding: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Raw confidence logits [...] for hidden [..., H] and W1[x_{k-1}] [..., r] already looked up (the
        fused Markov sampler returns them for a whole block: one batched product instead of one per step);
        ``prev_embedding`` is read only when the head takes Markov features."""
        if self.confidence_head is None:
            return None
        features = block_hidden
        if self.config.confidence_head_with_markov:
            assert prev_embedding is not None
            features = torch.cat([block_hidden, prev_embedding.to(block_hidden.dtype)], dim=-1)
        return self.confidence_head(features)

    def _check_token_ids(self, ids: torch.Tensor, name: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"{name} outside the vocabulary [0, {self.config.vocab_size}): {ids.tolist()}")
