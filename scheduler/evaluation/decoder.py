"""Offline speculative decoding of many prompts at once, recording what every round did (the eval harness).

Each round drafts a full block for every running request and verifies ALL of it (no scheduler, no threshold):
offline evaluation wants the complete trace of every round, i.e. the confidence logits z_1..z_gamma along the
sampled path and the number of accepted drafts. Everything else is derived from those traces
(:mod:`scheduler.evaluation.report`): accepted length tau (bonus included), per-position conditional acceptance,
the static confidence-threshold sweep (cutting a verified block at a threshold keeps min(accepted, cut) of
the same round), and STS calibration (offline traces have every position verified, so no censoring).

Verification is exact speculative sampling: at temperature T > 0 draft x_k (drawn from q_k) is accepted with
probability min(1, p_k(x_k) / q_k(x_k)) against the target's p_k = softmax(logits / T); the first rejection
draws the correction from norm(max(0, p_k - q_k)), and a fully accepted block draws the bonus token from
p_{gamma+1}. At temperature 0 drafts are accepted while they equal the target's argmax. Either way the output
follows the target's own distribution (tests check it against the target's greedy decoding and statistically).

The target runs through :class:`verify_service.target.TargetModel` (slot KV cache, ragged batches: rollback of
rejected drafts is moving a length back) and the drafter through its slot context cache, batched over all
running requests, so a few hundred prompts decode in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import sample_block
from scheduler.evaluation.reference_loop import acceptance_probabilities, residual_distribution
from scheduler.sts import CalibrationTraces
from verify_service.target import TargetModel, TargetOutput

#: Prefill chunks are bounded in tokens so the features of a chunk (tokens x m*H) stay small.
PREFILL_TOKEN_BUDGET = 32768


@dataclass
class DecodeTraces:
    """One row per (request, round): confidence logits [N, gamma], accepted drafts [N], request index [N].

    ``outputs[i]`` are the new tokens of prompt i (stop token kept, cut at max_new_tokens).
    ``has_confidence`` is False for a drafter without a confidence head (its logits are then zeros).
    """

    confidence_logits: np.ndarray
    accepted: np.ndarray
    request: np.ndarray
    outputs: list[list[int]]
    has_confidence: bool

    @property
    def gamma(self) -> int:
        return int(self.confidence_logits.shape[1])

    @property
    def num_rounds(self) -> int:
        return int(self.accepted.shape[0])

    def subset(self, rows: np.ndarray) -> DecodeTraces:
        """The traces of the selected rows (boolean mask or indices); outputs are kept whole."""
        return DecodeTraces(
            self.confidence_logits[rows],
            self.accepted[rows],
            self.request[rows],
            self.outputs,
            self.has_confidence,
        )

    def calibration_traces(self) -> CalibrationTraces:
        """STS input: every position of every round was verified."""
        if not self.has_confidence:
            raise ValueError("this drafter has no confidence head: nothing to calibrate")
        return CalibrationTraces.from_arrays(self.confidence_logits, self.accepted)

    def save(self, path: str) -> None:
        np.savez_compressed(
            path,
            logits=self.confidence_logits,
            accepted=self.accepted,
            request=self.request,
            has_confidence=np.array(self.has_confidence),
        )


def verify_block(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification of R full blocks -> (accepted drafts [R] int64, next token [R] int64).

    target_logits [R, L+1, V] fp32 (row k scores position k of [anchor, x_1..x_L], i.e. predicts x_{k+1});
    draft_probs [R, L, V]: the distributions the drafts were drawn from; drafts [R, L].
    """
    R, L = drafts.shape
    if target_logits.shape[:2] != (R, L + 1) or draft_probs.shape[:2] != (R, L):
        raise ValueError(
            f"verify_block: target logits {tuple(target_logits.shape)}, draft probs "
            f"{tuple(draft_probs.shape)} and drafts {tuple(drafts.shape)} disagree"
        )
    rows = torch.arange(R, device=drafts.device)
    if temperature == 0:
        argmax = target_logits.argmax(dim=-1)
        accepted = (drafts == argmax[:, :L]).long().cumprod(dim=1).sum(dim=1)
        return accepted, argmax[rows, accepted]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    ratio = acceptance_probabilities(p, draft_probs.float(), drafts)
    uniforms = torch.rand(R, L, generator=generator, device=drafts.device)
    accepted = (uniforms < ratio).long().cumprod(dim=1).sum(dim=1)
    # Residual at the first rejection; past the block the draft has no mass, so the "residual" is p itself.
    q = torch.cat([draft_probs.float(), torch.zeros_like(p[:, :1])], dim=1)
    dist = residual_distribution(p[rows, accepted], q[rows, accepted])
    return accepted, torch.multinomial(dist, 1, generator=generator).squeeze(-1)


