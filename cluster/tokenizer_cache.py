"""The scheduler's detokeniser kept between starts, so that a restarted scheduler loads it without transformers.

The scheduler needs one thing of the tokenizer: ``decode`` (ids to text, special tokens dropped) for streamed
text and stop strings. Loading it through transformers (``AutoTokenizer``) imports transformers, which the
scheduler needs for nothing else, and that import is a large part of what a scheduler replaced after a failure
spends before it serves again.

A fast (Rust-backed) transformers tokenizer decodes by handing the ids to its ``tokenizers.Tokenizer`` backend
and cleans the text up afterwards only when ``clean_up_tokenization_spaces`` is set. So when the loaded tokenizer
decodes exactly that way (a ``TokenizersBackend`` whose class overrides neither ``decode`` nor ``_decode`` and
that does no clean-up), its backend serialised with ``Tokenizer.to_str`` (model, normaliser, pre-tokeniser,
decoder, added tokens and which of them are special, as transformers configured them) decodes every id sequence
to the same text. :func:`load_decode` stores that string under ``<cache_dir>/tokenizers/`` and the next start
reads it with the ``tokenizers`` library alone. Before storing, the backend read back from the string is checked
against transformers' own decode on sample sequences (every added token, and random ids); on any difference
nothing is stored and every start loads through transformers. A tokenizer that decodes some other way is never
cached.

Key: a fingerprint of the tokenizer folder (name, size and SHA-256 of every file but weight files; the folder
may be the target model's) and of the transformers and tokenizers versions; a changed folder or library misses.
Files are ``<folder name>-<digest>.json``, written atomically (replicas of one node may share the folder; names and
writes: :mod:`cluster.cache_files`, which imports no torch); the cache never deletes anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

from cluster.cache_files import entry_path, package_version, write_atomic
from scheduler.stopping import Decode, tokenizer_decode

logger = logging.getLogger(__name__)

FORMAT = "dspark-tokenizer-cache/1"
#: Files of a model folder that are weights, not tokenizer files: left out of the fingerprint (large, and what
#: they hold does not change how ids decode).
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt"})
#: Random id sequences the serialised backend is checked on before it is stored (besides every added token).
CHECK_SEQUENCES = 256
CHECK_MAX_LEN = 24


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> dict[str, Any]:
    """What decoding with the tokenizer of ``tokenizer_dir`` depends on (see the module doc)."""
    folder = Path(tokenizer_dir)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix not in WEIGHT_SUFFIXES)
    if not files:
        raise ValueError(f"{folder}: no tokenizer files")
    return {
        "format": FORMAT,
        "files": [{"name": p.name, "size": p.stat().st_size, "sha256": _file_digest(p)} for p in files],
        "transformers": package_version("transformers"),
        "tokenizers": package_version("tokenizers"),
    }


def backend_decode(backend: Any) -> Decode:
    """The :data:`~scheduler.stopping.Decode` of a ``tokenizers.Tokenizer``: what transformers' ``decode`` with
    ``skip_special_tokens=True`` returns for a tokenizer that decodes by its backend alone (see the module doc)."""
    return lambda ids: backend.decode([int(i) for i in ids], skip_special_tokens=True)


def serialized_backend(tokenizer: Any) -> str | None:
    """``tokenizer``'s backend as ``Tokenizer.to_str`` writes it when the tokenizer decodes by that backend alone
    (so that the string decodes every sequence as the tokenizer does), else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers generation: its decode path is not the one checked here
        return None
    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not TokenizersBackend._decode
        or tokenizer.clean_up_tokenization_spaces
    ):
        return None
    text: str = tokenizer.backend_tokenizer.to_str()
    return text


def _same_decodes(tokenizer: Any, decode: Decode) -> bool:
    """Whether ``decode`` gives transformers' text for every added token alone and for seeded random sequences
    of ids mixed with added tokens."""
    vocab = len(tokenizer)
    added = sorted(int(i) for i in tokenizer.added_tokens_decoder)
    rng = random.Random(0)
    samples = [[i] for i in added]
    for _ in range(CHECK_SEQUENCES):
        seq = [rng.randrange(vocab) for _ in range(rng.randint(1, CHECK_MAX_LEN))]
        if added and rng.random() < 0.5:
            seq.insert(rng.randrange(len(seq) + 1), rng.choice(added))
        samples.append(seq)
    return all(decode(seq) == tokenizer.decode(seq, skip_special_tokens=True) for seq in samples)


class TokenizerCache:
    """Serialised tokenizer backends under ``root`` (normally ``<cache_dir>/tokenizers``), one file each."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path_for(self, name: str, fingerprint: dict[str, Any]) -> Path:
        return entry_path(self.root, name, fingerprint, "tokenizer")

    def lookup(self, name: str, fingerprint: dict[str, Any]) -> Any | None:
        """The cached backend (a ``tokenizers.Tokenizer``) for ``fingerprint``, or None (missing, unreadable,
        written for another fingerprint)."""
        path = self.path_for(name, fingerprint)
        if not path.is_file():
            return None
        try:
            from tokenizers import Tokenizer

            data = json.loads(path.read_text())
            if data.get("fingerprint") != fingerprint:
                raise ValueError("written for another fingerprint")
            return Tokenizer.from_str(data["backend"])
        except Exception as error:  # a broken entry costs a load through transformers, nothing else
            logger.warning("ignoring the cached tokenizer %s (%s)", path, error)
            return None

    def store(self, name: str, fingerprint: dict[str, Any], backend: str) -> Path:
        """Write ``backend`` (``Tokenizer.to_str``) for ``fingerprint`` atomically; returns its path."""
        body = json.dumps({"fingerprint": fingerprint, "backend": backend}) + "\n"
        return write_atomic(self.path_for(name, fingerprint), body)


def load_decode(tokenizer_dir: str | Path, cache_root: str | Path) -> Decode:
    """The decode of the tokenizer in ``tokenizer_dir`` (local files only): from the cache under
    ``<cache_root>/tokenizers`` when it holds this fingerprint, without importing transformers; else loaded
    through transformers and, when its decode is its backend's, checked and stored for the next start (see the
    module doc). Either way the text is transformers' ``decode(ids, skip_special_tokens=True)``."""
    folder = Path(tokenizer_dir)
    fingerprint = tokenizer_fingerprint(folder)
    cache = TokenizerCache(Path(cache_root) / "tokenizers")
    path = cache.path_for(folder.name, fingerprint)
    backend = cache.lookup(folder.name, fingerprint)
    if backend is not None:
        logger.info("tokenizer from the cache: %s", path)
        return backend_decode(backend)
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    serialized = serialized_backend(tokenizer)
    if serialized is None:
        logger.info("tokenizer %s does not decode by its backend alone: not cached", folder)
    elif not _same_decodes(tokenizer, backend_decode(Tokenizer.from_str(serialized))):
        logger.warning("tokenizer %s: its serialised backend decodes differently; not cached", folder)
    else:
        try:
            cache.store(folder.name, fingerprint, serialized)
            logger.info("tokenizer cached at %s", path)
        except OSError as error:  # a read-only or full cache folder: the next start loads through transformers
            logger.warning("tokenizer not cached (%s)", error)
    return tokenizer_decode(tokenizer)
