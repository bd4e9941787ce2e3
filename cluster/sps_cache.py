"""The SPS cache: profiled SPS tables kept between starts, keyed by a fingerprint of what they depend on.

A table measures the verify step of one engine on one device, so it is reusable exactly when nothing it depends
on changed. :func:`sps_fingerprint` collects that: the target's ``config.json`` and the identity of its weight
files (names, sizes and safetensors headers, i.e. tensor names, dtypes and shapes: a step's cost depends on
the shapes, not on the values, and reading headers stays cheap for many-GB checkpoints), the layers whose
hidden states the drafter consumes, dtype, device type and name, the torch / triton / CUDA versions, the engine
shape (block size, max_requests, graph mode, draft_top_k, graph prefill rows) and the profiler's
own version. Its digest names the cache file, so a changed fingerprint misses and the table is profiled anew;
the miss names what changed against an earlier table of the same model.

Files live under ``<cache_dir>/sps/`` as ``<target folder name>-<digest>.json`` and are written atomically
(several replicas of one node may share the folder; names and writes: :mod:`cluster.cache_files`). The cache never
deletes anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.cache_files import entry_path, json_digest, package_version, write_atomic
from scheduler.sps import SPSSource, load_sps

logger = logging.getLogger(__name__)

FORMAT = "dspark-sps-cache/1"
#: Largest safetensors header read for the fingerprint (a header is JSON of the tensor index: kilobytes).
MAX_HEADER_BYTES = 64 << 20


@dataclass(frozen=True)
class EngineShape:
    """The verify engine's shape, as far as a profiled step depends on it."""

    block_size: int
    max_requests: int
    graphs: str
    draft_top_k: int
    graph_prefill_rows: int


def _weight_identity(path: Path) -> dict[str, Any]:
    """Name, size and (safetensors) header digest of one weight file; other formats: name, size and mtime."""
    size = path.stat().st_size
    entry: dict[str, Any] = {"name": path.name, "size": size}
    if path.suffix == ".safetensors":
        with path.open("rb") as f:
            raw = f.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{path}: not a safetensors file (header length {length})")
            entry["header"] = hashlib.sha256(f.read(length)).hexdigest()
    else:
        entry["mtime_ns"] = path.stat().st_mtime_ns
    return entry


def device_identity(device: torch.device) -> dict[str, Any]:
    """What names a device's speed: the GPU's name and compute capability, or the CPU and its thread count."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {
            "type": "cuda",
            "name": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
        }
    return {
        "type": device.type,
        "name": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


def sps_fingerprint(
    target_dir: str | Path,
    feature_layer_ids: tuple[int, ...],
    dtype: str,
    device: torch.device,
    shape: EngineShape,
    profiler_version: int,
) -> dict[str, Any]:
    """Everything a profiled SPS table depends on (see the module doc); equal fingerprints, reusable table."""
    folder = Path(target_dir)
    config = json.loads((folder / "config.json").read_text())
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    if not weights:
        raise ValueError(f"{folder}: no weight files to fingerprint")
    return {
        "profiler_version": profiler_version,
        "model_config": json_digest(config),
        "weights": [_weight_identity(p) for p in weights],
        "feature_layer_ids": list(feature_layer_ids),
        "dtype": dtype,
        "device": device_identity(device),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "cuda": torch.version.cuda,
        "engine": {
            "block_size": shape.block_size,
            "max_requests": shape.max_requests,
            "graphs": shape.graphs,
            "draft_top_k": shape.draft_top_k,
            # Only bucketed steps have prefill rows (an eager engine's value is irrelevant).
            "graph_prefill_rows": shape.graph_prefill_rows if shape.graphs != "off" else 0,
        },
    }


def _changed(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fingerprint entries that differ."""
    out: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


class SPSCache:
    """SPS tables under ``root`` (normally ``<cache_dir>/sps``), one JSON file per fingerprint."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path_for(self, name: str, fingerprint: dict[str, Any]) -> Path:
        return entry_path(self.root, name, fingerprint, "model")

    def lookup(self, name: str, fingerprint: dict[str, Any]) -> SPSSource | None:
        """The cached table for ``fingerprint``, or None (missing, unreadable or for another fingerprint)."""
        path = self.path_for(name, fingerprint)
        if not path.is_file():
            self._explain_miss(name, fingerprint)
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("fingerprint") != fingerprint:
                raise ValueError("written for another fingerprint")
            return load_sps(data["sps"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring the cached SPS table %s (%s); profiling again", path, error)
            return None

    def store(self, name: str, fingerprint: dict[str, Any], sps: SPSSource) -> Path:
        """Write ``sps`` for ``fingerprint`` atomically; returns its path."""
        body = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "sps": sps.to_dict()}, indent=1) + "\n"
        return write_atomic(self.path_for(name, fingerprint), body)

    def _explain_miss(self, name: str, fingerprint: dict[str, Any]) -> None:
        """Log what changed against the newest cached table of the same model, if there is one."""
        stem = self.path_for(name, fingerprint).name.rsplit("-", 1)[0]
        others = sorted(self.root.glob(f"{stem}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for other in others:
            try:
                old = json.loads(other.read_text()).get("fingerprint")
            except (OSError, ValueError):
                continue
            if isinstance(old, dict):
                logger.info("the cached SPS table %s is stale for this engine (changed: %s)", other,
                            ", ".join(_changed(old, fingerprint)) or "nothing?")
                return