def _sample_first(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _features(out: TargetOutput) -> torch.Tensor:
    """The context features of a target forward: always there, since the decoder's target returns the features
    of the drafter's ``target_layer_ids`` (checked on construction; a drafter has at least one)."""
    assert out.features is not None, "the target returns no context features"
    return out.features


class OfflineSpeculativeDecoder:
    """Batched DSpark speculative decoding with full-block verification, recording every round."""

    def __init__(
        self,
        target: TargetModel,
        draft: DSparkDraftModel,
        *,
        temperature: float = 1.0,
        block: int | None = None,
        max_batch: int = 512,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
    ) -> None:
        if tuple(target.feature_layer_ids) != tuple(draft.config.target_layer_ids):
            raise ValueError(
                f"the target returns features of layers {list(target.feature_layer_ids)}, the drafter needs "
                f"{list(draft.config.target_layer_ids)}"
            )
        if target.vocab_size != draft.config.vocab_size:
            raise ValueError(
                f"vocabularies differ: target {target.vocab_size}, drafter {draft.config.vocab_size}"
            )
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        block = draft.block_size if block is None else block
        if not 1 <= block <= draft.block_size:
            raise ValueError(
                f"block must be in [1, {draft.block_size}] (the drafter's block size), got {block}"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.target = target
        self.draft = draft
        self.temperature = float(temperature)
        self.block = block
        self.max_batch = max_batch
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.generator = torch.Generator(device=target.device).manual_seed(seed)

    @property
    def max_prompt_tokens(self) -> int:
        return self.target.max_context_len

    @torch.no_grad()
    def run(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, progress: bool = False
    ) -> DecodeTraces:
        """Decode every prompt (in waves of ``max_batch``) and return all rounds' traces."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("need at least one prompt, and every prompt needs at least one token")
        limit = self.target.max_context_len - max_new_tokens - self.block - 1
        too_long = [i for i, p in enumerate(prompts) if len(p) > limit]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompts (e.g. #{too_long[0]}, {len(prompts[too_long[0]])} tokens) exceed "
                f"{limit} tokens: prompt + {max_new_tokens} new tokens + a block must fit the target's "
                f"{self.target.max_context_len} positions"
            )
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), unit="prompt", disable=not progress, desc="spec-decode", leave=False)
        logits, accepted, request, outputs = [], [], [], []
        for first in range(0, len(prompts), self.max_batch):
            wave = [list(map(int, p)) for p in prompts[first : first + self.max_batch]]
            z, a, r, out = self._run_wave(wave, max_new_tokens)
            logits += z
            accepted += a
            request += [first + i for i in r]
            outputs += out
            bar.update(len(wave))
        bar.close()
        gamma = self.block
        return DecodeTraces(
            confidence_logits=np.asarray(logits, dtype=np.float64).reshape(-1, gamma),
            accepted=np.asarray(accepted, dtype=np.int64),
            request=np.asarray(request, dtype=np.int64),
            outputs=outputs,
            has_confidence=self.draft.confidence_head is not None,
        )

    def _prefill(
        self, wave: list[list[int]], kv_slots: list[int], kv, ctx_slots: list[int], ctx_cache
    ) -> torch.Tensor:
        """Prompts into both caches; returns the first sampled token of every request [R]."""
        firsts = []
        start = 0
        while start < len(wave):
            end, tokens = start, 0
            while end < len(wave) and (end == start or tokens + len(wave[end]) <= PREFILL_TOKEN_BUDGET):
                tokens += len(wave[end])
                end += 1
            batch = self.target.prepare(kv, [(kv_slots[i], wave[i]) for i in range(start, end)])
            out = self.target.forward(kv, batch, logits_rows=batch.last_rows())
            self.draft.append_context(ctx_cache, ctx_slots[start:end], _features(out), batch.cu_seqlens.cpu())
            firsts.append(_sample_first(out.logits, self.temperature, self.generator))
            start = end
        return torch.cat(firsts)

    def _run_wave(
        self, wave: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[float]], list[int], list[int], list[list[int]]]:
        R, gamma, draft = len(wave), self.block, self.draft
        max_len = max(len(p) for p in wave) + max_new_tokens + gamma + 2
        kv = self.target.new_kv_cache(R, max_len)
        ctx_cache = draft.new_context_cache(R, max_len)
        kv_slots = [kv.allocate() for _ in range(R)]
        ctx_slots = [ctx_cache.allocate() for _ in range(R)]
        first = self._prefill(wave, kv_slots, kv, ctx_slots, ctx_cache).tolist()
        outputs = [[t] for t in first]
        anchor = list(first)
        start = [len(p) for p in wave]  # absolute position of each request's anchor
        active = [i for i in range(R) if first[i] not in self.stop_token_ids and max_new_tokens > 1]
        trace_logits: list[list[float]] = []
        trace_accepted: list[int] = []
        trace_request: list[int] = []
        device = draft.device
        while active:
            anchors = torch.tensor([anchor[i] for i in active], device=device)
            starts = torch.tensor([start[i] for i in active])
            hidden = draft.draft_block(anchors, starts, [ctx_slots[i] for i in active], ctx_cache)
            uniforms = None
            if self.temperature > 0:
                uniforms = torch.rand(len(active), draft.block_size, generator=self.generator, device=device)
            sample = sample_block(draft, hidden, anchors, temperature=self.temperature, uniforms=uniforms)
            assert sample.probs is not None, "sample_block returns the dense distribution at draft_top_k=0"
            drafts = sample.tokens[:, :gamma]
            chunks = torch.cat([anchors[:, None], drafts], dim=1).tolist()
            batch = self.target.prepare(kv, [(kv_slots[i], c) for i, c in zip(active, chunks, strict=True)])
            out = self.target.forward(kv, batch)
            num_accepted, next_token = verify_block(
                out.logits.view(len(active), gamma + 1, -1),
                sample.probs[:, :gamma].to(out.logits.device),
                drafts.to(out.logits.device),
                self.temperature,
                self.generator,
            )
            conf = (
                sample.confidence_logits[:, :gamma].float().cpu().tolist()
                if sample.confidence_logits is not None
                else [[0.0] * gamma] * len(active)
            )
            accepted_list, next_list = num_accepted.tolist(), next_token.tolist()
            still, keep = [], []
            for j, i in enumerate(active):
                a = accepted_list[j]
                trace_logits.append(conf[j])
                trace_accepted.append(a)
                trace_request.append(i)
                kv.truncate(kv_slots[i], start[i] + 1 + a)
                new = [*chunks[j][1 : a + 1], next_list[j]]
                stop_at = next((n for n, t in enumerate(new) if t in self.stop_token_ids), None)
                if stop_at is not None:
                    new = new[: stop_at + 1]
                outputs[i].extend(new)
                start[i] += a + 1
                anchor[i] = new[-1]
                keep.append(stop_at is None and len(outputs[i]) < max_new_tokens)
                if keep[-1]:
                    still.append(i)
                else:
                    del outputs[i][max_new_tokens:]
                    kv.free(kv_slots[i])
                    ctx_cache.release(ctx_slots[i])
            if still:
                # context rows of the continuing requests: their anchor and accepted drafts, in request order
                kept = torch.tensor(keep)
                rows_taken = torch.tensor(accepted_list) + 1
                rows = (torch.arange(gamma + 1)[None, :] < rows_taken[:, None]) & kept[:, None]
                all_features = _features(out)
                features = all_features.view(len(active), gamma + 1, -1)[rows.to(all_features.device)]
                cu = torch.from_numpy(np.concatenate([[0], np.cumsum(rows_taken[kept].numpy())]))
                draft.append_context(ctx_cache, [ctx_slots[i] for i in still], features, cu)
            active = still
        return trace_logits, trace_accepted, trace_request, outputs
