"""The sequential stage of DSpark drafting, torch path, batched over R requests.

After the parallel backbone gives block hidden states h_k and base logits U_k for k = 0..bs-1, drafting walks
the block left to right: the Markov / gated / RNN head adds a bias B_k that depends on the token sampled just
before (x_{-1} = the anchor), the token x_k is drawn from softmax((U_k + B_k) / T) (optionally truncated to
its top-k and renormalised), and the confidence head scores the same path. Only this loop is sequential, and
it is a few small matmuls per position.

Losslessness needs the verifier to see EXACTLY the distribution each draft token was drawn from; it is
returned here, dense [R, bs, V] or sparse (top-K ids + renormalised probs) when the drafter truncates (cheap
on the wire).

Two entry points:
- :func:`sample_block_keyed`, the draft engine's (eager and CUDA-graph steps alike): randomness keyed by
  (request seed, absolute position) through :mod:`kernels.rng`, so a request drafts the same block whatever the
  batch; sparse output only. A vanilla Markov head goes through the fused sampler of :mod:`kernels.markov`
  (Triton on CUDA, its torch reference elsewhere); the gated / RNN heads and a drafter without a Markov head
  take the torch loop below with uniforms of the same keys.
- :func:`sample_block`, the generic torch loop (offline evaluation, the reference loop, tests): explicit
  uniforms [R, bs] (one per drafted position, inverse-CDF sampling) or a ``torch.Generator``, dense or sparse
  output, ``return_logits``. Inverse-CDF order: the sparse distribution is walked in descending-probability
  order (``topk`` order), the dense one in vocabulary order.
The two draw different tokens from the same seed for sampled requests (the fused sampler races Gumbel keys of
per-token uniforms instead of inverting one CDF), both exact samplers of the same truncated distribution;
either way verification stays lossless because the verifier receives the distribution the token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draft_service.model import DSparkDraftModel
from kernels.checks import MAX_SPARSE_K
from kernels.markov import markov_sample_reference
from kernels.rng import STREAM_DRAFT_SAMPLE, uniform

GREEDY_TEMPERATURE = 1e-5  # below this a request is greedy (DeepSpec's threshold in logits_to_probs)
UNIFORM_MAX = 1.0 - 2.0**-24
"""Largest uniform fed to inverse-CDF sampling (the rng's output clamped below 1)."""


@dataclass
class DraftSample:
    """One drafted block for R requests.

    tokens [R, bs] int64: x_1..x_bs (row k is the token at position start+k+1). token_probs [R, bs] float32:
    q_k(x_k) under the distribution it was drawn from (1.0 for greedy rows). confidence_logits [R, bs] float32
    or None: raw logits of c_k along the sampled path (prev = anchor, x_1, ...). probs [R, bs, V] float32 or
    None: the dense draft distribution (when ``draft_top_k == 0``). topk_ids / topk_probs [R, bs, K] or None:
    the sparse draft distribution (when ``draft_top_k = K > 0``); ids are distinct per row, entries beyond a
    request's own top_k carry probability 0. logits [R, bs, V] float32 or None: corrected logits U_k + B_k
    before temperature (``return_logits=True``). Greedy rows (temperature 0) carry the one-hot distribution of
    their argmax, at the argmax's slot (slot 0, the largest z, in the fused sampler's sparse rows).
    """

    tokens: torch.Tensor
    token_probs: torch.Tensor
    confidence_logits: torch.Tensor | None
    probs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index j with cdf[j-1] <= u * total < cdf[j] for rows probs [R, n] and uniforms [R] in [0, 1).

    Never returns a zero-probability entry: the target is clamped strictly below the total mass.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _per_request(
    value: float | torch.Tensor | None, R: int, dtype: torch.dtype, name: str, default: float
) -> torch.Tensor:
    if value is None:
        return torch.full((R,), default, dtype=dtype)
    tensor = torch.as_tensor(value, dtype=dtype).reshape(-1).cpu()
    if tensor.numel() == 1:
        tensor = tensor.expand(R).clone()
    if tensor.numel() != R:
        raise ValueError(f"{name} must be a scalar or have one entry per request ({R}), got {tensor.numel()}")
    return tensor


@torch.no_grad()
def sample_block(
    model: DSparkDraftModel,
    block_hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 0.0,
    top_k: int | torch.Tensor | None = None,
    draft_top_k: int = 0,
    uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    base_logits: torch.Tensor | None = None,
    return_logits: bool = False,
) -> DraftSample:
    """Sample x_1..x_bs for R requests: block_hidden [R, bs, H], anchor_ids [R].

    temperature: scalar or [R] (0 = greedy argmax). top_k: scalar or [R], the request's own truncation (0 =
    off). draft_top_k: the drafter's truncation K (0 = dense output); the effective k of a request is
    min(top_k, K) over the ones that are set. uniforms [R, bs] in [0, 1) or a generator (needed only if some
    request samples). base_logits [R, bs, V] may be passed when already computed.
    """
    R, bs, _ = block_hidden.shape
    V = model.config.vocab_size
    dev = block_hidden.device
    anchor_ids = torch.as_tensor(anchor_ids, dtype=torch.int64).reshape(-1).to(dev)
    if anchor_ids.numel() != R:
        raise ValueError(f"anchor_ids must have {R} entries, got {anchor_ids.numel()}")
    temps = _per_request(temperature, R, torch.float32, "temperature", 0.0)
    if bool((temps < 0).any()) or not bool(torch.isfinite(temps).all()):
        raise ValueError(f"temperature must be finite and >= 0, got {temps.tolist()}")
    k_req = _per_request(top_k, R, torch.int64, "top_k", 0)
    if bool((k_req < 0).any()):
        raise ValueError(f"top_k must be >= 0, got {k_req.tolist()}")
    if draft_top_k < 0:
        raise ValueError(f"draft_top_k must be >= 0, got {draft_top_k}")
    K = min(draft_top_k, V)
    greedy = (temps < GREEDY_TEMPERATURE).to(dev)
    any_sampled = not bool(greedy.all())
    if any_sampled:
        if uniforms is None:
            uniforms = torch.rand(R, bs, generator=generator)
        if tuple(uniforms.shape) != (R, bs):
            raise ValueError(f"uniforms must be [{R}, {bs}], got {tuple(uniforms.shape)}")
        if bool((uniforms < 0).any()) or bool((uniforms >= 1).any()):
            raise ValueError("uniforms must lie in [0, 1)")
        uniforms = uniforms.to(dev, torch.float32)
    safe_t = torch.where(greedy, torch.ones_like(temps.to(dev)), temps.to(dev))[:, None]
    # Effective truncation per request; 0 = keep everything that the output form allows.
    k_eff = k_req.clone()
    if K > 0:
        k_eff = torch.where(k_eff > 0, k_eff.clamp(max=K), torch.full_like(k_eff, K))
    k_eff = k_eff.clamp(max=V).to(dev)
    return sample_block_prepared(
        model,
        block_hidden,
        anchor_ids,
        greedy=greedy,
        safe_t=safe_t,
        k_eff=k_eff,
        draft_top_k=K,
        uniforms=uniforms if any_sampled else None,
        base_logits=base_logits,
        return_logits=return_logits,
    )


def sample_block_prepared(
    model: DSparkDraftModel,
    block_hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    greedy: torch.Tensor,
    safe_t: torch.Tensor,
    k_eff: torch.Tensor,
    draft_top_k: int,
    uniforms: torch.Tensor | None,
    base_logits: torch.Tensor | None = None,
    return_logits: bool = False,
) -> DraftSample:
    """The sampling loop of :func:`sample_block` on prepared device tensors, without any checks.

    greedy [R] bool; safe_t [R, 1] (temperature, 1 for greedy rows); k_eff [R] effective truncation;
    draft_top_k K (already clamped to V); uniforms [R, bs] float32, or None when every request is greedy.
    With K > 0 nothing here reads a device value on the host, so the CUDA-graph draft step captures it
    (passing uniforms always: greedy rows ignore them).
    """
    R, bs, _ = block_hidden.shape
    V = model.config.vocab_size
    dev = block_hidden.device
    K = draft_top_k
    if base_logits is None:
        base_logits = model.base_logits(block_hidden, drafting=True)
    head = model.markov_head
    state = head.init_state(R, block_hidden) if head is not None else None
    prev = anchor_ids
    tokens, token_probs, confs, dists, ids_out, logits_out = [], [], [], [], [], []
    rows = torch.arange(R, device=dev)
    for k in range(bs):
        h_k = block_hidden[:, k]
        logits = base_logits[:, k].float()
        if head is not None:
            state, bias = head.step(state, prev, h_k)
            logits = logits + bias.float()
        conf = model.confidence_logits(h_k, prev)
        if conf is not None:
            confs.append(conf)
        greedy_tok = logits.argmax(dim=-1)
        ids: torch.Tensor | None
        if K > 0:
            vals, ids = logits.topk(K, dim=-1)
            keep = torch.arange(K, device=dev)[None, :] < k_eff[:, None]
            p = torch.softmax((vals / safe_t).masked_fill(~keep, float("-inf")), dim=-1)
            hit = ids == greedy_tok[:, None]
            # More than K exact ties at the top: put the argmax in the last entry (torch.where, not a boolean
            # index: no host sync).
            missing_last = ~hit.any(dim=-1, keepdim=True) & (torch.arange(K, device=dev) == K - 1)[None, :]
            ids = torch.where(missing_last, greedy_tok[:, None], ids)
            hit = hit | missing_last
            p = torch.where(greedy[:, None], hit.to(p.dtype), p)
            greedy_j = hit.int().argmax(dim=-1)
            ids_out.append(ids)
        else:
            scaled = logits / safe_t
            if bool((k_eff > 0).any()):
                kmax = int(k_eff.max())
                top_idx = logits.topk(kmax, dim=-1).indices
                keep = torch.arange(kmax, device=dev)[None, :] < k_eff[:, None]
                mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top_idx, keep)
                mask |= (k_eff == 0)[:, None]  # untruncated requests keep the whole vocabulary
                scaled = scaled.masked_fill(~mask, float("-inf"))
            p = torch.softmax(scaled, dim=-1)
            p = torch.where(greedy[:, None], torch.nn.functional.one_hot(greedy_tok, V).to(p.dtype), p)
            greedy_j = greedy_tok
            ids = None
        j = torch.where(greedy, greedy_j, inverse_cdf(p, uniforms[:, k])) if uniforms is not None else greedy_j
        tok = ids[rows, j] if ids is not None else j
        tokens.append(tok)
        token_probs.append(p[rows, j])
        dists.append(p)
        if return_logits:
            logits_out.append(logits)
        prev = tok

    dist = torch.stack(dists, dim=1)
    return DraftSample(
        tokens=torch.stack(tokens, dim=1),
        token_probs=torch.stack(token_probs, dim=1),
        confidence_logits=torch.stack(confs, dim=1) if confs else None,
        probs=dist if K == 0 else None,
        topk_ids=torch.stack(ids_out, dim=1) if K > 0 else None,
        topk_probs=dist if K > 0 else None,
        logits=torch.stack(logits_out, dim=1) if return_logits else None,
    )


