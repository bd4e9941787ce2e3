"""Load and save DSpark draft checkpoints in DeepSpec's exact on-disk layout.

A checkpoint is a folder with ``config.json`` (the target's HF config plus DSpark keys, see ``config.py``) and
unprefixed weights (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ``markov_head.markov_w1.weight``,
...) in ``model.safetensors`` or in shards listed by ``model.safetensors.index.json``, stored float32 or
bfloat16. This is what DeepSpec's ``save_pretrained`` writes, and what our own training writes through
:func:`save_draft_model`.

The drafter carries copies of the target's input embedding and LM head. They must equal the target's (the
draft was trained with them frozen); a mismatch means a draft paired with the wrong target, which would not
break correctness (verification is lossless) but would ruin acceptance, so we warn loudly instead of failing.
Every error is a :class:`CheckpointError` (a ValueError) naming the file and the key or tensor.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draft_service.config import REAL_VOCAB_KEY, CheckpointError, DraftConfig, validate_target_layer_ids
from draft_service.model import DSparkDraftModel, RotaryEmbedding
from kernels.uninitialised import uninitialised

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

__all__ = [
    "CheckpointError",
    "EmbeddingMismatchWarning",
    "check_embeddings",
    "check_target_compatibility",
    "load_draft_model",
    "read_safetensors_folder",
    "read_target_embeddings",
    "save_draft_model",
]


class EmbeddingMismatchWarning(UserWarning):
    """The draft's embedding / LM head copies differ from the target's."""


def _tensor_files(folder: Path) -> tuple[dict[str, Path], Path]:
    """Map tensor name -> safetensors file, and the file to name in errors (weights file or index)."""
    index_path = folder / INDEX_NAME
    single_path = folder / WEIGHTS_NAME
    if single_path.is_file():
        with safe_open(str(single_path), framework="pt") as handle:
            return {name: single_path for name in handle.keys()}, single_path  # noqa: SIM118
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(str(index_path), "weight_map", f"unreadable shard index ({exc})") from exc
        if not isinstance(weight_map, Mapping):
            raise CheckpointError(
                str(index_path), "weight_map", "expected an object {tensor name: shard file}"
            )
        files: dict[str, Path] = {}
        for name, shard in weight_map.items():
            shard_path = folder / str(shard)
            if not shard_path.is_file():
                raise CheckpointError(str(index_path), name, f"shard file {shard_path} not found")
            files[name] = shard_path
        return files, index_path
    raise CheckpointError(
        str(folder), WEIGHTS_NAME, f"no weights: neither {WEIGHTS_NAME} nor {INDEX_NAME} exists"
    )


def read_safetensors_folder(
    folder: str | Path, names: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], Path]:
    """Read tensors (all, or only ``names``) from a single-file or sharded safetensors folder.

    Returns the tensors in their stored dtype and the path to name in errors.
    """
    folder = Path(folder)
    files, source = _tensor_files(folder)
    wanted = list(files) if names is None else names
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name not in files:
            raise CheckpointError(str(source), name, "missing tensor")
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            present = set(handle.keys())
            for name in file_names:
                if name not in present:
                    raise CheckpointError(
                        str(path), name, "missing tensor (listed in the index, absent in the shard)"
                    )
                tensors[name] = handle.get_tensor(name)
    return tensors, source


def read_target_embeddings(target_dir: str | Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(target config.json, input embedding [V, H], output embedding [V, H]) of an HF Qwen3 folder.

    Reads only those two tensors. A tied target has no ``lm_head.weight``: its output projection is the
    embedding.
    """
    target_dir = Path(target_dir)
    config_path = target_dir / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(str(config_path), "<file>", "target config file not found")
    target_config = json.loads(config_path.read_text())
    files, _ = _tensor_files(target_dir)
    names = ["model.embed_tokens.weight"]
    tied = bool(target_config.get("tie_word_embeddings", False)) or "lm_head.weight" not in files
    if not tied:
        names.append("lm_head.weight")
    tensors, _ = read_safetensors_folder(target_dir, names)
    embed = tensors["model.embed_tokens.weight"]
    return target_config, embed, embed if tied else tensors["lm_head.weight"]


