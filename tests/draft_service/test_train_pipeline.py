"""The drafter pipeline on CPU, tiny: gen-responses -> train-drafter (3 heads, STS) -> reload -> dspark eval.

The same commands with the default (H200) settings build the shipped drafters (models/build_drafters.sh).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from draft_service.checkpoint import load_draft_model
from scheduler.sts import STSCalibration
from verify_service.demo.config import PretrainConfig, TargetShape
from verify_service.demo.corpus import build_corpus
from verify_service.demo.pretrain import pretrain

FILES = [
    "abc.py",
    "bisect.py",
    "colorsys.py",
    "fnmatch.py",
    "heapq.py",
    "keyword.py",
    "json/decoder.py",
    "shlex.py",
]
TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "demo" / "tokenizer"
TINY_TARGET = TargetShape(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=256,
)
TRAIN_FLAGS = [
    "--draft-layers", "1", "--target-layer-ids", "0", "2", "--markov-rank", "16", "--batch-size", "8",
    "--num-anchors", "8", "--warmup-steps", "2", "--lr", "3e-3", "--eval-sequences", "6", "--log-every", "5",
]  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    corpus, target, responses = root / "corpus", root / "target", root / "responses"
    build_corpus(corpus, TOKENIZER, val_fraction=0.25, select=FILES)
    cfg = PretrainConfig(
        batch_size=8,
        seq_len=32,
        lr=1e-2,
        warmup_steps=3,
        max_steps=30,
        eval_every=30,
        eval_windows=8,
        log_every=10,
    )
    pretrain(corpus, target, cfg, TINY_TARGET, progress_bar=False)
    assert main([
        "gen-responses", "--target", str(target), "--data", str(corpus), "--out", str(responses),
        "--num-train", "24", "--num-val", "6", "--batch-size", "8", "--val-batch-size", "3",
        "--min-prompt-tokens", "8", "--max-prompt-tokens", "24", "--max-new-tokens", "24",
    ]) == 0  # fmt: skip
    drafters = {}
    for head, steps, sts in (("vanilla", 40, "6"), ("rnn", 3, "0"), ("none", 3, "0")):
        drafters[head] = root / f"draft_{head}"
        assert main([
            "train-drafter", "--target", str(target), "--responses", str(responses),
            "--out", str(drafters[head]),
            "--head", head, "--max-steps", str(steps), "--eval-every", "20", "--sts-prompts", sts,
            "--sts-max-new-tokens", "16", *TRAIN_FLAGS,
        ]) == 0  # fmt: skip
    return {"root": root, "target": target, "responses": responses, **drafters}


def test_responses_hold_prompts_and_target_continuations(built: dict[str, Path]) -> None:
    from draft_service.training.responses import ResponseSet

    data = ResponseSet.load(built["responses"])
    assert len(data.train) == 24 and len(data.val) == 6
    assert set(data.train.index[:, 2].tolist()) == {24}
    assert data.train.prompt_lengths.min() >= 8 and data.train.prompt_lengths.max() <= 24
    assert data.meta["splits"]["train"]["response_tokens"] == 24 * 24


def test_drafter_learns_saves_and_reloads(built: dict[str, Path]) -> None:
    folder = built["vanilla"]
    metrics = json.loads((folder / "metrics.json").read_text())
    result, val = metrics["result"], metrics["val_history"]
    assert result["steps"] == 40 and result["stopped_by"] == "steps" and val["step"] == [0, 20, 40]
    assert result["final_val_loss"] < result["initial_val_loss"] - 0.3
    assert val["tau_proxy"][-1] > val["tau_proxy"][0]
    assert metrics["history"]["loss"][-1] < metrics["history"]["loss"][0]
    for file in ("config.json", "model.safetensors", "metrics.json", "training_curve.png", "sts.json"):
        assert (folder / file).is_file() and (folder / file).stat().st_size < 16 * 2**20
    draft = load_draft_model(folder, target_dir=built["target"])
    assert draft.config.markov_head_type == "vanilla" and draft.config.block_size == 7
    assert draft.config.target_layer_ids == (0, 2) and draft.config.mask_token_id == 4095
    sts = STSCalibration.load(folder / "sts.json")
    assert sts.gamma == 7 and metrics["sts"]["rounds_held_out"] > 0


def test_every_head_kind_trains_and_reloads(built: dict[str, Path]) -> None:
    for head, kind in (("rnn", "rnn"), ("none", None)):
        draft = load_draft_model(built[head], target_dir=built["target"])
        assert draft.config.markov_head_type == kind and draft.confidence_head is not None
        assert draft.config.confidence_head_with_markov == (kind is not None)
        assert not (built[head] / "sts.json").exists()


def test_eval_command_reports_every_drafter(built: dict[str, Path], tmp_path: Path) -> None:
    prompts = tmp_path / "code.jsonl"
    prompts.write_text(
        json.dumps({"turns": ["def bisect(a, x):\n    "]})
        + "\n"
        + json.dumps({"turns": ["import heapq\n"]})
        + "\n"
    )
    out = tmp_path / "eval"
    assert main([
        "eval", "--target", str(built["target"]), "--drafters", f"dspark={built['vanilla']}",
        f"dflash={built['none']}", "--baseline", "dflash", "--prompts", str(prompts),
        "--max-new-tokens", "16",
        "--out", str(out),
    ]) == 0  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    for name in ("dspark", "dflash"):
        run = results["runs"][name]["code"]
        assert run["prompts"] == 2 and run["rounds"] >= 2 and 1.0 <= run["tau"] <= 8.0
        assert len(run["conditional_acceptance"]) == 7 and len(run["threshold_sweep"]["tau"]) > 1
    assert (
        "ece_sts" in results["runs"]["dspark"]["code"] and "ece_sts" not in results["runs"]["dflash"]["code"]
    )
    for png in ("tau.png", "acceptance_by_position.png", "threshold_sweep.png", "reliability_dspark.png"):
        assert (out / png).stat().st_size > 0
    assert "dspark / dflash" in (out / "results.md").read_text()
    assert results["command"].startswith(f"dspark eval --target {built['target']} --drafters dspark=")


def test_bad_inputs_are_clear_errors(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["train-drafter", "--target", str(built["target"]), "--responses", str(tmp_path), "--out",
                 str(tmp_path / "d"), "--max-steps", "1"]) == 2  # fmt: skip
    assert "gen-responses" in capsys.readouterr().err
    assert main(["eval", "--target", str(built["target"]), "--drafters", "nonsense", "--prompts", "x.jsonl",
                 "--out", str(tmp_path)]) == 2  # fmt: skip
    assert "NAME=DIR" in capsys.readouterr().err
