"""``dspark eval``: offline evaluation of drafters on prompt files, as the paper reports it.

For every prompt file (``{"turns": [...]}`` per line; the first turn goes through the target tokenizer's chat
template) and every drafter, :class:`scheduler.evaluation.decoder.OfflineSpeculativeDecoder` decodes all prompts with
full-block verification and this module turns the traces into:

- accepted length tau: mean over rounds of (accepted drafts + 1), the bonus/correction token included (paper
  Table 1);
- per-position conditional acceptance P(x_k accepted | x_1..x_{k-1} accepted) (paper Figure 2);
- a static confidence-threshold sweep (paper Figure 5): a round cut at the first k with sigmoid(z_k) < t keeps
  min(accepted, cut) of the SAME round (verification of a prefix decides its tokens exactly as the full block
  does), so acceptance rate of verified tokens and tau follow from the traces for every t at once;
- reliability of the prefix survival prod_{i<=k} c_i before and after the drafter's STS (``sts.json`` in its
  folder) (paper Figure 6), with the pooled ECE.

Written to ``--out``: ``results.md`` (tables), ``results.json`` (all numbers), ``tau.png``,
``acceptance_by_position.png``, ``threshold_sweep.png``, ``reliability_<drafter>.png`` and, with
``--save-traces``, the raw traces ``traces_<drafter>_<dataset>.npz``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the evaluation module imports torch and transformers: only the handler needs them
    from scheduler.evaluation.decoder import DecodeTraces

DEFAULT_THRESHOLDS = tuple(np.round(np.linspace(0.0, 0.95, 20), 2).tolist())


# ---- metrics ---------------------------------------------------------------------------------------------


def accepted_length(accepted: np.ndarray) -> float:
    """tau: mean accepted drafts per round plus the bonus/correction token."""
    return float(np.mean(accepted + 1)) if accepted.size else float("nan")


def conditional_acceptance(accepted: np.ndarray, gamma: int) -> np.ndarray:
    """[gamma]: rounds that accepted >= k drafts over rounds that accepted >= k-1 (NaN where none did)."""
    reached = np.array([(accepted >= k).sum() for k in range(gamma + 1)], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(reached[:-1] > 0, reached[1:] / reached[:-1], np.nan)


def threshold_sweep(
    logits: np.ndarray, accepted: np.ndarray, thresholds: Sequence[float]
) -> dict[str, list[float]]:
    """Cut every round at the first position whose raw confidence sigmoid(z_k) is below t (DeepSpec's static
    threshold); per t: mean verified drafts, acceptance rate of verified drafts, and tau."""
    gamma = logits.shape[1]
    confidence = 0.5 * (1.0 + np.tanh(0.5 * logits))
    out: dict[str, list[float]] = {"threshold": [], "verified": [], "acceptance_rate": [], "tau": []}
    for t in thresholds:
        below = confidence < t
        cut = np.where(below.any(axis=1), below.argmax(axis=1), gamma)
        kept = np.minimum(accepted, cut)
        out["threshold"].append(float(t))
        out["verified"].append(float(cut.mean()))
        out["acceptance_rate"].append(float(kept.sum() / cut.sum()) if cut.sum() else float("nan"))
        out["tau"].append(float((kept + 1).mean()))
    return out


def summarize(traces: DecodeTraces, thresholds: Sequence[float], calibration: Any | None) -> dict[str, Any]:
    """All numbers of one (drafter, dataset) run."""
    from scheduler.sts import prefix_ece

    summary: dict[str, Any] = {
        "prompts": len(traces.outputs),
        "rounds": traces.num_rounds,
        "new_tokens": int(sum(len(o) for o in traces.outputs)),
        "tau": accepted_length(traces.accepted),
        "mean_accepted_drafts": float(traces.accepted.mean()) if traces.num_rounds else float("nan"),
        "conditional_acceptance": conditional_acceptance(traces.accepted, traces.gamma).tolist(),
    }
    if traces.has_confidence and traces.num_rounds:
        summary["threshold_sweep"] = threshold_sweep(traces.confidence_logits, traces.accepted, thresholds)
        cal_traces = traces.calibration_traces()
        per_raw, pooled_raw = prefix_ece(cal_traces, None)
        summary["ece_raw"] = pooled_raw
        summary["ece_raw_per_position"] = per_raw.tolist()
        if calibration is not None:
            per_sts, pooled_sts = prefix_ece(cal_traces, calibration)
            summary["ece_sts"] = pooled_sts
            summary["ece_sts_per_position"] = per_sts.tolist()
    return summary


# ---- prompts ---------------------------------------------------------------------------------------------


def load_prompts(
    path: Path, tokenizer: Any, max_prompts: int, max_tokens: int
) -> tuple[list[list[int]], int]:
    """Token ids of the first turn of every line, through the chat template; prompts longer than max_tokens
    keep their last max_tokens tokens. Returns (prompts, number truncated)."""
    prompts, truncated = [], 0
    lines = Path(path).read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            turn = record["turns"][0]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f'{path}:{number}: expected {{"turns": ["...", ...]}} ({exc})') from None
        if not isinstance(turn, str):
            raise ValueError(f"{path}:{number}: the first turn must be a string")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"{path}:{number}: the prompt is empty after the chat template")
        if len(ids) > max_tokens:
            ids, truncated = ids[-max_tokens:], truncated + 1
        prompts.append(ids)
        if max_prompts and len(prompts) >= max_prompts:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts, truncated


# ---- report ----------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.{digits}f}"


def _markdown(results: dict[str, Any]) -> str:
    drafters, datasets = results["drafters"], results["datasets"]
    runs = results["runs"]
    s = results["settings"]
    lines = [
        "# Offline evaluation",
        "",
        f"Target `{s['target']}`; temperature {s['temperature']}, block {s['block']} (full-block "
        "verification, exact "
        f"speculative sampling), up to {s['max_new_tokens']} new tokens per prompt"
        f"{', stop at EOS' if s['stop_at_eos'] else ''}; {results['environment']['device']}.",
        "",
        f"Command: `{results['command']}`",
        "",
        "## Accepted length tau (bonus token included)",
        "",
        "| drafter | " + " | ".join(datasets) + " | mean |",
        "| --- | " + " | ".join("---:" for _ in datasets) + " | ---: |",
    ]
    means = {}
    for name in drafters:
        taus = [runs[name][d]["tau"] for d in datasets]
        means[name] = float(np.mean(taus))
        lines.append(f"| {name} | " + " | ".join(_fmt(t) for t in taus) + f" | {_fmt(means[name])} |")
    baseline = s.get("baseline")
    if baseline:
        for name in drafters:
            if name == baseline:
                continue
            ratios = [runs[name][d]["tau"] / runs[baseline][d]["tau"] for d in datasets]
            lines.append(
                f"| {name} / {baseline} | "
                + " | ".join(f"{r:.3f}x" for r in ratios)
                + f" | {means[name] / means[baseline]:.3f}x |"
            )
    gamma = s["block"]
    lines += [
        "",
        "## Per-position conditional acceptance P(x_k accepted | x_1..x_{k-1} accepted)",
        "",
        "| drafter | dataset | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in range(gamma)) + " |",
    ]
    for name in drafters:
        for d in datasets:
            row = runs[name][d]["conditional_acceptance"]
            lines.append(f"| {name} | {d} | " + " | ".join(_fmt(v, 3) for v in row) + " |")
    lines += [
        "",
        "## Calibration of prefix survival (pooled ECE over all positions, all rounds)",
        "",
        "| drafter | dataset | ECE raw | ECE after STS |",
        "| --- | --- | ---: | ---: |",
    ]
    for name in drafters:
        for d in datasets:
            run = runs[name][d]
            lines.append(f"| {name} | {d} | {_fmt(run.get('ece_raw'), 4)} | {_fmt(run.get('ece_sts'), 4)} |")
    lines += [
        "",
        "## Static confidence threshold sweep (acceptance rate of verified drafts / tau)",
        "",
        "| threshold | " + " | ".join(f"{n} ({d})" for n in drafters for d in datasets) + " |",
        "| ---: | " + " | ".join("---:" for _ in drafters for _ in datasets) + " |",
    ]
    thresholds = s["thresholds"]
    for i, t in enumerate(thresholds):
        if i % 2:
            continue
        cells = []
        for name in drafters:
            for d in datasets:
                sweep = runs[name][d].get("threshold_sweep")
                cells.append(
                    f"{_fmt(sweep['acceptance_rate'][i], 3)} / {_fmt(sweep['tau'][i])}" if sweep else "n/a"
                )
        lines.append(f"| {t:.2f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Runs",
        "",
        "| drafter | dataset | prompts | rounds | new tokens | seconds |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name in drafters:
        for d in datasets:
            run = runs[name][d]
            lines.append(
                f"| {name} | {d} | {run['prompts']} | {run['rounds']} | {run['new_tokens']} "
                f"| {run['seconds']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _plots(
    results: dict[str, Any], traces: dict[str, dict[str, DecodeTraces]], calibrations: dict, out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scheduler.sts import CalibrationTraces, STSCalibration, reliability_diagram

    drafters, datasets, runs = results["drafters"], results["datasets"], results["runs"]
    gamma = results["settings"]["block"]
    fig, ax = plt.subplots(figsize=(max(5, 2 + 1.5 * len(datasets) * len(drafters) / 2), 4))
    width = 0.8 / len(drafters)
    for j, name in enumerate(drafters):
        taus = [runs[name][d]["tau"] for d in datasets]
        bars = ax.bar(np.arange(len(datasets)) + j * width, taus, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(np.arange(len(datasets)) + 0.4 - width / 2, datasets)
    ax.set(
        ylabel="accepted length tau (bonus included)",
        title=f"tau at T={results['settings']['temperature']}, block {gamma}",
    )
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, d in zip(axes[0], datasets, strict=True):
        for name in drafters:
            ax.plot(range(1, gamma + 1), runs[name][d]["conditional_acceptance"], "o-", label=name)
        ax.set(xlabel="draft position k", ylabel="P(accept x_k | prefix accepted)", ylim=(0, 1), title=d)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=110)
    plt.close(fig)

    fig, (ax_rate, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    styles = ["-", "--", ":", "-."]
    for j, name in enumerate(drafters):
        for i, d in enumerate(datasets):
            sweep = runs[name][d].get("threshold_sweep")
            if sweep is None:
                continue
            style = dict(color=f"C{j}", linestyle=styles[i % len(styles)], marker=".")
            ax_rate.plot(sweep["threshold"], sweep["acceptance_rate"], label=f"{name} ({d})", **style)
            ax_tau.plot(sweep["threshold"], sweep["tau"], label=f"{name} ({d})", **style)
    ax_rate.set(
        xlabel="confidence threshold", ylabel="acceptance rate of verified drafts", title="Threshold sweep"
    )
    ax_tau.set(
        xlabel="confidence threshold",
        ylabel="tau (bonus included)",
        title="Accepted length under the threshold",
    )
    for ax in (ax_rate, ax_tau):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "threshold_sweep.png", dpi=110)
    plt.close(fig)

    for name in drafters:
        runs_of = [t for t in traces[name].values() if t.has_confidence and t.num_rounds]
        if not runs_of:
            continue
        pooled = CalibrationTraces.from_arrays(
            np.concatenate([t.confidence_logits for t in runs_of]),
            np.concatenate([t.accepted for t in runs_of]),
        )
        calibration = calibrations.get(name) or STSCalibration.identity(pooled.gamma)
        reliability_diagram(pooled, calibration, out / f"reliability_{name}.png")


# ---- the command -----------------------------------------------------------------------------------------


def run_eval(
    target_dir: Path,
    drafters: dict[str, Path],
    prompt_files: Sequence[Path],
    out_dir: Path,
    *,
    temperature: float = 1.0,
    block: int | None = None,
    max_new_tokens: int = 256,
    max_prompts: int = 0,
    max_batch: int = 512,
    device: str = "cpu",
    seed: int = 0,
    stop_at_eos: bool = True,
    baseline: str | None = None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    save_traces: bool = False,
    command: str = "",
) -> dict[str, Any]:
    """Evaluate every drafter on every prompt file; writes the report to ``out_dir``, returns its numbers."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from draft_service.checkpoint import load_draft_model
    from scheduler.evaluation.decoder import OfflineSpeculativeDecoder
    from scheduler.sts import STSCalibration
    from verify_service.target import TargetModel

    if not drafters:
        raise ValueError("name at least one drafter (--drafters NAME=DIR)")
    if baseline is not None and baseline not in drafters:
        raise ValueError(f"baseline {baseline!r} is not one of the drafters {sorted(drafters)}")
    names = [Path(p).stem for p in prompt_files]
    if len(set(names)) != len(names):
        raise ValueError(f"prompt files must have distinct names, got {names}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    hf_model = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=dtype, local_files_only=True)
    # transformers wraps PreTrainedModel.to in a decorator whose signature mypy misreads (self as the argument).
    hf_model = hf_model.to(dev)  # type: ignore[arg-type]
    models = {
        name: load_draft_model(path, target_dir=target_dir, dtype=dtype, device=dev)
        for name, path in drafters.items()
    }
    gamma = block or min(m.block_size for m in models.values())
    max_prompt = int(hf_model.config.max_position_embeddings) - max_new_tokens - gamma - 1
    if max_prompt < 1:
        raise ValueError(
            f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the target's context"
        )
    prompts, truncated = {}, {}
    for name, path in zip(names, prompt_files, strict=True):
        prompts[name], truncated[name] = load_prompts(Path(path), tokenizer, max_prompts, max_prompt)
    calibrations = {
        name: STSCalibration.load(Path(path) / "sts.json") if (Path(path) / "sts.json").is_file() else None
        for name, path in drafters.items()
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    all_traces: dict[str, dict[str, DecodeTraces]] = {}
    for name, draft in models.items():
        target = TargetModel(hf_model, draft.config.target_layer_ids)
        stops = target.eos_token_ids if stop_at_eos else ()
        runs[name], all_traces[name] = {}, {}
        calibration = calibrations[name]
        if calibration is not None and calibration.gamma < gamma:
            raise ValueError(
                f"{drafters[name]}/sts.json has {calibration.gamma} temperatures, fewer than block {gamma}"
            )
        if calibration is not None:
            calibration = STSCalibration(calibration.temperatures[:gamma])
        for dataset, ids in prompts.items():
            decoder = OfflineSpeculativeDecoder(
                target,
                draft,
                temperature=temperature,
                block=gamma,
                max_batch=max_batch,
                stop_token_ids=stops,
                seed=seed,
            )
            start = time.perf_counter()
            traces = decoder.run(ids, max_new_tokens, progress=True)
            seconds = time.perf_counter() - start
            summary = summarize(traces, thresholds, calibration)
            summary.update(seconds=round(seconds, 2), truncated_prompts=truncated[dataset])
            runs[name][dataset] = summary
            all_traces[name][dataset] = traces
            if save_traces:
                traces.save(str(out_dir / f"traces_{name}_{dataset}.npz"))
            print(
                f"{name} on {dataset}: tau {summary['tau']:.3f} over {summary['rounds']} rounds "
                f"({summary['prompts']} prompts, {seconds:.1f}s)",
                file=sys.stderr,
            )
    results = {
        "command": command,
        "drafters": list(drafters),
        "datasets": names,
        "settings": {
            "target": str(target_dir),
            "drafter_dirs": {k: str(v) for k, v in drafters.items()},
            "prompt_files": [str(p) for p in prompt_files],
            "temperature": temperature,
            "block": gamma,
            "max_new_tokens": max_new_tokens,
            "max_prompts": max_prompts,
            "stop_at_eos": stop_at_eos,
            "seed": seed,
            "baseline": baseline,
            "thresholds": list(thresholds),
            "sts": {k: (v.temperatures.tolist() if v is not None else None) for k, v in calibrations.items()},
        },
        "environment": {
            "device": torch.cuda.get_device_name(dev)
            if dev.type == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
        },
        "runs": runs,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "results.md").write_text(_markdown(results))
    _plots(results, all_traces, calibrations, out_dir)
    return results


def _parse_drafters(values: Sequence[str]) -> dict[str, Path]:
    drafters: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--drafters takes NAME=DIR entries, got {value!r}")
        if name in drafters:
            raise ValueError(f"drafter name {name!r} given twice")
        drafters[name] = Path(path)
    return drafters


def _command_line(args: argparse.Namespace) -> str:
    """The command as it ran (every setting spelled out), for the report."""
    parts = [
        f"dspark eval --target {args.target} --drafters {' '.join(args.drafters)}",
        f"--prompts {' '.join(str(p) for p in args.prompts)} --temperature {args.temperature}",
        f"--max-new-tokens {args.max_new_tokens} --device {args.device} --seed {args.seed} --out {args.out}",
    ]
    if args.block is not None:
        parts.append(f"--block {args.block}")
    if args.max_prompts:
        parts.append(f"--max-prompts {args.max_prompts}")
    if args.baseline:
        parts.append(f"--baseline {args.baseline}")
    if args.ignore_eos:
        parts.append("--ignore-eos")
    return " ".join(parts)


def _cmd_eval(args: argparse.Namespace) -> int:
    try:
        drafters = _parse_drafters(args.drafters)
        run_eval(
            args.target,
            drafters,
            args.prompts,
            args.out,
            temperature=args.temperature,
            block=args.block,
            max_new_tokens=args.max_new_tokens,
            max_prompts=args.max_prompts,
            max_batch=args.max_batch,
            device=args.device,
            seed=args.seed,
            stop_at_eos=not args.ignore_eos,
            baseline=args.baseline,
            save_traces=args.save_traces,
            command=_command_line(args),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "results.md").read_text())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``eval`` to the ``dspark`` parser."""
    p = sub.add_parser(
        "eval", help="offline tau, acceptance by position, threshold sweep and STS reliability"
    )
    p.add_argument("--target", type=Path, required=True, help="target model folder (HF Qwen3 + tokenizer)")
    p.add_argument(
        "--drafters", nargs="+", required=True, metavar="NAME=DIR", help="drafter folders to compare"
    )
    p.add_argument("--prompts", type=Path, nargs="+", required=True, help='JSONL files of {"turns": [...]}')
    p.add_argument("--out", type=Path, required=True, help="report folder (results.md, results.json, PNGs)")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="0 = greedy; > 0 = exact speculative sampling"
    )
    p.add_argument(
        "--block", type=int, default=None, help="draft tokens verified per round (default: block size)"
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens decoded per prompt")
    p.add_argument("--max-prompts", type=int, default=0, help="first N prompts of each file (0: all)")
    p.add_argument("--max-batch", type=int, default=512, help="prompts decoded together")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled decoding (temperature > 0)")
    p.add_argument("--ignore-eos", action="store_true", help="decode max-new-tokens even past EOS")
    p.add_argument("--baseline", default=None, help="drafter name the others' tau is divided by")
    p.add_argument("--save-traces", action="store_true", help="also write every run's raw traces (.npz)")
    p.set_defaults(handler=_cmd_eval)
