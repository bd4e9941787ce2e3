"""Batched generation speed of the demo target, two ways, to pick the engine of ``dspark gen-responses``.

- ``hf-dynamic``: transformers' own forward with its dynamic KV cache on equal-length prompts (no padding,
  last-position logits only); what ``gen-responses`` uses (``draft_service.training.responses.decode_batch``);
- ``slot``: our ``TargetModel.generate`` (slot KV cache, ragged batches, the serving path's attention).

Both decode greedily the same random prompts (``TargetModel.generate`` samples with one torch generator per
row, a Python loop that would measure the sampler rather than the model). Prints generated tokens/s per
engine and writes them as JSON.

GPU:  PYTHONPATH=. python bench/bench_gen_responses.py --device cuda --out /tmp/bench_gen.json
CPU:  PYTHONPATH=. python bench/bench_gen_responses.py --small
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draft_service.training.responses import decode_batch
from scheduler.evaluation.reference_loop import load_target
from verify_service.target import TargetModel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=Path("models/demo/target"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--small", action="store_true", help="8 prompts of 32 tokens, 16 new tokens (CPU check)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.small:
        args.batch, args.prompt_len, args.new_tokens = 8, 32, 16
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = load_target(args.target, dtype=dtype, device=str(device))
    prompts = torch.randint(1, hf.config.vocab_size - 1, (args.batch, args.prompt_len), device=device)
    greedy = torch.ones(args.batch, dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    target = TargetModel(hf)
    cache = target.new_kv_cache(args.batch, args.prompt_len + args.new_tokens)
    rows = prompts.tolist()
    engines = {
        "hf-dynamic": lambda n: decode_batch(hf, prompts, n, greedy, 1.0, generator),
        "slot": lambda n: target.generate(rows, n, cache=cache),
    }
    results = {}
    for name, run in engines.items():
        run(2)  # warm-up (kernels, allocator)
        _sync(device)
        start = time.perf_counter()
        run(args.new_tokens)
        _sync(device)
        seconds = time.perf_counter() - start
        results[name] = {
            "seconds": round(seconds, 3),
            "tokens_per_second": round(args.batch * args.new_tokens / seconds),
        }
        print(f"{name:>10}: {results[name]['tokens_per_second']:>9} generated tokens/s ({seconds:.2f}s)")
    report = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
