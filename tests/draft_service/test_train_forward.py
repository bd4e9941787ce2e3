"""Drafter training pieces: the batched multi-anchor forward, the DSpark loss, anchors, response storage."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from model_factory import PairSpec, random_draft, write_target

from draft_service.training.forward import block_attention_mask, multi_block_hidden
from draft_service.training.loss import LossWeights, dspark_loss, position_weights
from draft_service.training.recipe import DrafterShape, DrafterTrainConfig, draft_config_dict
from draft_service.training.responses import ResponseSplit
from draft_service.training.trainer import sample_anchors


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    spec = PairSpec(block_size=4, draft_layers=2, target_layer_ids=(0, 2), markov_head_type="rnn")
    target_dir = write_target(tmp_path_factory.mktemp("pair") / "target", spec)
    return spec, random_draft(target_dir, spec), target_dir


def test_multi_block_forward_equals_forward_blocks_row_by_row(pair) -> None:
    """All anchors of a sequence in one masked pass == each anchor alone over its context prefix."""
    spec, draft, _ = pair
    torch.manual_seed(0)
    B, S, A = 2, 13, 5
    features = torch.randn(B, S, len(spec.target_layer_ids) * spec.hidden)
    anchors = torch.tensor([[1, 4, 4, 9, 13], [2, 3, 7, 11, 12]])
    anchor_ids = torch.randint(0, spec.vocab - 1, (B, A))
    with torch.no_grad():
        ours = multi_block_hidden(draft, features, anchors, anchor_ids)
        reference = draft.forward_blocks(
            features.repeat_interleave(A, dim=0), anchor_ids.reshape(-1), anchors.reshape(-1)
        ).view(B, A, spec.block_size, -1)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)


def test_teacher_features_are_what_the_verifier_sends(pair) -> None:
    """Training reads context features from HF hidden states; serving from TargetModel: they must agree."""
    from transformers import Qwen3ForCausalLM

    from draft_service.training.teacher import Teacher
    from verify_service.target import TargetModel

    spec, _, target_dir = pair
    hf = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    ids = torch.randint(0, spec.vocab, (1, 11), generator=torch.Generator().manual_seed(2))
    features, final_hidden = Teacher(hf, spec.target_layer_ids).features(ids)
    target = TargetModel(hf, spec.target_layer_ids)
    cache = target.new_kv_cache(1, 16)
    slot = cache.allocate()
    out = target.forward(cache, target.prepare(cache, [(slot, ids[0].tolist())]))
    torch.testing.assert_close(features[0], out.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(Teacher(hf, ()).logits(final_hidden[0]), out.logits, atol=1e-4, rtol=1e-4)


def test_block_mask_sees_own_block_and_earlier_context_only() -> None:
    mask = block_attention_mask(torch.tensor([[2, 5]]), context_len=6, block_size=3)[0, 0]
    assert mask.shape == (6, 6 + 6)
    assert mask[0, :6].tolist() == [True, True, False, False, False, False]  # block 0: anchor at 2
    assert mask[3, :6].tolist() == [True] * 5 + [False]  # block 1: anchor at 5
    assert mask[0, 6:].tolist() == [True] * 3 + [False] * 3
    assert mask[5, 6:].tolist() == [False] * 3 + [True] * 3


def test_multi_block_forward_rejects_bad_anchors(pair) -> None:
    spec, draft, _ = pair
    features = torch.randn(1, 4, len(spec.target_layer_ids) * spec.hidden)
    with pytest.raises(ValueError, match="anchor positions"):
        multi_block_hidden(draft, features, torch.tensor([[0]]), torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"\[B, A\]"):
        multi_block_hidden(draft, features, torch.tensor([[1, 2]]), torch.tensor([[1]]))


def test_loss_is_zero_tv_and_full_acceptance_when_draft_equals_target() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 4, 10)
    labels = torch.randint(0, 10, (6, 4))
    out = dspark_loss(logits.clone(), logits, labels, torch.zeros(6, 4), LossWeights())
    assert float(out.tv) == pytest.approx(0.0, abs=1e-6)
    assert out.acceptance.tolist() == pytest.approx([1.0] * 4, abs=1e-6)
    assert float(out.tau_proxy) == pytest.approx(5.0, abs=1e-5)  # 1 + block size
    assert float(out.confidence_error) == pytest.approx(0.5, abs=1e-6)  # sigmoid(0) against label 1
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), labels.reshape(-1), reduction="none").view(
        6, 4
    )
    w = position_weights(4, 7.0)
    assert float(out.ce) == pytest.approx(float((ce.mean(0) * w).sum() / w.sum()), rel=1e-5)
    assert float(out.loss) == pytest.approx(0.1 * float(out.ce) + float(out.bce), rel=1e-5)


def test_loss_terms_and_weights() -> None:
    assert position_weights(3, 7.0).tolist() == pytest.approx([1.0, math.exp(-1 / 7), math.exp(-2 / 7)])
    draft = torch.tensor([[[0.0, 0.0]]])  # p_d = (0.5, 0.5)
    target = torch.tensor([[[math.log(3.0), 0.0]]])  # p_t = (0.75, 0.25)
    out = dspark_loss(draft, target, torch.tensor([[0]]), torch.tensor([[0.0]]), LossWeights())
    assert float(out.tv) == pytest.approx(0.25)
    assert out.acceptance.tolist() == pytest.approx([0.75])
    bce = -(0.75 * math.log(0.5) + 0.25 * math.log(0.5))
    assert float(out.bce) == pytest.approx(bce)
    assert float(out.loss) == pytest.approx(0.1 * math.log(2) + 0.9 * 0.25 + bce, rel=1e-6)


def test_confidence_label_carries_no_gradient_into_the_draft_distribution() -> None:
    torch.manual_seed(1)
    draft = torch.randn(3, 2, 5, requires_grad=True)
    confidence = torch.randn(3, 2, requires_grad=True)
    out = dspark_loss(
        draft,
        torch.randn(3, 2, 5),
        torch.zeros(3, 2, dtype=torch.long),
        confidence,
        LossWeights(ce=0.0, tv=0.0, confidence=1.0),
    )
    out.loss.backward()
    assert draft.grad is None or float(draft.grad.abs().max()) == 0.0
    assert float(confidence.grad.abs().max()) > 0


def test_anchors_lie_in_the_response_with_room_for_a_block() -> None:
    prompt = torch.tensor([3, 10, 1])
    length = torch.tensor([20, 19, 9])
    anchors = sample_anchors(prompt, length, 500, 4, torch.Generator().manual_seed(0))
    assert bool((anchors >= prompt[:, None]).all()) and bool((anchors + 4 <= length[:, None] - 1).all())
    assert anchors[0].min() == 3 and anchors[0].max() == 15  # the whole range is reachable


def test_draft_config_for_each_head(tmp_path: Path) -> None:
    from draft_service.config import DraftConfig

    target_config = {
        "vocab_size": 64,
        "hidden_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "model_type": "qwen3",
        "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
    }
    for head in ("vanilla", "rnn", "none"):
        shape = DrafterShape(head=head, target_layer_ids=(0, 2), markov_rank=8)
        config = DraftConfig.from_dict(draft_config_dict(target_config, shape, DrafterTrainConfig()))
        assert config.mask_token_id == 63 and config.block_size == 7 and config.enable_confidence_head
        assert config.markov_head_type == (None if head == "none" else head)
        assert config.confidence_head_with_markov == (head != "none")
    with pytest.raises(ValueError, match="head"):
        draft_config_dict(target_config, DrafterShape(head="gru"))


def test_response_split_round_trip(tmp_path: Path) -> None:
    prompts = [np.array([5, 6, 7]), np.array([1, 2])]
    responses = [np.array([8, 9]), np.array([3, 4, 0, 11])]
    split = ResponseSplit.from_sequences(prompts, responses, [True, False])
    split.save(tmp_path, "train")
    loaded = ResponseSplit.load(tmp_path, "train")
    assert len(loaded) == 2 and loaded.lengths.tolist() == [5, 6] and loaded.prompt_lengths.tolist() == [3, 2]
    p, r = loaded.sequence(1)
    assert p.tolist() == [1, 2] and r.tolist() == [3, 4, 0, 11]
    assert loaded.padded(pad_id=0).tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 11]]
    assert loaded.index[:, 3].tolist() == [1, 0]
    with pytest.raises(ValueError, match="no val split"):
        ResponseSplit.load(tmp_path, "val")
