"""The demo tokenizer: shipped folder loads offline through transformers, special ids, exact round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from verify_service.demo.corpus import collect_sources
from verify_service.demo.tokenizer import (
    DEFAULT_TOKENIZER_DIR,
    EOS_TOKEN,
    MASK_TOKEN,
    load_tokenizer,
    save_tokenizer,
    tokenizer_sha256,
    tokenizer_special_ids,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def shipped() -> PreTrainedTokenizerFast:
    return load_tokenizer(DEFAULT_TOKENIZER_DIR)


def test_shipped_tokenizer_layout(shipped: PreTrainedTokenizerFast) -> None:
    assert isinstance(shipped, PreTrainedTokenizerFast)
    assert len(shipped) == 4096
    assert shipped.eos_token == shipped.bos_token == shipped.pad_token == EOS_TOKEN
    assert shipped.eos_token_id == shipped.pad_token_id == 0
    assert shipped.mask_token == MASK_TOKEN and shipped.mask_token_id == 4095
    assert tokenizer_special_ids(DEFAULT_TOKENIZER_DIR) == (0, 4095, 4096)
    # No BOS/EOS is added on encode: prompts are token-exact.
    assert shipped.encode("x = 1") == shipped.encode("x = 1", add_special_tokens=False)


def test_chat_template_continues_the_user_text(shipped: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "# helper module\n"},
        {"role": "user", "content": "def add(a, b):\n"},
    ]
    assert shipped.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "# helper module\ndef add(a, b):\n"
    )
    turn = [{"role": "user", "content": "x = "}, {"role": "assistant", "content": "1\n"}]
    assert shipped.apply_chat_template(turn, tokenize=False) == "x = 1\n" + EOS_TOKEN


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_of_arbitrary_text(shipped: PreTrainedTokenizerFast, text: str) -> None:
    assert shipped.decode(shipped.encode(text)) == text


# Indentation, line endings, non-ASCII and literal special-token text: where byte-level BPE could slip.
FRAGMENTS = [
    "    ",
    "\t",
    "\n",
    "\r\n",
    " ",
    "def",
    "_x",
    "'''",
    "\u00e9",
    "\U0001f600",
    "<|mask|>",
    "<|endoftext|>",
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS)))
def test_round_trip_of_code_like_fragments(shipped: PreTrainedTokenizerFast, parts: list[str]) -> None:
    text = "".join(parts)
    assert shipped.decode(shipped.encode(text)) == text


def test_round_trip_of_stdlib_sources(shipped: PreTrainedTokenizerFast) -> None:
    sources, _ = collect_sources(select=["textwrap.py", "json/encoder.py", "encodings/cp1252.py"])
    for source in sources:
        ids = shipped.encode(source.text)
        assert shipped.decode(ids) == source.text
        assert len(ids) < len(source.text) / 2.5  # BPE merges compress code well beyond bytes


def test_trained_tokenizer_puts_mask_last(tmp_path: Path) -> None:
    texts = [s.text for s in collect_sources(select=["bisect.py", "heapq.py"])[0]]
    files = save_tokenizer(train_tokenizer(texts, vocab_size=300), tmp_path)
    assert [f.name for f in files] == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    assert tokenizer_special_ids(tmp_path) == (0, 299, 300)
    loaded = load_tokenizer(tmp_path)
    assert loaded.mask_token_id == 299 and len(loaded) == 300
    assert len(tokenizer_sha256(tmp_path)) == 64


def test_bad_tokenizer_requests_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be"):
        train_tokenizer(["x = 1"], vocab_size=100)
    with pytest.raises(ValueError, match="fewer than"):
        train_tokenizer(["x = 1\n"], vocab_size=4096)
    with pytest.raises(ValueError, match="no saved tokenizer"):
        tokenizer_special_ids(tmp_path)
