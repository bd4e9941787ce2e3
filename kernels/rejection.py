"""Rejection sampling over ragged draft blocks: the contract, input validation and the torch reference.

The math (speculative sampling, Leviathan et al. / Chen et al.): request r proposes l_r draft tokens
x_1..x_l drawn from draft distributions p_d,k. The target scored [anchor, x_1..x_l], giving l_r + 1 target
distributions p_t,0..p_t,l. Left to right, x_k is accepted with probability min(1, p_t(x_k) / p_d(x_k));
at the first rejection one token is drawn from the residual norm(max(0, p_t - p_d)) and the rest is dropped;
if all are accepted one bonus token is drawn from p_t,l. The emitted tokens are then distributed exactly as
the target's own samples. At temperature 0 (greedy) this becomes: accept while x_k == argmax p_t,k, then emit
the target argmax.

Layout (ragged, no padding to gamma): ``draft_token_ids [N]`` holds every request's drafts back to back,
``cu_draft_lens [R+1]`` their offsets (request r owns drafts cu[r]..cu[r+1]-1; l_r = cu[r+1] - cu[r] >= 0).
``target_logits [N + R, V]`` holds request r's l_r + 1 rows at rows cu[r] + r .. cu[r+1] + r: row k scores the
token after [anchor, x_1..x_k], i.e. it is the target distribution for x_{k+1}, and the last row is the bonus
row. This is exactly the verify pass output for the flattened batch [anchor_r, x_r,1..x_r,l] over all r.
``output_tokens [N + R]`` uses the same rows: request r's emitted tokens (accepted drafts, then the
correction or bonus token) are ``output_tokens[cu[r] + r : cu[r] + r + num_accepted[r] + 1]``; the other
entries are -1. A request with l_r = 0 just samples one token from the target, which is also how the first
token after prefill is drawn.

Target distribution of a sampled row (temperature T > 0), the same in the reference and the kernel:
  z = logits * (1 / T) (float32: the reciprocal rounded once, then one rounded product per token, which
  is cheaper than a division per token in the kernel; -0.0 canonicalised to +0.0);
  top-k (k > 0 and k < V): keep every token whose z is >= the k-th largest z counted with multiplicity, so
  tokens tied with the k-th value are all kept (possibly more than k tokens);
  top-p (p < 1), applied after top-k to the renormalised top-k distribution: keep every token whose z is >=
  tau_p, where tau_p is the largest z value such that the probability mass of {z >= tau_p} is >= p; i.e. the
  smallest descending-order prefix reaching mass p, extended by all tokens tied with its last value (the token
  that crosses p is kept);
  p_t(v) = exp(z_v - max z) / sum_{kept u} exp(z_u - max z) on kept tokens, 0 elsewhere.
Integer thresholds (top-k) are identical in both implementations; the top-p boundary compares float sums, so
the two implementations could disagree only when a prefix mass lies within float rounding (~1e-6) of p.

Random numbers come from :mod:`kernels.rng` at the absolute position of the token being decided
(``positions[r] + 1 + k`` for row k, ``positions[r]`` being the anchor's position): the accept test of x_k
uses stream STREAM_ACCEPT, index 0; the residual or bonus draw uses STREAM_TARGET_SAMPLE, indices 0 and 1.

Residual and bonus draws are by inverse CDF in two levels, with two uniforms. With e_v = exp(z_v - max z) on
kept tokens (0 elsewhere) and Z = sum e, the residual weight is w = Z * max(0, p_t - p_d) = max(0, e - Z * p_d)
(the bonus row has p_d = 0, so w = e). The vocabulary is cut into blocks of CDF_BLOCK ids; with the block
masses M_b = sum_{v in b} w_v, the block b is the first (in id order) whose running mass exceeds
u_0 * sum_b M_b, then the token is the first id of b whose running weight inside b exceeds u_1 * M_b
(u_i: STREAM_TARGET_SAMPLE, index i). P(b) = M_b / sum M and P(v | b) = w_v / M_b, so the draw follows norm(w)
exactly, for any block size; no per-entry random number or log is needed. In floats every search takes the
first entry of positive weight whose running sum exceeds the target, or the last entry of positive weight when
rounding lets the target pass the end: a chosen block has positive mass, hence a positive entry, so a token of
weight 0 (a -inf logit, a token removed by top-k / top-p, a residual of 0) is never drawn. The second uniform
resolves the token to float precision relative to its block's mass rather than to the whole row's. If the
residual is all zero (a rejection that has probability 0 in exact arithmetic but can occur by float rounding
when p_d == p_t), the same draw runs on the weights e (that is, p_t) with the same uniforms. The Triton kernel
computes the same sums in another order, so the two implementations can differ only when a target lies within
float rounding of a running-sum boundary.

Sparse draft distributions: a drafter may sample x_k from its top-K truncated, renormalised distribution and
send only ``(ids [N, K], probs [N, K])``. Verification stays exact because the rejection rule only needs
p_d(x_k) at the sampled token (found among the K ids; x_k is always in the support since it was drawn from
it) and the residual max(0, p_t - p_d) over the vocabulary; p_d is exactly 0 outside the K ids, so there the
residual is p_t. The truncated distribution is simply the proposal distribution, and rejection sampling is
exact for any proposal as long as it is the one the draft was actually drawn from. Duplicate ids in a sparse
row add up (so padding with probability 0 is harmless).

Greedy requests (T == 0) ignore draft probabilities, top-k and top-p; ties in the argmax go to the smaller
token id (``torch.argmax`` semantics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.checks import MAX_SPARSE_K, check_request_params, check_vector, require
from kernels.float_keys import canonical
from kernels.rng import STREAM_ACCEPT, STREAM_TARGET_SAMPLE, uniform

PROB_SUM_TOLERANCE = 1e-3
"""Allowed |sum(p_d) - 1| per draft row (float32 sums over a large vocabulary carry ~1e-5 of rounding)."""

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CDF_BLOCK = 2048
"""Vocabulary ids per block of the inverse-CDF draw (a power of two >= 16 for the Triton kernels, which read it
at call time, so both implementations always cut the same blocks). Any block size gives the same distribution."""


@dataclass(frozen=True)
class RejectionOutput:
    """Result of verifying one ragged batch.

    ``num_accepted [R]`` int64: accepted draft tokens per request (0..l_r); each request emits
    num_accepted + 1 tokens. ``output_tokens [N + R]`` int64, laid out like the target rows: request r's
    emitted tokens are ``output_tokens[cu[r] + r : cu[r] + r + num_accepted[r] + 1]``, other entries are -1.
    """

    num_accepted: torch.Tensor
    output_tokens: torch.Tensor

    def per_request(self, cu_draft_lens: torch.Tensor) -> list[list[int]]:
        """Emitted tokens of every request as Python lists (one host transfer; for engines and tests)."""
        cu = cu_draft_lens.tolist()
        accepted = self.num_accepted.tolist()
        tokens = self.output_tokens.tolist()
        return [tokens[cu[r] + r : cu[r] + r + accepted[r] + 1] for r in range(len(accepted))]


def validate_rejection_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_draft_lens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_prob_ids: torch.Tensor | None,
) -> None:
    """Raise ValueError with a clear message on any malformed input (shapes, dtypes, devices, values).

    Value checks read the (small) control tensors and the draft probabilities of sampled requests; the target
    logits are only checked for shape and dtype, never read.
    """
    require(
        isinstance(target_logits, torch.Tensor) and target_logits.dim() == 2,
        "target_logits must be a 2-D tensor [N + R, V]",
    )
    require(
        target_logits.dtype in _LOGIT_DTYPES,
        f"target_logits must be float32, bfloat16 or float16, got {target_logits.dtype}",
    )
    device = target_logits.device
    rows, vocab = target_logits.shape
    require(vocab > 0, "target_logits has an empty vocabulary dimension")
    require(
        isinstance(draft_token_ids, torch.Tensor) and draft_token_ids.dim() == 1,
        "draft_token_ids must be a 1-D tensor [N]",
    )
    num_draft = draft_token_ids.shape[0]
    check_vector("draft_token_ids", draft_token_ids, num_draft, True, device)
    num_req = check_request_params(temperature, seeds, positions, device)
    check_vector("cu_draft_lens", cu_draft_lens, num_req + 1, True, device)
    check_vector("top_k", top_k, num_req, True, device)
    check_vector("top_p", top_p, num_req, False, device)
    require(
        rows == num_draft + num_req,
        f"target_logits must have N + R = {num_draft} + {num_req} = "
        f"{num_draft + num_req} rows (one per draft token plus one bonus row per request), got {rows}",
    )

    cu = cu_draft_lens.to(torch.int64)
    require(int(cu[0]) == 0, f"cu_draft_lens[0] must be 0, got {int(cu[0])}")
    require(bool((cu[1:] >= cu[:-1]).all()), "cu_draft_lens must be non-decreasing (monotone offsets)")
    require(
        int(cu[-1]) == num_draft,
        f"cu_draft_lens[-1] must equal the number of draft tokens {num_draft}, got {int(cu[-1])}",
    )
    require(bool(((top_p > 0) & (top_p <= 1)).all()), "top_p must be in (0, 1] (1 means off)")
    require(bool((top_k >= 0).all()), "top_k must be >= 0 (0 means off)")
    if num_draft > 0:
        require(
            bool(((draft_token_ids >= 0) & (draft_token_ids < vocab)).all()),
            f"draft_token_ids must be in [0, {vocab})",
        )

    sampled = temperature > 0
    lens = cu[1:] - cu[:-1]
    draft_sampled = torch.repeat_interleave(sampled, lens, output_size=num_draft)
    if draft_probs is None:
        require(draft_prob_ids is None, "draft_prob_ids given without draft_probs")
        require(
            num_draft == 0 or not bool(draft_sampled.any()),
            "draft_probs is required when a request with temperature > 0 has draft tokens",
        )
        return
    require(
        isinstance(draft_probs, torch.Tensor) and draft_probs.dim() == 2,
        "draft_probs must be a 2-D tensor ([N, V] dense or [N, K] sparse)",
    )
    require(
        draft_probs.dtype == torch.float32,
        f"draft_probs must be float32 (the exact distribution the "
        f"drafts were sampled from), got {draft_probs.dtype}",
    )
    require(
        draft_probs.device == device, f"draft_probs is on {draft_probs.device}, target_logits on {device}"
    )
    require(
        draft_probs.shape[0] == num_draft,
        f"draft_probs must have {num_draft} rows (one per draft token), got {draft_probs.shape[0]}",
    )
    if draft_prob_ids is None:
        require(
            draft_probs.shape[1] == vocab,
            f"dense draft_probs must have shape [{num_draft}, {vocab}], got "
            f"{list(draft_probs.shape)} (pass draft_prob_ids for a sparse distribution)",
        )
    else:
        require(
            isinstance(draft_prob_ids, torch.Tensor) and draft_prob_ids.shape == draft_probs.shape,
            f"draft_prob_ids must have the shape of draft_probs {list(draft_probs.shape)}",
        )
        require(
            not draft_prob_ids.dtype.is_floating_point and draft_prob_ids.dtype != torch.bool,
            f"draft_prob_ids must be an integer tensor, got {draft_prob_ids.dtype}",
        )
        require(draft_prob_ids.device == device, "draft_prob_ids must be on the device of target_logits")
        require(
            0 < draft_probs.shape[1] <= MAX_SPARSE_K,
            f"sparse draft distributions need 1 <= K <= {MAX_SPARSE_K} entries per row, "
            f"got {draft_probs.shape[1]}",
        )
        if num_draft > 0:
            require(
                bool(((draft_prob_ids >= 0) & (draft_prob_ids < vocab)).all()),
                f"draft_prob_ids must be in [0, {vocab})",
            )
    checked = draft_probs[draft_sampled]
    if checked.numel() > 0:
        require(bool(torch.isfinite(checked).all()), "draft_probs contains NaN or inf")
        require(bool((checked >= 0).all()), "draft_probs must be non-negative")
        worst = float((checked.sum(dim=1, dtype=torch.float64) - 1.0).abs().max())
        require(
            worst <= PROB_SUM_TOLERANCE,
            f"draft_probs rows must sum to 1 (tolerance "
            f"{PROB_SUM_TOLERANCE}); worst row is off by {worst:.3g}",
        )


def _row_layout(cu: torch.Tensor, num_req: int, num_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of every target row [N + R], request of every draft token [N]) without a host sync."""
    lens = cu[1:] - cu[:-1]
    requests = torch.arange(num_req, device=cu.device)
    row_req = torch.repeat_interleave(requests, lens + 1, output_size=num_draft + num_req)
    draft_req = torch.repeat_interleave(requests, lens, output_size=num_draft)
    return row_req, draft_req


