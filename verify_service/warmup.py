"""Warm-up of a verify engine at start-up: every kind of step it launches while serving runs once, on scratch
requests, before the replica reports ready, so no real request pays a compilation or a first-use allocation.

What runs (:func:`warm_up_verify`), each through :meth:`VerifyEngine.step` as a round would call it:

- a prefill step of a greedy and a sampled prompt together (greedy first-token pick and the sampler);
- a verify step of the greedy request with ``max_drafts`` drafts and no distribution (with graphs: the
  verify-only bucketed path every greedy round takes);
- a verify step of both requests, the sampled one with a sparse draft distribution of the engine's width
  (rejection sampling over ragged blocks; with graphs: the bucketed path with distributions);
- a verify step of both with no drafts (the rounds of autoregressive or gated-off decoding);
- with graphs on, a prefill too long for any bucket (the eager fallback a long prompt takes), and prefills of
  :data:`EAGER_PREFILL_COUNTS` prompts together too long for any bucket (the eager fallback of a wave of
  prompts arriving at once: Triton specialises an integer argument equal to 1, or divisible by 16, separately,
  so one long prompt leaves the kernels' request counts of such a wave unbuilt).

The graph runner itself captures (and, before capture, runs) every bucket of its shape table when it is built,
so each bucket's kernels exist before this runs. Not covered: chained verify steps queued behind the drafter
(:meth:`VerifyEngine.start_chained`, in-process placement with captured graphs only; they replay the already
captured buckets) and Triton specialisations of shapes other than the ones above (Triton compiles one variant
per distinct constexpr value and per argument alignment class; an eager step of an unusual shape may still
compile once). Scratch requests use fixed seeds (no random state is consumed) and are released at the end, so
the engine is left exactly as empty as it was.
"""

from __future__ import annotations

import logging
import time

import torch

from kernels.sampling import SamplingParams
from verify_service.engine import PrefillItem, VerifyEngine, VerifyItem

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0, seed=0)
SAMPLED = SamplingParams(temperature=0.8, top_k=32, top_p=0.95, seed=0)
PROMPT_LEN = 8
#: Width of the sparse draft distribution on an engine without graphs (any width works there).
EAGER_DIST_WIDTH = 16
#: Prompts per eager multi-prompt warm-up prefill: one count of each class Triton specialises apart from 1
#: (divisible by 16, and not).
EAGER_PREFILL_COUNTS = (3, 16)


def _distribution(tokens: list[int], width: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A valid sparse draft distribution [len(tokens), width]: each draft token first, then other ids."""
    ids = torch.tensor([[(t + j) % vocab for j in range(width)] for t in tokens], dtype=torch.int64, device=device)
    probs = torch.full((len(tokens), width), 1.0 / width, dtype=torch.float32, device=device)
    return ids, probs


def warm_up_verify(engine: VerifyEngine, max_drafts: int) -> int:
    """Run the steps listed in the module doc on scratch requests; returns how many steps ran. ``max_drafts``:
    the drafter's block size gamma (0 or 1 without a drafter: verifies carry at most one draft)."""
    if engine.num_free_slots < 2:
        raise ValueError("warm-up needs two free KV slots: run it before serving")
    started = time.perf_counter()
    vocab = engine.vocab_size
    device = engine.target.device
    drafts = max(0, min(max_drafts, engine.max_seq_len - PROMPT_LEN - 2))
    width = min(engine.graphs.draft_top_k if engine.graphs is not None else EAGER_DIST_WIDTH, vocab)
    prompt = [i % vocab for i in range(1, PROMPT_LEN + 1)]
    ids = ("warmup-greedy", "warmup-sampled")
    steps = 0
    try:
        first = engine.step([PrefillItem(ids[0], prompt, GREEDY), PrefillItem(ids[1], prompt, SAMPLED)])
        anchors = {r.req_id: r.tokens[-1] for r in first}
        steps += 1
        if drafts:
            block = [(anchors[ids[0]] + k + 1) % vocab for k in range(drafts)]
            out = engine.step(verifies=[VerifyItem(ids[0], anchors[ids[0]], block, position=PROMPT_LEN)])
            anchors[ids[0]] = out[0].tokens[-1]
            dist_ids, dist_probs = _distribution(block, width, vocab, device)
            items = [
                VerifyItem(rid, anchors[rid], block, dist_ids, dist_probs, engine.context_length(rid)) for rid in ids
            ]
            out = engine.step(verifies=items)
            anchors.update((r.req_id, r.tokens[-1]) for r in out)
            steps += 2
        engine.step(verifies=[VerifyItem(rid, anchors[rid], [], position=engine.context_length(rid)) for rid in ids])
        steps += 1
        engine.release_many(ids)
        if engine.graphs is not None:
            long_len = min(engine.max_seq_len - 1, engine.graphs.max_rows + 1)
            if long_len > PROMPT_LEN and not engine.graphs.fits([(long_len, True)], 0):
                engine.step([PrefillItem("warmup-long", [i % vocab for i in range(long_len)], GREEDY)])
                engine.release_many(["warmup-long"])
                steps += 1
            steps += _eager_prefill_waves(engine)
    finally:
        engine.release_many([*ids, "warmup-long"])
    logger.info("verify engine warmed up: %d steps in %.2f s", steps, time.perf_counter() - started)
    return steps


def _eager_prefill_waves(engine: VerifyEngine) -> int:
    """Prefill :data:`EAGER_PREFILL_COUNTS` prompts together (the first sampled, the others greedy), each wave
    just too long for the graph buckets, where the engine has the slots and the context length for it; returns
    the steps run. Every scratch request is released, also when a step fails."""
    graphs = engine.graphs
    assert graphs is not None  # called only with graphs on
    vocab, ran = engine.vocab_size, 0
    for count in EAGER_PREFILL_COUNTS:
        length = max(PROMPT_LEN, -(-(graphs.max_rows + 1) // count))
        if count > engine.num_free_slots or length > engine.max_seq_len - 2 or graphs.fits([(length, True)] * count, 0):
            continue
        ids = [f"warmup-wave-{count}-{i}" for i in range(count)]
        try:
            engine.step(
                [
                    PrefillItem(rid, [(i + j) % vocab for j in range(length)], SAMPLED if i == 0 else GREEDY)
                    for i, rid in enumerate(ids)
                ]
            )
        finally:
            engine.release_many(ids)
        ran += 1
    return ran
