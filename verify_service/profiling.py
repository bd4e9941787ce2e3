"""SPS profiling of a verify engine: target steps per second as a function of the verify batch size B.

Algorithm 1 needs SPS(B) for the exact replica it schedules. A verify step of B tokens is emulated as it happens in
serving: R requests, each verifying a chunk of up to ``chunk`` tokens (anchor + drafts) over a short context, in
one ragged pass over the slot cache. The slots are scratch: allocated, filled, and released by the profiler, so it
can run at startup before any request arrives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scheduler.sps import SPSTable, cuda_event_timer, default_batch_grid, profile_sps, wall_clock_timer
from verify_service.target import TargetModel


def profile_target_sps(
    target: TargetModel,
    *,
    chunk: int,
    max_batch_tokens: int,
    context: int = 64,
    batch_sizes: Sequence[int] | None = None,
    warmup: int = 2,
    repeats: int = 7,
    progress: bool = True,
) -> SPSTable:
    """Measure SPS(B) for B in ``batch_sizes`` (default: a grid up to ``max_batch_tokens``).

    ``chunk`` is the largest verify chunk (block size + 1); each step uses ceil(B / chunk) requests whose
    contexts are ``context`` tokens long, which is what a verify pass of B tokens looks like.
    """
    sizes = list(batch_sizes) if batch_sizes is not None else default_batch_grid(max_batch_tokens)
    max_requests = -(-max(sizes) // chunk)
    cache = target.new_kv_cache(max_requests, context + chunk + 1)
    slots = [cache.allocate() for _ in range(max_requests)]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (max_requests, context), generator=generator)
    batch = target.prepare(cache, [(s, prompt[i].tolist()) for i, s in enumerate(slots)])
    target.forward(cache, batch, logits_rows=torch.empty(0, dtype=torch.int64, device=target.device),
                   feature_rows=torch.empty(0, dtype=torch.int64, device=target.device))
    drafts = torch.randint(0, target.vocab_size, (max_requests, chunk), generator=generator).tolist()

    def run_step(batch_tokens: int) -> None:
        chunks, remaining = [], batch_tokens
        for i, slot in enumerate(slots):
            if remaining <= 0:
                break
            n = min(chunk, remaining)
            chunks.append((slot, drafts[i][:n]))
            remaining -= n
        step = target.prepare(cache, chunks)
        target.forward(cache, step)
        for slot, _ in chunks:
            cache.truncate(slot, context)

    timer = cuda_event_timer(target.device) if target.device.type == "cuda" else wall_clock_timer
    try:
        return profile_sps(
            run_step,
            sizes,
            model=str(target.config.name_or_path or "target"),
            device=str(target.device),
            dtype=str(target.dtype).removeprefix("torch."),
            warmup=warmup,
            repeats=repeats,
            timer=timer,
            progress=progress,
        )
    finally:
        for slot in slots:
            cache.free(slot)
