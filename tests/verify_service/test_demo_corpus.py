"""The demo corpus: file selection, hash split, manifest, token streams that decode back to the sources."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from verify_service.demo.corpus import (
    EXCLUDED_FILES,
    CorpusManifest,
    TokenWindows,
    assign_splits,
    build_corpus,
    collect_sources,
    corpus_sha256,
    encode_documents,
    list_stdlib_sources,
    load_corpus,
    split_documents,
    stdlib_root,
)
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


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sources, _ = collect_sources(select=FILES)
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer([s.text for s in sources], vocab_size=320), folder)
    return folder


@pytest.fixture(scope="module")
def small_corpus(small_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    build_corpus(folder, small_tokenizer, val_fraction=0.2, select=FILES)
    return folder


def test_stdlib_listing_skips_tests_third_party_and_generated_data() -> None:
    paths = list_stdlib_sources(stdlib_root())
    assert paths == sorted(paths) and len(paths) > 300
    assert "json/decoder.py" in paths and "asyncio/events.py" in paths
    for path in paths:
        parts = path.split("/")
        assert path.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(parts[:-1]), path
        assert not parts[-1].startswith("_sysconfigdata_") and path not in EXCLUDED_FILES
        assert (stdlib_root() / path).stat().st_size > 0


def test_collect_sources_on_a_fake_stdlib(tmp_path: Path) -> None:
    files = {
        "a.py": b"x = 1\n",
        "pkg/__init__.py": b"",
        "pkg/mod.py": b"def f():\n    return 2\n",
        "pkg/tests/test_mod.py": b"assert True\n",
        "test/test_a.py": b"pass\n",
        "site-packages/lib.py": b"pass\n",
        "latin.py": "s = 'caf\u00e9'\n".encode("latin-1"),
        "notes.txt": b"not python\n",
    }
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    sources, skipped = collect_sources(tmp_path, val_fraction=0.5)
    assert [s.path for s in sources] == ["a.py", "pkg/mod.py"]
    assert skipped == ["latin.py"]
    assert sources[1].text == "def f():\n    return 2\n"
    assert {s.split for s in sources} == {"train", "val"}
    with pytest.raises(ValueError, match="not corpus files"):
        collect_sources(tmp_path, select=["pkg/tests/test_mod.py"])
    with pytest.raises(ValueError, match="not a directory"):
        collect_sources(tmp_path / "missing")


def test_split_is_a_pure_function_of_the_path() -> None:
    paths = list_stdlib_sources(stdlib_root())
    forward = assign_splits(paths, 0.05)
    backward = assign_splits(list(reversed(paths)), 0.05)
    assert forward == backward
    share = sum(s == "val" for s in forward.values()) / len(paths)
    assert 0.02 < share < 0.09
    assert set(assign_splits(["one.py", "two.py"], 0.01).values()) == {"train", "val"}
    assert set(assign_splits(["one.py", "two.py"], 0.99).values()) == {"train", "val"}
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="val_fraction"):
            assign_splits(paths, bad)


def test_corpus_hash_covers_paths_and_contents_not_order() -> None:
    sources, _ = collect_sources(select=FILES[:3])
    digest = corpus_sha256(sources)
    assert corpus_sha256(list(reversed(sources))) == digest
    changed = [sources[0].__class__(sources[0].path, sources[0].text + " ", sources[0].split), *sources[1:]]
    assert corpus_sha256(changed) != digest
    renamed = [sources[0].__class__("x.py", sources[0].text, sources[0].split), *sources[1:]]
    assert corpus_sha256(renamed) != digest


def test_built_streams_decode_back_to_the_sources(small_corpus: Path) -> None:
    manifest = CorpusManifest.load(small_corpus)
    sources, _ = collect_sources(select=FILES, val_fraction=0.2)
    assert manifest.num_files == len(FILES) and manifest.sha256 == corpus_sha256(sources)
    assert manifest.mask_token_id == manifest.vocab_size - 1 == 319 and manifest.eos_token_id == 0
    tokenizer = Tokenizer.from_file(str(small_corpus / "tokenizer" / "tokenizer.json"))
    for split in ("train", "val"):
        stream = np.fromfile(small_corpus / f"{split}.bin", dtype="<u2")
        assert stream.size == manifest.split_tokens[split] and stream[-1] == manifest.eos_token_id
        docs = [tokenizer.decode(d.tolist(), skip_special_tokens=False) for d in split_documents(stream, 0)]
        assert docs == [s.text for s in sources if s.split == split]
        assert manifest.split_files[split] == len(docs)
    listed = json.loads((small_corpus / "manifest.json").read_text())["files"]
    assert [f["path"] for f in listed] == sorted(FILES)


def test_load_corpus_checks_streams_and_tokenizer(small_corpus: Path, tmp_path: Path) -> None:
    corpus = load_corpus(small_corpus)
    assert len(corpus.train) == corpus.manifest.split_tokens["train"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in small_corpus.iterdir():
        (broken / item.name).symlink_to(item)
    (broken / "val.bin").unlink()
    np.zeros(3, dtype="<u2").tofile(broken / "val.bin")
    with pytest.raises(ValueError, match="manifest says"):
        load_corpus(broken)
    with pytest.raises(ValueError, match="not a corpus folder"):
        load_corpus(tmp_path)


def test_literal_special_tokens_are_refused(small_tokenizer: Path) -> None:
    with pytest.raises(ValueError, match="reserved special token"):
        encode_documents(small_tokenizer / "tokenizer.json", ["x = '<|endoftext|>'\n"], 0, [319])


def test_split_documents_round_trip() -> None:
    stream = np.asarray([5, 6, 0, 7, 0, 0, 8], dtype="<u2")
    docs = split_documents(stream, 0)
    assert [d.tolist() for d in docs] == [[5, 6], [7], [], [8]]


def test_token_windows_are_stream_slices() -> None:
    stream = torch.arange(100, dtype=torch.int32)
    windows = TokenWindows(stream)
    batch = windows.sample(6, 9, torch.Generator().manual_seed(0))
    assert batch.shape == (6, 10) and batch.dtype == torch.int64
    assert torch.equal(batch - batch[:, :1], torch.arange(10).expand(6, 10))
    assert int(batch.max()) <= 99
    tiled = windows.tiled(10)
    assert tiled.shape == (9, 11) and torch.equal(tiled[:, 0], torch.arange(0, 90, 10))
    assert windows.tiled(10, max_windows=2).shape == (2, 11)
    with pytest.raises(ValueError, match="cannot give windows"):
        windows.sample(1, 100, torch.Generator())
    with pytest.raises(ValueError, match="1-D"):
        TokenWindows(torch.zeros(2, 2))
