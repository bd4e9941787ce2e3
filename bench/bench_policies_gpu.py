"""Speculative policies under load at a realistic model size: one run, one GPU, the whole sweep (issue 11).

The trained demo pair (``models/demo/target`` + ``models/demo/draft_dspark``) is inflated in memory into the
qwen3-4b shape (function-preserving, see docs/COST_REALISTIC.md), so every step costs what a 4B target and a
2-layer drafter of its width cost, while acceptance is the trained demo drafter's. Then:

1. copy bandwidth of the device (a device-to-device copy; bandwidth = bytes read + written per second);
2. the SPS table of the inflated target (verify steps of B tokens = ceil(B / (block + 1)) requests over a
   context of typical length, CUDA-event timed), B up to 128 * (block + 1), saved with the results; the same
   measurements give the verify step time against the memory-bandwidth floor (weights + KV bytes / bandwidth),
   and after the sweep the same step for <= 32 requests is replayed as a CUDA graph (the GPU's own time);
   with graphs on and ``--sps-by-requests on`` (the default) also SPS tables by request count, one per
   concurrency level R (R requests verifying 1 .. block + 1 tokens each), which the scheduled policies price
   their rounds with (a step of B tokens costs more when more requests share it: scheduler.sps.RequestSPS);
3. plain transformers ``generate`` of the inflated target at 1 request (greedy, tokens/s), the baseline;
4. for every concurrency level and policy, closed-loop continuous batching: ``concurrency`` requests in flight,
   a new one (next prompt of the mix) as soon as one finishes; after a warm-up, a fixed time window is measured.
   Per cell: median tokens/s per user (a finished request's output tokens / its wall time from arrival to
   finish), aggregate tokens/s (tokens emitted in the window / window), tau, verification budget (verified
   drafts per request per round), verify batch tokens per round, draft / schedule / verify / other host ms per
   round (other = commit, stop checks, and the drafter's context append). Per level, the median tokens/s per
   user is also taken over the prompts that every cell of the level finished in its window (the same requests
   for every policy); the goal on per-user speed at 1 request is judged on that (common_prompt_per_user).

Policies: ``autoregressive`` (no drafter), ``fixed-1`` (MTP-1-like), ``full`` (DFlash-like: the whole block is
verified; drafted by the same DSpark drafter, so it isolates the verification policy from the drafter
architecture), ``dspark`` (Algorithm 1 on the SPS table), ``dspark-async`` (capacity planned two rounds ahead).
Both DSpark policies may also skip the drafter in a round (``--draft-skip on``, the default with measured draft
costs: :mod:`scheduler.draft_gate`), when a plain target round is predicted to deliver more tokens per second
than the best speculative one (high load); every cell reports the fraction of rounds that skipped.

Decoding: temperature 0 by default (``--temperature``): greedy output must be identical under every policy, so
each cell also reports how many finished requests equal the autoregressive cell's output for the same prompt
(bf16 batch-shape rounding can flip near-ties, so this is a sanity signal, not a test). EOS is ignored so every
request produces its max_tokens (128 +- 32, fixed per prompt), which keeps the load identical across policies.
Engines run eagerly (CUDA graphs off): the graph-mode verify step pads every request to the full block, so it
would cost the same whatever a policy verifies, and rounds with joining requests run eagerly anyway.

Time: every cell gets --warmup-s + --measure-s, shrunk so that the sweep ends --time-limit-s after start;
progress lines are flushed as it goes; the JSON is rewritten after every step, so a timeout still leaves results.
Outputs in --out-dir: policies.json, policies.log, policies_throughput.png (paper Figure 7 style),
policies_budget.png (Figure 8 style). The last thing printed is a short table and the goals.

GPU (one H200; the prompt files copied to .data/prompts):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/bench_policies_gpu.py --prompts-dir .data/prompts --out-dir $OUT
CPU smoke (a small inflation, tiny budgets, < 2 minutes):
    PYTHONPATH=. python bench/bench_policies_gpu.py --small --prompts-dir /work/shared/data/prompts --out-dir /tmp/pol
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.engine_setup import DEMO_TARGET, ROOT, chat_prompts, load_calibration, tokenizer_for
from bench.timing import timed
from draft_service.engine import DraftEngine
from draft_service.inflate import inflate_pair
from kernels.sampling import SamplingParams
from scheduler.algorithm import DraftCost
from scheduler.draft_gate import DraftGate
from scheduler.engine import SpeculativeEngine
from scheduler.policy import DSparkAsync, DSparkScheduled, VerifyPolicy, make_policy
from scheduler.profiling import profile_graph_sps, profile_graph_sps_by_requests, profile_target_sps
from scheduler.sps import SPSMonotonicityWarning, SPSSource, SPSTable, default_batch_grid
from scheduler.sts import STSCalibration
from verify_service.attention import CachedAttentionMetadata
from verify_service.engine import VerifyEngine
from verify_service.inflate import SHAPES, Qwen3Shape
from verify_service.target import TargetModel

POLICIES = ("autoregressive", "fixed-1", "full", "dspark", "dspark-async")
OVERHEAD_SOURCE = "full"  # the cell whose per-round time outside the verify step feeds the scheduled policies
FIXED_POLICIES = ("autoregressive", "fixed-1", "full")
SCHEDULED_POLICIES = ("dspark", "dspark-async")
DEMO_DRAFTER = ROOT / "models" / "demo" / "draft_dspark"
# --small: the demo pair (hidden 256, 8 layers, 4/2 heads of 64, vocab 4096) in a slightly larger shape that a
# 2-core CPU runs in seconds; it still exercises every inflation path (width, heads, head dim, layers, vocab).
SMALL_SHAPE = Qwen3Shape(384, 9, 8, 4, 128, 1024, 4352, True)
GOAL_USER_SPEEDUP = 2.5
GOAL_FLOOR_RATIO = 1.5
FLOOR_MAX_REQUESTS = 32
MIN_MEASURE_S = 1.0
FILES = {
    "json": "policies.json",
    "log": "policies.log",
    "throughput": "policies_throughput.png",
    "budget": "policies_budget.png",
}


# ------------------------------------------------------------------------------------------------ reporting
class Reporter:
    """Progress lines to stdout (flushed) and a log file; the results JSON rewritten atomically on demand."""

    def __init__(self, out_dir: Path, started: float) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.started = started
        self._log = (out_dir / FILES["log"]).open("w")
        self.results: dict[str, Any] = {"status": "running"}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def log(self, message: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {message}"
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def raw(self, text: str) -> None:
        """Unprefixed text (the final table)."""
        print(text, flush=True)
        self._log.write(text + "\n")
        self._log.flush()

    def save(self) -> None:
        self.results["elapsed_s"] = self.elapsed()
        path = self.out_dir / FILES["json"]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=_json_default))
        os.replace(tmp, path)

    def close(self) -> None:
        self._log.close()


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# -------------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class PromptMix:
    """The prompt mix every cell serves in the same order: datasets interleaved, so any prefix is mixed."""

    names: list[str]  # "humaneval/3"
    token_ids: list[list[int]]
    max_tokens: list[int]  # per prompt, fixed across cells

    def __len__(self) -> int:
        return len(self.token_ids)

    def summary(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.token_ids]
        return {
            "count": len(lengths),
            "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
            "max_tokens": {
                "min": min(self.max_tokens),
                "mean": float(np.mean(self.max_tokens)),
                "max": max(self.max_tokens),
            },
            "datasets": sorted({n.split("/")[0] for n in self.names}),
        }


def load_prompt_mix(
    prompts_dir: Path,
    datasets: Sequence[str],
    tokenizer: Any,
    *,
    per_dataset: int,
    max_prompt_tokens: int,
    max_tokens: int,
    jitter: int,
    seed: int = 0,
) -> PromptMix:
    """First turns of each dataset's first ``per_dataset`` records through the chat template; prompts longer
    than ``max_prompt_tokens`` are dropped; max_tokens = ``max_tokens`` +- ``jitter`` per prompt (seeded), so
    that requests finish at different rounds as in real traffic."""
    per_set: list[list[tuple[str, list[int]]]] = []
    for name in datasets:
        path = prompts_dir / f"{name}.jsonl"
        if not path.is_file():
            raise ValueError(f"prompt file {path} does not exist (copy /work/shared/data/prompts there)")
        with path.open() as handle:
            available = sum(1 for line in handle if line.strip())
        ids = chat_prompts(path, tokenizer, min(per_dataset, available))
        per_set.append([(f"{name}/{i}", p) for i, p in enumerate(ids) if len(p) <= max_prompt_tokens])
    names, token_ids = [], []
    for i in range(max(len(s) for s in per_set)):
        for s in per_set:
            if i < len(s):
                names.append(s[i][0])
                token_ids.append(s[i][1])
    if not token_ids:
        raise ValueError(f"no prompt of at most {max_prompt_tokens} tokens in {list(datasets)}")
    rng = np.random.default_rng(seed)
    lengths = [max(1, int(max_tokens + rng.integers(-jitter, jitter + 1))) for _ in token_ids]
    return PromptMix(names, token_ids, lengths)


# ------------------------------------------------------------------------------------ device measurements
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_device(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` on the device (:func:`bench.timing.timed`: CUDA events on GPUs, wall clock
    elsewhere)."""
    return timed(fn, device, repeats, warmup) / 1e3


