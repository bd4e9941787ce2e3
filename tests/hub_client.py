"""Drive a SchedulerHub the way concurrent HTTP clients would: every prompt streamed at once, tokens collected."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kernels.sampling import SamplingParams
from scheduler.hub import SchedulerHub


def generate_all(hub: SchedulerHub, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
    """The tokens of every prompt (request ids r0, r1, ...), all streamed concurrently through ``hub``."""

    async def one(i: int) -> list[int]:
        tokens: list[int] = []
        async for delta in hub.generate(f"r{i}", list(prompts[i]), params):
            tokens.extend(delta.token_ids)
        return tokens

    async def run_all() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    return asyncio.run(run_all())
