"""The scheduler's detokeniser cache: the first load goes through transformers and stores the tokenizer's backend,
the next one reads it without importing transformers and decodes every sequence as transformers does; a changed
folder misses, a tokenizer that cleans its text up is never cached, and a broken or unwritable cache only costs
a load through transformers. The demo tokenizer (and copies of it); nothing is mocked."""

from __future__ import annotations

import json
import logging
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cluster.tokenizer_cache import TokenizerCache, load_decode, tokenizer_fingerprint

ROOT = Path(__file__).resolve().parents[2]
DEMO_TARGET = ROOT / "models" / "demo" / "target"  # the target folder holds the tokenizer, as a Qwen3 folder does


def _samples(vocab: int, special: list[int]) -> list[list[int]]:
    rng = random.Random(7)
    samples = [[i] for i in range(vocab)]  # every id alone (the demo vocabulary is small)
    for _ in range(500):
        seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        seq.insert(rng.randrange(len(seq) + 1), rng.choice(special))
        samples.append(seq)
    return samples


def test_a_cached_tokenizer_decodes_as_transformers_in_a_process_without_transformers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = AutoTokenizer.from_pretrained(DEMO_TARGET, local_files_only=True)
    samples = _samples(len(reference), sorted(reference.added_tokens_decoder))
    expected = [reference.decode(seq, skip_special_tokens=True) for seq in samples]
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="cluster.tokenizer_cache"):
        first = load_decode(DEMO_TARGET, cache)
    assert "tokenizer cached at" in caplog.text
    assert [first(seq) for seq in samples] == expected
    stored = list((cache / "tokenizers").glob("target-*.json"))
    assert len(stored) == 1
    # The weights are not part of the fingerprint (the tokenizer folder may be the model's).
    names = [f["name"] for f in json.loads(stored[0].read_text())["fingerprint"]["files"]]
    assert "tokenizer.json" in names and "model.safetensors" not in names

    # A fresh process, as a restarted scheduler replica: what the replica imports (the Serve application, the hub,
    # the health check's and registration's modules) and the cached decode. Neither transformers nor Triton is
    # imported (the scheduler needs neither, and both are a large part of a replacement's start); the text is
    # transformers' text.
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    script = (
        "import json, logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "import cluster.app, cluster.backend, scheduler.failover, scheduler.hub\n"
        "from cluster.tokenizer_cache import load_decode\n"
        f"decode = load_decode({str(DEMO_TARGET)!r}, {str(cache)!r})\n"
        f"samples = json.loads(open({str(tmp_path / 'samples.json')!r}).read())\n"
        "texts = [decode(s) for s in samples]\n"
        "print(json.dumps({'loaded': sorted({'transformers', 'triton'} & set(sys.modules)), 'texts': texts}))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["loaded"] == []
    assert result["texts"] == expected
    assert "tokenizer from the cache" in run.stderr


def test_a_changed_folder_misses_and_a_cleaning_tokenizer_is_not_cached(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    load_decode(DEMO_TARGET, cache)
    folder = tmp_path / "tokenizer"
    shutil.copytree(DEMO_TARGET, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    assert tokenizer_fingerprint(folder) == tokenizer_fingerprint(DEMO_TARGET)  # the same files: the same key

    # clean_up_tokenization_spaces on a WordPiece-style clean-up: transformers changes the text after the backend,
    # so the backend alone would not decode the same; never cached, and the decode is transformers' own.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert tokenizer_fingerprint(folder) != tokenizer_fingerprint(DEMO_TARGET)
    with caplog.at_level(logging.INFO, logger="cluster.tokenizer_cache"):
        decode = load_decode(folder, cache)
    assert "not cached" in caplog.text
    assert TokenizerCache(cache / "tokenizers").lookup(folder.name, tokenizer_fingerprint(folder)) is None
    reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for seq in _samples(len(reference), sorted(reference.added_tokens_decoder))[-100:]:
        assert decode(seq) == reference.decode(seq, skip_special_tokens=True)


def test_a_broken_or_unwritable_cache_costs_only_a_load_through_transformers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = AutoTokenizer.from_pretrained(DEMO_TARGET, local_files_only=True)
    seq = [5, 17, 0, 42, len(reference) - 1, 99]
    cache = tmp_path / "cache"
    load_decode(DEMO_TARGET, cache)
    [entry] = (cache / "tokenizers").glob("*.json")
    entry.write_text("{not json")
    with caplog.at_level(logging.INFO, logger="cluster.tokenizer_cache"):
        decode = load_decode(DEMO_TARGET, cache)
    assert "ignoring the cached tokenizer" in caplog.text and "tokenizer cached at" in caplog.text  # stored anew
    assert decode(seq) == reference.decode(seq, skip_special_tokens=True)

    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")  # a cache root that cannot hold folders
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cluster.tokenizer_cache"):
        decode = load_decode(DEMO_TARGET, blocked)
    assert "tokenizer not cached" in caplog.text
    assert decode(seq) == reference.decode(seq, skip_special_tokens=True)


def test_an_entry_keeps_its_file_name(tmp_path: Path) -> None:
    """Caches written by earlier versions are found only while names and digests stay the same: pinned for a
    fixed fingerprint (the folder name made file-safe, the first 16 hex digits of the canonical JSON's SHA-256)."""
    fingerprint = {"format": "x/1", "files": [{"name": "tokenizer.json", "size": 3}], "b": None, "a": 1.5}
    cache = TokenizerCache(tmp_path)
    assert cache.path_for("Qwen/Qwen3 8B!", fingerprint) == tmp_path / "Qwen_Qwen3_8B-ef0a004a4332926b.json"
    assert cache.path_for("..", fingerprint) == tmp_path / "tokenizer-ef0a004a4332926b.json"