def copy_bandwidth(device: torch.device, num_bytes: int) -> dict[str, float]:
    """Device-to-device copy of ``num_bytes``: bandwidth = (bytes read + bytes written) / time, the rate at
    which the memory system moves bytes, i.e. the rate a weight-streaming step can at best read at."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = time_device(lambda: dst.copy_(src), device, warmup=3, repeats=10)
    return {"bytes": num_bytes, "seconds": seconds, "bytes_per_s": 2 * num_bytes / seconds}


def weight_bytes(target: TargetModel) -> int:
    """Bytes a target step must read: every parameter once (tied embedding = the LM head, read in full); an
    untied input embedding is only gathered row by row, so it does not count."""
    params = {p.data_ptr(): p for p in target.modules.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed, head = target.embed_tokens_weight, target.lm_head_weight
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(target: TargetModel) -> int:
    """K + V bytes of one token over all layers."""
    return target.num_layers * 2 * target.num_kv_heads * target.head_dim * target.dtype.itemsize


def floor_seconds(
    weights: int, kv_per_token: int, requests: int, tokens_read_per_request: int, bandwidth: float
) -> float:
    """The memory-bandwidth floor of a verify step: weights + the requests' K/V read once, at copy bandwidth."""
    return (weights + requests * tokens_read_per_request * kv_per_token) / bandwidth


def sps_grid(chunk: int, concurrency: Sequence[int]) -> list[int]:
    """SPS batch sizes up to max(concurrency) * chunk; the grid includes R * chunk for every level R (a full-block
    verify step of R requests), which the floor comparison reads back."""
    max_b = max(concurrency) * chunk
    return sorted(set(default_batch_grid(max_b)) | {r * chunk for r in concurrency})


def profile_sps(target: TargetModel, chunk: int, grid: Sequence[int], context: int) -> SPSTable:
    """SPS(B) of eager target passes over ``grid`` (the engines run eagerly: graphs off)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SPSMonotonicityWarning)  # the raw rates are kept and reported
        return profile_target_sps(
            target, chunk=chunk, max_batch_tokens=max(grid), context=context, batch_sizes=grid, progress=False
        )


def captured_verify_step_s(target: TargetModel, requests: int, chunk: int, context: int) -> float:
    """Device time of one verify forward (``requests`` chunks of ``chunk`` tokens over ``context`` cached tokens)
    captured as a CUDA graph and replayed: what the GPU itself needs, without the eager path's launch overhead.
    The replay rewrites the same K/V rows every time (the slots' lengths never advance), so it is repeatable."""
    device = target.device
    cache = target.new_kv_cache(requests, context + chunk + 1)
    slots = [cache.allocate() for _ in range(requests)]
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.vocab_size, (requests, context), generator=generator)
    none = torch.empty(0, dtype=torch.int64, device=device)
    target.forward(
        cache,
        target.prepare(cache, [(slot, prompt[i].tolist()) for i, slot in enumerate(slots)]),
        logits_rows=none,
        feature_rows=none,
    )
    drafts = torch.randint(0, target.vocab_size, (requests, chunk), generator=generator).tolist()
    batch = target.prepare(cache, [(slot, drafts[i]) for i, slot in enumerate(slots)])
    meta = CachedAttentionMetadata.from_batch(batch, target.query_groups, target.attention_backend)

    def step() -> object:
        return target.run_layers(cache, batch.input_ids, meta)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs recommends
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = time_device(graph.replay, device, warmup=2, repeats=10)
    del graph
    return seconds


def hf_generate_baseline(target: TargetModel, prompt: list[int], max_new_tokens: int, repeats: int) -> dict[str, Any]:
    """Plain transformers ``generate`` (greedy, HF's own cache and attention) at 1 request: tokens/s =
    new tokens / wall time of the call (prefill included), median over ``repeats`` after one short warm-up.
    Padded vocabulary ids are suppressed by the inflated model's generation config."""
    model = target.modules  # transformers' Qwen3ForCausalLM: inflate_pair's target wraps one
    device = target.device
    input_ids = torch.tensor([prompt], dtype=torch.int64, device=device)
    kwargs = {"attention_mask": torch.ones_like(input_ids), "do_sample": False}
    with torch.no_grad():
        # Lengths as max_length / min_length (prompt included): max_new_tokens would clash with the config's
        # max_length and make transformers warn on every call.
        warm = len(prompt) + 8
        model.generate(input_ids, max_length=warm, min_length=warm, **kwargs)
        _sync(device)
        times, output = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            total = len(prompt) + max_new_tokens
            output = model.generate(input_ids, max_length=total, min_length=total, **kwargs)
            _sync(device)
            times.append(time.perf_counter() - t0)
    assert output is not None
    seconds = statistics.median(times)
    tokens = output[0, len(prompt) :].tolist()
    return {
        "new_tokens": len(tokens),
        "seconds": seconds,
        "tokens_per_s": len(tokens) / seconds,
        "runs": len(times),
        "tokens": tokens,
    }


# ------------------------------------------------------------------------------------------------- the cell
def scheduled_policy(
    policy: str, sps: SPSSource, draft_cost: DraftCost, no_draft_cost: DraftCost | None = None
) -> VerifyPolicy:
    """dspark / dspark-async with the whole-round objective (the round time outside the verify step); with
    ``no_draft_cost`` (the round time outside the verify step of a round without drafts) they may also skip the
    drafter in rounds where a plain target round is predicted to be faster (scheduler.draft_gate)."""
    gate = None if no_draft_cost is None else DraftGate(sps, draft_cost, no_draft_cost)
    if policy == "dspark":
        return DSparkScheduled(sps, draft_cost, gate)
    if policy == "dspark-async":
        return DSparkAsync(sps, draft_cost=draft_cost, gate=gate)
    raise ValueError(f"{policy!r} is not a scheduled policy")


def verify_scale(times: list[tuple[float, float]]) -> float:
    """Measured / predicted verify time over the calibrating cells of one level ((measured, predicted) ms per
    round each): the factor their SPS table is off by under this load (1.0 without such cells)."""
    measured, predicted = sum(t[0] for t in times), sum(t[1] for t in times)
    return measured / predicted if measured > 0 and predicted > 0 else 1.0


def _gate_counts(engine: SpeculativeEngine) -> tuple[int, int, int]:
    """(rounds decided, rounds skipped, full predictions made) by the policy's skip-the-draft gate; zeros
    without one."""
    gates = [g for g in (getattr(p, "gate", None) for p in getattr(engine, "policies", [engine.policy])) if g]
    return tuple(sum(getattr(g, name) for g in gates) for name in ("decisions", "skipped", "predictions"))


