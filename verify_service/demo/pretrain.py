"""Pre-training of the demo target: a small transformers Qwen3 causal LM on the stdlib corpus.

A plain PyTorch loop on purpose (no Trainer): the run must fit a hard wall-clock limit (the GPU tool's
10-minute commands), so the loop owns its stopping rule. Training stops at the first of three limits
(wall-clock minutes, optimizer steps, epochs over the train stream) and the cosine learning-rate schedule
follows *progress*, the largest of the three fractions, so the schedule always ends decayed whichever limit
binds. The model is always saved, even when the budget runs out mid-way: by default the weights with the best
validation loss (the corpus is small, so a long run can overfit; the metrics file says which step was kept).

Output folder: ``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16, each weight file < 16
MiB), ``metrics.json`` (settings, provenance, loss history), ``training_curve.png`` and, unless disabled, the
tokenizer files, so ``from_pretrained(folder)`` gives model and tokenizer offline.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from verify_service.demo.config import PretrainConfig, RunSchedule, TargetShape
from verify_service.demo.corpus import DemoCorpus, load_corpus
from verify_service.demo.tokenizer import MODEL_MAX_LENGTH, tokenizer_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel, Qwen3Config

__all__ = [
    "PretrainConfig",
    "TargetShape",
    "evaluate",
    "learning_rate",
    "lm_loss",
    "pretrain",
    "run_progress",
    "target_config",
]

#: Every weight file must come back through the GPU tool (16 MiB per file) and stay small in the repository.
MAX_WEIGHT_FILE_BYTES = 16 * 2**20
METRICS_NAME = "metrics.json"
CURVE_NAME = "training_curve.png"


def target_config(shape: TargetShape, vocab_size: int, eos_token_id: int) -> Qwen3Config:
    """The transformers ``Qwen3Config`` of the target (tied embeddings, EOS doubling as BOS and pad)."""
    from transformers import Qwen3Config

    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


def learning_rate(cfg: RunSchedule, step: int, progress: float) -> float:
    """Linear warmup over ``warmup_steps`` times a cosine from ``lr`` to ``min_lr_ratio * lr`` in progress."""
    warmup = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return cfg.lr * warmup * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def run_progress(
    cfg: RunSchedule, step: int, seconds: float, tokens: int, train_tokens: int
) -> tuple[float, str]:
    """Fraction of the run done and the limit that defines it (the largest fraction wins)."""
    fractions = {}
    if cfg.max_minutes is not None:
        fractions["time"] = seconds / (cfg.max_minutes * 60.0)
    if cfg.max_steps is not None:
        fractions["steps"] = step / cfg.max_steps
    if cfg.max_epochs is not None:
        fractions["epochs"] = tokens / (cfg.max_epochs * train_tokens)
    limit = max(fractions, key=fractions.__getitem__)
    return fractions[limit], limit


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    # bf16 autocast on CUDA (fp32 master weights and optimizer state); plain fp32 on CPU, as everywhere.
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model: Callable[..., Any], windows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-token cross entropy (fp32) of windows [B, L+1]: inputs = first L tokens, labels = last L.
    ``model``: a causal LM, or its ``torch.compile`` wrapper (called like it, returns an output with ``logits``)."""
    with _autocast(device):
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean token loss over fixed windows (all of one length, so batch means average exactly)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], batch_size):
        chunk = windows[start : start + batch_size]
        total += lm_loss(model, chunk, windows.device).item() * chunk.shape[0]
    model.train(was_training)
    return total / windows.shape[0]


def _optimizer(model: torch.nn.Module, cfg: PretrainConfig, device: torch.device) -> torch.optim.Optimizer:
    # Weight decay on matrices only: decaying RMSNorm gains pulls them to 0 for no regularisation benefit.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def _plot(metrics: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    hist, val = metrics["history"], metrics["val_history"]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1))
    ax_loss.plot(hist["tokens"], hist["train_loss"], label="train (mean of logged steps)", lw=1)
    ax_loss.plot(val["tokens"], val["val_loss"], "o-", label="validation", ms=3)
    kept = metrics["result"]["saved_tokens"]
    ax_loss.axvline(kept, color="grey", ls=":", label="saved weights")
    ax_loss.set_yscale("log")  # the first steps fall from ln(vocab) ~ 8; the interesting part is near the end
    ax_loss.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_loss.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax_loss.set_ylabel("cross entropy (nats/token, log scale)")
    train_tokens = metrics["corpus"]["train_tokens"]
    epochs = ax_loss.secondary_xaxis(
        "top", functions=(lambda t: t / train_tokens, lambda e: e * train_tokens)
    )
    epochs.set_xlabel("epochs over the train split")
    fig.suptitle(f"demo target pre-training ({metrics['model']['parameters'] / 1e6:.2f}M params)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.plot(hist["tokens"], hist["lr"], color="tab:green", lw=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("training tokens")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _environment(device: torch.device) -> dict[str, str]:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _save(model: PreTrainedModel, corpus: DemoCorpus, out_dir: Path, cfg: PretrainConfig) -> list[str]:
    from transformers import GenerationConfig

    eos = corpus.manifest.eos_token_id
    # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads (self as the argument).
    model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False, max_length=MODEL_MAX_LENGTH
    )
    model.save_pretrained(str(out_dir), max_shard_size="15MB")
    too_big = [p.name for p in out_dir.glob("*.safetensors") if p.stat().st_size >= MAX_WEIGHT_FILE_BYTES]
    if too_big:
        raise ValueError(f"weight files over 16 MiB: {too_big}")
    if cfg.copy_tokenizer:
        for file in tokenizer_files(corpus.tokenizer_dir):
            shutil.copy2(file, out_dir / file.name)
    return sorted(p.name for p in out_dir.iterdir())


