"""The reference single-request speculative decoding loop: the oracle for the serving engine.

Batch 1, fixed block, temperature 0, optional static confidence threshold, stop token ids, max_new_tokens:
exactly DeepSpec's evaluator loop (``generate_decoding_sample`` + ``verify_draft_tokens`` with the DSpark
``_propose`` / ``_update``), restated plainly. The target is a plain transformers ``Qwen3ForCausalLM`` with a
``DynamicCache`` and ``output_hidden_states``; the drafter is our :class:`DSparkDraftModel` with its slot
context cache, appended every round with the target features of [anchor, accepted drafts] (DeepSpec's draft
cache cropped back to ``start``). Every round is recorded so the engine can be compared round by round, not
just on tokens.

Also here: the temperature > 0 verification math of one block (acceptance probabilities and residual
distributions) in its plainest form, the oracle for batched rejection sampling.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3ForCausalLM

from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import sample_block

PROB_FLOOR = 1e-8  # DeepSpec clamps draft probabilities and residual masses at this value


@dataclass
class RoundRecord:
    """One draft + verify round, in the fields of the fixture's ``reference.json``."""

    start: int  # absolute position of the anchor
    draft_cache_len_before: int  # context rows cached when the round began
    new_context_len: int  # rows appended this round (= start - draft_cache_len_before)
    anchor_token: int
    proposed_tokens: list[int]  # drafts sent for verification (after confidence truncation)
    confidence_logits: (
        list[float] | None
    )  # raw logits of the proposed tokens; None if no head or empty proposal
    accepted_draft_tokens: int
    effective_proposal_length: int
    next_token: int  # correction or bonus token (the target's argmax after the accepted prefix)
    terminated_by_stop_token: bool
    block_hidden: torch.Tensor  # [bs, H] draft block hidden states after the final norm
    block_confidence_logits: torch.Tensor | None  # [bs] raw confidence logits of the whole block


@dataclass
class SpecDecodeResult:
    new_tokens: list[int]
    acceptance_lengths: list[int]  # tau per round: accepted drafts + 1 (no +1 when a draft was a stop token)
    proposal_lengths: list[int]
    accepted_draft_lengths: list[int]
    rounds: list[RoundRecord] = field(default_factory=list)

    @property
    def verify_count(self) -> int:
        return len(self.rounds)