class SharedEngines:
    """One verify engine and one draft engine (KV and context caches sized for the largest level), shared by
    every cell: a cell is a fresh SpeculativeEngine (policy, metrics) over them, and leaves them empty."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Any,
        max_requests: int,
        max_seq_len: int,
        calibration: STSCalibration | None,
        graphs: str = "off",
        prefill_rows: int = 0,
    ) -> None:
        self._args = (target, drafter, max_requests, max_seq_len, calibration)
        self.graphs, self.prefill_rows = graphs, prefill_rows
        self.max_requests = max_requests
        self.verify: VerifyEngine
        self.draft: DraftEngine
        self._build()

    def _build(self) -> None:
        target, drafter, max_requests, max_seq_len, calibration = self._args
        self.verify = VerifyEngine(
            target,
            max_requests,
            max_seq_len,
            graphs=self.graphs,
            max_drafts=drafter.block_size,
            draft_top_k=16,
            graph_prefill_rows=self.prefill_rows,
        )
        self.draft = DraftEngine(
            drafter, max_requests, max_seq_len, draft_top_k=16, calibration=calibration, graphs=self.graphs
        )

    def idle(self) -> bool:
        return self.verify.num_free_slots == self.max_requests and self.draft.num_free_slots == self.max_requests

    def rebuild(self) -> None:
        """Fresh caches after a failure left the old ones in an unknown state."""
        del self.verify, self.draft
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._build()


@dataclass
class CellBudget:
    warmup_s: float
    measure_s: float


@dataclass
class _Live:
    index: int
    arrival: float
    tokens: list[int] = field(default_factory=list)


def run_cell(
    engine: SpeculativeEngine,
    policy: str,
    mix: PromptMix,
    concurrency: int,
    budget: CellBudget,
    temperature: float,
) -> tuple[dict[str, Any], dict[int, list[int]]]:
    """Closed-loop continuous batching for a warm-up and a measured window; returns the cell's row and the
    outputs of every request that finished (warm-up included; by prompt index) for the greedy cross-checks."""
    live: dict[str, _Live] = {}
    next_prompt = 0

    def submit() -> None:
        nonlocal next_prompt
        index = next_prompt % len(mix)
        next_prompt += 1
        params = SamplingParams(
            temperature=temperature,
            max_tokens=mix.max_tokens[index],
            ignore_eos=True,
            seed=None if temperature == 0 else index,
        )
        live[engine.add_request(mix.token_ids[index], params)] = _Live(index, time.perf_counter())

    def step() -> tuple[float, int, list[tuple[_Live, Any]]]:
        t0 = time.perf_counter()
        deltas = engine.step()
        wall = time.perf_counter() - t0
        emitted, finished = 0, []
        for out in deltas:
            entry = live[out.req_id]
            entry.tokens.extend(out.new_token_ids)
            emitted += len(out.new_token_ids)
            if out.finished:
                done = live.pop(out.req_id)
                outputs[done.index] = done.tokens
                finished.append((done, out.metrics))
                submit()
        return wall, emitted, finished

    outputs: dict[int, list[int]] = {}  # every finished request's tokens by prompt index, warm-up included
    for _ in range(concurrency):
        submit()
    start = time.perf_counter()
    warm_rounds = 0
    while warm_rounds < 2 or time.perf_counter() - start < budget.warmup_s:
        step()
        warm_rounds += 1

    before = engine.snapshot()
    gate_before = _gate_counts(engine)
    runner = getattr(engine.verify, "graphs", None)  # a remote verifier's graphs are its own business
    replays_before = runner.replays if runner is not None else 0
    chained_before = runner.chained if runner is not None else 0
    drafter = getattr(engine.draft, "graphs", None)
    behind_before = drafter.behind if drafter is not None else 0
    window_start = time.perf_counter()
    rounds, emitted_total, finished_in_window, walls = 0, 0, 0, []
    user_rates: list[float] = []
    rates_by_prompt: dict[str, list[float]] = {}  # JSON keys: the prompt index as text
    while rounds < 3 or time.perf_counter() - window_start < budget.measure_s:
        wall, emitted, finished = step()
        rounds += 1
        walls.append(wall)
        emitted_total += emitted
        for done, m in finished:
            rate = m.num_output_tokens / (m.finish_time - m.arrival_time)
            user_rates.append(rate)
            rates_by_prompt.setdefault(str(done.index), []).append(rate)
        finished_in_window += len(finished)
    window = time.perf_counter() - window_start
    after = engine.snapshot()
    gate_after = _gate_counts(engine)
    decided = gate_after[0] - gate_before[0]
    graph_steps = (runner.replays - replays_before) if runner is not None else 0
    chained_steps = (runner.chained - chained_before) if runner is not None else 0
    behind_steps = (drafter.behind - behind_before) if drafter is not None else 0

    per_user_source = "finished"
    if len(user_rates) < 3:  # too few finished in the window: the in-flight requests' rates so far
        now = time.perf_counter()
        per_user_source = "in_flight"
        user_rates += [len(e.tokens) / (now - e.arrival) for e in live.values() if e.tokens and now > e.arrival]
    for req_id in list(live):
        engine.abort(req_id)

    drafts = after.num_drafts - before.num_drafts
    engine_rounds = max(after.rounds - before.rounds, 1)
    draft_ms = 1000 * (after.draft_time_s - before.draft_time_s) / engine_rounds
    sched_ms = 1000 * (after.schedule_time_s - before.schedule_time_s) / engine_rounds
    verify_ms = 1000 * (after.verify_time_s - before.verify_time_s) / engine_rounds
    round_ms = 1000 * float(np.mean(walls))
    verify_tokens = after.verify_tokens_per_round * after.rounds - before.verify_tokens_per_round * before.rounds
    row = {
        "concurrency": concurrency,
        "policy": policy,
        "warmup_s": budget.warmup_s,
        "window_s": window,
        "rounds": rounds,
        "finished": finished_in_window,
        "requests_per_round": drafts / engine_rounds,  # decoding (verified) per round; joiners prefill
        "per_user_tokens_per_s": statistics.median(user_rates) if user_rates else float("nan"),
        "per_user_source": per_user_source,
        "per_user_samples": len(user_rates),
        "per_user_by_prompt": rates_by_prompt,  # finished in the window: prompt index -> tokens/s per user
        "aggregate_tokens_per_s": emitted_total / window,
        "tau": (after.num_accepted_tokens - before.num_accepted_tokens + drafts) / drafts if drafts else 0.0,
        "verify_budget": (after.num_draft_tokens - before.num_draft_tokens) / drafts if drafts else 0.0,
        "verify_tokens_per_round": verify_tokens / engine_rounds,
        "conditional_acceptance": [
            (a1 - a0) / (r1 - r0) if r1 > r0 else None
            for a0, a1, r0, r1 in zip(
                before.accepted_per_position,
                after.accepted_per_position,
                before.reached_per_position,
                after.reached_per_position,
                strict=True,
            )
        ],
        "draft_ms": draft_ms,
        "schedule_ms": sched_ms,
        "verify_ms": verify_ms,
        "other_host_ms": round_ms - draft_ms - sched_ms - verify_ms,
        "host_ms": round_ms - draft_ms - verify_ms,
        "round_ms": round_ms,
        "round_ms_median": 1000 * statistics.median(walls),
        "graph_step_fraction": graph_steps / rounds,  # verify steps on the graph path (the rest ran eagerly)
        "chained_round_fraction": chained_steps / rounds,  # verify steps queued behind the drafter (chained)
        "behind_round_fraction": behind_steps / rounds,  # draft steps queued behind a verify step
        # Rounds whose drafter the skip-the-draft gate skipped (plain target rounds), of the rounds it decided.
        "skipped_round_fraction": (gate_after[1] - gate_before[1]) / decided if decided else 0.0,
        # Rounds in which the gate made a full prediction (the others reused its last prediction to draft).
        "predicted_round_fraction": (gate_after[2] - gate_before[2]) / decided if decided else 0.0,
    }
    return row, outputs


def per_user_pass(
    engines: dict[str, SpeculativeEngine], mix: PromptMix, seconds: float, temperature: float
) -> tuple[dict[str, dict[str, float]], dict[str, dict[int, list[int]]]]:
    """Tokens/s per user of every policy on THE SAME prompts, one request at a time: prompt after prompt of the
    mix, each served by every policy in turn, until ``seconds`` have passed (at least one prompt; a prompt is
    served by all policies or by none). Returns the rates by policy and prompt index (as text, like the cells'
    ``per_user_by_prompt``) and the outputs by policy and prompt index.

    Why: the cells at 1 request measure a time window, and a faster policy's window covers more and later
    prompts; their common prompts are the few the slowest cell finished (6-15 of them), and per-user speed
    varies 1.7-5x with the prompt, so which prompts are common moved the per-user goal's ratio by +-0.2x
    between runs of unchanged code (2026-12-02). Here the prompt set is the same by construction."""
    rates: dict[str, dict[str, float]] = {policy: {} for policy in engines}
    outputs: dict[str, dict[int, list[int]]] = {policy: {} for policy in engines}
    start = time.perf_counter()
    for index in range(len(mix)):
        for policy, engine in engines.items():
            params = SamplingParams(
                temperature=temperature,
                max_tokens=mix.max_tokens[index],
                ignore_eos=True,
                seed=None if temperature == 0 else index,
            )
            [done] = engine.generate([mix.token_ids[index]], params)
            metrics = done.metrics
            rates[policy][str(index)] = metrics.num_output_tokens / (metrics.finish_time - metrics.arrival_time)
            outputs[policy][index] = done.token_ids
        if time.perf_counter() - start >= seconds:
            break
    return rates, outputs


def per_user_speedups(rates: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each policy's per-prompt speed-up over autoregressive decoding on the prompts both served: the median
    (what the goal is judged on), the geometric mean and the range, and the prompt count."""
    base = rates.get("autoregressive", {})
    out: dict[str, dict[str, float]] = {}
    for policy, by_prompt in rates.items():
        if policy == "autoregressive":
            continue
        ratios = [by_prompt[i] / base[i] for i in base if i in by_prompt and base[i] > 0]
        if ratios:
            out[policy] = {
                "median": statistics.median(ratios),
                "geomean": math.exp(statistics.fmean(math.log(r) for r in ratios)),
                "min": min(ratios),
                "max": max(ratios),
                "prompts": len(ratios),
            }
    return out


