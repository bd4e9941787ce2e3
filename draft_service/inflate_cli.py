"""``dspark inflate``: embed the demo pair into a real Qwen3 shape for cost-realistic benchmarks.

Only argparse at import time (``dspark --help`` stays fast); torch and the models load inside the handler.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_inflate(args: argparse.Namespace) -> int:
    import torch

    from draft_service.checkpoint import load_draft_model
    from draft_service.inflate import compare_drafts, inflate_pair
    from verify_service.inflate import compare_logits, load_small_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.check_tokens < 16:
        print(f"error: --check-tokens must be >= 16, got {args.check_tokens}", file=sys.stderr)
        return 2
    try:
        pair = inflate_pair(
            args.target,
            args.draft,
            args.shape,
            dtype=args.dtype,
            device=device,
            fill=args.fill,
            seed=args.seed,
            out_dir=args.out,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = pair.info
    target = info["target"]
    print(
        f"target {args.shape}: {target['parameters'] / 1e9:.3f}B parameters, {target['bytes'] / 2**30:.2f} GiB "
        f"{args.dtype} on {device}, {100 * target['zero_fraction']:.1f}% exact zeros, real vocabulary "
        f"{target['real_vocab_size']} of {target['shape']['vocab_size']}"
    )
    if "draft" in info:
        draft = info["draft"]
        print(
            f"draft: {draft['parameters'] / 1e9:.3f}B parameters, {draft['bytes'] / 2**30:.2f} GiB, "
            f"{100 * draft['zero_fraction']:.1f}% exact zeros"
        )
    saved = f", saved to {args.out} in {info['save_s']:.1f} s" if args.out else ""
    print(f"built in {info['build_s']:.1f} s{saved}")
    if args.check:
        generator = torch.Generator().manual_seed(args.seed)
        small_target = load_small_target(args.target)
        ids = torch.randint(0, target["real_vocab_size"], (2, args.check_tokens), generator=generator)
        report = compare_logits(small_target, pair.target, ids)
        if pair.draft is not None:
            report.update(compare_drafts(small_target, load_draft_model(args.draft), pair, ids))
        for key, value in report.items():
            print(f"  {key}: {value:.3g}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inflate",
        help="embed a small target (and drafter) into a larger Qwen3 shape, function-preserving",
        description="See docs/COST_REALISTIC.md for what the inflated models do and do not represent.",
    )
    p.add_argument("--target", required=True, help="small HF Qwen3 target folder")
    p.add_argument("--draft", default=None, help="small DSpark drafter folder (DeepSpec layout); optional")
    p.add_argument(
        "--shape", required=True, help="Qwen3 shape: qwen3-0.6b, qwen3-1.7b, qwen3-4b or qwen3-8b"
    )
    p.add_argument("--out", default=None, help="write OUT/target and OUT/draft (omit: build in memory only)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the written weights")
    p.add_argument("--device", default=None, help="where to build (default: cuda when available, else cpu)")
    p.add_argument(
        "--fill", default="random", choices=["random", "zeros"], help="values of the entries that cannot matter"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --fill random and of the --check inputs")
    p.add_argument("--check", action="store_true", help="compare logits with the small models' and print the diffs")
    p.add_argument("--check-tokens", type=int, default=128, help="sequence length of the --check inputs")
    p.set_defaults(handler=_cmd_inflate)