def check_target_compatibility(
    config: DraftConfig, target_config: Mapping[str, Any], *, draft_source: str, target_source: str
) -> None:
    """The draft must fit its target: same vocabulary (and real vocabulary) and width, valid target layer ids."""
    for key in ("vocab_size", "hidden_size"):
        if key in target_config and target_config[key] != getattr(config, key):
            raise CheckpointError(
                draft_source,
                key,
                f"draft has {getattr(config, key)} but the target ({target_source}) has {target_config[key]}",
            )
    target_real = target_config.get(REAL_VOCAB_KEY, target_config.get("vocab_size"))
    draft_real = config.real_vocab_size or config.vocab_size
    if target_real is not None and target_real != draft_real:
        raise CheckpointError(
            draft_source,
            REAL_VOCAB_KEY,
            f"draft's real vocabulary is {draft_real} ids but the target's ({target_source}) is {target_real}",
        )
    target_layers = target_config.get("num_hidden_layers")
    if target_layers is not None:
        if target_layers != config.num_target_layers:
            raise CheckpointError(
                draft_source,
                "num_target_layers",
                f"draft was built for {config.num_target_layers} target layers, the target "
                f"({target_source}) has {target_layers}",
            )
        validate_target_layer_ids(
            list(config.target_layer_ids), int(target_layers), draft_source, "target_layer_ids"
        )


def _same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact when stored alike; within bf16/fp16 rounding when one side was stored at lower precision."""
    if a.shape != b.shape:
        return False
    if a.dtype == b.dtype:
        return torch.equal(a, b)
    low = a.dtype if a.dtype != torch.float32 else b.dtype
    return torch.equal(a.to(low), b.to(low))


def check_embeddings(
    draft_embed: torch.Tensor,
    draft_lm_head: torch.Tensor,
    target_embed: torch.Tensor,
    target_lm_head: torch.Tensor,
    *,
    source: str,
) -> list[str]:
    """Warn (EmbeddingMismatchWarning) for each copy that differs from the target's; return the messages."""
    problems = []
    for key, draft_w, target_w in (
        ("embed_tokens.weight", draft_embed, target_embed),
        ("lm_head.weight", draft_lm_head, target_lm_head),
    ):
        if not _same_weights(draft_w, target_w):
            diff = (
                (draft_w.float() - target_w.float()).abs().max().item()
                if draft_w.shape == target_w.shape
                else None
            )
            message = (
                f"{source}: '{key}' differs from the target's copy (max abs diff {diff}, shapes "
                f"{tuple(draft_w.shape)} vs {tuple(target_w.shape)}): is this draft trained for this target?"
            )
            problems.append(message)
            logger.warning(message)
            warnings.warn(message, EmbeddingMismatchWarning, stacklevel=3)
    return problems


def load_draft_model(
    draft_dir: str | Path,
    *,
    target_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DSparkDraftModel:
    """Load a DeepSpec-layout draft folder; with ``target_dir``, also check it against the target (HF folder).

    Weights stored bf16/fp16/fp32 are converted to ``dtype`` (float32 on CPU per SHARED_DECISIONS).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise CheckpointError(str(draft_dir), "<folder>", "draft checkpoint folder not found")
    config_path = draft_dir / CONFIG_NAME
    config = DraftConfig.from_json(config_path)
    target_embed = target_lm_head = None
    if target_dir is not None:
        target_config, target_embed, target_lm_head = read_target_embeddings(target_dir)
        check_target_compatibility(
            config,
            target_config,
            draft_source=str(config_path),
            target_source=str(Path(target_dir) / CONFIG_NAME),
        )

    with uninitialised():  # every parameter is assigned from the files below
        model = DSparkDraftModel(config)
    expected = model.state_dict()
    files, source = _tensor_files(draft_dir)
    for name in files:
        if name not in expected:
            raise CheckpointError(
                str(files[name]), name, "unexpected tensor (not part of this config's model)"
            )
    raw, _ = read_safetensors_folder(draft_dir, list(expected))
    for name, tensor in raw.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                str(files[name]),
                name,
                f"shape {tuple(tensor.shape)} does not match {tuple(expected[name].shape)} implied by "
                f"{config_path}",
            )
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(str(files[name]), name, f"unsupported dtype {tensor.dtype}")
    if target_embed is not None and target_lm_head is not None:
        check_embeddings(
            raw["embed_tokens.weight"],
            raw["lm_head.weight"],
            target_embed,
            target_lm_head,
            source=str(source),
        )

    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in raw.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
    model.requires_grad_(False)
    return model.eval()


def save_draft_model(
    model: DSparkDraftModel,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``model`` in DeepSpec's layout: config.json + unprefixed safetensors (sharded above
    max_shard_bytes).

    Stale weight files in ``out_dir`` are removed first so a folder never holds two competing weight sets.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    config = model.config.to_dict()
    config["dtype"] = DTYPE_NAMES[dtype]
    config.pop("torch_dtype", None)
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    metadata = {"format": "pt"}
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata=metadata)
        return out_dir
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir
