"""Markov-head sampling (DSpark's vanilla sequential head): contract, validation and the torch reference loop.

For each request the head turns the backbone's base logits U_1..U_gamma into draft tokens one at a time:

    z_k = U_k + W1[x_{k-1}] @ W2^T          (x_0 = the anchor; W1, W2 stored [V, r] like DeepSpec's weights)
    x_k ~ softmax(z_k / T), optionally truncated to its top-K tokens and renormalised.

Outputs per request and step: the token, the probability of that token under the distribution it was drawn
from (what verification needs as p_d(x_k)), optionally that whole distribution in sparse form (ids and probs,
``top_k > 0``) or the corrected logits z_k, and the confidence-head input W1[x_{k-1}].

Semantics shared bit for bit with the Triton kernel (:mod:`kernels.markov_triton`):
- Greedy requests (T == 0) take argmax z_k (ties: smaller id) and report probability 1: their draft
  distribution is the point mass, and in sparse form it is (top-K ids, [1, 0, ..., 0]).
- Sampled requests use the Gumbel-max form of the exponential race, argmax_v (z_v / T - log E_v) with
  E_v = -log u_v and u_v from :mod:`kernels.rng` (stream STREAM_DRAFT_SAMPLE, position = the anchor position
  + 1 + k, index = token id). It needs no normalisation, so the kernel samples in the same streaming pass
  that computes z_k; the log-sum-exp for the token's probability is accumulated alongside.
- ``top_k > 0``: the support is exactly the K largest z (ties broken towards smaller ids, so exactly K tokens,
  unlike the verifier's tie-keeping top-k: the sparse wire format has K slots), ids sorted by descending z.
  The race runs over those K tokens with the same per-token uniforms.
- ``k_eff`` (optional, [R], each in [1, K]): a request's own truncation inside the K slots. Its support is
  the first k_eff[r] of the K sorted entries, i.e. its own exact top-k_eff (the first k of an exact top-K are
  the exact top-k); the race and the renormalisation run over those, and slots k_eff[r]..K-1 keep their ids
  with probability 0 (the wire format keeps K slots). A greedy request ignores it (the argmax is slot 0).
The Markov drafter needs no target-side filtering: any proposal distribution keeps verification exact, as
long as the verifier receives the distribution the token was actually drawn from, which these outputs are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.checks import MAX_SPARSE_K, check_request_params, check_vector, require
from kernels.float_keys import canonical, pack_value_id, unpack_value_id
from kernels.rng import STREAM_DRAFT_SAMPLE, uniform

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MarkovSample:
    """Draft block produced by the Markov head for R requests and gamma steps.

    tokens [R, gamma] int64; token_probs [R, gamma] float32 (p_d of each token, 1.0 for greedy requests);
    confidence_inputs [R, gamma, r] (W1[x_{k-1}], dtype of W1: the confidence head reads [h_k; W1[x_{k-1}]]);
    sparse_ids / sparse_probs [R, gamma, K] int64 / float32 when top_k = K > 0 (else None);
    logits [R, gamma, V] float32 (the corrected logits z_k, before temperature) when asked (else None).
    """

    tokens: torch.Tensor
    token_probs: torch.Tensor
    confidence_inputs: torch.Tensor
    sparse_ids: torch.Tensor | None = None
    sparse_probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def validate_markov_inputs(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: int,
    k_eff: torch.Tensor | None = None,
) -> None:
    """Raise ValueError with a clear message on any malformed input."""
    require(
        isinstance(base_logits, torch.Tensor) and base_logits.dim() == 3,
        "base_logits must be a 3-D tensor [R, gamma, V]",
    )
    require(
        base_logits.dtype in _FLOAT_DTYPES,
        f"base_logits must be float32, bfloat16 or float16, got {base_logits.dtype}",
    )
    device = base_logits.device
    num_req, gamma, vocab = base_logits.shape
    require(
        gamma > 0 and vocab > 0, f"base_logits must have gamma > 0 and V > 0, got {list(base_logits.shape)}"
    )
    for name, weight in (("w1", w1), ("w2", w2)):
        require(
            isinstance(weight, torch.Tensor) and weight.dim() == 2,
            f"{name} must be a 2-D tensor [V, r] (W2 stored as nn.Linear(r -> V).weight)",
        )
        require(weight.shape[0] == vocab, f"{name} has {weight.shape[0]} rows, the vocabulary is {vocab}")
        require(
            weight.dtype in _FLOAT_DTYPES, f"{name} must be float32, bfloat16 or float16, got {weight.dtype}"
        )
        require(weight.device == device, f"{name} is on {weight.device}, base_logits on {device}")
    require(
        w1.shape == w2.shape and w1.shape[1] > 0,
        f"w1 {list(w1.shape)} and w2 {list(w2.shape)} must both be [V, r] with r > 0",
    )
    require(w1.dtype == w2.dtype, f"w1 ({w1.dtype}) and w2 ({w2.dtype}) must share a dtype")
    check_vector("temperature", temperature, num_req, False, device)
    check_request_params(temperature, seeds, positions, device)
    check_vector("anchor_ids", anchor_ids, num_req, True, device)
    require(bool(((anchor_ids >= 0) & (anchor_ids < vocab)).all()), f"anchor_ids must be in [0, {vocab})")
    require(isinstance(top_k, int) and not isinstance(top_k, bool), "top_k must be an int")
    require(
        0 <= top_k <= min(vocab, MAX_SPARSE_K),
        f"top_k must be in [0, {min(vocab, MAX_SPARSE_K)}] (0 = full vocabulary), got {top_k}",
    )
    if k_eff is not None:
        require(top_k > 0, "k_eff (a per-request truncation inside the top-K) needs top_k > 0")
        check_vector("k_eff", k_eff, num_req, True, device)
        require(bool(((k_eff >= 1) & (k_eff <= top_k)).all()), f"k_eff must be in [1, top_k={top_k}]")


def confidence_inputs(w1: torch.Tensor, anchor_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """W1[x_{k-1}] for every step: [R, gamma, r] (x_0 = anchor)."""
    previous = torch.cat([anchor_ids.to(torch.int64)[:, None], tokens[:, :-1]], dim=1)
    return w1[previous]


def markov_sample_reference(
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: int = 0,
    return_logits: bool = False,
    validate: bool = True,
    k_eff: torch.Tensor | None = None,
) -> MarkovSample:
    """Torch reference: gamma sequential steps, each a [R, r] x [r, V] product plus sampling, in float32.

    ``positions[r]`` is the anchor's absolute position; step k draws the token at position positions + 1 + k.
    ``k_eff`` [R] (with ``top_k > 0``): per-request truncation inside the K slots (None: K for every request).
    """
    if validate:
        validate_markov_inputs(base_logits, anchor_ids, w1, w2, temperature, seeds, positions, top_k, k_eff)
    num_req, gamma, vocab = base_logits.shape
    device = base_logits.device
    w1f = w1.to(torch.float32)
    w2t = w2.to(torch.float32).t()
    greedy = temperature == 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)[:, None]
    seeds = seeds.to(torch.int64)[:, None]
    vocab_ids = torch.arange(vocab, device=device)
    tokens = torch.empty((num_req, gamma), dtype=torch.int64, device=device)
    token_probs = torch.empty((num_req, gamma), dtype=torch.float32, device=device)
    sparse_ids = torch.empty((num_req, gamma, top_k), dtype=torch.int64, device=device) if top_k else None
    sparse_probs = torch.empty((num_req, gamma, top_k), dtype=torch.float32, device=device) if top_k else None
    logits = (
        torch.empty((num_req, gamma, vocab), dtype=torch.float32, device=device) if return_logits else None
    )
    one = torch.ones(num_req, dtype=torch.float32, device=device)
    if top_k:
        live = torch.arange(top_k, device=device)[None, :] < (top_k if k_eff is None else k_eff[:, None])

    previous = anchor_ids.to(torch.int64)
    for k in range(gamma):
        z = base_logits[:, k].to(torch.float32) + w1f[previous] @ w2t
        if logits is not None:
            logits[:, k] = z
        position = (positions.to(torch.int64) + 1 + k)[:, None]
        if top_k == 0:
            scaled = canonical(z / safe_t)
            noise = torch.log(-torch.log(uniform(seeds, position, STREAM_DRAFT_SAMPLE, vocab_ids[None, :])))
            token = torch.where(greedy[:, None], z, scaled - noise).argmax(dim=-1)
            log_norm = torch.logsumexp(scaled, dim=-1)
            prob = torch.where(greedy, one, torch.exp(scaled.gather(1, token[:, None]).squeeze(1) - log_norm))
        else:
            top = pack_value_id(canonical(z), vocab_ids[None, :]).topk(top_k, dim=-1).values
            values, ids = unpack_value_id(top)
            scaled = canonical(values / safe_t).masked_fill(~live, float("-inf"))
            probs = torch.exp(scaled - torch.logsumexp(scaled, dim=-1, keepdim=True))
            noise = torch.log(-torch.log(uniform(seeds, position, STREAM_DRAFT_SAMPLE, ids)))
            winner = torch.where(greedy, 0, (scaled - noise).argmax(dim=-1))
            token = ids.gather(1, winner[:, None]).squeeze(1)
            prob = torch.where(greedy, one, probs.gather(1, winner[:, None]).squeeze(1))
            point_mass = (torch.arange(top_k, device=device) == 0).to(torch.float32)
            assert sparse_ids is not None and sparse_probs is not None
            sparse_ids[:, k] = ids
            sparse_probs[:, k] = torch.where(greedy[:, None], point_mass[None, :], probs)
        tokens[:, k] = token
        token_probs[:, k] = prob
        previous = token
    return MarkovSample(
        tokens=tokens,
        token_probs=token_probs,
        confidence_inputs=confidence_inputs(w1, anchor_ids, tokens),
        sparse_ids=sparse_ids,
        sparse_probs=sparse_probs,
        logits=logits,
    )
