"""The Qwen3 target: HF weights, our own batched forward over the slot KV cache.

The checkpoint's modules (projections, norms, MLPs, rotary embedding, LM head) come in transformers' layout,
either read straight from the safetensors files (:mod:`verify_service.qwen3`, what ``from_pretrained`` does: no
transformers import at a replica's start) or from a transformers ``Qwen3ForCausalLM`` (the constructor takes
either; the offline tools pass transformers' models). This wrapper runs its own forward so that one call can
serve a ragged batch of prefill chunks and verify chunks, write their K/V into per-request slots, and return
just what the round needs: fp32 logits of selected rows and the context features (hidden states of
`feature_layer_ids`) of selected rows. HF's own cache and attention code would need a padded batch and a cache
object per request, and cannot roll a request back by moving a counter.

Context feature of layer id l: -1 is the embedding output, l in [0, L) is HF `hidden_states[l + 1]`, i.e. the
output of decoder layer l; for the last layer that is, as in HF, after the final norm. Features of several
ids are concatenated on the last axis in the order given: [rows, m * H].
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verify_service.attention import ATTENTION_BACKENDS, CachedAttentionMetadata, store_kv, varlen_cached_attention
from verify_service.kv_cache import RaggedBatch, SlotKVCache
from verify_service.qwen3 import Qwen3Modules, apply_rotary_pos_emb, load_qwen3

if TYPE_CHECKING:
    from transformers import Qwen3ForCausalLM

logger = logging.getLogger(__name__)

REAL_VOCAB_KEY = "dspark_real_vocab_size"
"""config.json key of a model with a padded vocabulary (verify_service/inflate.py): ids at or past it are padding."""


def real_vocab_size(config: Any) -> int:
    """The ids a model may read or emit: ``dspark_real_vocab_size`` when set, else ``vocab_size``."""
    get: Callable[..., Any] = (
        config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    )
    vocab = int(get("vocab_size"))
    real = get(REAL_VOCAB_KEY, None)
    if real is None:
        return vocab
    if isinstance(real, bool) or not isinstance(real, int) or not 0 < real <= vocab:
        raise ValueError(f"{REAL_VOCAB_KEY} must be an int in [1, vocab_size={vocab}], got {real!r}")
    return real


@dataclass(frozen=True)
class TargetOutput:
    """What one forward pass returns for the rows the caller selected."""

    # [rows, V] float32: row i predicts the token after row i's position; -inf past the real vocabulary.
    logits: torch.Tensor
    features: torch.Tensor | None  # [rows, m * H] in the model dtype; None when no feature layers are set


class TargetModel:
    """A Qwen3 causal LM evaluated over a SlotKVCache; see the module docstring."""

    def __init__(self, modules: Qwen3Modules | Qwen3ForCausalLM, feature_layer_ids: Sequence[int] = ()) -> None:
        """``modules``: the checkpoint's module tree in transformers' Qwen3 layout (see the module docstring)."""
        config = modules.config
        if config.model_type != "qwen3":
            raise ValueError(f"TargetModel: expected a qwen3 model, got model_type={config.model_type!r}")
        unsupported = sorted(set(config.layer_types or ()) - {"full_attention"})
        if unsupported:
            raise ValueError(f"TargetModel: layer types {unsupported} (sliding window) are not supported")
        num_layers = config.num_hidden_layers
        ids = tuple(int(i) for i in feature_layer_ids)
        bad = [i for i in ids if not -1 <= i < num_layers]
        if bad:
            raise ValueError(
                f"TargetModel: feature layer ids {bad} are outside [-1, {num_layers - 1}] "
                f"(the target has {num_layers} decoder layers)"
            )
        # Typed Any: the two trees share a layout (attribute names and module computations), not a class.
        self.modules: Any = modules.eval().requires_grad_(False)
        self.config = config
        self.feature_layer_ids = ids
        self.num_layers = num_layers
        self.hidden_size = config.hidden_size
        # An inflated model (verify_service/inflate.py) has a padded vocabulary: ids from `dspark_real_vocab_size`
        # on are never read (prepare refuses them) and never emitted (their logits are -inf).
        self.logits_width = config.vocab_size
        self.vocab_size = real_vocab_size(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads or config.num_attention_heads  # HF's default when unset
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TargetModel: {self.num_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} kv heads"
            )
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._attention_backend: str | None = None
        self.fused: bool | None = None  # fused layer kernels: None = on CUDA with the triton backend
        self._fused_layers: list[_FusedLayer] | None = None
        # The fused path's (CUDA's) weight GEMMs and LM head run the skinny Triton GEMMs
        # (kernels/skinny_gemm_triton.py) for passes of at most FASTER_ROWS tokens on Hopper GPUs, where they were
        # measured faster than cuBLAS (docs/benchmarks/kernels.md); larger passes and other GPUs use cuBLAS
        # (skinny_gemm_triton.tuned_for). False: cuBLAS always.
        self.skinny_gemm = True
        self._skinny_counters: torch.Tensor | None = None

    @property
    def attention_backend(self) -> str:
        """'triton' on CUDA, 'torch' elsewhere, unless set (see :mod:`verify_service.attention`)."""
        if self._attention_backend is not None:
            return self._attention_backend
        return "triton" if self.device.type == "cuda" else "torch"

    @attention_backend.setter
    def attention_backend(self, backend: str | None) -> None:
        if backend is not None and backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; use one of {ATTENTION_BACKENDS}")
        self._attention_backend = backend

    @property
    def use_fused(self) -> bool:
        """Whether ``run_layers`` runs the fused layer kernels (:mod:`kernels.fused_layer_triton`)."""
        if self.fused is not None:
            return self.fused
        return self.device.type == "cuda" and self.attention_backend == "triton"

    @property
    def query_groups(self) -> int:
        """Query heads per kv head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        feature_layer_ids: Sequence[int] = (),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> TargetModel:
        """Load a local HF Qwen3 folder (config.json + safetensors); nothing is downloaded.

        Read by :func:`verify_service.qwen3.load_qwen3` (the same weights and module computations as
        transformers' loader, without importing transformers); a config it does not reproduce (another RoPE
        type, sliding-window layers, ...) loads through transformers' ``Qwen3ForCausalLM`` instead. Either way
        tied embeddings (no lm_head.weight in the file), `rope_parameters` or legacy top-level `rope_theta`, GQA
        and q/k norms are handled.
        """
        path = Path(folder)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"TargetModel: {config_file} does not exist (expected a local HF model folder)")
        model_type = json.loads(config_file.read_text()).get("model_type")
        if model_type != "qwen3":
            raise ValueError(f"TargetModel: {config_file} has model_type={model_type!r}, expected 'qwen3'")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"TargetModel: no *.safetensors weight file in {path}")
        modules = load_qwen3(path, dtype=dtype, device=device)
        if modules is not None:
            return cls(modules, feature_layer_ids)
        logger.info("TargetModel: %s is loaded through transformers (a config verify_service.qwen3 does not read)",
                    path)
        from transformers import Qwen3ForCausalLM

        hf_model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads (self as the argument).
        return cls(hf_model.to(device), feature_layer_ids)  # type: ignore[arg-type]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens_weight.device

    @property
    def max_context_len(self) -> int:
        """The config's max_position_embeddings: the longest context the model was built for."""
        return int(self.config.max_position_embeddings)

    @property
    def feature_dim(self) -> int:
        """Width of the context features: len(feature_layer_ids) * hidden_size."""
        return len(self.feature_layer_ids) * self.hidden_size

    @property
    def embed_tokens_weight(self) -> torch.Tensor:
        """[V, H] input embedding (the drafter's copy must equal it)."""
        return self.modules.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] output projection; the same tensor as the embedding when the config ties them."""
        return self.modules.lm_head.weight

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from generation_config.json (or config.json); empty when none is set."""
        generation_config = getattr(self.modules, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.config.eos_token_id
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def new_kv_cache(self, num_slots: int, max_seq_len: int) -> SlotKVCache:
        """A slot cache shaped for this model, on its device and in its dtype."""
        return SlotKVCache(
            self.num_layers,
            num_slots,
            max_seq_len,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def prepare(
        self, cache: SlotKVCache, chunks: Sequence[tuple[int, Sequence[int] | torch.Tensor]]
    ) -> RaggedBatch:
        """Validate (slot, token ids) chunks and flatten them into a RaggedBatch (see RaggedBatch.build)."""
        self._check_cache(cache)
        return RaggedBatch.build(cache, chunks, self.vocab_size)

    @torch.no_grad()
    def forward(
        self,
        cache: SlotKVCache,
        batch: RaggedBatch,
        *,
        logits_rows: torch.Tensor | None = None,
        feature_rows: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the batch, append its K/V to the slots (lengths advance by each chunk), return selected rows.

        logits_rows / feature_rows: int64 row indices into the flattened batch (None = every row; an empty
        tensor = none), e.g. `batch.last_rows()` for a prefill chunk that only needs its next-token logits.
        The batch must have been prepared against the cache's current lengths; a stale batch is refused before
        anything is written.
        """
        self._check_cache(cache)
        for slot, start in zip(batch.slot_list, batch.starts, strict=True):
            if cache.length(slot) != start:
                raise ValueError(
                    f"TargetModel.forward: batch expects slot {slot} at length {start}, the cache holds "
                    f"{cache.length(slot)} (prepare the batch again)"
                )
        meta = CachedAttentionMetadata.from_batch(batch, self.query_groups, self.attention_backend)
        out = self.run_layers(cache, batch.input_ids, meta, logits_rows=logits_rows, feature_rows=feature_rows)
        for slot, length in zip(batch.slot_list, batch.seqlens, strict=True):
            cache.advance(slot, length)
        return out

    @torch.no_grad()
    def run_layers(
        self,
        cache: SlotKVCache,
        input_ids: torch.Tensor,
        meta: CachedAttentionMetadata,
        *,
        logits_rows: torch.Tensor | None = None,
        feature_rows: torch.Tensor | None = None,
    ) -> TargetOutput:
        """The model itself over flattened tokens [N] laid out as ``meta`` says: writes their K/V into the
        cache, never touches the host-side lengths and never syncs with the device (with a kernel backend),
        so the CUDA-graph runner captures exactly this. ``forward`` is the checked, bookkeeping wrapper."""
        if self.use_fused:
            return self._run_layers_fused(cache, input_ids, meta, logits_rows, feature_rows)
        logits_rows, feature_rows = _selected_rows(input_ids, logits_rows, feature_rows)

        backbone = self.modules.model
        num_tokens = input_ids.shape[0]
        x = backbone.embed_tokens(input_ids)
        cos, sin = backbone.rotary_emb(x, meta.positions[None])
        cos, sin = cos[0], sin[0]  # [N, D]
        collected: dict[int, torch.Tensor] = {}
        if -1 in self.feature_layer_ids:
            collected[-1] = x[feature_rows]
        for index, layer in enumerate(backbone.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(num_tokens, self.num_heads, self.head_dim))
            k = attn.k_norm(attn.k_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim))
            v = attn.v_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            store_kv(cache.k[index], cache.v[index], k, v, meta)
            o = varlen_cached_attention(q, cache.k[index], cache.v[index], meta, attn.scaling)
            x = x + attn.o_proj(o.reshape(num_tokens, self.num_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if index in self.feature_layer_ids and index != self.num_layers - 1:
                collected[index] = x[feature_rows]
        if self.num_layers - 1 in self.feature_layer_ids:
            collected[self.num_layers - 1] = backbone.norm(x[feature_rows])
        return self._output(backbone.norm(x[logits_rows]), collected)

    def _fused(self) -> list[_FusedLayer]:
        """Per layer: the q/k/v and gate/up projections as one weight each (built once; the HF modules' weights
        become views into them, so nothing is held twice) and the q/k norm weights side by side."""
        if self._fused_layers is None:
            from kernels.fused_layer_triton import stack_into_views

            layers = []
            for layer in self.modules.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                projections = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
                if any(p.bias is not None for p in projections):
                    raise ValueError("TargetModel: fused layers need bias-free projections (set fused = False)")
                qkv = stack_into_views([attn.q_proj, attn.k_proj, attn.v_proj])
                gate_up = stack_into_views([mlp.gate_proj, mlp.up_proj])
                qk_norm = torch.stack([attn.q_norm.weight, attn.k_norm.weight])
                layers.append(_FusedLayer(qkv, gate_up, qk_norm))
            self._fused_layers = layers
        return self._fused_layers

    def _run_layers_fused(
        self,
        cache: SlotKVCache,
        input_ids: torch.Tensor,
        meta: CachedAttentionMetadata,
        logits_rows: torch.Tensor | None,
        feature_rows: torch.Tensor | None,
    ) -> TargetOutput:
        """``run_layers`` with the fused kernels: per layer add+norm, one QKV matmul, norm+rotary+KV store,
        attention, o_proj, add+norm, one gate/up matmul, silu*up, down_proj (the residual add of the down
        projection is done by the next layer's add+norm). Same values as the HF-module path, op by op."""
        from kernels.fused_layer_triton import add_rms_norm, qk_norm_rope_store, silu_mul
        from kernels.skinny_gemm_triton import skinny_gate_up_silu, skinny_linear, takes_pass

        fused = self._fused()
        logits_rows, feature_rows = _selected_rows(input_ids, logits_rows, feature_rows)
        backbone = self.modules.model
        num_tokens = input_ids.shape[0]
        counters = self._skinny_workspace() if self.skinny_gemm and takes_pass(num_tokens, self.device) else None
        last = self.num_layers - 1
        x = backbone.embed_tokens(input_ids).contiguous()  # the residual stream, updated in place from here on
        cos, sin = backbone.rotary_emb(x, meta.positions[None])
        cos, sin = cos[0], sin[0]
        collected: dict[int, torch.Tensor] = {}
        if -1 in self.feature_layer_ids:
            collected[-1] = x[feature_rows]
        delta = None
        for index, (layer, weights) in enumerate(zip(backbone.layers, fused, strict=True)):
            attn = layer.self_attn
            norm = layer.input_layernorm
            h = add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)  # x += the previous layer's MLP
            if index - 1 in self.feature_layer_ids and index > 0:
                collected[index - 1] = x[feature_rows]
            if counters is None:
                qkv = torch.nn.functional.linear(h, weights.qkv)
            else:
                qkv = skinny_linear(h, weights.qkv, counters=counters)
            q = qk_norm_rope_store(
                qkv,
                weights.qk_norm,
                cos,
                sin,
                attn.q_norm.variance_epsilon,
                cache.k[index],
                cache.v[index],
                meta.token_slots,
                meta.positions,
                self.num_heads,
                self.num_kv_heads,
            )
            o = varlen_cached_attention(q, cache.k[index], cache.v[index], meta, attn.scaling)
            norm = layer.post_attention_layernorm
            if counters is None:
                h = add_rms_norm(x, attn.o_proj(o.reshape(num_tokens, -1)), norm.weight, norm.variance_epsilon)
                delta = layer.mlp.down_proj(silu_mul(torch.nn.functional.linear(h, weights.gate_up)))
            else:  # the residual adds happen in the projections' epilogues, x updated in place
                skinny_linear(o.reshape(num_tokens, -1), attn.o_proj.weight, x, counters=counters)
                h = add_rms_norm(x, None, norm.weight, norm.variance_epsilon)
                act = skinny_gate_up_silu(h, weights.gate_up, counters=counters)
                skinny_linear(act, layer.mlp.down_proj.weight, x, counters=counters)
                delta = None
        h = add_rms_norm(x, delta, backbone.norm.weight, backbone.norm.variance_epsilon)  # x: the last layer's output
        if last in self.feature_layer_ids:
            collected[last] = h[feature_rows]
        normed = h[logits_rows]
        if counters is not None:  # normed has at most num_tokens <= FASTER_ROWS rows
            return self._output(normed, collected, skinny_linear(normed, self.lm_head_weight, counters=counters))
        return self._output(normed, collected)

    def _skinny_workspace(self) -> torch.Tensor:
        """The skinny GEMMs' arrival counters, this model's own (:func:`kernels.skinny_gemm_triton.model_counters`:
        made on an eager pass, the projections they replace checked bias-free)."""
        if self._skinny_counters is None:
            from kernels.skinny_gemm_triton import model_counters

            tree = self.modules
            projections = [tree.lm_head] + [m for layer in tree.model.layers for m in (layer.self_attn.o_proj,
                                                                                      layer.mlp.down_proj)]  # fmt: skip
            self._skinny_counters = model_counters("TargetModel", self.device, projections)
        return self._skinny_counters

    def _output(
        self, normed: torch.Tensor, collected: dict[int, torch.Tensor], projected: torch.Tensor | None = None
    ) -> TargetOutput:
        """Both layer paths end alike: logits of the final-normed rows (padded vocabulary ids never win) and the
        chosen layers' rows concatenated in ``feature_layer_ids`` order. ``projected``: the LM head's output
        for ``normed`` when the caller already computed it (the skinny GEMM)."""
        logits = (self.modules.lm_head(normed) if projected is None else projected).float()
        if self.vocab_size < self.logits_width:
            logits[:, self.vocab_size :] = float("-inf")
        features = None
        if self.feature_layer_ids:
            features = torch.cat([collected[i] for i in self.feature_layer_ids], dim=-1)
        return TargetOutput(logits=logits, features=features)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        cache: SlotKVCache | None = None,
    ) -> list[list[int]]:
        """Plain autoregressive decoding of several prompts through the slot cache (batched, a token a step).

        The baseline speculative decoding is measured against, and its oracle at temperature 0 (argmax of fp32
        logits, the same as HF `generate(do_sample=False)`). A request stops after `max_new_tokens` or after
        emitting a stop token (kept in the output, as HF does with EOS). At temperature > 0, request i samples
        with its own torch.Generator seeded `seed + i` (the distribution is the target's; the random stream is
        not the engine's position-keyed one). Uses `cache` if given (its slots are freed afterwards), else a
        temporary one.
        """
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: need at least one prompt, and every prompt needs at least one token")
        _check_sampling(temperature, top_k, top_p)
        if cache is None:
            cache = self.new_kv_cache(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
        generators = None
        if temperature > 0:
            base = int(torch.randint(0, 2**62, ())) if seed is None else seed
            generators = [torch.Generator(self.device).manual_seed(base + i) for i in range(len(prompts))]
        stop = set(int(t) for t in stop_token_ids)
        slots: list[int] = []
        try:
            for _ in prompts:
                slots.append(cache.allocate())
            outputs: list[list[int]] = [[] for _ in prompts]
            chunks: list[tuple[int, Sequence[int] | torch.Tensor]] = list(zip(slots, prompts, strict=True))
            active = list(range(len(prompts)))
            while active:
                batch = self.prepare(cache, chunks)
                logits = self.forward(
                    cache, batch, logits_rows=batch.last_rows(), feature_rows=_NO_ROWS
                ).logits
                gens = None if generators is None else [generators[i] for i in active]
                next_tokens = sample_tokens(logits, temperature, top_k, top_p, gens).tolist()
                still_active = []
                for request, token in zip(active, next_tokens, strict=True):
                    outputs[request].append(token)
                    if len(outputs[request]) < max_new_tokens and token not in stop:
                        still_active.append(request)
                active = still_active
                chunks = [(slots[i], [outputs[i][-1]]) for i in active]
            return outputs
        finally:
            for slot in slots:
                cache.free(slot)

    def _check_cache(self, cache: SlotKVCache) -> None:
        expected = (self.num_layers, self.num_kv_heads, self.head_dim)
        actual = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
        if actual != expected:
            raise ValueError(
                f"TargetModel: cache shaped (layers, kv_heads, head_dim)={actual}, the model needs {expected}"
            )


_NO_ROWS = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class _FusedLayer:
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]: q_proj, k_proj, v_proj weights stacked
    gate_up: torch.Tensor  # [2 I, H]: gate_proj, up_proj weights stacked
    qk_norm: torch.Tensor  # [2, D]: q_norm, k_norm weights


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """Next token per row of fp32 logits [R, V] -> int64 [R]: argmax at temperature 0, else a sample from
    softmax(logits / T) restricted to the top_k tokens, then to the smallest set reaching top_p (HF order)."""
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    if generators is None or len(generators) != logits.shape[0]:
        raise ValueError("sample_tokens: temperature > 0 needs one torch.Generator per row")
    scores = logits / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)])


def _selected_rows(
    input_ids: torch.Tensor, logits_rows: torch.Tensor | None, feature_rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose logits / features a pass returns: every row unless given, on the device of the tokens."""
    all_rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    logits_rows = all_rows if logits_rows is None else logits_rows.to(all_rows.device)
    feature_rows = all_rows if feature_rows is None else feature_rows.to(all_rows.device)
    return logits_rows, feature_rows
