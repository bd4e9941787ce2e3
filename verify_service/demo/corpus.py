"""The demo corpus: the Python standard library's own source, split by file and stored as flat token streams.

Why this corpus: it is present on every machine that runs the project, so the demo models can be rebuilt
anywhere without a download, and a code model gives the drafter long, predictable stretches to speculate on.
Its exact content depends on the interpreter, so the manifest records the Python version, every file used and
a sha256 over them, and token streams built on one machine can be carried to another whose Python differs.

On-disk layout of a corpus folder (what :func:`build_corpus` writes and :func:`load_corpus` reads):

- ``train.bin`` / ``val.bin``: little-endian uint16 token ids, every document followed by the EOS id;
- ``manifest.json``: provenance, split sizes and the per-file list (:class:`CorpusManifest`);
- ``tokenizer/``: a copy of the tokenizer the ids belong to, so a corpus folder is self-describing.

:class:`TokenWindows` serves training batches from a stream; drafter training reuses it (prompts are windows
of the train stream) together with :func:`split_documents`.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from verify_service.demo.config import DEFAULT_VAL_FRACTION

#: Directory names whose ``.py`` files are not part of the corpus: test suites (their fixtures include
#: deliberately broken or odd code), third-party packages, and bytecode caches.
EXCLUDED_DIR_NAMES: frozenset[str] = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
#: Build artefacts of one particular interpreter install (absolute build paths, compiler flags): leaving them
#: out makes the corpus hash the same on every install of the same CPython version.
EXCLUDED_PREFIXES: tuple[str, ...] = ("_sysconfigdata_", "config-")
#: Generated data, not code: ``pydoc_data/topics.py`` is one 750 KB string of help-text prose (6% of the
#: stdlib's bytes), which would skew a code model and, landing in either split, dominate it.
EXCLUDED_FILES: frozenset[str] = frozenset({"pydoc_data/topics.py"})
TOKEN_DTYPE = np.dtype("<u2")
MANIFEST_NAME = "manifest.json"
TRAIN_NAME = "train.bin"
VAL_NAME = "val.bin"
TOKENIZER_SUBDIR = "tokenizer"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class SourceFile:
    """One corpus document: a stdlib file's text, its path relative to the stdlib root and its split."""

    path: str
    text: str
    split: str


def stdlib_root() -> Path:
    """The source folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(relative: Path) -> bool:
    if any(part in EXCLUDED_DIR_NAMES for part in relative.parts[:-1]):
        return True
    return any(part.startswith(EXCLUDED_PREFIXES) for part in relative.parts)


def list_stdlib_sources(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus's non-empty ``.py`` files under ``root``, sorted (corpus order)."""
    if not root.is_dir():
        raise ValueError(f"stdlib root {root} is not a directory")
    # Empty files (bare ``__init__.py``) carry no text and would only put EOS after EOS into the stream.
    found = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file() and p.stat().st_size > 0)
    return sorted(r.as_posix() for r in found if not _excluded(r) and r.as_posix() not in EXCLUDED_FILES)


def _split_key(path: str) -> float:
    """A uniform number in [0, 1) fixed by the file's path alone, so the split never depends on file order."""
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big") / 2.0**64