def kernel_backend(device: torch.device) -> str:
    """The fused sampler (and slot attention) the draft steps use on ``device``: 'triton' on CUDA, else
    'reference' (the kernels' torch twins, same layout; the Triton interpreter is for tests only)."""
    return "triton" if device.type == "cuda" else "reference"


def fuses_markov_head(model: DSparkDraftModel, draft_top_k: int) -> bool:
    """Whether :func:`sample_block_keyed` samples this drafter with the fused Markov kernel: a vanilla head (the
    gated and RNN heads mix h_k into the bias, which the kernel does not compute) and K within its sparse
    width."""
    head = model.markov_head
    return head is not None and head.head_type == "vanilla" and 1 <= draft_top_k <= MAX_SPARSE_K


def _markov_impl(backend: str):
    if backend == "triton":
        from kernels.markov_triton import markov_sample_triton

        return markov_sample_triton
    if backend == "reference":
        return markov_sample_reference
    raise ValueError(f"Markov sampler backend must be 'triton' or 'reference', got {backend!r}")


@torch.no_grad()
def sample_block_keyed(
    model: DSparkDraftModel,
    block_hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    temperature: torch.Tensor,
    k_eff: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_top_k: int,
    backend: str,
    validate: bool = False,
) -> DraftSample:
    """The draft engine's block sampling for R requests, sparse (``draft_top_k`` = K >= 1 slots per row).

    Device tensors [R]: temperature (float32; below GREEDY_TEMPERATURE = greedy), k_eff (the request's
    truncation in [1, K]: min(its top_k, K), or K), seeds (int64) and positions (the anchor's absolute position:
    draft k decides position positions + 1 + k, and its random numbers are keyed by (seed, that position)).
    ``backend``: 'triton' or 'reference' (:func:`kernel_backend`); the eager and the graph steps pass the same
    one, so graphs on / off / static draft the same tokens. Nothing here reads a device value on the host
    unless ``validate`` (the eager path's input checks), so the CUDA-graph draft step captures it.

    A vanilla Markov head goes through :mod:`kernels.markov`: the kernel reads the lm_head output in its
    storage dtype, cut to the real vocabulary of an inflated pair (padded ids are never sampled nor listed),
    computes z_k = U_k + W1[x_{k-1}] W2^T in fp32 and draws x_k by a Gumbel-max race over the request's exact
    top-k_eff with per-token uniforms (:mod:`kernels.markov`'s contract); the sparse rows are (the K largest
    z, sorted; probabilities renormalised over the first k_eff, 0 after). That is an exact sample of the same
    truncated softmax the torch loop draws by inverse CDF, from other random numbers, and the returned rows
    are the distribution it was drawn from: what lossless verification needs. The confidence head then reads
    [h_k ; W1[x_{k-1}]] for the whole block in one product. Other heads: the torch loop, inverse CDF on the
    uniforms of the same keys.
    """
    bs = block_hidden.shape[1]
    K = draft_top_k
    temps = torch.where(temperature < GREEDY_TEMPERATURE, 0.0, temperature)
    if fuses_markov_head(model, K):
        head = model.markov_head
        assert head is not None
        real = model.real_vocab_size
        base = model.project_vocab(block_hidden)[..., :real]  # a strided view: no float copy of [R, bs, V]
        out = _markov_impl(backend)(
            base,
            anchor_ids,
            head.markov_w1.weight[:real],
            head.markov_w2.weight[:real],
            temps,
            seeds,
            positions,
            top_k=K,
            validate=validate,
            k_eff=k_eff,
        )
        return DraftSample(
            tokens=out.tokens,
            token_probs=out.token_probs,
            confidence_logits=model.confidence_from_embedding(block_hidden, out.confidence_inputs),
            topk_ids=out.sparse_ids,
            topk_probs=out.sparse_probs,
        )
    device = block_hidden.device
    token_positions = positions[:, None] + 1 + torch.arange(bs, device=device)[None, :]
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    uniforms = uniform(seeds[:, None], token_positions, STREAM_DRAFT_SAMPLE, zero)
    greedy = temps == 0
    return sample_block_prepared(
        model,
        block_hidden,
        anchor_ids,
        greedy=greedy,
        safe_t=torch.where(greedy, torch.ones_like(temps), temps)[:, None],
        k_eff=k_eff,
        draft_top_k=K,
        uniforms=torch.clamp(uniforms, max=UNIFORM_MAX),
    )
