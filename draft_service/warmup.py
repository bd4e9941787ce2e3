"""Warm-up of a draft engine at start-up: the steps it launches while serving run once on scratch requests
before the replica reports ready, so no real request pays a compilation or a first-use allocation.

What runs (:func:`warm_up_draft`), through the engine's public calls as a round makes them:

- ``append_context`` of a short context for a greedy and a sampled request (rows of the kind the serving
  path sends: projected [n, H] when the verifier projects, raw [n, m*H] otherwise);
- ``propose`` for both together (the sequential head's sampled path and its sparse distribution);
- ``append_context`` of one committed row each, then ``propose`` for the greedy request alone (with graphs:
  the greedy bucketed step, whose outputs are views of the graph's buffers);
- for :data:`WAVE_COUNTS` requests together (where the slots allow), ``append_context`` of a short context and
  ``propose``: a wave of prompts arriving at once (Triton specialises an integer argument equal to 1, or
  divisible by 16, separately).

The graph runner captures (running each once first) every bucket of its shape table when it is built. Not
covered: ``propose_behind`` (a draft step chained behind a verify step on the same device: in-process placement
with captured graphs only, replaying buckets captured at build) and Triton specialisations of other shapes.
Scratch requests use fixed seeds and are released at the end.
"""

from __future__ import annotations

import logging
import time

import torch

from draft_service.engine import ContextItem, DraftEngine, DraftItem
from kernels.sampling import SamplingParams

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0, seed=0)
SAMPLED = SamplingParams(temperature=0.8, top_k=32, top_p=0.95, seed=0)
CONTEXT_LEN = 8
#: Requests per warm-up wave: one count of each class Triton specialises apart from 1 (divisible by 16, and not).
WAVE_COUNTS = (3, 16)


def warm_up_draft(engine: DraftEngine, projected: bool) -> int:
    """Run the steps listed in the module doc on scratch requests; returns how many proposals ran.
    ``projected``: whether the serving path appends rows the verifier projected."""
    if engine.num_free_slots < 2:
        raise ValueError("warm-up needs two free context slots: run it before serving")
    started = time.perf_counter()
    model = engine.model
    width = model.config.hidden_size if projected else model.config.context_feature_size
    ids = ("warmup-greedy", "warmup-sampled")

    def rows(n: int) -> torch.Tensor:
        return torch.zeros((n, width), dtype=model.dtype, device=model.device)

    try:
        engine.add_requests([(ids[0], GREEDY), (ids[1], SAMPLED)])
        engine.append_context([ContextItem(rid, 0, rows(CONTEXT_LEN)) for rid in ids], projected=projected)
        engine.propose([DraftItem(rid, 1, CONTEXT_LEN) for rid in ids])
        engine.append_context([ContextItem(rid, CONTEXT_LEN, rows(1)) for rid in ids], projected=projected)
        engine.propose([DraftItem(ids[0], 2, CONTEXT_LEN + 1)])
    finally:
        engine.release_many(ids)
    proposals = 2
    for count in WAVE_COUNTS:
        if count > engine.num_free_slots:
            continue
        wave = [f"warmup-wave-{count}-{i}" for i in range(count)]
        try:
            engine.add_requests([(rid, SAMPLED if i == 0 else GREEDY) for i, rid in enumerate(wave)])
            engine.append_context([ContextItem(rid, 0, rows(CONTEXT_LEN)) for rid in wave], projected=projected)
            engine.propose([DraftItem(rid, 1, CONTEXT_LEN) for rid in wave])
        finally:
            engine.release_many(wave)
        proposals += 1
    logger.info("draft engine warmed up: %d proposals in %.2f s", proposals, time.perf_counter() - started)
    return proposals