def load_target(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Qwen3ForCausalLM:
    """A local HF Qwen3 folder as a plain transformers model (SDPA attention, eval mode)."""
    model = Qwen3ForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads (self as the argument).
    return model.to(device).eval()  # type: ignore[arg-type]


def context_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """HF hidden_states -> context features [B, S, m*H]: id -1 = embedding output, id l =
    hidden_states[l+1]."""
    return torch.cat([hidden_states[0 if i == -1 else i + 1] for i in target_layer_ids], dim=-1)


def cache_kwargs(model: Qwen3ForCausalLM, cache: DynamicCache) -> dict[str, object]:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); pass the cache under the name it
    takes."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _crop(cache: DynamicCache, length: int) -> None:
    """Roll the target KV cache back to ``length`` positions (negative crop works across transformers 5.x)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def _trim_after_stop(tokens: list[int], stop_token_ids: Sequence[int] | None) -> list[int]:
    for i, token in enumerate(tokens):
        if stop_token_ids and token in stop_token_ids:
            return tokens[: i + 1]
    return tokens


def _check_prompt(prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    return prompt


@torch.no_grad()
def target_greedy(
    target: Qwen3ForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
) -> list[int]:
    """Plain greedy decoding of the target, token by token with a KV cache: what speculation must
    reproduce."""
    prompt = _check_prompt(prompt_ids, max_new_tokens)
    device = target.device
    cache = DynamicCache()
    ids = torch.tensor([prompt], device=device)
    new: list[int] = []
    position = 0
    while len(new) < max_new_tokens:
        positions = torch.arange(position, position + ids.shape[1], device=device)[None]
        logits = target(input_ids=ids, position_ids=positions, **cache_kwargs(target, cache)).logits
        position += ids.shape[1]
        token = int(logits[0, -1].argmax())
        new.append(token)
        if stop_token_ids and token in stop_token_ids:
            break
        ids = torch.tensor([[token]], device=device)
    return new


@torch.no_grad()
def speculative_generate(
    target: Qwen3ForCausalLM,
    draft: DSparkDraftModel,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    confidence_threshold: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
) -> SpecDecodeResult:
    """Greedy DSpark speculative decoding of one prompt (DeepSpec's evaluator semantics at temperature 0).

    Each round drafts a full block; with a threshold t > 0 (and a confidence head) the proposal is cut at the
    first k with sigmoid(c_k) < t, possibly to nothing. The target verifies [anchor, proposal]; the longest
    prefix equal to its argmax is accepted, and its argmax after that prefix is the correction/bonus token.
    """
    prompt = _check_prompt(prompt_ids, max_new_tokens)
    if not 0.0 <= confidence_threshold <= 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
    stops = set(stop_token_ids or ())
    device = target.device
    bs = draft.block_size
    num_prompt = len(prompt)
    max_length = num_prompt + max_new_tokens
    result = SpecDecodeResult([], [], [], [])

    target_cache = DynamicCache()
    prefill = target(
        input_ids=torch.tensor([prompt], device=device),
        position_ids=torch.arange(num_prompt, device=device)[None],
        output_hidden_states=True,
        logits_to_keep=1,
        **cache_kwargs(target, target_cache),
    )
    output = [*prompt, int(prefill.logits[0, -1].argmax())]
    if output[-1] in stops:
        result.new_tokens = output[num_prompt:]
        return result
    pending = context_features(prefill.hidden_states, draft.config.target_layer_ids)[0]

    draft_cache = draft.new_context_cache(num_slots=1, max_seq_len=max_length + bs + 1)
    slot = draft_cache.allocate()
    start = num_prompt
    while start < max_length:
        cache_len_before = draft_cache.length(slot)
        draft.append_context(draft_cache, [slot], pending, [0, pending.shape[0]])
        anchor = output[start]
        block_hidden = draft.draft_block(torch.tensor([anchor]), torch.tensor([start]), [slot], draft_cache)
        sample = sample_block(draft, block_hidden, torch.tensor([anchor]))
        drafts = sample.tokens[0].tolist()
        conf = sample.confidence_logits[0] if sample.confidence_logits is not None else None
        proposal_len = bs
        if conf is not None and confidence_threshold > 0.0:
            below = (torch.sigmoid(conf) < confidence_threshold).nonzero()
            proposal_len = int(below[0, 0]) if below.numel() else bs
        proposed = drafts[:proposal_len]

        verify = target(
            input_ids=torch.tensor([[anchor, *proposed]], device=device),
            position_ids=torch.arange(start, start + proposal_len + 1, device=device)[None],
            output_hidden_states=True,
            **cache_kwargs(target, target_cache),
        )
        target_argmax = verify.logits[0].argmax(dim=-1).tolist()
        accepted = 0
        while accepted < proposal_len and proposed[accepted] == target_argmax[accepted]:
            accepted += 1
        effective_len, terminated = proposal_len, False
        stop_hits = [i for i, token in enumerate(proposed[:accepted]) if token in stops]
        if stop_hits:
            accepted = effective_len = stop_hits[0] + 1
            terminated = True
        next_token = target_argmax[accepted]
        result.rounds.append(
            RoundRecord(
                start=start,
                draft_cache_len_before=cache_len_before,
                new_context_len=start - cache_len_before,
                anchor_token=anchor,
                proposed_tokens=proposed,
                confidence_logits=conf[:proposal_len].tolist()
                if conf is not None and proposal_len > 0
                else None,
                accepted_draft_tokens=accepted,
                effective_proposal_length=effective_len,
                next_token=next_token,
                terminated_by_stop_token=terminated,
                block_hidden=block_hidden[0],
                block_confidence_logits=conf,
            )
        )
        result.proposal_lengths.append(effective_len)
        result.accepted_draft_lengths.append(accepted)
        output.extend(proposed[:accepted])
        if terminated:
            result.acceptance_lengths.append(accepted)
            start += accepted
            _crop(target_cache, start)
            break
        output.append(next_token)
        result.acceptance_lengths.append(accepted + 1)
        start += accepted + 1
        _crop(target_cache, start)
        pending = context_features(verify.hidden_states, draft.config.target_layer_ids)[0, : accepted + 1]
        if stops.intersection(output[-(accepted + 1) :]):
            break

    result.new_tokens = _trim_after_stop(output[num_prompt : min(start + 1, max_length)], list(stops))
    return result


def acceptance_probabilities(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor
) -> torch.Tensor:
    """min(1, p_t[k, x_k] / max(p_d[k, x_k], 1e-8)) for target_probs [.., L(+1), V], draft_probs [.., L,
    V]."""
    length = draft_tokens.shape[-1]
    p_t = target_probs[..., :length, :].gather(-1, draft_tokens[..., None]).squeeze(-1)
    p_d = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).clamp_min(PROB_FLOOR)
    return torch.clamp(p_t / p_d, max=1.0)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(p_t - p_d, 0)), falling back to p_t where the residual mass is <= 1e-8 (DeepSpec's rule)."""
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass <= PROB_FLOOR, target_probs, residual)
    return residual / residual.sum(dim=-1, keepdim=True).clamp_min(PROB_FLOOR)