def filter_thresholds(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row keep threshold tau (tokens with z >= tau are kept; -inf = keep all), see the module doc.

    Off the CPU nothing here reads a device value on the host (every row is sorted and the rows without
    top-k / top-p are masked afterwards), so the reference sampler can be captured in a CUDA graph."""
    rows, vocab = z.shape
    off = torch.full((rows,), float("-inf"), dtype=torch.float32, device=z.device)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1
    need = use_k | use_p
    if z.device.type == "cpu" and not bool(need.any()):
        return off  # reading the flag is free on the CPU: skip the sort when no row filters
    sorted_z = z.sort(dim=-1, descending=True).values
    k = top_k.to(torch.int64).clamp(1, vocab) - 1
    kth = sorted_z.gather(1, k[:, None]).squeeze(1)
    tau_k = torch.where(use_k, kth, off)
    weights = torch.where(sorted_z >= tau_k[:, None], torch.exp(sorted_z - sorted_z[:, :1]), 0.0)
    total = weights.sum(dim=-1)
    reached = weights.cumsum(dim=-1) >= top_p[:, None].to(torch.float32) * total[:, None]
    first = torch.where(
        reached.any(dim=-1),
        reached.to(torch.int8).argmax(dim=-1),
        torch.full_like(total, vocab - 1, dtype=torch.int64),
    )
    tau_p = torch.where(use_p, sorted_z.gather(1, first[:, None]).squeeze(1), off)
    return torch.where(need, torch.maximum(tau_k, tau_p), off)


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """float32 1 / T (IEEE division; the Triton kernels compute the same value with ``div_rn``)."""
    return 1.0 / temperature.to(torch.float32)


def target_weights(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised filtered weights exp(z - max z) on kept tokens [rows, V] and their sums [rows, 1]."""
    z = canonical(logits.to(torch.float32) * inverse_temperature(temperature)[:, None])
    tau = filter_thresholds(z, top_k, top_p)
    z_max = z.max(dim=-1, keepdim=True).values
    weights = torch.where(z >= tau[:, None], torch.exp(z - z_max), 0.0)
    return weights, weights.sum(dim=-1, keepdim=True)


def target_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Filtered target distribution p_t [rows, V] float32 of sampled rows (per-row T > 0, top-k, top-p)."""
    weights, norm = target_weights(logits, temperature, top_k, top_p)
    return weights / norm


def _first_positive_crossing(weights: torch.Tensor, cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row (last dim): the first entry with running mass > target and weight > 0; if rounding lets the
    target pass every entry, the last entry of positive weight (0 when no entry has positive weight)."""
    size = weights.shape[-1]
    index = torch.arange(size, device=weights.device)
    first = torch.where((cum > target[..., None]) & (weights > 0), index, size).amin(dim=-1)
    last = torch.where(weights > 0, index, 0).amax(dim=-1)
    return torch.where(first < size, first, last)


def inverse_cdf_draw(weights: torch.Tensor, u_block: torch.Tensor, u_inner: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``weights [R, V]`` (non-negative, unnormalised) by the two-level inverse CDF of the
    module doc: the block of CDF_BLOCK ids by its running mass against ``u_block [R]`` times the total, then
    the id inside it by its running weight against ``u_inner [R]`` times the block's mass."""
    rows, vocab = weights.shape
    block = CDF_BLOCK
    num_blocks = -(-vocab // block)
    blocks = torch.nn.functional.pad(weights, (0, num_blocks * block - vocab)).view(rows, num_blocks, block)
    mass = blocks.sum(dim=-1)
    b = _first_positive_crossing(mass, mass.cumsum(dim=-1), u_block * mass.sum(dim=-1))
    chosen = blocks[torch.arange(rows, device=weights.device), b]
    i = _first_positive_crossing(chosen, chosen.cumsum(dim=-1), u_inner * chosen.sum(dim=-1))
    return b * block + i


def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_draft_lens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_prob_ids: torch.Tensor | None = None,
    validate: bool = True,
) -> RejectionOutput:
    """Pure-torch rejection sampler (vectorised over the batch); the oracle for the Triton kernels.

    ``draft_probs`` is dense ``[N, V]`` or, with ``draft_prob_ids [N, K]``, sparse ``[N, K]`` (float32);
    it may be None when no sampled request has drafts. ``validate=False`` skips the checks (and their host
    syncs) for callers whose inputs were produced by trusted code.
    """
    if validate:
        validate_rejection_inputs(
            target_logits,
            draft_token_ids,
            draft_probs,
            cu_draft_lens,
            temperature,
            top_k,
            top_p,
            seeds,
            positions,
            draft_prob_ids,
        )
    device = target_logits.device
    num_req = temperature.shape[0]
    num_draft = draft_token_ids.shape[0]
    cu = cu_draft_lens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    row_req, draft_req = _row_layout(cu, num_req, num_draft)
    row_start = cu[:-1] + torch.arange(num_req, device=device)
    temperature = temperature.to(torch.float32)
    greedy = temperature == 0
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)

    argmax = target_logits.argmax(dim=-1)
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    weights, norm = target_weights(
        target_logits, safe_t[row_req], top_k[row_req].to(torch.int64), top_p[row_req]
    )
    p_t = weights / norm

    x = draft_token_ids.to(torch.int64)
    k_draft = torch.arange(num_draft, device=device) - cu[draft_req]
    target_row = torch.arange(num_draft, device=device) + draft_req
    if draft_probs is None:
        pd_x = torch.zeros(num_draft, dtype=torch.float32, device=device)
    elif draft_prob_ids is None:
        pd_x = draft_probs.gather(1, x[:, None]).squeeze(1)
    else:
        pd_x = torch.where(draft_prob_ids.to(torch.int64) == x[:, None], draft_probs, 0.0).sum(dim=1)
    pt_x = p_t[target_row, x]
    u = uniform(seeds[draft_req], positions[draft_req] + 1 + k_draft, STREAM_ACCEPT, torch.zeros_like(x))
    accept = torch.where(greedy[draft_req], x == argmax[target_row], u * pd_x < pt_x)
    first_reject = torch.where(accept, lens[draft_req], k_draft)
    num_accepted = lens.clone().scatter_reduce(0, draft_req, first_reject, reduce="amin", include_self=True)

    sample_row = row_start + num_accepted
    bonus = num_accepted == lens
    weight_s, norm_s = weights[sample_row], norm[sample_row]
    pd_s = torch.zeros_like(weight_s)
    draft_row = torch.where(bonus, 0, cu[:-1] + num_accepted).clamp(max=max(num_draft - 1, 0))
    if draft_probs is not None and num_draft > 0:
        if draft_prob_ids is None:
            pd_s = draft_probs[draft_row]
        else:
            pd_s = pd_s.scatter_add(1, draft_prob_ids[draft_row].to(torch.int64), draft_probs[draft_row])
        pd_s = torch.where(bonus[:, None], 0.0, pd_s)  # the bonus row draws from p_t itself
    # residual weights w = Z * max(0, p_t - p_d) = max(0, e - Z * p_d); p_t itself if they are all zero
    residual = (weight_s - norm_s * pd_s).clamp(min=0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, weight_s)
    position_s = positions + 1 + num_accepted
    index = torch.zeros_like(position_s)
    sampled = inverse_cdf_draw(
        residual,
        uniform(seeds, position_s, STREAM_TARGET_SAMPLE, index),
        uniform(seeds, position_s, STREAM_TARGET_SAMPLE, index + 1),
    )
    final = torch.where(greedy, argmax[sample_row], sampled)

    # Rejected drafts go to a trash row past the end: a scatter of static shape, no boolean index (no sync).
    rows = num_draft + num_req
    output = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
    kept = k_draft < num_accepted[draft_req]
    output.index_copy_(0, torch.where(kept, target_row, rows), x)
    output[sample_row] = final
    return RejectionOutput(num_accepted=num_accepted, output_tokens=output[:rows])
