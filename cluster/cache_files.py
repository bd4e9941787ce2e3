"""The files of the fingerprint-keyed caches (:mod:`cluster.sps_cache`, :mod:`cluster.tokenizer_cache`): how an
entry is named, how it is written, and the digests and package versions their fingerprints hold.

Contract: the entry for ``name`` and ``fingerprint`` is ``<root>/<slug>-<digest>.json``: the slug is ``name``
with every run of characters other than letters, digits, ``.``, ``_`` and ``-`` replaced by ``_`` and leading and
trailing ``.`` / ``_`` dropped (the cache's ``default`` when nothing is left), the digest the first 16 hex digits
of :func:`json_digest` of the fingerprint. Caches written earlier are found only while these names stay the same
(pinned by both caches' tests). Entries are written atomically (a temporary file in the same folder, then
renamed), so replicas of one node may share the folder. Standard library only: the scheduler replica imports the
tokenizer cache and none of torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any


def json_digest(value: Any) -> str:
    """SHA-256 (hex) of ``value`` as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """The digest that names a fingerprint's entry (see the module doc)."""
    return json_digest(fingerprint)[:16]


def entry_path(root: Path, name: str, fingerprint: dict[str, Any], default: str) -> Path:
    """``<root>/<slug of name, or default>-<digest>.json`` (see the module doc)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or default
    return root / f"{slug}-{fingerprint_digest(fingerprint)}.json"


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically, creating its folder; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)
    return path


def package_version(package: str) -> str | None:
    """The installed version of ``package``, None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
