"""Drafter inflation (draft_service/inflate.py): the inflated drafter on the inflated target's context features
drafts exactly what the small drafter drafts on the small target's, and speculative decoding of the inflated pair
gives the small pair's tokens and acceptance.

Small pairs: random Qwen3 targets (hidden 32, 4/2 heads of dim 8, 4 layers, vocab 96, rms_norm_eps 0.05 so that
eps mistakes are visible) with random DeepSpec-layout drafters from tests/model_factory.py, inflated into hidden 48,
8/4 heads of dim 16, 6 target layers, intermediate 96, vocab 160, in float32.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from model_factory import PairSpec, random_draft
from transformers import Qwen3Config, Qwen3ForCausalLM

from cluster.cli import main as cli_main
from draft_service.checkpoint import CheckpointError, load_draft_model, save_draft_model
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.inflate import InflatedPair, inflate_draft, inflate_pair
from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import sample_block
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.inflate import Qwen3Shape, inflate_target, load_small_target, save_target
from verify_service.target import TargetModel

V_SMALL, V_BIG = 96, 160
BIG = Qwen3Shape(48, 6, 8, 4, 16, 96, V_BIG, True)
TOL = 1e-5


def write_small_pair(root: Path, spec: PairSpec) -> tuple[Path, Path]:
    """A random target with a large eps and non-trivial norm weights, and a random drafter for it."""
    config = Qwen3Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.target_layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate, max_position_embeddings=256, rms_norm_eps=0.05,
        initializer_range=0.1, tie_word_embeddings=spec.tie_embeddings, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(spec.seed)
    target = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    draft_dir = root / "draft"
    save_draft_model(random_draft(target_dir, spec), draft_dir)
    return target_dir, draft_dir


SPECS = {
    "vanilla": PairSpec(vocab=V_SMALL, block_size=5, target_layer_ids=(-1, 0, 2), seed=3),
    "gated": PairSpec(vocab=V_SMALL, markov_head_type="gated", draft_layers=2, seed=4),
    "rnn-untied": PairSpec(vocab=V_SMALL, markov_head_type="rnn", tie_embeddings=False, seed=5),
    "nomarkov": PairSpec(vocab=V_SMALL, markov_rank=0, markov_head_type=None, confidence_with_markov=False, seed=6),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def pair_dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_small_pair(tmp_path_factory.mktemp(request.param), SPECS[request.param])


def features_of(hf: Qwen3ForCausalLM, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1] for i in layer_ids], dim=-1)


def test_draft_block_logits_equal(pair_dirs: tuple[Path, Path]) -> None:
    target_dir, draft_dir = pair_dirs
    pair = inflate_pair(target_dir, draft_dir, BIG, dtype=torch.float32, device="cpu")
    small_target = load_small_target(target_dir)
    small = load_draft_model(draft_dir, target_dir=target_dir)
    big = pair.draft
    assert isinstance(big, DSparkDraftModel)
    c = big.config
    assert (c.hidden_size, c.num_target_layers, c.vocab_size, c.real_vocab_size) == (48, 6, V_BIG, V_SMALL)
    assert c.mask_token_id == small.config.mask_token_id and c.target_layer_ids == small.config.target_layer_ids
    assert torch.equal(big.embed_tokens.weight, pair.target.get_input_embeddings().weight)
    assert torch.equal(big.lm_head.weight, pair.target.get_output_embeddings().weight)

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V_SMALL, (3, 14), generator=generator)
    lengths = torch.tensor([14, 9, 3])
    anchors = torch.tensor([7, 50, 95])
    layer_ids = small.config.target_layer_ids
    with torch.no_grad():
        h_small = small.forward_blocks(features_of(small_target, ids, layer_ids), anchors, lengths)
        h_big = big.forward_blocks(features_of(pair.target, ids, layer_ids), anchors, lengths)
    assert (h_big[..., :32] - h_small).abs().max().item() < TOL
    assert bool((h_big[..., 32:] == 0).all())

    u_small, u_big = small.base_logits(h_small), big.base_logits(h_big)
    diff = (u_big[..., :V_SMALL] - u_small).abs().max().item()
    print(f"max |draft logit diff| (fp32): {diff:.2e}")
    assert diff < TOL
    assert bool((u_big[..., V_SMALL:] == float("-inf")).all())
    prev = torch.randint(0, V_SMALL, (3, small.block_size), generator=generator)
    m_small, m_big = small.markov_logits(u_small, prev, h_small), big.markov_logits(u_big, prev, h_big)
    assert (m_big[..., :V_SMALL] - m_small).abs().max().item() < TOL
    conf_small, conf_big = small.confidence_logits(h_small, prev), big.confidence_logits(h_big, prev)
    assert (conf_big - conf_small).abs().max().item() < TOL

    # Sampling at T=1 with the same uniforms: the same tokens, never a padded id; also through top-K sparse form.
    uniforms = torch.rand(3, small.block_size, generator=generator)
    for top_k in (0, 8):
        s_small = sample_block(small, h_small, anchors, temperature=1.0, draft_top_k=top_k, uniforms=uniforms)
        s_big = sample_block(big, h_big, anchors, temperature=1.0, draft_top_k=top_k, uniforms=uniforms)
        assert torch.equal(s_big.tokens, s_small.tokens)
        assert int(s_big.tokens.max()) < V_SMALL


def test_saved_pair_loads_without_embedding_warnings(pair_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, draft_dir = pair_dirs
    pair = inflate_pair(target_dir, draft_dir, BIG, dtype=torch.bfloat16, out_dir=tmp_path)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["dspark_real_vocab_size"] == V_SMALL and config["num_target_layers"] == 6
    assert (tmp_path / "target" / "config.json").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an EmbeddingMismatchWarning would fail here
        loaded = load_draft_model(tmp_path / "draft", target_dir=tmp_path / "target", dtype=torch.bfloat16)
    assert loaded.config.real_vocab_size == V_SMALL
    for name, tensor in pair.draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def _spec_engine(target: TargetModel, draft: DSparkDraftModel, policy: str) -> SpeculativeEngine:
    sps = SPSTable([1, 8, 16, 32, 64], [1000, 990, 960, 900, 700])
    verify = VerifyEngine(target, max_requests=6, max_seq_len=128)
    drafter = DraftEngine(draft, max_requests=6, max_seq_len=128)
    return SpeculativeEngine(verify, drafter, make_policy(policy, sps, draft.block_size))


@pytest.fixture(scope="module")
def vanilla_pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[InflatedPair, TargetModel, DSparkDraftModel]:
    target_dir, draft_dir = write_small_pair(tmp_path_factory.mktemp("engine"), SPECS["vanilla"])
    small_draft = load_draft_model(draft_dir, target_dir=target_dir)
    small_target = TargetModel.from_pretrained(target_dir, small_draft.config.target_layer_ids)
    pair = inflate_pair(target_dir, draft_dir, BIG, dtype=torch.float32, fill="random", seed=9)
    return pair, small_target, small_draft


@pytest.mark.parametrize("policy", ["full", "dspark"])
def test_speculative_greedy_output_and_acceptance_equal(vanilla_pairs, policy: str) -> None:
    pair, small_target, small_draft = vanilla_pairs
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, V_SMALL, size=int(rng.integers(2, 20))).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    small = _spec_engine(small_target, small_draft, policy).generate(prompts, params)
    big = _spec_engine(pair.target_model(), pair.draft, policy).generate(prompts, params)
    assert [r.token_ids for r in big] == [r.token_ids for r in small]
    assert [r.metrics.accepted for r in big] == [r.metrics.accepted for r in small]
    assert [r.token_ids for r in small] == small_target.generate(prompts, max_new_tokens=40)
    assert sum(sum(r.metrics.accepted) for r in small) > 0  # the drafts are verified, some accepted


def test_speculative_sampling_at_t1_matches_and_never_emits_padding(vanilla_pairs) -> None:
    pair, small_target, small_draft = vanilla_pairs
    prompts = [[5, 17, 33], [60, 3, 3, 81], [1], [90, 91, 92, 93, 94]]
    params = [SamplingParams(temperature=1.0, max_tokens=48, seed=s) for s in range(len(prompts))]
    small = _spec_engine(small_target, small_draft, "full").generate(prompts, params)
    big = _spec_engine(pair.target_model(), pair.draft, "full").generate(prompts, params)
    assert [r.token_ids for r in big] == [r.token_ids for r in small]
    assert all(0 <= t < V_SMALL for r in big for t in r.token_ids)


def test_real_vocabulary_is_validated(vanilla_pairs, tmp_path: Path) -> None:
    pair, _, small_draft = vanilla_pairs
    raw = pair.draft.config.to_dict()
    with pytest.raises(CheckpointError, match="dspark_real_vocab_size"):
        DraftConfig.from_dict({**raw, "dspark_real_vocab_size": V_BIG + 1})
    with pytest.raises(CheckpointError, match="padded id"):
        DraftConfig.from_dict({**raw, "mask_token_id": V_SMALL + 1})
    # A drafter inflated for another real vocabulary does not fit this target.
    save_target(pair.target, tmp_path / "target")
    save_draft_model(pair.draft, tmp_path / "draft")
    config_file = tmp_path / "draft" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "dspark_real_vocab_size": 120}))
    with pytest.raises(CheckpointError, match="real vocabulary"):
        load_draft_model(tmp_path / "draft", target_dir=tmp_path / "target")
    with pytest.raises(ValueError, match="real ids"):
        inflate_draft(small_draft, inflate_target(other_vocab_target(), BIG, dtype=torch.float32))


def other_vocab_target() -> Qwen3ForCausalLM:
    """A small Qwen3 whose vocabulary (80) differs from the drafters' (96)."""
    config = Qwen3Config(vocab_size=80, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64)  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def test_cli_inflates_saves_and_checks(pair_dirs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    target_dir, draft_dir = pair_dirs
    shape_file = tmp_path / "shape.json"
    shape_file.write_text(json.dumps({"model_type": "qwen3", **dataclasses.asdict(BIG)}))
    out = tmp_path / "out"
    args = ["inflate", "--target", str(target_dir), "--draft", str(draft_dir), "--shape", str(shape_file)]
    options = ["--out", str(out), "--device", "cpu", "--dtype", "float32", "--check", "--check-tokens", "16"]
    code = cli_main([*args, *options])
    text = capsys.readouterr().out
    assert code == 0, text
    report = {k.strip(): float(v) for k, v in (line.split(":") for line in text.splitlines() if "diff" in line)}
    assert report["max_abs_logit_diff"] < TOL and report["draft_max_abs_logit_diff"] < TOL
    loaded = load_draft_model(out / "draft", target_dir=out / "target")
    assert loaded.config.hidden_size == BIG.hidden_size
    assert cli_main([*args[:-1], "qwen3-5b", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err
