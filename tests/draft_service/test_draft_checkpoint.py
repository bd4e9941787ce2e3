"""Draft checkpoint loading: DeepSpec layout variants load, and every bad checkpoint fails with the file and
key.

Errors are CheckpointError (a ValueError) whose message names the offending file and the config key or tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_service.checkpoint import (
    CheckpointError,
    EmbeddingMismatchWarning,
    load_draft_model,
    save_draft_model,
)
from draft_service.config import DraftConfig
from tests.model_factory import PairSpec, draft_config_dict, write_pair

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "deepspec_tiny_a"
SPEC = PairSpec(markov_head_type="rnn", target_layer_ids=(-1, 1), tie_embeddings=False)


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    write_pair(root, SPEC)
    return root


@pytest.fixture
def pair(pair_root, tmp_path) -> tuple[Path, Path]:
    """A private, mutable copy of the pair for one test."""
    shutil.copytree(pair_root, tmp_path / "pair")
    return tmp_path / "pair" / "target", tmp_path / "pair" / "draft"


def edit_config(draft_dir: Path, **changes) -> Path:
    path = draft_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


def expect_error(match_file: Path | str, key: str, **load_kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        load_draft_model(**load_kwargs)
    message = str(info.value)
    assert str(match_file) in message and key in message, message
    assert isinstance(info.value, ValueError)
    return info.value


def test_loads_with_target_check(pair):
    target_dir, draft_dir = pair
    model = load_draft_model(draft_dir, target_dir=target_dir)
    assert model.config.markov_head_type == "rnn" and model.config.target_layer_ids == (-1, 1)
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_config(pair):
    _, draft_dir = pair
    (draft_dir / "config.json").unlink()
    expect_error(draft_dir / "config.json", "<file>", draft_dir=draft_dir)


def test_missing_folder(tmp_path):
    expect_error(tmp_path / "nope", "<folder>", draft_dir=tmp_path / "nope")


def test_missing_weights_file(pair):
    _, draft_dir = pair
    (draft_dir / "model.safetensors").unlink()
    expect_error(draft_dir, "model.safetensors", draft_dir=draft_dir)


def test_missing_tensor(pair):
    _, draft_dir = pair
    weights = draft_dir / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["markov_head.joint_proj.bias"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    expect_error(weights, "markov_head.joint_proj.bias", draft_dir=draft_dir)


def test_unexpected_tensor_and_wrong_shape(pair):
    _, draft_dir = pair
    weights = draft_dir / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["layers.5.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(weights))
    expect_error(weights, "layers.5.mlp.up_proj.weight", draft_dir=draft_dir)
    del tensors["layers.5.mlp.up_proj.weight"]
    tensors["fc.weight"] = torch.zeros(SPEC.hidden, SPEC.hidden)
    save_file(tensors, str(weights))
    error = expect_error(weights, "fc.weight", draft_dir=draft_dir)
    assert "shape" in str(error)


def test_unknown_markov_head_type(pair):
    _, draft_dir = pair
    config = edit_config(draft_dir, markov_head_type="lstm")
    expect_error(config, "markov_head_type", draft_dir=draft_dir)


def test_missing_config_keys(pair):
    _, draft_dir = pair
    config = edit_config(draft_dir, markov_head_type=None)
    expect_error(config, "markov_head_type", draft_dir=draft_dir)
    config = edit_config(draft_dir, markov_head_type="rnn", block_size=None)
    expect_error(config, "block_size", draft_dir=draft_dir)
    config = edit_config(draft_dir, block_size=4, enable_confidence_head="yes")
    expect_error(config, "enable_confidence_head", draft_dir=draft_dir)


def test_vocab_and_width_mismatch_with_target(pair):
    target_dir, draft_dir = pair
    target_config = target_dir / "config.json"
    data = json.loads(target_config.read_text())
    target_config.write_text(json.dumps({**data, "vocab_size": SPEC.vocab + 1}))
    error = expect_error(draft_dir / "config.json", "vocab_size", draft_dir=draft_dir, target_dir=target_dir)
    assert str(target_config) in str(error)
    target_config.write_text(json.dumps({**data, "hidden_size": SPEC.hidden * 2}))
    expect_error(draft_dir / "config.json", "hidden_size", draft_dir=draft_dir, target_dir=target_dir)


def test_target_layer_ids_out_of_range(pair):
    target_dir, draft_dir = pair
    for bad in (
        [0, SPEC.target_layers - 1],
        [-2, 0],
        [0, 17],
        [1, 0],
    ):  # last layer, below -1, beyond, unordered
        config = edit_config(draft_dir, target_layer_ids=bad)
        expect_error(config, "target_layer_ids", draft_dir=draft_dir)
    # valid for the draft's own num_target_layers, but the target has fewer layers
    edit_config(draft_dir, target_layer_ids=[-1, 1])
    target_config = target_dir / "config.json"
    data = json.loads(target_config.read_text())
    target_config.write_text(json.dumps({**data, "num_hidden_layers": 2}))
    expect_error(draft_dir / "config.json", "num_target_layers", draft_dir=draft_dir, target_dir=target_dir)


def test_missing_shard_is_named(pair, tmp_path):
    _, draft_dir = pair
    sharded = save_draft_model(load_draft_model(draft_dir), tmp_path / "sharded", max_shard_bytes=8192)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    expect_error(sharded / "model.safetensors.index.json", shard, draft_dir=sharded)


def test_embedding_mismatch_warns(pair):
    target_dir, draft_dir = pair
    weights = draft_dir / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.5
    save_file(tensors, str(weights))
    with pytest.warns(EmbeddingMismatchWarning, match="lm_head.weight"):
        load_draft_model(draft_dir, target_dir=target_dir)


def test_bf16_checkpoint_of_fp32_target_does_not_warn(pair, tmp_path, recwarn):
    target_dir, draft_dir = pair
    bf16 = save_draft_model(load_draft_model(draft_dir), tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_draft_model(bf16, target_dir=target_dir)
    assert model.dtype == torch.float32
    assert not [w for w in recwarn if issubclass(w.category, EmbeddingMismatchWarning)]


def test_legacy_top_level_rope_theta(tmp_path):
    """Older configs write rope_theta at top level; the parsed RoPE and the model output are the same."""
    shutil.copytree(FIXTURE / "draft", tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    (tmp_path / "draft" / "config.json").write_text(
        json.dumps({**config, "rope_theta": theta, "rope_scaling": None})
    )
    legacy = load_draft_model(tmp_path / "draft")
    modern = load_draft_model(FIXTURE / "draft")
    assert legacy.config == modern.config
    features = torch.randn(6, legacy.config.context_feature_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(legacy.draft_block_uncached(features, 3), modern.draft_block_uncached(features, 3))
    bad = {**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0}}
    (tmp_path / "draft" / "config.json").write_text(json.dumps(bad))
    expect_error(
        tmp_path / "draft" / "config.json", "rope_parameters.rope_type", draft_dir=tmp_path / "draft"
    )


def test_config_roundtrip_keeps_deepspec_keys():
    raw = json.loads((FIXTURE / "draft" / "config.json").read_text())
    config = DraftConfig.from_dict(raw)
    out = config.to_dict()
    assert out == raw  # nothing lost, nothing renamed
    no_heads = draft_config_dict(raw | {"num_hidden_layers": 4}, PairSpec(markov_rank=0, confidence=False))
    parsed = DraftConfig.from_dict(no_heads)
    assert parsed.markov_head_type is None and "markov_head_type" not in parsed.to_dict()
    assert "confidence_head_with_markov" not in parsed.to_dict()
