"""Warm-up of a whole round pipeline at start-up: scratch requests decoded through the round driver itself.

The engines' own warm-ups (:mod:`verify_service.warmup`, :mod:`draft_service.warmup`) run each step kind once on
its own. What they cannot reach is what only the round driver launches: the chained rounds (verify queued behind
the draft step, the next draft step behind the verify step), the draft steps launched ahead, and every request
count the bucketed steps are captured for, each of which a first real round at that count would otherwise pay.
:func:`warm_up_rounds` decodes a batch of greedy requests at every request count of ``request_counts`` (and one
sampled request), so each of those paths runs at each bucket before a replica reports ready.

The round driver used here is thrown away afterwards (its metrics and the policy's learnt timings would
otherwise count the scratch rounds): callers build the serving driver over the same engines, which this leaves
exactly as empty as it found them (every scratch request finishes and is released).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine

logger = logging.getLogger(__name__)

PROMPT_LEN = 8
#: Output tokens per scratch request: enough rounds for a chained round and a draft launched behind it to run.
OUTPUT_TOKENS = 24


def warm_up_rounds(engine: SpeculativeEngine, request_counts: Sequence[int]) -> int:
    """Decode ``R`` scratch greedy requests together for each ``R`` in ``request_counts`` (capped at the free
    slots), then one sampled request; returns the rounds run. Fixed seeds, no stop on EOS."""
    started = time.perf_counter()
    vocab = engine.verify.vocab_size
    prompt = [i % vocab for i in range(1, PROMPT_LEN + 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, seed=0)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=OUTPUT_TOKENS, ignore_eos=True, seed=0)
    capacity = engine.verify.num_free_slots
    rounds = 0
    batches = [(count, greedy) for count in sorted(set(request_counts)) if 0 < count <= capacity]
    for count, params in [*batches, (1, sampled)]:
        for i in range(count):
            engine.add_request(prompt, params, req_id=f"warmup-rounds-{count}-{i}-{params.temperature}")
        while engine.has_unfinished():
            engine.step()
            rounds += 1
    logger.info("round pipeline warmed up at %s requests: %d rounds in %.1f s", [c for c, _ in batches], rounds,
                time.perf_counter() - started)
    return rounds
