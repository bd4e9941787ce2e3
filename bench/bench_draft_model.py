"""Latency of one drafting round of the DSpark draft model: batched backbone pass + sequential head.

Random weights in the shape of DeepSpec's Qwen3-4B drafter (5 draft layers, block 7, Markov rank 256,
target_layer_ids [1, 9, 17, 25, 33]) unless ``--small``. For each batch size R, every request gets a context
of ``--context`` rows in the slot cache; then ``draft_block`` and ``sample_block`` (greedy; T = 1 dense;
T = 1 sparse top-K) are timed separately (median over ``--iters`` after warm-up).

GPU:  python bench/bench_draft_model.py --device cuda --dtype bfloat16 --batch-sizes 1 8 32 128
CPU:  python bench/bench_draft_model.py --small --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from draft_service.config import DraftConfig
from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import sample_block

QWEN3_4B_DRAFT = dict(
    vocab_size=151936,
    hidden_size=2560,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9728,
    num_hidden_layers=5,
    num_target_layers=36,
    target_layer_ids=[1, 9, 17, 25, 33],
    mask_token_id=151669,
    markov_rank=256,
)
SMALL_DRAFT = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    num_hidden_layers=2,
    num_target_layers=4,
    target_layer_ids=[0, 2],
    mask_token_id=511,
    markov_rank=32,
)


def build_config(small: bool, block_size: int) -> DraftConfig:
    shape = SMALL_DRAFT if small else QWEN3_4B_DRAFT
    return DraftConfig.from_dict(
        {
            **shape,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            "block_size": block_size,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        },
        source="bench",
    )


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median wall time of fn in milliseconds (synchronising the device around each call)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_batch(model: DSparkDraftModel, R: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One batch size: context prefill into the slot cache, then the timed pieces of a drafting round."""
    config = model.config
    cache = model.new_context_cache(num_slots=R, max_seq_len=args.context + 1)
    slots = [cache.allocate() for _ in range(R)]
    features = torch.randn(R * args.context, config.context_feature_size, device=device, dtype=model.dtype)
    cu = torch.arange(R + 1) * args.context

    def prefill() -> None:
        cache.lengths.zero_()
        model.append_context(cache, slots, features, cu)

    prefill_ms = timed(prefill, max(2, args.iters // 4), device)
    anchors = torch.randint(0, config.vocab_size, (R,), device=device)
    positions = torch.full((R,), args.context)
    hidden = model.draft_block(anchors, positions, slots, cache)
    u = torch.rand(R, config.block_size, device=device)
    return {
        "R": R,
        "context": args.context,
        "device": str(device),
        "dtype": args.dtype,
        "shape": "small" if args.small else "qwen3-4b-dspark",
        "append_context_ms": prefill_ms,
        "draft_block_ms": timed(
            lambda: model.draft_block(anchors, positions, slots, cache), args.iters, device
        ),
        "sample_greedy_ms": timed(lambda: sample_block(model, hidden, anchors), args.iters, device),
        "sample_t1_dense_ms": timed(
            lambda: sample_block(model, hidden, anchors, temperature=1.0, uniforms=u), args.iters, device
        ),
        "sample_t1_topk_ms": timed(
            lambda: sample_block(model, hidden, anchors, temperature=1.0, uniforms=u, draft_top_k=args.top_k),
            args.iters,
            device,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=1024, help="context rows per request")
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument("--top-k", type=int, default=64, help="K of the sparse draft distribution")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = DSparkDraftModel(build_config(args.small, args.block_size)).to(dtype).eval()
    results = [bench_batch(model, R, args, device) for R in tqdm(args.batch_sizes, desc="batch sizes")]
    header = list(results[0])
    print(" | ".join(header))
    for row in results:
        print(" | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in header))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
