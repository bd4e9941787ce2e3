"""The drafter training loop (DeepSpec recipe), bounded by wall-clock time like the target's pre-training.

A step: B response sequences are run through the frozen target once (context features + final hidden states),
A anchors per sequence are drawn uniformly among the response positions (an anchor is a token the target
produced; its block predicts the next bs tokens, all inside the response), the drafter runs all A blocks of a
sequence in one pass (:mod:`.forward`), its Markov / RNN bias is teacher-forced along the target's tokens, and
the DSpark loss (:mod:`.loss`) is minimised with AdamW under a warmup + cosine schedule that follows run
progress. The embedding and LM head are copies of the target's and stay frozen.

Output folder (every file < 16 MiB): ``config.json`` + ``model.safetensors`` (DeepSpec layout, bf16),
``metrics.json`` (settings, loss history, held-out statistics, STS report), ``training_curve.png``, and after
STS calibration ``sts.json`` + ``sts_reliability.png``. The model is always saved, also when the time budget
runs out or the run is interrupted.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from draft_service.checkpoint import load_draft_model, save_draft_model
from draft_service.config import DraftConfig
from draft_service.model import DSparkDraftModel
from draft_service.training.forward import multi_block_hidden
from draft_service.training.loss import LossOutput, LossWeights, dspark_loss
from draft_service.training.recipe import DrafterShape, DrafterTrainConfig, draft_config_dict
from draft_service.training.responses import ResponseSet, ResponseSplit
from draft_service.training.teacher import Teacher

MAX_WEIGHT_FILE_BYTES = 16 * 2**20
METRICS_NAME = "metrics.json"
CURVE_NAME = "training_curve.png"


def init_drafter(model: DSparkDraftModel, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """HF-style init (normal 0.02, zero biases, unit norms), the Markov output map at zero (the drafter starts
    as its parallel backbone alone and learns the bias from there), and frozen copies of the target's
    embedding and LM head."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
                bias = getattr(module, "bias", None)  # Linear's may be None; Embedding has none
                if bias is not None:
                    bias.zero_()
        if model.markov_head is not None:
            model.markov_head.markov_w2.weight.zero_()
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)


