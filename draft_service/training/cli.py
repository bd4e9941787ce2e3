"""``dspark`` subcommands of drafter training: ``gen-responses``, ``train-drafter``, ``calibrate-drafter``.

Registered by ``cluster/cli.py``; heavy imports happen inside the handlers so ``dspark --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from draft_service.training.recipe import HEADS, DrafterShape, DrafterTrainConfig, ResponseConfig


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _cmd_gen_responses(args: argparse.Namespace) -> int:
    from draft_service.training.responses import generate_responses

    names = {f.name for f in fields(ResponseConfig)}
    cfg = ResponseConfig(**{k: v for k, v in vars(args).items() if k in names})
    try:
        meta = generate_responses(args.target, args.data, args.out, cfg)
    except ValueError as exc:
        return _fail(str(exc))
    splits = ", ".join(f"{k} {v['sequences']} sequences" for k, v in meta["splits"].items())
    print(
        f"responses ({splits}) in {meta['seconds']:.1f}s, {meta['generated_tokens_per_second']} generated "
        f"tokens/s on {meta['device']} -> {args.out}"
    )
    return 0


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from draft_service.training.trainer import train_drafter

    names = {f.name for f in fields(DrafterTrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    for limit in ("max_minutes", "max_epochs"):  # 0 switches a limit off
        values[limit] = values[limit] or None
    shape = DrafterShape(
        head=args.head,
        num_draft_layers=args.draft_layers,
        block_size=args.block_size,
        target_layer_ids=tuple(args.target_layer_ids),
        markov_rank=args.markov_rank,
        mask_token_id=args.mask_token_id,
    )
    try:
        train_drafter(args.target, args.responses, args.out, shape, DrafterTrainConfig(**values))
    except ValueError as exc:
        return _fail(str(exc))
    return 0


def _cmd_calibrate_drafter(args: argparse.Namespace) -> int:
    from draft_service.training.calibration import calibrate_drafter
    from draft_service.training.responses import ResponseSet

    try:
        val = ResponseSet.load(args.responses).val
        prompts = [val.sequence(i)[0].tolist() for i in range(min(args.prompts, len(val)))]
        report = calibrate_drafter(
            args.target,
            args.drafter,
            prompts,
            device=args.device,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
    except ValueError as exc:
        return _fail(str(exc))
    metrics_path = Path(args.drafter) / "metrics.json"
    if metrics_path.is_file():
        metrics = json.loads(metrics_path.read_text())
        metrics["sts"] = report
        metrics_path.write_text(json.dumps(metrics, indent=1) + "\n")
    print(report["report"])
    print(
        f"ECE of prefix survival (held-out half): raw {report['ece_raw']:.4f} -> STS {report['ece_sts']:.4f}"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the drafter-training subcommands to the ``dspark`` parser."""
    r = ResponseConfig()
    p = sub.add_parser(
        "gen-responses", help="regenerate responses to corpus prompts with the target (drafter data)"
    )
    p.add_argument("--target", type=Path, required=True, help="target model folder (HF Qwen3)")
    p.add_argument("--data", type=Path, required=True, help="corpus folder written by `dspark demo-corpus`")
    p.add_argument("--out", type=Path, required=True, help="responses folder to write")
    p.add_argument("--device", default=r.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument("--num-train", type=int, default=r.num_train, help="train-split prompts")
    p.add_argument("--num-val", type=int, default=r.num_val, help="held-out (val-split) prompts")
    p.add_argument(
        "--batch-size", type=int, default=r.batch_size, help="prompts decoded together (train split)"
    )
    p.add_argument(
        "--val-batch-size", type=int, default=r.val_batch_size, help="prompts decoded together (val)"
    )
    p.add_argument("--min-prompt-tokens", type=int, default=r.min_prompt_tokens,
                   help="shortest prompt cut from the corpus")
    p.add_argument("--max-prompt-tokens", type=int, default=r.max_prompt_tokens,
                   help="longest prompt cut from the corpus")
    p.add_argument("--max-new-tokens", type=int, default=r.max_new_tokens, help="response length")
    p.add_argument(
        "--greedy-fraction", type=float, default=r.greedy_fraction, help="share of greedy responses"
    )
    p.add_argument(
        "--temperature", type=float, default=r.temperature, help="temperature of the sampled share"
    )
    p.add_argument("--seed", type=int, default=r.seed, help="seed of prompt choice and sampling")
    p.set_defaults(handler=_cmd_gen_responses)

    d, s = DrafterTrainConfig(), DrafterShape()
    p = sub.add_parser(
        "train-drafter", help="train a DSpark drafter (DeepSpec recipe) on regenerated responses"
    )
    p.add_argument("--target", type=Path, required=True, help="target model folder (HF Qwen3)")
    p.add_argument("--responses", type=Path, required=True, help="folder written by `dspark gen-responses`")
    p.add_argument("--out", type=Path, required=True, help="drafter folder to write (DeepSpec layout)")
    p.add_argument(
        "--head",
        choices=HEADS,
        default=s.head,
        help="vanilla / rnn: DSpark heads; none: DFlash-style baseline",
    )
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--max-minutes", type=float, default=d.max_minutes, help="wall-clock budget of the loop (0: none)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="optimizer step limit")
    p.add_argument("--max-epochs", type=float, default=None, help="limit in passes over the train responses")
    p.add_argument("--draft-layers", type=int, default=s.num_draft_layers, help="transformer layers of the drafter")
    p.add_argument("--block-size", type=int, default=s.block_size, help="draft tokens per block (gamma)")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=list(s.target_layer_ids),
                   help="target layers whose outputs form the context features (never the last)")
    p.add_argument("--markov-rank", type=int, default=s.markov_rank, help="rank of the DSpark head's Markov term")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the last vocabulary id")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="response sequences per step")
    p.add_argument("--num-anchors", type=int, default=d.num_anchors, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear lr warm-up steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient norm clip")
    p.add_argument("--ce-weight", type=float, default=d.ce_weight, help="weight of the cross-entropy loss term")
    p.add_argument("--tv-weight", type=float, default=d.tv_weight, help="weight of the total-variation loss term")
    p.add_argument("--confidence-weight", type=float, default=d.confidence_weight,
                   help="weight of the confidence head's BCE term")
    p.add_argument(
        "--loss-decay", type=float, default=d.loss_decay, help="position weights exp(-(k-1)/decay)"
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out evaluations")
    p.add_argument(
        "--eval-sequences", type=int, default=d.eval_sequences, help="held-out sequences per evaluation"
    )
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of initialisation and data order")
    p.add_argument(
        "--sts-prompts", type=int, default=d.sts_prompts, help="held-out prompts for STS (0: skip)"
    )
    p.add_argument("--sts-max-new-tokens", type=int, default=d.sts_max_new_tokens,
                   help="tokens decoded per STS calibration prompt")
    p.set_defaults(handler=_cmd_train_drafter)

    p = sub.add_parser("calibrate-drafter", help="fit STS for a trained drafter on held-out decoding traces")
    p.add_argument("--target", type=Path, required=True, help="target model folder (HF Qwen3)")
    p.add_argument("--drafter", type=Path, required=True, help="trained drafter folder; its sts.json is written there")
    p.add_argument("--responses", type=Path, required=True, help="its held-out (val) prompts are used")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--prompts", type=int, default=d.sts_prompts, help="held-out prompts decoded")
    p.add_argument("--max-new-tokens", type=int, default=d.sts_max_new_tokens, help="tokens decoded per prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled decoding")
    p.set_defaults(handler=_cmd_calibrate_drafter)