def _first_difference(tokens: list[int], reference: list[int]) -> int:
    """The first position where two outputs differ (the shorter one's length when one is a prefix)."""
    return next((j for j, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b),
                min(len(tokens), len(reference)))  # fmt: skip


def agreement(outputs: dict[int, list[int]], reference: dict[int, list[int]] | None) -> dict[str, Any] | None:
    """How many finished requests equal the reference's output for the same prompt (both finished), and for
    each that does not, the position of its first different token (prompt index as text -> position): a bf16
    near-tie flipped by another batch shape shows as one late position, a defect as early and many."""
    if reference is None:
        return None
    common = [i for i in outputs if i in reference]
    differ = {str(i): _first_difference(outputs[i], reference[i]) for i in common if outputs[i] != reference[i]}
    return {"compared": len(common), "equal": len(common) - len(differ), "first_difference": differ}


def cell_budget(args: argparse.Namespace, deadline: float, now: float, cells_left: int) -> CellBudget | None:
    """This cell's share of the time left (keeping a reserve for plots and the table); None = no time left."""
    share = (deadline - now - args.reserve_s) / max(cells_left, 1)
    warmup = min(args.warmup_s, 0.2 * share)
    measure = min(args.measure_s, share - warmup)
    if measure < MIN_MEASURE_S:
        return None
    return CellBudget(warmup, measure)


# ---------------------------------------------------------------------------------------------------- goals
def _all_met(flags: Sequence[bool | None]) -> bool | None:
    """False if any level missed; None if there is no level with data; True otherwise."""
    known = [f for f in flags if f is not None]
    if not known:
        return None
    return all(known)


def _verdict(met: bool | None) -> str:
    return "NO DATA" if met is None else "MET" if met else "NOT MET"