@dataclass
class _Best:
    """The lowest validation loss so far, its step and a copy of the weights then (None before any is below inf)."""

    loss: float = math.inf
    step: int = 0
    state: dict[str, torch.Tensor] | None = None


def pretrain(
    data_dir: Path,
    out_dir: Path,
    cfg: PretrainConfig,
    shape: TargetShape | None = None,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """Train the target on a corpus folder and save it to ``out_dir``; returns the metrics written there."""
    from tqdm.auto import tqdm
    from transformers import Qwen3ForCausalLM

    cfg.validate()
    shape = shape or TargetShape()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(Path(data_dir), device)
    manifest = corpus.manifest
    if cfg.seq_len > shape.max_position_embeddings:
        raise ValueError(
            f"seq_len {cfg.seq_len} exceeds max_position_embeddings {shape.max_position_embeddings}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = Qwen3ForCausalLM(target_config(shape, manifest.vocab_size, manifest.eos_token_id))
    # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads (self as the argument).
    model.to(device)  # type: ignore[arg-type]
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = _optimizer(model, cfg, device)
    forward = torch.compile(model) if cfg.compile else model
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    val_windows = corpus.val.tiled(cfg.seq_len, cfg.eval_windows)
    train_tokens = len(corpus.train)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    history: dict[str, list] = {"step": [], "tokens": [], "train_loss": [], "lr": []}
    val_history: dict[str, list] = {"step": [], "tokens": [], "val_loss": []}
    best = _Best()

    def record_val(step: int) -> float:
        loss = evaluate(model, val_windows, cfg.batch_size)
        val_history["step"].append(step)
        val_history["tokens"].append(step * tokens_per_step)
        val_history["val_loss"].append(loss)
        if loss < best.loss:
            best.loss, best.step = loss, step
            best.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return loss

    initial_val = record_val(0)
    bar = tqdm(total=100, unit="%", disable=not progress_bar, mininterval=5.0, desc="train-target")
    bar.write(f"{n_params / 1e6:.2f}M params, {train_tokens} train tokens, step 0 val loss {initial_val:.4f}")
    step, running, lr = 0, torch.zeros((), device=device), cfg.lr
    start = time.perf_counter()
    while True:
        progress, limit = run_progress(
            cfg, step, time.perf_counter() - start, step * tokens_per_step, train_tokens
        )
        bar.update(max(0, int(100 * min(progress, 1.0)) - bar.n))
        if progress >= 1.0:
            break
        lr = learning_rate(cfg, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = lm_loss(forward, corpus.train.sample(cfg.batch_size, cfg.seq_len, generator), device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        running += loss.detach()
        if step % cfg.log_every == 0:
            mean = (running / cfg.log_every).item()
            running.zero_()
            history["step"].append(step)
            history["tokens"].append(step * tokens_per_step)
            history["train_loss"].append(mean)
            history["lr"].append(lr)
            bar.set_postfix(loss=f"{mean:.3f}", lr=f"{lr:.2e}", step=step, refresh=False)
        if step % cfg.eval_every == 0:
            val = record_val(step)
            bar.write(f"step {step} ({step * tokens_per_step / train_tokens:.2f} epochs) val loss {val:.4f}")
    train_seconds = time.perf_counter() - start
    bar.close()
    final_val = val_history["val_loss"][-1] if val_history["step"][-1] == step else record_val(step)

    saved_step, saved_val = (best.step, best.loss) if cfg.keep == "best" else (step, final_val)
    if cfg.keep == "best":
        if best.state is None:
            raise ValueError("keep='best': no validation loss was below infinity, so no weights were kept")
        model.load_state_dict(best.state)
    files = _save(model, corpus, out_dir, cfg)
    metrics: dict[str, Any] = {
        "model": {"parameters": n_params, "vocab_size": manifest.vocab_size, **asdict(shape)},
        "train_config": asdict(cfg),
        "corpus": {
            "sha256": manifest.sha256,
            "python_version": manifest.python_version,
            "num_files": manifest.num_files,
            "train_tokens": train_tokens,
            "val_tokens": len(corpus.val),
            "val_windows": int(val_windows.shape[0]),
            "tokenizer_sha256": manifest.tokenizer_sha256,
        },
        "result": {
            "steps": step,
            "tokens_seen": step * tokens_per_step,
            "epochs": step * tokens_per_step / train_tokens,
            "stopped_by": limit,
            "train_seconds": round(train_seconds, 2),
            "tokens_per_second": round(step * tokens_per_step / max(train_seconds, 1e-9)),
            "initial_val_loss": initial_val,
            "final_val_loss": final_val,
            "best_val_loss": best.loss,
            "best_step": best.step,
            "saved": cfg.keep,
            "saved_step": saved_step,
            "saved_tokens": saved_step * tokens_per_step,
            "saved_val_loss": saved_val,
            "final_train_loss": history["train_loss"][-1] if history["train_loss"] else None,
        },
        "environment": _environment(device),
        "history": history,
        "val_history": val_history,
        "files": [*files, METRICS_NAME, CURVE_NAME],
    }
    (out_dir / METRICS_NAME).write_text(json.dumps(metrics, indent=1) + "\n")
    _plot(metrics, out_dir / CURVE_NAME)
    print(
        f"saved {cfg.keep} weights (step {saved_step}, val loss {saved_val:.4f}) to {out_dir}; "
        f"{step} steps, {metrics['result']['epochs']:.2f} epochs in {train_seconds:.0f}s, stopped by {limit}"
    )
    return metrics
