"""verify_service.qwen3 reads a checkpoint into exactly what transformers' loader gives the target (bit for bit),
falls back to transformers for configs it does not reproduce, refuses weights that do not fit, and keeps
transformers out of the verifier replica's imports (what its restart paid 3-5 s for on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors.torch import load_file, save_file
from test_verify_target import make_qwen3, random_ids
from transformers import Qwen3ForCausalLM

from verify_service.qwen3 import Qwen3Modules, load_qwen3
from verify_service.target import TargetModel


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_are_transformers_weights(tmp_path: Path, tied: bool, dtype: torch.dtype) -> None:
    folder = make_qwen3(tmp_path, seed=3, tied=tied)
    ours = load_qwen3(folder, dtype=dtype, device="cpu")
    assert ours is not None
    theirs = Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    ours_state, their_state = ours.state_dict(), theirs.state_dict()
    assert ours_state.keys() == their_state.keys()
    for name, tensor in ours_state.items():
        assert tensor.dtype == their_state[name].dtype and torch.equal(tensor, their_state[name]), name
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert not any(p.requires_grad for p in ours.parameters()) and not ours.training
    positions = torch.arange(40)[None]
    x = torch.zeros(1, dtype=dtype)
    for mine, reference in zip(ours.model.rotary_emb(x, positions), theirs.model.rotary_emb(x, positions),
                               strict=True):
        assert torch.equal(mine, reference)


@pytest.mark.parametrize("tied", [True, False])
def test_the_target_computes_the_same_logits_and_features_either_way(tmp_path: Path, tied: bool) -> None:
    """Prefill chunks then verify chunks of a ragged batch, and greedy generation: equal, not just close."""
    folder = make_qwen3(tmp_path, seed=4, tied=tied)
    layer_ids = (-1, 1, 2)
    ours = TargetModel.from_pretrained(folder, layer_ids)
    assert isinstance(ours.modules, Qwen3Modules)
    theirs = TargetModel(Qwen3ForCausalLM.from_pretrained(folder, local_files_only=True), layer_ids)
    gen = torch.Generator().manual_seed(4)
    prompts, chunks = [random_ids(gen, 9), random_ids(gen, 3)], [random_ids(gen, 5), random_ids(gen, 2)]
    outputs = []
    for target in (ours, theirs):
        cache = target.new_kv_cache(2, 32)
        slots = [cache.allocate(), cache.allocate()]
        steps = [target.forward(cache, target.prepare(cache, list(zip(slots, batch, strict=True))))
                 for batch in (prompts, chunks)]
        outputs.append(steps)
    for mine, reference in zip(*outputs, strict=True):
        assert torch.equal(mine.logits, reference.logits) and torch.equal(mine.features, reference.features)
    assert ours.generate(prompts, 16) == theirs.generate(prompts, 16)
    assert ours.eos_token_ids == theirs.eos_token_ids


def test_a_config_it_does_not_reproduce_loads_through_transformers(tmp_path: Path) -> None:
    folder = make_qwen3(tmp_path, seed=5)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    config_file.write_text(json.dumps(config))
    assert load_qwen3(folder, dtype=torch.float32, device="cpu") is None
    target = TargetModel.from_pretrained(folder, (0,))
    assert isinstance(target.modules, Qwen3ForCausalLM)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    folder = make_qwen3(tmp_path, seed=6, tied=False)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing .*up_proj.*unexpected .*extra"):
        load_qwen3(folder, dtype=torch.float32, device="cpu")


def test_the_verifier_replica_imports_no_transformers() -> None:
    """What a verifier replica imports before serving: the Serve application, the engine builder, its services."""
    code = ("import sys, cluster.app, cluster.loading, verify_service.rpc_service, draft_service.projection; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "[]"
