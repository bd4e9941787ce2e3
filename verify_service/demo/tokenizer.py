"""The demo tokenizer: byte-level BPE trained on the corpus, saved as a transformers fast tokenizer.

Byte-level BPE because it is lossless on any text (every byte has a token), which the serving stack relies on:
``decode(encode(x)) == x`` for any prompt. Special tokens follow the Qwen3 convention the drafter expects:

- ``<|endoftext|>`` (id 0) is EOS, BOS and padding at once; documents in the corpus are separated by it;
- ``<|mask|>`` takes the LAST id (``vocab_size - 1``), like the reserved id Qwen3 drafters use as mask token:
  the DSpark drafter fills block slots 1..gamma-1 with its embedding, and the target never sees it in
  training.

The chat template just concatenates message contents (assistant turns end with EOS): the demo target is a
code-continuation model, so a chat request whose user message is code gets that code continued.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
DEFAULT_VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 2048
#: The files a saved tokenizer consists of (what gets copied next to a model or into a corpus folder).
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
#: Shipped tokenizer folder of the repository.
DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "models" / "demo" / "tokenizer"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
_BYTE_ALPHABET = 256


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, show_progress: bool = False
) -> Tokenizer:
    """Train a byte-level BPE whose ids are EOS = 0, learned tokens, and the mask token at ``vocab_size - 1``.

    Raises ValueError when the texts are too small to learn ``vocab_size`` tokens: a shorter vocab would move
    the mask token off the last id that model configs and the drafter assume.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not _BYTE_ALPHABET + 2 <= vocab_size <= 2**16:
        raise ValueError(
            f"vocab_size must be in [{_BYTE_ALPHABET + 2}, 65536] (uint16 corpus), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the last id is kept for the mask token, added after training
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    learned = tokenizer.get_vocab_size()
    if learned != vocab_size - 1:
        raise ValueError(
            f"the texts gave only {learned} tokens, fewer than vocab_size - 1 = {vocab_size - 1}"
        )
    tokenizer.add_special_tokens([MASK_TOKEN])
    assert tokenizer.token_to_id(MASK_TOKEN) == vocab_size - 1 and tokenizer.token_to_id(EOS_TOKEN) == 0
    return tokenizer


def save_tokenizer(
    tokenizer: Tokenizer, out_dir: Path, model_max_length: int = MODEL_MAX_LENGTH
) -> list[Path]:
    """Save as a ``PreTrainedTokenizerFast`` folder that ``AutoTokenizer.from_pretrained`` loads offline."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,  # the cleanup rewrites " ." to ".", breaking exact round trips
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 writes its internal backend name; the public class name also loads with older releases.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer_files(out_dir)


def tokenizer_files(folder: Path) -> list[Path]:
    """The saved tokenizer's files in ``folder`` (ValueError if it holds no tokenizer)."""
    folder = Path(folder)
    files = [folder / name for name in TOKENIZER_FILE_NAMES if (folder / name).is_file()]
    if not files or files[0].name != "tokenizer.json":
        raise ValueError(f"{folder} holds no saved tokenizer (tokenizer.json missing)")
    return files


def tokenizer_sha256(folder: Path) -> str:
    """Fingerprint of a saved tokenizer (names and bytes of its files), recorded in corpus manifests."""
    digest = hashlib.sha256()
    for file in tokenizer_files(folder):
        data = file.read_bytes()
        digest.update(f"{file.name}\n{len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


def tokenizer_special_ids(folder: Path) -> tuple[int, int, int]:
    """(eos id, mask id, vocab size) of a saved tokenizer, checking the mask token holds the last id."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_files(folder)[0]))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id, mask_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(MASK_TOKEN)
    if eos_id is None or mask_id != vocab_size - 1:
        raise ValueError(f"{folder}: expected {EOS_TOKEN} and {MASK_TOKEN} at the last id {vocab_size - 1}")
    return eos_id, mask_id, vocab_size


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer as transformers serves it (offline, from the local folder only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
