"""``dspark`` subcommands that rebuild the demo models: ``train-tokenizer``, ``demo-corpus``,
``train-target``.

Kept beside the code they drive so the CLI module only registers them; heavy imports happen inside the
handlers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import fields
from pathlib import Path


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from verify_service.demo.corpus import collect_sources, corpus_sha256
    from verify_service.demo.tokenizer import save_tokenizer, train_tokenizer

    try:
        sources, skipped = collect_sources(args.stdlib, args.val_fraction)
        train = [s for s in sources if s.split == "train"]
        tokenizer = train_tokenizer((s.text for s in train), args.vocab_size, show_progress=True)
        files = save_tokenizer(tokenizer, args.out)
    except ValueError as exc:
        return _fail(str(exc))
    provenance = {
        "trained_on": "train split of the Python stdlib corpus (see verify_service/demo/corpus.py)",
        "python_version": platform.python_version(),
        "val_fraction": args.val_fraction,
        "train_files": len(train),
        "train_bytes": sum(len(s.text.encode("utf-8")) for s in train),
        "train_sha256": corpus_sha256(train),
        "skipped": skipped,
        "vocab_size": args.vocab_size,
    }
    (Path(args.out) / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    print(f"tokenizer ({args.vocab_size} ids) trained on {len(train)} files -> {[str(f) for f in files]}")
    return 0


def _cmd_demo_corpus(args: argparse.Namespace) -> int:
    from verify_service.demo.corpus import build_corpus

    try:
        manifest = build_corpus(args.out, args.tokenizer, args.stdlib, args.val_fraction)
    except ValueError as exc:
        return _fail(str(exc))
    print(
        f"corpus of Python {manifest.python_version} stdlib: {manifest.num_files} files, "
        f"{manifest.total_bytes} bytes, "
        f"sha256 {manifest.sha256[:16]}...; tokens train {manifest.split_tokens['train']} / "
        f"val {manifest.split_tokens['val']} -> {args.out}"
    )
    return 0


_SHAPE_FLAGS = {
    "hidden_size": "--hidden-size",
    "num_hidden_layers": "--layers",
    "num_attention_heads": "--heads",
    "num_key_value_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "intermediate_size": "--intermediate-size",
    "max_position_embeddings": "--max-position-embeddings",
    "rope_theta": "--rope-theta",
}


def _cmd_train_target(args: argparse.Namespace) -> int:
    from verify_service.demo.config import PretrainConfig, TargetShape
    from verify_service.demo.pretrain import pretrain

    names = {f.name for f in fields(PretrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    for limit in ("max_minutes", "max_epochs"):  # 0 switches a limit off
        values[limit] = values[limit] or None
    cfg = PretrainConfig(**values)
    shape = TargetShape(**{k: getattr(args, k) for k in _SHAPE_FLAGS})
    try:
        pretrain(args.data, args.out, cfg, shape)
    except ValueError as exc:
        return _fail(str(exc))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the demo-model subcommands to the ``dspark`` parser."""
    from verify_service.demo.config import DEFAULT_VAL_FRACTION, PretrainConfig, TargetShape
    from verify_service.demo.tokenizer import DEFAULT_TOKENIZER_DIR, DEFAULT_VOCAB_SIZE

    def corpus_options(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--stdlib", type=Path, default=None, help="stdlib folder (default: this interpreter's)"
        )
        p.add_argument(
            "--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, help="share of files held out"
        )

    p = sub.add_parser("train-tokenizer", help="train the demo byte-level BPE tokenizer on the stdlib corpus")
    p.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_DIR, help="output folder")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="total ids incl. EOS and mask")
    corpus_options(p)
    p.set_defaults(handler=_cmd_train_tokenizer)

    p = sub.add_parser("demo-corpus", help="tokenize the stdlib corpus into train.bin / val.bin + manifest")
    p.add_argument("--out", type=Path, required=True, help="output folder (e.g. .data/demo)")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER_DIR, help="tokenizer folder")
    corpus_options(p)
    p.set_defaults(handler=_cmd_demo_corpus)

    d, s = PretrainConfig(), TargetShape()
    p = sub.add_parser("train-target", help="pre-train the demo Qwen3 target on a corpus folder")
    p.add_argument("--data", type=Path, required=True, help="corpus folder written by `dspark demo-corpus`")
    p.add_argument("--out", type=Path, required=True, help="model output folder")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--max-minutes", type=float, default=d.max_minutes, help="wall-clock budget of the loop (0: none)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="optimizer step limit")
    p.add_argument(
        "--max-epochs",
        type=float,
        default=d.max_epochs,
        help="limit in passes over the train tokens (0: none)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear lr warm-up steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient norm clip")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation passes")
    p.add_argument("--eval-windows", type=int, default=d.eval_windows, help="max validation windows")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of initialisation and data order")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--keep", choices=("best", "last"), default=d.keep, help="weights to save")
    p.add_argument(
        "--no-tokenizer",
        dest="copy_tokenizer",
        action="store_false",
        help="don't copy tokenizer files to --out",
    )
    for name, flag in _SHAPE_FLAGS.items():
        p.add_argument(
            flag, dest=name, type=type(getattr(s, name)), default=getattr(s, name), help="model shape"
        )
    p.set_defaults(handler=_cmd_train_target)
