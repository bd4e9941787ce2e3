"""Target pre-training on CPU: a tiny config learns, saves bf16, reloads offline and generates greedily."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from cluster.cli import main
from verify_service.demo.config import PretrainConfig, TargetShape
from verify_service.demo.corpus import build_corpus, collect_sources
from verify_service.demo.pretrain import learning_rate, pretrain, run_progress
from verify_service.demo.tokenizer import save_tokenizer, train_tokenizer

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
TINY = TargetShape(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sources, _ = collect_sources(select=FILES)
    tokenizer_dir = tmp_path_factory.mktemp("tok")
    save_tokenizer(
        train_tokenizer([s.text for s in sources if s.split == "train"], vocab_size=320), tokenizer_dir
    )
    folder = tmp_path_factory.mktemp("corpus")
    build_corpus(folder, tokenizer_dir, val_fraction=0.2, select=FILES)
    return folder


@pytest.fixture(scope="module")
def trained(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("target")
    cfg = PretrainConfig(
        device="cpu",
        batch_size=8,
        seq_len=32,
        lr=1e-2,
        warmup_steps=3,
        max_steps=40,
        max_minutes=5.0,
        eval_every=20,
        eval_windows=16,
        log_every=5,
    )
    return out, pretrain(corpus_dir, out, cfg, TINY, progress_bar=False)


def test_tiny_target_learns(trained: tuple[Path, dict]) -> None:
    _, metrics = trained
    result, hist = metrics["result"], metrics["history"]
    assert result["steps"] == 40 and result["stopped_by"] == "steps"
    assert metrics["val_history"]["step"] == [0, 20, 40]
    assert result["final_val_loss"] < result["initial_val_loss"] - 1.0
    assert result["initial_val_loss"] == pytest.approx(math.log(320), abs=0.3)  # untrained: near uniform
    assert hist["train_loss"][-1] < hist["train_loss"][0] - 1.0
    assert result["saved_val_loss"] == result["best_val_loss"] == min(metrics["val_history"]["val_loss"])
    assert hist["lr"][-1] == pytest.approx(1e-3, rel=0.05)  # decayed to min_lr_ratio * lr at the end


def test_saved_folder_is_a_loadable_bf16_model_with_tokenizer(trained: tuple[Path, dict]) -> None:
    out, metrics = trained
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(metrics["files"]) and len(names) <= 8
    assert {"config.json", "generation_config.json", "model.safetensors", "training_curve.png"} <= set(names)
    assert all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 0 and config["vocab_size"] == 320
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert (out / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    model = Qwen3ForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()
    prompt = torch.tensor([tokenizer.encode("def heappush(heap, item):\n")])
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    # Greedy generation with the KV cache equals argmax decoding without it, token for token.
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, ids)
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = PretrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10)
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(0.1)
    assert learning_rate(cfg, 9, 0.0) == pytest.approx(1.0)
    lrs = [learning_rate(cfg, 10 + i, i / 100) for i in range(101)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert lrs[-1] == pytest.approx(0.1) and lrs[50] == pytest.approx(0.55)


def test_progress_follows_the_tightest_limit() -> None:
    cfg = PretrainConfig(max_minutes=10.0, max_steps=1000, max_epochs=2.0)
    assert run_progress(cfg, 100, 300.0, 500, 1000) == (0.5, "time")
    assert run_progress(cfg, 900, 60.0, 500, 1000) == (0.9, "steps")
    assert run_progress(cfg, 10, 60.0, 1500, 1000) == (0.75, "epochs")
    only_steps = PretrainConfig(max_minutes=None, max_steps=10, max_epochs=None)
    assert run_progress(only_steps, 10, 1e9, 10**12, 1) == (1.0, "steps")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_minutes": None, "max_epochs": None}, "at least one"),
        ({"max_steps": 0}, "must be positive"),
        ({"batch_size": 0}, "must be >= 1"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"keep": "first"}, "keep must be"),
    ],
)
def test_bad_settings_raise(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PretrainConfig(**change).validate()


def test_cli_reports_bad_input(corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train-target", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "not a corpus folder" in capsys.readouterr().err
    args = ["train-target", "--data", str(corpus_dir), "--out", str(tmp_path / "o"), "--seq-len", "4096"]
    assert main(args) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    assert main(["demo-corpus", "--out", str(tmp_path / "c"), "--tokenizer", str(tmp_path)]) == 2
    assert "no saved tokenizer" in capsys.readouterr().err