def assign_splits(paths: Sequence[str], val_fraction: float) -> dict[str, str]:
    """Map each path to "train" or "val" by hashing it; both splits get at least one file when possible."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    keys = {p: _split_key(p) for p in paths}
    splits = {p: "val" if k < val_fraction else "train" for p, k in keys.items()}
    if len(paths) >= 2:
        if "val" not in splits.values():
            splits[min(keys, key=keys.__getitem__)] = "val"
        if "train" not in splits.values():
            splits[max(keys, key=keys.__getitem__)] = "train"
    return splits


def collect_sources(
    root: Path | None = None, val_fraction: float = DEFAULT_VAL_FRACTION, select: Sequence[str] | None = None
) -> tuple[list[SourceFile], list[str]]:
    """Read the corpus documents in corpus order; returns (documents, paths skipped for not being UTF-8).

    ``select`` restricts the corpus to these relative paths (tests, quick experiments); each must be a corpus
    file.
    """
    root = stdlib_root() if root is None else Path(root)
    paths = list_stdlib_sources(root)
    if select is not None:
        unknown = sorted(set(select) - set(paths))
        if unknown:
            raise ValueError(f"not corpus files under {root}: {unknown}")
        chosen = set(select)
        paths = [p for p in paths if p in chosen]
    if not paths:
        raise ValueError(f"no corpus files found under {root}")
    texts: dict[str, str] = {}
    skipped: list[str] = []
    for path in paths:
        try:
            texts[path] = (root / path).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(path)
    splits = assign_splits(list(texts), val_fraction)
    return [SourceFile(p, t, splits[p]) for p, t in texts.items()], skipped


def corpus_sha256(sources: Sequence[SourceFile]) -> str:
    """sha256 over the sorted file list and contents: for each file ``path\\n<byte length>\\n<bytes>``."""
    digest = hashlib.sha256()
    for source in sorted(sources, key=lambda s: s.path):
        data = source.text.encode("utf-8")
        digest.update(f"{source.path}\n{len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


@dataclass
class CorpusManifest:
    """Provenance and shape of a built corpus folder (serialised as ``manifest.json``)."""

    python_version: str
    python_implementation: str
    stdlib_root: str
    val_fraction: float
    num_files: int
    total_bytes: int
    sha256: str
    tokenizer_sha256: str
    vocab_size: int
    eos_token_id: int
    mask_token_id: int
    split_files: dict[str, int]
    split_bytes: dict[str, int]
    split_tokens: dict[str, int]
    files: list[dict[str, object]]
    skipped: list[str] = field(default_factory=list)
    excluded_dir_names: list[str] = field(default_factory=lambda: sorted(EXCLUDED_DIR_NAMES))
    excluded_prefixes: list[str] = field(default_factory=lambda: list(EXCLUDED_PREFIXES))
    excluded_files: list[str] = field(default_factory=lambda: sorted(EXCLUDED_FILES))
    token_dtype: str = "uint16"

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, folder: Path) -> CorpusManifest:
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise ValueError(
                f"{folder} is not a corpus folder: {MANIFEST_NAME} is missing (run `dspark demo-corpus`)"
            )
        return cls(**json.loads(path.read_text()))


def encode_documents(
    tokenizer_file: Path, texts: Sequence[str], eos_id: int, reserved: Sequence[int]
) -> list[np.ndarray]:
    """Token ids of each text (no special tokens added), refusing texts that spell a reserved token literally.

    Why refuse: a document containing the text ``<|endoftext|>`` would be cut in two by a fake EOS, silently
    changing what the model learns; the stdlib has none, so any occurrence means unexpected input.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if tokenizer.get_vocab_size() > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"vocab of {tokenizer.get_vocab_size()} does not fit {TOKEN_DTYPE}")
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    banned = np.asarray(sorted({eos_id, *reserved}))
    out = []
    for i, encoding in enumerate(encodings):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        if np.isin(ids, banned).any():
            raise ValueError(f"document {i} contains a reserved special token as literal text")
        out.append(ids.astype(TOKEN_DTYPE))
    return out


def _join_with_eos(docs: Sequence[np.ndarray], eos_id: int) -> np.ndarray:
    eos = np.asarray([eos_id], dtype=TOKEN_DTYPE)
    return np.concatenate([part for doc in docs for part in (doc, eos)]) if docs else np.zeros(0, TOKEN_DTYPE)


def build_corpus(
    out_dir: Path,
    tokenizer_dir: Path,
    root: Path | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    select: Sequence[str] | None = None,
) -> CorpusManifest:
    """Tokenize the stdlib corpus with ``tokenizer_dir``'s tokenizer into ``out_dir`` (layout: see module)."""
    from verify_service.demo.tokenizer import tokenizer_files, tokenizer_sha256, tokenizer_special_ids

    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    eos_id, mask_id, vocab_size = tokenizer_special_ids(tokenizer_dir)
    sources, skipped = collect_sources(root, val_fraction, select)
    docs = encode_documents(tokenizer_dir / "tokenizer.json", [s.text for s in sources], eos_id, [mask_id])

    out_dir.mkdir(parents=True, exist_ok=True)
    tok_out = out_dir / TOKENIZER_SUBDIR
    if tok_out.exists():
        shutil.rmtree(tok_out)
    tok_out.mkdir()
    for file in tokenizer_files(tokenizer_dir):
        shutil.copy2(file, tok_out / file.name)
    split_tokens = {}
    for split, name in zip(SPLITS, (TRAIN_NAME, VAL_NAME), strict=True):
        stream = _join_with_eos([d for d, s in zip(docs, sources, strict=True) if s.split == split], eos_id)
        stream.tofile(out_dir / name)
        split_tokens[split] = int(stream.size)

    sizes = [len(s.text.encode("utf-8")) for s in sources]
    manifest = CorpusManifest(
        python_version=platform.python_version(),
        python_implementation=f"{platform.python_implementation()} {sys.version.split()[0]}",
        stdlib_root=str(stdlib_root() if root is None else root),
        val_fraction=val_fraction,
        num_files=len(sources),
        total_bytes=sum(sizes),
        sha256=corpus_sha256(sources),
        tokenizer_sha256=tokenizer_sha256(tokenizer_dir),
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        mask_token_id=mask_id,
        split_files={sp: sum(s.split == sp for s in sources) for sp in SPLITS},
        split_bytes={
            sp: sum(n for n, s in zip(sizes, sources, strict=True) if s.split == sp) for sp in SPLITS
        },
        split_tokens=split_tokens,
        files=[
            {"path": s.path, "bytes": n, "tokens": int(d.size), "split": s.split}
            for s, n, d in zip(sources, sizes, docs, strict=True)
        ],
        skipped=skipped,
    )
    manifest.save(out_dir)
    return manifest