def mean_cells(cells: Sequence[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    """One row per (concurrency, policy): the first repeat's row with every number averaged over the repeats,
    plus the number of repeats and the min / max aggregate tokens/s."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["concurrency"], c["policy"]), []).append(c)
    merged = {}
    for key, rows in groups.items():
        row = dict(rows[0])
        for name, value in rows[0].items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and name not in ("concurrency", "repeat"):
                row[name] = float(np.mean([r[name] for r in rows]))
        aggregates = [r["aggregate_tokens_per_s"] for r in rows]
        row.update(repeats=len(rows), aggregate_min=min(aggregates), aggregate_max=max(aggregates))
        merged[key] = row
    return merged


def common_prompt_per_user(cells: Sequence[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    """Median tokens/s per user of each (concurrency, policy) over the prompts that finished in the measured
    window of EVERY cell of that concurrency (all policies, all repeats), pooled over the repeats.

    Why: a cell's own median is over the prompts it happened to finish in its window, and a faster policy's
    window covers other prompts than a slower one's (at 1 request: ~16 prompts for autoregressive, ~45 for
    DSpark, from a warm-up that also ends at different prompts). Per-user speed varies with the prompt (its
    acceptance, its length), so those medians compare different requests; on the common prompts every policy is
    measured on the same requests."""
    levels: dict[int, list[dict[str, Any]]] = {}
    for c in cells:
        if "per_user_by_prompt" in c:
            levels.setdefault(c["concurrency"], []).append(c)
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for level, rows in levels.items():
        common = set.intersection(*(set(r["per_user_by_prompt"]) for r in rows))
        for policy in {r["policy"] for r in rows}:
            rates = [rate for r in rows if r["policy"] == policy for i in common for rate in r["per_user_by_prompt"][i]]
            out[(level, policy)] = {
                "tokens_per_s": statistics.median(rates) if rates else float("nan"),
                "prompts": len(common),
            }
    return out


def evaluate_goals(
    cells: Sequence[dict[str, Any]],
    floor_rows: Sequence[dict[str, Any]],
    levels: Sequence[int],
    fixed_prompts: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """The three goals of issue 11 with the measured ratios (None where a cell is missing). Repeated cells count
    by their mean; the ratio of each repeat (against that repeat's best fixed policy) gives the spread. The
    per-user goal is judged on ``fixed_prompts`` (:func:`per_user_speedups` of :func:`per_user_pass`: the
    median per-prompt speed-up on the same prompts) when given, else on the 1-request cells' common prompts."""
    by = mean_cells(cells)
    runs: dict[tuple[int, int], dict[str, float]] = {}
    for c in cells:
        runs.setdefault((c["concurrency"], c.get("repeat", 0)), {})[c["policy"]] = c["aggregate_tokens_per_s"]
    throughput = []
    for level in levels:
        fixed = {p: by[(level, p)]["aggregate_tokens_per_s"] for p in FIXED_POLICIES if (level, p) in by}
        entry: dict[str, Any] = {"concurrency": level}
        if fixed:
            best = max(fixed, key=fixed.__getitem__)
            entry.update(best_fixed=best, best_fixed_tokens_per_s=fixed[best])
            for policy in SCHEDULED_POLICIES:
                if (level, policy) in by:
                    entry[f"{policy}_ratio"] = by[(level, policy)]["aggregate_tokens_per_s"] / fixed[best]
                    entry[f"{policy}_ratio_per_repeat"] = [
                        run[policy] / max(run[p] for p in FIXED_POLICIES if p in run)
                        for (lv, _), run in sorted(runs.items())
                        if lv == level and policy in run and any(p in run for p in FIXED_POLICIES)
                    ]
        # None = no data (a missing cell), never counted as met or missed.
        entry["met"] = entry["dspark_ratio"] >= 1.0 if "dspark_ratio" in entry else None
        throughput.append(entry)

    # Judged on the prompts every cell at 1 request finished (common_prompt_per_user); the ratios of the cells'
    # own window medians are kept beside them ("window_median").
    common = common_prompt_per_user(cells)
    speedup: dict[str, Any] = {"goal": GOAL_USER_SPEEDUP, "window_median": {}}
    base, common_base = by.get((1, "autoregressive")), common.get((1, "autoregressive"))
    if common_base is not None:
        speedup["common_prompts"] = common_base["prompts"]
    for policy in POLICIES[1:]:
        if base is not None and (1, policy) in by:
            speedup["window_median"][policy] = by[(1, policy)]["per_user_tokens_per_s"] / base["per_user_tokens_per_s"]
        if common_base is not None and common_base["prompts"] and (1, policy) in common:
            speedup[policy] = common[(1, policy)]["tokens_per_s"] / common_base["tokens_per_s"]
    speedup["source"] = "common prompts of the 1-request cells"
    if fixed_prompts:
        speedup["common_window"] = {p: speedup.pop(p) for p in POLICIES[1:] if p in speedup}
        speedup["fixed_prompts"] = fixed_prompts
        speedup["source"] = "the same prompts served by every policy (per_user_pass), median per-prompt speed-up"
        speedup.update({policy: entry["median"] for policy, entry in fixed_prompts.items()})
    speedup["met"] = speedup["dspark"] >= GOAL_USER_SPEEDUP if "dspark" in speedup else None

    # Judged on the CUDA-graph replay where measured (the GPU's own time: what the goal is about), else eager.
    floor = []
    for row in floor_rows:
        if row["requests"] <= FLOOR_MAX_REQUESTS:
            judged_on = "graph" if "graph_ratio" in row else "eager"
            ratio = row["graph_ratio"] if judged_on == "graph" else row["ratio"]
            floor.append(dict(row, judged_on=judged_on, met=ratio <= GOAL_FLOOR_RATIO))
    return {
        "dspark_vs_best_fixed_aggregate": {
            "goal": ">= 1.0 at every concurrency (fixed = autoregressive, fixed-1, full)",
            "levels": throughput,
            "met": _all_met([t["met"] for t in throughput]),
        },
        "per_user_speedup_at_1": speedup,
        "verify_step_vs_memory_floor": {
            "goal": f"<= {GOAL_FLOOR_RATIO}x for <= {FLOOR_MAX_REQUESTS} requests",
            "rows": floor,
            "met": _all_met([r["met"] for r in floor]),
        },
    }


# ---------------------------------------------------------------------------------------------------- plots
def plot_throughput(
    cells: Sequence[dict[str, Any]],
    baseline: dict[str, Any] | None,
    path: Path,
    title: str,
    series: Callable[[dict[str, Any]], str] = lambda cell: cell["policy"],
) -> None:
    """Paper Figure 7 style: aggregate tokens/s vs tokens/s per user, one line per series (default: policy)
    across concurrency."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    for name in dict.fromkeys(series(c) for c in cells):  # in order of appearance
        rows = sorted((c for c in cells if series(c) == name), key=lambda c: c["concurrency"])
        xs = [c["per_user_tokens_per_s"] for c in rows]
        ys = [c["aggregate_tokens_per_s"] for c in rows]
        ax.plot(xs, ys, marker="o", label=name)
        for c, x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(f"{c['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if baseline is not None:
        rate = baseline["tokens_per_s"]
        ax.scatter([rate], [rate], marker="x", color="black", zorder=5, label="HF generate (1 request)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the decades, no labels on the minor ticks (they collide)
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("tokens/s per user (median)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_budget(cells: Sequence[dict[str, Any]], block_size: int, path: Path, title: str) -> None:
    """Paper Figure 8 style: verification budget (verified drafts per request per round) vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    for policy in POLICIES:
        rows = sorted((c for c in cells if c["policy"] == policy), key=lambda c: c["concurrency"])
        if rows:
            ax.plot([c["concurrency"] for c in rows], [c["verify_budget"] for c in rows], marker="o", label=policy)
    levels = sorted({c["concurrency"] for c in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(level) for level in levels])
    ax.set_ylim(-0.2, block_size + 0.5)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("verified drafts per request per round")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- table
def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:{width}.{digits}f}"


def final_table(results: dict[str, Any]) -> list[str]:
    lines = [
        f"{results['machine']}; {results['shape']} {results['dtype']}; block {results['block_size']}; "
        f"temperature {results['temperature']}",
        f"{'c':>4} {'policy':>14} {'user t/s':>9} {'agg t/s':>9} {'tau':>5} {'budget':>6} {'B/rnd':>6} "
        f"{'draft':>6} {'sched':>6} {'verify':>7} {'other':>6} {'round':>7} {'fin':>4} {'=AR':>7} {'graph':>5} "
        f"{'chain':>5} {'bhnd':>4} {'skip':>4}",
    ]
    for c in results["cells"]:
        agree = c.get("agreement_with_autoregressive")
        agree_text = f"{agree['equal']}/{agree['compared']}" if agree else "-"
        lines.append(
            f"{c['concurrency']:>4}{'#' + str(c.get('repeat', 0)):>3} {c['policy']:>14} "
            f"{_fmt(c['per_user_tokens_per_s'], 9)} "
            f"{_fmt(c['aggregate_tokens_per_s'], 9)} {_fmt(c['tau'], 5, 2)} {_fmt(c['verify_budget'], 6, 2)} "
            f"{_fmt(c['verify_tokens_per_round'], 6)} {_fmt(c['draft_ms'], 6, 2)} {_fmt(c['schedule_ms'], 6, 2)} "
            f"{_fmt(c['verify_ms'], 7, 2)} {_fmt(c['other_host_ms'], 6, 2)} {_fmt(c['round_ms'], 7, 2)} "
            f"{c['finished']:>4} {agree_text:>7} {_fmt(100 * c.get('graph_step_fraction', 0.0), 5, 0)} "
            f"{_fmt(100 * c.get('chained_round_fraction', 0.0), 5, 0)} "
            f"{_fmt(100 * c.get('behind_round_fraction', 0.0), 4, 0)} "
            f"{_fmt(100 * c.get('skipped_round_fraction', 0.0), 4, 0)}"
        )
    lines.append(
        "(ms per round; budget = verified drafts per request per round; B/rnd = verify batch tokens; "
        "=AR: finished outputs equal to autoregressive's; graph: % of verify steps on the graph path; "
        "chain: % of rounds chained behind the drafter; bhnd: % of rounds drafted behind a verify step; "
        "skip: % of rounds that skipped the drafter)"
    )
    common = common_prompt_per_user(results["cells"])
    for level in sorted({c for c, _ in common}):
        rows = {p: common[(level, p)] for p in POLICIES if (level, p) in common}
        prompts = next(iter(rows.values()))["prompts"]
        lines.append(
            f"user t/s on the {prompts} prompts every c={level} cell finished: "
            + ", ".join(f"{p} {_fmt(r['tokens_per_s'], 0)}" for p, r in rows.items())
        )
    baseline = results.get("hf_generate")
    if baseline:
        lines.append(f"HF generate, 1 request: {baseline['tokens_per_s']:.1f} tokens/s")
    goals = results.get("goals")
    if goals:
        g1 = goals["dspark_vs_best_fixed_aggregate"]
        parts = [
            f"c={t['concurrency']}: {_fmt(t.get('dspark_ratio'), 0, 2)}x vs {t.get('best_fixed', '-')}"
            f" [{'/'.join(f'{r:.2f}' for r in t.get('dspark_ratio_per_repeat', []))}]"
            f" (async {_fmt(t.get('dspark-async_ratio'), 0, 2)}x)"
            for t in g1["levels"]
        ]
        lines.append(f"GOAL dspark agg >= best fixed [{_verdict(g1['met'])}]: " + "; ".join(parts))
        g2 = goals["per_user_speedup_at_1"]
        window = g2.get("window_median", {})
        fixed = g2.get("fixed_prompts")
        common_window = g2.get("common_window", g2)
        on = (
            f"median per-prompt speed-up on the {next(iter(fixed.values()))['prompts']} prompts every policy served"
            if fixed
            else f"on the {g2.get('common_prompts', 0)} prompts every cell finished"
        )
        lines.append(
            f"GOAL per-user at 1 request >= {GOAL_USER_SPEEDUP}x autoregressive [{_verdict(g2['met'])}], {on}: "
            + ", ".join(f"{p} {_fmt(g2.get(p), 0, 2)}x" for p in POLICIES[1:] if p in g2)
            + (
                " (geometric mean "
                + ", ".join(f"{p} {fixed[p]['geomean']:.2f}x" for p in POLICIES[1:] if p in fixed)
                + "; the cells' common prompts: "
                + ", ".join(f"{p} {_fmt(common_window[p], 0, 2)}x" for p in POLICIES[1:] if p in common_window)
                + ")"
                if fixed
                else ""
            )
            + " (each cell's own window median: "
            + ", ".join(f"{p} {_fmt(window[p], 0, 2)}x" for p in POLICIES[1:] if p in window)
            + ")"
        )
        g3 = goals["verify_step_vs_memory_floor"]
        lines.append(
            f"GOAL verify step <= {GOAL_FLOOR_RATIO}x memory floor [{_verdict(g3['met'])}]: "
            + "; ".join(
                f"R={r['requests']} B={r['batch_tokens']}: floor {r['floor_ms']:.2f} ms, eager {r['step_ms']:.2f} ms "
                f"= {r['ratio']:.2f}x"
                + (f", graph {r['graph_step_ms']:.2f} ms = {r['graph_ratio']:.2f}x" if "graph_ratio" in r else "")
                for r in g3["rows"]
            )
        )
    return lines


# ----------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-dir", type=Path, required=True, help="folder with <dataset>.jsonl prompt files")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mbpp"])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--drafter", type=Path, default=DEMO_DRAFTER)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-tokens-jitter", type=int, default=32)
    parser.add_argument("--per-dataset", type=int, default=160, help="prompts taken from each dataset")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--measure-s", type=float, default=9.0)
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="seconds from start by which the sweep ends (cells shrink to fit); default 420, --small 100",
    )
    parser.add_argument("--reserve-s", type=float, default=10.0, help="kept for plots and the table")
    parser.add_argument("--hf-repeats", type=int, default=2, help="0: skip the transformers generate baseline")
    parser.add_argument(
        "--graphs",
        default=None,
        choices=["off", "static", "capture"],
        help="engine steps: CUDA graphs (capture), the same bucketed steps run eagerly (static), or eager (off); "
        "default capture on cuda, static with --small",
    )
    parser.add_argument(
        "--prefill-rows", type=int, default=1024, help="graph-step room for joining prompts' tokens per round"
    )
    parser.add_argument(
        "--draft-cost",
        default="measured",
        choices=["measured", "none"],
        help="scheduled policies: Algorithm 1 with the whole-round objective tau / (T_other + 1/SPS(B)), T_other "
        f"= draft + schedule + host ms per round of the same level's {OVERHEAD_SOURCE!r} cell (measured), or "
        "tau * SPS(B) (none)",
    )
    parser.add_argument(
        "--draft-skip",
        default="on",
        choices=["on", "off"],
        help="scheduled policies with measured draft costs: may skip the drafter in rounds where a plain target "
        "round is predicted to be faster (no-draft round time outside the verify step = schedule + host ms of the "
        "same level's autoregressive cell); off: always draft",
    )
    parser.add_argument(
        "--sps-by-requests",
        default="on",
        choices=["on", "off"],
        help="scheduled policies price a round of R requests with an SPS table profiled at R requests (one per "
        "concurrency level, graph step only); off: the token table (ceil(B / (block + 1)) requests per step)",
    )
    parser.add_argument(
        "--verify-calibration",
        default="on",
        choices=["on", "off"],
        help="scheduled policies scale their SPS tables by measured / predicted verify time of the same level's "
        "autoregressive and full cells (the profile's steps are idle ones: under load, longer contexts and "
        "joining prompts' prefill make every step slower; the draft cost is measured from those cells alike)",
    )
    parser.add_argument(
        "--draft-ahead",
        default="on",
        choices=["on", "off"],
        help="the engine launches the next round's drafts before a round's commit (SpeculativeEngine draft_ahead: "
        "the host commits while the device drafts), as dspark serve does with CUDA graphs",
    )
    parser.add_argument(
        "--chain-verify",
        default="on",
        choices=["on", "off"],
        help="rounds whose lengths the policy fixes before the drafts exist (fixed-N and full always, dspark when "
        "a uniform length is close to Algorithm 1's choice, dspark-async when its planned capacity holds every "
        "draft) queue the verify step right behind the draft step on the device (SpeculativeEngine "
        "chain_verify), as dspark serve does with CUDA graphs",
    )
    parser.add_argument(
        "--chain-draft",
        default="on",
        choices=["on", "off"],
        help="a chained round also queues the next round's draft step behind its verify step, which takes the "
        "committed rows and the next anchors on the device (SpeculativeEngine chain_draft), as dspark serve does "
        "with CUDA graphs",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of every cell (interleaved), for error bars")
    parser.add_argument(
        "--user-pass-s",
        type=float,
        default=30.0,
        help="seconds kept for the per-user pass at 1 request after the cells (every policy serves the same "
        "prompts one at a time; the per-user goal is judged on it); 0: off (judged on the cells' common prompts)",
    )
    parser.add_argument("--bandwidth-mib", type=int, default=1024)
    parser.add_argument(
        "--small", action="store_true", help="CPU smoke run: a small inflation, concurrency 1 and 4, tiny budgets"
    )
    args = parser.parse_args(argv)
    if args.small:
        args.shape = "small"
        args.concurrency = [1, 4]
        args.max_tokens, args.max_tokens_jitter = 24, 6
        args.per_dataset, args.max_prompt_tokens = 8, 256
        args.warmup_s, args.measure_s = 0.3, 1.5
        args.reserve_s = 5.0
        args.hf_repeats, args.bandwidth_mib = 1, 64
        args.user_pass_s = min(args.user_pass_s, 10.0)
    if args.time_limit_s is None:
        args.time_limit_s = 100.0 if args.small else 420.0
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.graphs is None:
        args.graphs = "capture" if args.device.startswith("cuda") else "static" if args.small else "off"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if any(c < 1 for c in args.concurrency):
        raise ValueError(f"concurrency levels must be >= 1, got {args.concurrency}")
    args.concurrency = sorted(set(args.concurrency))
    return args


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
        return f"{name} ({memory:.0f} GiB), {os.cpu_count()} CPUs, torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --small (CPU) for a smoke test", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared 2-core VM: a second OpenMP thread mostly waits for a busy core
    deadline = started + args.time_limit_s
    report = Reporter(args.out_dir, started)
    shape = SMALL_SHAPE if args.shape == "small" else SHAPES[args.shape]
    results = report.results
    results.update(
        machine=machine_description(device),
        device=str(device),
        dtype=args.dtype,
        shape=args.shape,
        shape_sizes=dataclasses.asdict(shape),
        temperature=args.temperature,
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        cells=[],
        skipped_cells=[],
    )
    report.log(
        f"{results['machine']}; inflating {args.target.name} + {args.drafter.name} into {args.shape} ({args.dtype})"
    )

    # 1. the inflated pair and the prompt mix
    pair = inflate_pair(args.target, args.drafter, shape, dtype=args.dtype, device=device, seed=0)
    target, drafter = pair.target_model(), pair.draft
    assert drafter is not None
    block = drafter.block_size
    results["block_size"] = block
    results["inflation"] = pair.info
    results["weights_gib"] = {
        "target": weight_bytes(target) / 2**30,
        "drafter": sum(p.numel() * p.element_size() for p in drafter.parameters()) / 2**30,
    }
    report.log(
        f"inflated in {pair.info['build_s']:.1f} s: target {results['weights_gib']['target']:.2f} GiB, "
        f"drafter {results['weights_gib']['drafter']:.2f} GiB, block {block}"
    )
    tokenizer = tokenizer_for(args.target)
    mix = load_prompt_mix(
        args.prompts_dir,
        args.datasets,
        tokenizer,
        per_dataset=args.per_dataset,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens,
        jitter=args.max_tokens_jitter,
    )
    results["prompts"] = mix.summary()
    max_seq_len = min(target.max_context_len, max(len(p) for p in mix.token_ids) + max(mix.max_tokens) + block + 2)
    context = int(statistics.median(len(p) for p in mix.token_ids)) + args.max_tokens // 2
    results["max_seq_len"], results["profile_context"] = max_seq_len, context
    report.log(f"prompts: {results['prompts']}; max_seq_len {max_seq_len}")
    report.save()

    # 2. engines (shared by all cells: KV and context caches for the largest level; graphs captured here)
    max_requests = max(args.concurrency)
    calibration = load_calibration(args.drafter)
    t0 = time.perf_counter()
    engines = SharedEngines(
        target, drafter, max_requests, max_seq_len, calibration, graphs=args.graphs, prefill_rows=args.prefill_rows
    )
    runner = engines.verify.graphs
    results["graphs"] = {
        "mode": args.graphs,
        "build_s": time.perf_counter() - t0,
        "verify_buckets": None if runner is None else len(runner.steps),
        "prefill_rows": args.prefill_rows,
    }
    report.log(
        f"engines built (graphs {args.graphs}, {results['graphs']['verify_buckets']} verify buckets) in "
        f"{results['graphs']['build_s']:.1f} s"
    )

    # 3. bandwidth, SPS table (of the step the engine runs), verify step vs the memory floor
    bandwidth = copy_bandwidth(device, args.bandwidth_mib * 2**20)
    results["copy_bandwidth"] = bandwidth
    report.log(f"copy bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (read + write)")
    grid = sps_grid(block + 1, args.concurrency)
    device_times = None
    if runner is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SPSMonotonicityWarning)  # the raw rates are kept and reported
            sps, device_times = profile_graph_sps(engines.verify, chunk=block + 1, batch_sizes=grid, context=context)
        results["sps_device_step_s"] = device_times
    else:
        sps = profile_sps(target, block + 1, grid, context)
    results["sps"] = sps.to_dict()
    results["sps_source"] = "graph step (host packing + replay + result copy)" if runner else "eager forward"
    weights, kv_token = weight_bytes(target), kv_bytes_per_token(target)
    floor_rows = []
    for r in args.concurrency:
        b = r * (block + 1)
        step = 1.0 / float(sps.measured_steps_per_s[grid.index(b)])
        floor = floor_seconds(weights, kv_token, r, context + block + 1, bandwidth["bytes_per_s"])
        row = {
            "requests": r,
            "batch_tokens": b,
            "context": context,
            "step_ms": 1000 * step,
            "floor_ms": 1000 * floor,
            "ratio": step / floor,
        }
        if device_times is not None:  # the replay's device time: what the floor goal is about
            graph = device_times[grid.index(b)]
            row.update(graph_step_ms=1000 * graph, graph_ratio=graph / floor)
        floor_rows.append(row)
    results["verify_vs_floor"] = floor_rows
    report.log(
        "SPS profiled: "
        + ", ".join(f"B={b}: {1000 / s:.2f} ms" for b, s in zip(grid, sps.measured_steps_per_s, strict=True))
    )
    report.log(
        "verify step vs floor: "
        + "; ".join(
            f"R={f['requests']}: {f['step_ms']:.2f}"
            + (f" (device {f['graph_step_ms']:.2f})" if "graph_step_ms" in f else "")
            + f"/{f['floor_ms']:.2f} ms"
            for f in floor_rows
        )
    )
    scheduling_sps: SPSSource = sps  # what the scheduled policies price verify steps with
    results["sps_by_requests"] = None
    if args.sps_by_requests == "on" and runner is None:
        report.log("SPS by request count needs the graph step (--graphs static/capture): the token table is used")
    elif args.sps_by_requests == "on":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SPSMonotonicityWarning)
            scheduling_sps, by_device = profile_graph_sps_by_requests(
                engines.verify, chunk=block + 1, request_counts=args.concurrency, context=context
            )
        results["sps_by_requests"] = scheduling_sps.to_dict()
        results["sps_by_requests_device_step_s"] = {str(r): times for r, times in by_device.items()}
        report.log(
            "SPS by request count: "
            + "; ".join(
                f"R={r}: "
                + ", ".join(f"B={b} {1000 / s:.2f}" for b, s in zip(t.batch_sizes, t.measured_steps_per_s, strict=True))
                + " ms"
                for r, t in scheduling_sps.tables.items()
            )
        )
    report.save()

    def engine_for(
        policy: str,
        concurrency: int,
        draft_cost: DraftCost | None = None,
        no_draft_cost: DraftCost | None = None,
        verify_scale: float = 1.0,
    ) -> SpeculativeEngine:
        return SpeculativeEngine(
            engines.verify,
            engines.draft,
            scheduled_policy(policy, scheduling_sps.scaled(verify_scale), draft_cost, no_draft_cost)
            if draft_cost is not None
            else make_policy(policy, scheduling_sps, block),
            eos_token_ids=target.eos_token_ids,
            max_running=concurrency,
            draft_ahead=args.draft_ahead == "on",
            chain_verify=args.chain_verify == "on",
            chain_draft=args.chain_draft == "on",
        )

    for policy in args.policies:  # first calls compile the Triton kernels for the chunk shapes each policy makes
        try:
            engine_for(policy, 4).generate(
                mix.token_ids[:4], SamplingParams(temperature=args.temperature, max_tokens=16, ignore_eos=True, seed=0)
            )
        except Exception as error:  # one shot on the device: record, rebuild, go on with the other policies
            report.log(f"warm-up of {policy} FAILED: {error!r}\n{traceback.format_exc(limit=6)}")
            results.setdefault("errors", []).append({"stage": f"warm-up {policy}", "error": repr(error)})
            engines.rebuild()
    _sync(device)
    report.log("engines warmed up")

    # 4. plain transformers generate at 1 request
    baseline = None
    if args.hf_repeats < 1:
        report.log("HF generate: skipped (--hf-repeats 0)")
    else:
        try:
            baseline = hf_generate_baseline(target, mix.token_ids[0], mix.max_tokens[0], args.hf_repeats)
            results["hf_generate"] = {k: v for k, v in baseline.items() if k != "tokens"}
            report.log(
                f"HF generate, 1 request: {baseline['tokens_per_s']:.1f} tokens/s ({baseline['new_tokens']} tokens)"
            )
        except Exception as error:
            report.log(f"HF generate FAILED: {error!r}\n{traceback.format_exc(limit=6)}")
            results.setdefault("errors", []).append({"stage": "hf generate", "error": repr(error)})
    report.save()

    # 5. the sweep
    # The per-user pass after the cells needs the 1-request cells (their draft costs and calibration).
    user_pass_s = args.user_pass_s if 1 in args.concurrency and "autoregressive" in args.policies else 0.0
    # Repeats interleaved per level (policy after policy, then again), so that drifts hit every policy alike.
    plan = [(c, k, p) for c in args.concurrency for k in range(args.repeats) for p in args.policies]
    reference: dict[int, dict[int, list[int]]] = {}
    overheads: dict[tuple[int, int], DraftCost] = {}
    no_draft_overheads: dict[tuple[int, int], DraftCost] = {}
    # Measured and predicted verify ms per round of the calibrating cells, by (level, repeat).
    verify_times: dict[tuple[int, int], list[tuple[float, float]]] = {}

    def measured_costs(policy: str, concurrency: int, repeat: int) -> tuple[DraftCost | None, DraftCost | None, float]:
        """A scheduled policy's draft cost, no-draft cost and verify scale from the calibrating cells of its level
        and repeat measured so far (None, None / the no-draft cost, 1.0 for the others)."""
        cost = overheads.get((concurrency, repeat)) if policy in SCHEDULED_POLICIES else None
        # Without an autoregressive cell at this level the no-draft round counts its verify step only.
        no_draft = no_draft_overheads.get((concurrency, repeat), DraftCost()) if args.draft_skip == "on" else None
        scale = verify_scale(verify_times.get((concurrency, repeat), []))
        if args.verify_calibration == "off" or policy not in SCHEDULED_POLICIES:
            scale = 1.0
        return cost, no_draft, scale

    bar = tqdm(plan, desc="cells", unit="cell", disable=not sys.stderr.isatty())
    for n, (concurrency, repeat, policy) in enumerate(bar):
        budget = cell_budget(args, deadline - user_pass_s, time.perf_counter(), len(plan) - n)
        if budget is None:
            results["skipped_cells"].append(
                {"concurrency": concurrency, "repeat": repeat, "policy": policy, "reason": "time limit"}
            )
            report.log(f"c={concurrency} {policy}: skipped (time limit)")
            continue
        try:
            cost, no_draft, scale = measured_costs(policy, concurrency, repeat)
            engine = engine_for(policy, concurrency, cost, no_draft if cost is not None else None, scale)
            row, outputs = run_cell(engine, policy, mix, concurrency, budget, args.temperature)
            if not engines.idle():
                raise RuntimeError("the cell left requests behind in the engines")
        except Exception as error:  # e.g. out of memory at the largest level: keep the rest of the sweep
            report.log(f"c={concurrency} {policy}: FAILED {error!r}\n{traceback.format_exc(limit=6)}")
            results.setdefault("errors", []).append({"stage": f"cell c={concurrency} {policy}", "error": repr(error)})
            engines.rebuild()
            report.save()
            continue
        row["repeat"] = repeat
        row["draft_cost_s"] = None if cost is None else cost.fixed_s
        row["no_draft_cost_s"] = None if cost is None or no_draft is None else no_draft.fixed_s
        row["verify_scale"] = scale
        if policy in ("autoregressive", OVERHEAD_SOURCE) and row["rounds"]:
            predicted = 1000 / float(
                scheduling_sps.table_for(concurrency).steps_per_second(row["verify_tokens_per_round"])
            )
            verify_times.setdefault((concurrency, repeat), []).append((row["verify_ms"], predicted))
        if args.draft_cost == "measured" and policy == OVERHEAD_SOURCE:
            # Algorithm 1's whole-round objective needs the round time outside the verify step at this load.
            overhead = (row["draft_ms"] + row["schedule_ms"] + row["other_host_ms"]) / 1000
            overheads[(concurrency, repeat)] = DraftCost(fixed_s=max(overhead, 0.0))
        if args.draft_cost == "measured" and policy == "autoregressive":
            # A round that skips the drafter: the autoregressive round's time outside the verify step (its
            # context append to the drafter, which the autoregressive engine does not do, is not included).
            overhead = (row["schedule_ms"] + row["other_host_ms"]) / 1000
            no_draft_overheads[(concurrency, repeat)] = DraftCost(fixed_s=max(overhead, 0.0))
        if policy == "autoregressive" and concurrency not in reference:
            reference[concurrency] = outputs
            if concurrency == 1 and 0 in outputs and baseline is not None:
                row["hf_generate_equal"] = outputs[0] == baseline["tokens"]
        row["agreement_with_autoregressive"] = (
            agreement(outputs, reference.get(concurrency)) if policy != "autoregressive" else None
        )
        results["cells"].append(row)
        report.save()
        report.log(
            f"c={concurrency:<3} #{repeat} {policy:<14} user {row['per_user_tokens_per_s']:8.1f} t/s  agg "
            f"{row['aggregate_tokens_per_s']:8.1f} t/s  tau {row['tau']:.2f}  budget {row['verify_budget']:.2f}  "
            f"round {row['round_ms']:.2f} ms (draft {row['draft_ms']:.2f} sched {row['schedule_ms']:.2f} verify "
            f"{row['verify_ms']:.2f} other {row['other_host_ms']:.2f})  {row['rounds']} rounds, "
            f"{row['finished']} finished, {100 * row['graph_step_fraction']:.0f}% graph steps, "
            f"{100 * row['chained_round_fraction']:.0f}% chained, "
            f"{100 * row['skipped_round_fraction']:.0f}% rounds skipped the draft"
        )

    # 6. graphs off: the verify step as a replayed CUDA graph (after the sweep: a failed capture cannot spoil it)
    if device.type == "cuda" and runner is None:
        for row in floor_rows:
            if row["requests"] > FLOOR_MAX_REQUESTS:
                continue
            try:
                step = captured_verify_step_s(target, row["requests"], block + 1, context)
                row.update(graph_step_ms=1000 * step, graph_ratio=1000 * step / row["floor_ms"])
                report.log(
                    f"verify step R={row['requests']} as a CUDA graph: {row['graph_step_ms']:.2f} ms "
                    f"(floor {row['floor_ms']:.2f} ms, eager {row['step_ms']:.2f} ms)"
                )
            except Exception as error:
                report.log(f"captured verify step R={row['requests']} FAILED: {error!r}")
                results.setdefault("errors", []).append({"stage": "captured verify step", "error": repr(error)})
                break
        report.save()

    # 7. per user at 1 request: every policy on the same prompts, with the first repeat's costs at that level
    fixed_prompts = None
    if user_pass_s > 0 and time.perf_counter() < deadline:
        try:
            pass_engines = {}
            for policy in args.policies:
                cost, no_draft, scale = measured_costs(policy, 1, 0)
                pass_engines[policy] = engine_for(policy, 1, cost, no_draft if cost is not None else None, scale)
            seconds = min(user_pass_s, deadline - time.perf_counter())
            rates, pass_outputs = per_user_pass(pass_engines, mix, seconds, args.temperature)
            fixed_prompts = per_user_speedups(rates)
            reference_outputs = pass_outputs.get("autoregressive")
            results["per_user_pass"] = {
                "rates_by_prompt": rates,
                "speedups": fixed_prompts,
                "agreement_with_autoregressive": {
                    p: agreement(o, reference_outputs) for p, o in pass_outputs.items() if p != "autoregressive"
                },
            }
            report.log(
                "per-user pass at 1 request, the same "
                + f"{len(rates.get('autoregressive', {}))} prompts for every policy: "
                + ", ".join(
                    f"{p} {v['median']:.2f}x (geometric mean {v['geomean']:.2f}x, {v['min']:.2f}-{v['max']:.2f})"
                    for p, v in fixed_prompts.items()
                )
            )
        except Exception as error:
            report.log(f"per-user pass FAILED: {error!r}\n{traceback.format_exc(limit=6)}")
            results.setdefault("errors", []).append({"stage": "per-user pass", "error": repr(error)})
            engines.rebuild()
        report.save()

    # 8. goals, plots, table
    results["goals"] = evaluate_goals(results["cells"], floor_rows, args.concurrency, fixed_prompts)
    results["status"] = "done" if not (results["skipped_cells"] or results.get("errors")) else "partial"
    report.save()
    title = (
        f"demo pair inflated to {args.shape} ({args.dtype}), {results['machine'].split(',')[0]}, T={args.temperature}"
    )
    if results["cells"]:
        means = list(mean_cells(results["cells"]).values())
        results["mean_cells"] = means
        report.save()
        plot_throughput(means, results.get("hf_generate"), args.out_dir / FILES["throughput"], title)
        plot_budget(means, block, args.out_dir / FILES["budget"], title)
    report.log(f"wrote {', '.join(sorted(p.name for p in args.out_dir.iterdir()))}")
    report.raw("\n".join(final_table(results)))
    report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
