"""Single-request decoding speed on CPU: speculative (policies full / dspark) vs plain autoregressive decoding of
the same target, in the same engine, side by side in one run.

Every prompt (humaneval, first turn, through the tokenizer's chat template) is generated once per policy, the
policies interleaved prompt by prompt so that a busy machine slows them alike; tokens/s = generated tokens /
wall time of ``SpeculativeEngine.generate`` (prefill included). Greedy (temperature 0, EOS ignored so every
request produces --max-tokens), so the outputs of all policies must be identical: the run checks it. The dspark
policy uses an SPS table profiled here first, on this CPU, for the target's verify step at 1..block+1 tokens.

Drafter: --drafter, else models/demo/dspark if it exists, else a random drafter (then speculative decoding
cannot win: it measures the overhead of drafting and verifying blocks that are rejected; the output says so).

    PYTHONPATH=. python -m bench.bench_engine_cpu --prompts /work/shared/data/prompts/humaneval.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from bench.engine_setup import (
    DEMO_TARGET,
    ROOT,
    build_engine,
    chat_prompts,
    demo_drafter,
    load_calibration,
    load_pair,
    tokenizer_for,
    write_random_drafter,
)
from kernels.sampling import SamplingParams
from scheduler.sps import SPSMonotonicityWarning, profile_sps
from verify_service.target import TargetModel

SHARED = Path(os.environ.get("DSPARK_SHARED_DIR", ROOT.parent / "shared"))


def profile_verify_sps(target: TargetModel, context: int, max_tokens: int):
    """SPS(B) of one request's verify step (B tokens over a context of ``context`` tokens) on this machine."""
    cache = target.new_kv_cache(1, context + max_tokens + 1)
    slot = cache.allocate()
    target.forward(cache, target.prepare(cache, [(slot, [1] * context)]))

    def run_step(batch_tokens: int) -> None:
        target.forward(cache, target.prepare(cache, [(slot, [1] * batch_tokens)]))
        cache.truncate(slot, context)

    with warnings.catch_warnings():
        # Timing noise can make a larger B look faster; the table replaces it by the running minimum.
        warnings.simplefilter("ignore", SPSMonotonicityWarning)
        return profile_sps(
            run_step, list(range(1, max_tokens + 1)), model="demo target", device="cpu", warmup=2, repeats=9
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--drafter", type=Path, default=None)
    parser.add_argument("--prompts", type=Path, default=SHARED / "data" / "prompts" / "humaneval.jsonl")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--policies", nargs="+", default=["autoregressive", "full", "dspark"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: no oversubscription)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.prompts.is_file():
        print(f"{args.prompts} does not exist (shared prompt data is read by path)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    tmp = tempfile.TemporaryDirectory()
    drafter_dir, random_drafter = args.drafter, False
    if drafter_dir is None:
        drafter_dir = demo_drafter()
        if drafter_dir is None:
            drafter_dir = write_random_drafter(args.target, Path(tmp.name) / "drafter")
            random_drafter = True
    note = " (RANDOM weights: no trained drafter yet, so drafts are rejected)" if random_drafter else ""
    print(f"drafter: {drafter_dir}{note}")
    target, drafter = load_pair(args.target, drafter_dir, "cpu", torch.float32)
    tokenizer = tokenizer_for(args.target)
    prompts = chat_prompts(args.prompts, tokenizer, args.num_prompts)
    block = drafter.block_size
    context = int(statistics.median(len(p) for p in prompts))
    sps = profile_verify_sps(target, context, block + 1)
    max_seq_len = max(len(p) for p in prompts) + args.max_tokens + block + 2
    engines = {
        policy: build_engine(
            target,
            None if policy == "autoregressive" else drafter,
            policy=policy,
            sps=sps,
            max_requests=1,
            max_seq_len=max_seq_len,
            calibration=load_calibration(drafter_dir),
        )
        for policy in args.policies
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for engine in engines.values():  # warm-up (allocator, first-call costs)
        engine.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    runs: dict[str, list[dict]] = {policy: [] for policy in engines}
    outputs: dict[str, list[list[int]]] = {policy: [] for policy in engines}
    plan = [(i, policy) for i in range(len(prompts)) for policy in engines]
    for i, policy in tqdm(plan, desc="generate", unit="run"):
        engine = engines[policy]
        before = engine.snapshot()
        start = time.perf_counter()
        result = engine.generate([prompts[i]], params)[0]
        elapsed = time.perf_counter() - start
        after = engine.snapshot()
        rounds = after.rounds - before.rounds
        drafts = after.num_drafts - before.num_drafts
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        runs[policy].append(
            {
                "prompt": i,
                "prompt_tokens": len(prompts[i]),
                "tokens": len(result.token_ids),
                "seconds": elapsed,
                "rounds": rounds,
                "tau": (accepted + drafts) / drafts if drafts else 1.0,
                "verified_per_round": (after.num_draft_tokens - before.num_draft_tokens) / max(rounds, 1),
                "draft_s": after.draft_time_s - before.draft_time_s,
                "verify_s": after.verify_time_s - before.verify_time_s,
            }
        )
        outputs[policy].append(result.token_ids)

    baseline = "autoregressive" if "autoregressive" in engines else next(iter(engines))
    identical = all(outputs[p] == outputs[baseline] for p in engines)
    summary = []
    for policy, rows in runs.items():
        tokens = sum(r["tokens"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        summary.append(
            {
                "policy": policy,
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "tau": statistics.mean(r["tau"] for r in rows),
                "verified_per_round": statistics.mean(r["verified_per_round"] for r in rows),
                "draft_ms_per_token": 1000 * sum(r["draft_s"] for r in rows) / tokens,
                "verify_ms_per_token": 1000 * sum(r["verify_s"] for r in rows) / tokens,
            }
        )
    base_rate = next(s["tokens_per_s"] for s in summary if s["policy"] == baseline)
    for row in summary:
        row["speedup"] = row["tokens_per_s"] / base_rate
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch thread(s), torch {torch.__version__}"
    result = {
        "machine": machine,
        "target": str(args.target),
        "drafter": str(drafter_dir),
        "random_drafter": random_drafter,
        "block_size": block,
        "prompts": str(args.prompts),
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "sps": sps.to_dict(),
        "outputs_identical": identical,
        "summary": summary,
        "runs": runs,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    tmp.cleanup()

    print(f"\nmachine: {machine}")
    print(
        f"{len(prompts)} prompts of {args.prompts.name}, {args.max_tokens} tokens each, greedy, block {block}; "
        f"drafter {'random' if random_drafter else drafter_dir}; outputs identical across policies: {identical}"
    )
    print(
        f"{'policy':>15} {'tokens/s':>9} {'speed-up':>9} {'tau':>6} {'verified/round':>15} "
        f"{'draft ms/tok':>13} {'verify ms/tok':>14}"
    )
    for row in summary:
        print(
            f"{row['policy']:>15} {row['tokens_per_s']:9.1f} {row['speedup']:9.2f} {row['tau']:6.2f} "
            f"{row['verified_per_round']:15.2f} {row['draft_ms_per_token']:13.2f} {row['verify_ms_per_token']:14.2f}"
        )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