def split_documents(stream: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """Cut an EOS-separated token stream back into its documents (the EOS ids themselves are dropped)."""
    ends = np.flatnonzero(stream == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1]) if ends.size else np.zeros(0, dtype=np.int64)
    docs = [stream[s:e] for s, e in zip(starts, ends, strict=True)]
    tail = stream[ends[-1] + 1 :] if ends.size else stream
    return docs + ([tail] if tail.size else [])


class TokenWindows:
    """A token stream held as one tensor on the training device, served as windows of ``seq_len + 1`` tokens.

    A window's first ``seq_len`` tokens are the inputs and its last ``seq_len`` the next-token labels. Holding
    the whole stream on the device (a few MB) lets batches be gathered there with no host round trip per step.
    """

    def __init__(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"a token stream is 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens

    @classmethod
    def from_file(cls, path: Path, device: str | torch.device = "cpu") -> TokenWindows:
        ids = np.fromfile(path, dtype=TOKEN_DTYPE).astype(np.int32)
        return cls(torch.from_numpy(ids).to(device))

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def _check(self, seq_len: int) -> None:
        if seq_len < 1 or len(self) < seq_len + 1:
            raise ValueError(f"a stream of {len(self)} tokens cannot give windows of {seq_len} + 1 tokens")

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """``batch_size`` windows starting at uniform random offsets: int64 [batch_size, seq_len + 1]."""
        self._check(seq_len)
        device = self.tokens.device
        starts = torch.randint(0, len(self) - seq_len, (batch_size, 1), generator=generator, device=device)
        offsets = torch.arange(seq_len + 1, device=device)
        return self.tokens[starts + offsets].long()

    def tiled(self, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
        """Consecutive non-overlapping windows from the start (a fixed eval set): int64 [n, seq_len + 1]."""
        self._check(seq_len)
        n = (len(self) - 1) // seq_len
        if max_windows is not None:
            n = min(n, max_windows)
        starts = torch.arange(n, device=self.tokens.device)[:, None] * seq_len
        return self.tokens[starts + torch.arange(seq_len + 1, device=self.tokens.device)].long()


@dataclass
class DemoCorpus:
    """A loaded corpus folder: its manifest, both token streams and the tokenizer folder they belong to."""

    manifest: CorpusManifest
    train: TokenWindows
    val: TokenWindows
    tokenizer_dir: Path


def load_corpus(folder: Path, device: str | torch.device = "cpu") -> DemoCorpus:
    """Load a corpus folder onto ``device``, checking that its streams and tokenizer match the manifest."""
    from verify_service.demo.tokenizer import tokenizer_sha256

    folder = Path(folder)
    manifest = CorpusManifest.load(folder)
    tokenizer_dir = folder / TOKENIZER_SUBDIR
    if tokenizer_sha256(tokenizer_dir) != manifest.tokenizer_sha256:
        raise ValueError(f"{tokenizer_dir} is not the tokenizer the corpus was built with (sha256 differs)")
    streams = {}
    for split, name in zip(SPLITS, (TRAIN_NAME, VAL_NAME), strict=True):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is missing")
        streams[split] = TokenWindows.from_file(path, device)
        if len(streams[split]) != manifest.split_tokens[split]:
            raise ValueError(
                f"{path} holds {len(streams[split])} tokens, the manifest says {manifest.split_tokens[split]}"
            )
    return DemoCorpus(manifest, streams["train"], streams["val"], tokenizer_dir)