def sample_anchors(
    prompt_lengths: torch.Tensor,
    lengths: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """Anchors [B, A] uniform in [prompt_length, length - block_size - 1]: each anchor is a response token and
    its block's bs targets (positions p+1..p+bs) lie inside the response."""
    span = (lengths - block_size - prompt_lengths).clamp(min=1)
    u = torch.rand(prompt_lengths.shape[0], num_anchors, generator=generator, device=prompt_lengths.device)
    return prompt_lengths[:, None] + (u * span[:, None]).long()


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def block_loss(
    model: DSparkDraftModel,
    teacher: Teacher,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    weights: LossWeights,
) -> LossOutput:
    """The loss of B sequences ids [B, S] with anchors [B, A] (see the module docstring)."""
    B, A = anchors.shape
    bs = model.block_size
    features, final_hidden = teacher.features(ids)
    rows = anchors[:, :, None] + torch.arange(bs, device=ids.device)  # positions of [anchor, x_1..x_{bs-1}]
    batch_index = torch.arange(B, device=ids.device)[:, None, None]
    prev_ids = ids[batch_index, rows].reshape(B * A, bs)
    labels = ids[batch_index, rows + 1].reshape(B * A, bs)
    target_logits = teacher.logits(final_hidden[batch_index, rows]).reshape(B * A, bs, -1)
    with _autocast(ids.device):
        hidden = multi_block_hidden(model, features, anchors, ids.gather(1, anchors)).reshape(B * A, bs, -1)
        base = model.base_logits(hidden)
        draft_logits = model.markov_logits(base, prev_ids, hidden)
        confidence = model.confidence_logits(hidden, prev_ids)
    return dspark_loss(draft_logits.float(), target_logits, labels, confidence, weights)


def _usable(split: ResponseSplit, block_size: int, name: str) -> torch.Tensor:
    keep = torch.from_numpy(split.index[:, 2] > block_size).nonzero().squeeze(-1)
    if keep.numel() == 0:
        raise ValueError(f"no {name} response is longer than the block size {block_size}")
    return keep


class _Batches:
    """Response sequences of one split on the device, padded, with their prompt and total lengths."""

    def __init__(self, split: ResponseSplit, keep: torch.Tensor, pad_id: int, device: torch.device) -> None:
        self.ids = split.padded(pad_id, device)[keep.to(device)]
        self.prompt_lengths = torch.from_numpy(split.prompt_lengths).to(device)[keep.to(device)]
        self.lengths = torch.from_numpy(split.lengths).to(device)[keep.to(device)]

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lengths = self.lengths[index]
        return self.ids[index, : int(lengths.max())], self.prompt_lengths[index], lengths


@torch.no_grad()
def evaluate(
    model: DSparkDraftModel,
    teacher: Teacher,
    val: _Batches,
    anchors: torch.Tensor,
    batch_size: int,
    weights: LossWeights,
) -> dict[str, Any]:
    """Held-out loss terms, per-position teacher-forced acceptance and tau proxy on fixed anchors."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    acceptance = torch.zeros(model.block_size, device=anchors.device)
    n = len(val)
    for first in range(0, n, batch_size):
        index = torch.arange(first, min(first + batch_size, n), device=anchors.device)
        ids, _, _ = val.take(index)
        out = block_loss(model, teacher, ids, anchors[index], weights)
        share = len(index) / n
        for key in ("loss", "ce", "tv", "bce", "tau_proxy", "confidence_error"):
            sums[key] = sums.get(key, 0.0) + float(getattr(out, key)) * share
        acceptance += out.acceptance * share
    model.train(was_training)
    return {**sums, "acceptance": acceptance.tolist()}


def _optimizer(
    model: DSparkDraftModel, cfg: DrafterTrainConfig, device: torch.device
) -> torch.optim.Optimizer:
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

    hist, val = metrics["history"], metrics["val_history"]
    fig, (ax_loss, ax_tau, ax_pos) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot(hist["step"], hist["loss"], lw=1, label="train")
    ax_loss.plot(val["step"], val["loss"], "o-", ms=3, label="held-out")
    ax_loss.plot(val["step"], val["tv"], "s--", ms=3, label="held-out TV")
    ax_loss.set(xlabel="step", ylabel="loss", title="DSpark loss (0.1 CE + 0.9 TV + 1.0 BCE)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_tau.plot(hist["step"], hist["tau_proxy"], lw=1, label="train")
    ax_tau.plot(val["step"], val["tau_proxy"], "o-", ms=3, label="held-out")
    ax_tau.set(
        xlabel="step",
        ylabel="1 + sum_k prod_{i<=k} (1 - TV_i)",
        title="acceptance proxy (teacher-forced tau)",
    )
    ax_tau.grid(alpha=0.3)
    ax_tau.legend()
    final = val["acceptance"][-1]
    ax_pos.bar(range(1, len(final) + 1), final)
    ax_pos.set(
        xlabel="block position k",
        ylabel="1 - TV(p_d, p_t)",
        ylim=(0, 1),
        title="held-out acceptance per position",
    )
    ax_pos.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"drafter '{metrics['shape']['head']}' "
        f"({metrics['model']['trainable_parameters'] / 1e6:.2f}M trained params)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _environment(device: torch.device) -> dict[str, str]:
    import platform

    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__}


def train_drafter(
    target_dir: str | Path,
    responses_dir: str | Path,
    out_dir: str | Path,
    shape: DrafterShape,
    cfg: DrafterTrainConfig,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """Train one drafter and save it (plus metrics, curve and, if enabled, STS) to ``out_dir``."""
    from tqdm.auto import tqdm

    from draft_service.checkpoint import read_target_embeddings
    from scheduler.evaluation.reference_loop import load_target
    from verify_service.demo.pretrain import learning_rate, run_progress

    cfg.validate()
    shape.validate()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    torch.manual_seed(cfg.seed)
    responses = ResponseSet.load(responses_dir)
    target_config, embed, lm_head = read_target_embeddings(target_dir)
    if responses.meta["vocab_size"] != target_config["vocab_size"]:
        raise ValueError(
            f"responses use {responses.meta['vocab_size']} ids, the target {target_config['vocab_size']}"
        )
    if len(responses.val) == 0:
        raise ValueError(f"{responses_dir} has no held-out (val) responses: generate some with --num-val")
    config = DraftConfig.from_dict(draft_config_dict(target_config, shape, cfg), source="train-drafter")
    model = DSparkDraftModel(config)
    init_drafter(model, embed.float(), lm_head.float())
    model.to(device).train()
    target_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = Teacher(
        load_target(target_dir, dtype=target_dtype, device=str(device)), config.target_layer_ids
    )

    bs, pad = config.block_size, int(responses.meta["eos_token_id"])
    train = _Batches(responses.train, _usable(responses.train, bs, "train"), pad, device)
    val_keep = _usable(responses.val, bs, "held-out")[: cfg.eval_sequences]
    val = _Batches(responses.val, val_keep, pad, device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    val_anchors = sample_anchors(
        val.prompt_lengths,
        val.lengths,
        cfg.num_anchors,
        bs,
        torch.Generator(device=device).manual_seed(cfg.seed + 1),
    )
    weights = LossWeights(cfg.ce_weight, cfg.tv_weight, cfg.confidence_weight, cfg.loss_decay)
    optimizer = _optimizer(model, cfg, device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    history: dict[str, list] = {
        k: [] for k in ("step", "sequences", "loss", "ce", "tv", "bce", "tau_proxy", "lr")
    }
    val_history: dict[str, list] = {
        k: [] for k in ("step", "loss", "ce", "tv", "bce", "tau_proxy", "confidence_error", "acceptance")
    }

    def record_val(step: int) -> dict[str, Any]:
        stats = evaluate(model, teacher, val, val_anchors, cfg.batch_size, weights)
        val_history["step"].append(step)
        for key in list(val_history)[1:]:
            val_history[key].append(stats[key])
        return stats

    initial = record_val(0)
    bar = tqdm(
        total=100, unit="%", disable=not progress_bar, mininterval=5.0, desc=f"train-drafter[{shape.head}]"
    )
    bar.write(
        f"{trainable / 1e6:.2f}M trainable params, {len(train)} train sequences, step 0 held-out loss "
        f"{initial['loss']:.4f}, tau proxy {initial['tau_proxy']:.3f}"
    )
    step, lr, limit = 0, cfg.lr, "steps"
    running = {k: torch.zeros((), device=device) for k in ("loss", "ce", "tv", "bce", "tau_proxy")}
    start = time.perf_counter()
    try:
        while True:
            progress, limit = run_progress(
                cfg, step, time.perf_counter() - start, step * cfg.batch_size, len(train)
            )
            bar.update(max(0, int(100 * min(progress, 1.0)) - bar.n))
            if progress >= 1.0:
                break
            lr = learning_rate(cfg, step, progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            index = torch.randint(0, len(train), (cfg.batch_size,), generator=generator, device=device)
            ids, prompt_lengths, lengths = train.take(index)
            anchors = sample_anchors(prompt_lengths, lengths, cfg.num_anchors, bs, generator)
            losses = block_loss(model, teacher, ids, anchors, weights)
            optimizer.zero_grad(set_to_none=True)
            losses.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            step += 1
            for key, value in running.items():
                value += getattr(losses, key).detach()
            if step % cfg.log_every == 0:
                means = {k: (v / cfg.log_every).item() for k, v in running.items()}
                for v in running.values():
                    v.zero_()
                history["step"].append(step)
                history["sequences"].append(step * cfg.batch_size)
                history["lr"].append(lr)
                for key, mean in means.items():
                    history[key].append(mean)
                bar.set_postfix(
                    loss=f"{means['loss']:.3f}", tau=f"{means['tau_proxy']:.2f}", step=step, refresh=False
                )
            if step % cfg.eval_every == 0:
                stats = record_val(step)
                bar.write(
                    f"step {step}: held-out loss {stats['loss']:.4f}, tau proxy {stats['tau_proxy']:.3f}"
                )
    except KeyboardInterrupt:
        limit = "interrupted"
    train_seconds = time.perf_counter() - start
    bar.close()
    final = (
        record_val(step) if val_history["step"][-1] != step else {k: v[-1] for k, v in val_history.items()}
    )

    out = Path(out_dir)
    save_draft_model(model, out, dtype=torch.bfloat16)
    too_big = [p.name for p in out.glob("*.safetensors") if p.stat().st_size >= MAX_WEIGHT_FILE_BYTES]
    if too_big:
        raise ValueError(f"weight files over 16 MiB: {too_big}")
    load_draft_model(out, target_dir=target_dir)  # the folder must load against its target as shipped

    metrics: dict[str, Any] = {
        "shape": {**asdict(shape), "target_layer_ids": list(shape.target_layer_ids)},
        "train_config": asdict(cfg),
        "model": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters": trainable,
            "block_size": bs,
            "draft_layers": config.num_draft_layers,
        },
        "data": {
            "responses": str(responses_dir),
            "train_sequences": len(train),
            "val_sequences": len(val),
            "corpus_sha256": responses.meta.get("corpus_sha256"),
        },
        "result": {
            "steps": step,
            "sequences_seen": step * cfg.batch_size,
            "blocks_seen": step * cfg.batch_size * cfg.num_anchors,
            "epochs": step * cfg.batch_size / len(train),
            "stopped_by": limit,
            "train_seconds": round(train_seconds, 2),
            "steps_per_second": round(step / max(train_seconds, 1e-9), 3),
            "initial_val_loss": initial["loss"],
            "final_val_loss": final["loss"],
            "final_val_tau_proxy": final["tau_proxy"],
            "final_val_acceptance": final["acceptance"],
            "final_train_loss": history["loss"][-1] if history["loss"] else None,
        },
        "environment": _environment(device),
        "history": history,
        "val_history": val_history,
    }
    if cfg.sts_prompts > 0:
        from draft_service.training.calibration import calibrate_drafter

        prompts = [
            responses.val.sequence(i)[0].tolist() for i in range(min(cfg.sts_prompts, len(responses.val)))
        ]
        metrics["sts"] = calibrate_drafter(
            target_dir, out, prompts, device=cfg.device, max_new_tokens=cfg.sts_max_new_tokens, seed=cfg.seed
        )
        bar.write(f"STS ({metrics['sts']['rounds_held_out']} held-out rounds):\n{metrics['sts']['report']}")
    (out / METRICS_NAME).write_text(json.dumps(metrics, indent=1) + "\n")
    _plot(metrics, out / CURVE_NAME)
    print(
        f"saved drafter '{shape.head}' to {out}: {step} steps in {train_seconds:.0f}s (stopped by {limit}), "
        f"held-out loss {initial['loss']:.4f} -> {final['loss']:.4f}, tau proxy {final['tau_proxy']:.3f}"
        + (
            f", STS ECE {metrics['sts']['ece_raw']:.4f} -> {metrics['sts']['ece_sts']:.4f}"
            if "sts" in metrics
            else ""
        )
    )
    return metrics
