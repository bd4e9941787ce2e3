"""Internal consistency of the draft model over many shapes (random weights, real transformers targets).

Shapes vary GQA ratio, block size, Markov rank and head type (vanilla / gated / RNN / none), confidence head
(with / without Markov features / absent), draft layer count, tied and untied target embeddings, and
target_layer_ids including -1. Checks: slot cache == recompute from scratch (also after rollback), one batched
ragged pass == single requests, batched sampling == per-request sampling, the teacher-forced heads reproduce
the sampling path, greedy speculative decoding == target greedy decoding, and save -> load round trips.
"""

from __future__ import annotations

import copy

import pytest
import torch

from draft_service.checkpoint import load_draft_model, save_draft_model
from draft_service.model import DSparkDraftModel
from draft_service.sequential_head import sample_block
from scheduler.evaluation.reference_loop import context_features, load_target, speculative_generate, target_greedy
from tests.model_factory import PairSpec, write_pair

SPECS = [
    PairSpec(),
    PairSpec(
        heads=4,
        kv_heads=4,
        block_size=7,
        draft_layers=2,
        markov_rank=16,
        markov_head_type="gated",
        confidence_with_markov=False,
        tie_embeddings=False,
        target_layer_ids=(-1, 1),
        seed=1,
    ),
    PairSpec(
        heads=8,
        kv_heads=2,
        head_dim=4,
        block_size=3,
        draft_layers=3,
        markov_head_type="rnn",
        target_layer_ids=(-1, 0, 2),
        seed=2,
    ),
    PairSpec(
        block_size=5,
        markov_rank=0,
        markov_head_type=None,
        confidence_with_markov=False,
        tie_embeddings=False,
        target_layer_ids=(1,),
        seed=3,
    ),
    PairSpec(
        block_size=1,
        markov_rank=0,
        markov_head_type=None,
        confidence=False,
        confidence_with_markov=False,
        target_layer_ids=(-1,),
        seed=4,
    ),
    PairSpec(
        heads=2,
        kv_heads=1,
        head_dim=16,
        block_size=6,
        markov_rank=12,
        markov_head_type="rnn",
        confidence=False,
        confidence_with_markov=False,
        tie_embeddings=False,
        target_layer_ids=(0, 1, 2),
        seed=5,
    ),
    PairSpec(
        vocab=80,
        hidden=48,
        heads=6,
        kv_heads=3,
        head_dim=8,
        target_layers=3,
        block_size=2,
        draft_layers=2,
        markov_rank=6,
        markov_head_type="gated",
        target_layer_ids=(-1, 1),
        seed=6,
    ),
]


@pytest.fixture(scope="module", params=SPECS, ids=[s.name for s in SPECS])
def pair(request, tmp_path_factory):
    spec: PairSpec = request.param
    target_dir, draft_dir = write_pair(tmp_path_factory.mktemp("pair"), spec)
    target = load_target(target_dir)
    draft = load_draft_model(draft_dir, target_dir=target_dir)
    return spec, target, draft, draft_dir


def features_of(target, draft: DSparkDraftModel, length: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """Random token ids and their real target context features [length, m*H]."""
    ids = torch.randint(
        0, draft.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return ids[0].tolist(), context_features(out.hidden_states, draft.config.target_layer_ids)[0]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cache_equals_recompute_including_rollback(pair):
    spec, target, draft, _ = pair
    ids, features = features_of(target, draft, 14, seed=spec.seed)
    cache = draft.new_context_cache(num_slots=3, max_seq_len=32)
    cache.allocate()  # occupy slot 0 so the request lives in a non-zero slot
    slot = cache.allocate()
    length = 0
    for chunk in (5, 3, 1, 2):  # prefill, then rounds appending accepted rows
        draft.append_context(cache, [slot], features[length : length + chunk], [0, chunk])
        length += chunk
        hidden = draft.draft_block(torch.tensor([ids[length]]), torch.tensor([length]), [slot], cache)
        close(hidden[0], draft.draft_block_uncached(features[:length], ids[length]))
    # the verifier may ship projected context instead of raw features (1/m of the bytes): same cache content
    other = cache.allocate()
    projected = draft.project_context(features[:length])
    draft.append_context(cache, [other], projected, [0, length], projected=True)
    close(cache.k[:, other, :length], cache.k[:, slot, :length])
    close(cache.v[:, other, :length], cache.v[:, slot, :length])
    cache.crop(slot, 6)  # rollback, then re-append different rows at positions 6.. (they must overwrite)
    draft.append_context(cache, [slot], features[8:12], [0, 4])
    expected = draft.draft_block_uncached(torch.cat([features[:6], features[8:12]]), ids[3])
    close(draft.draft_block(torch.tensor([ids[3]]), torch.tensor([10]), [slot], cache)[0], expected)


def test_batched_ragged_pass_equals_single_requests(pair):
    spec, target, draft, _ = pair
    lengths = [4, 9, 1]
    rows = [features_of(target, draft, n + 1, seed=spec.seed * 10 + i) for i, n in enumerate(lengths)]
    cache = draft.new_context_cache(num_slots=4, max_seq_len=16)
    slots = [cache.allocate() for _ in lengths][::-1]  # slots in a non-trivial order
    cu = torch.tensor([0, *lengths]).cumsum(0)
    draft.append_context(
        cache, slots, torch.cat([f[:n] for (_, f), n in zip(rows, lengths, strict=True)]), cu
    )
    anchors = torch.tensor([ids[n] for (ids, _), n in zip(rows, lengths, strict=True)])
    hidden = draft.draft_block(anchors, torch.tensor(lengths), slots, cache)
    for r, ((ids, f), n) in enumerate(zip(rows, lengths, strict=True)):
        close(hidden[r], draft.draft_block_uncached(f[:n], ids[n]))
    # the cache-free batched forward (padding + mask) agrees, and it is differentiable (training forward)
    padded = torch.zeros(3, max(lengths), draft.config.context_feature_size)
    for r, ((_, f), n) in enumerate(zip(rows, lengths, strict=True)):
        padded[r, :n] = f[:n]
    with torch.enable_grad():
        training_copy = copy.deepcopy(draft).requires_grad_(True)
        recomputed = training_copy.forward_blocks(padded, anchors, torch.tensor(lengths))
        recomputed.square().sum().backward()
    close(recomputed.detach(), hidden)
    assert training_copy.fc.weight.grad is not None and training_copy.fc.weight.grad.abs().sum() > 0
    # a sub-batch in another order gives the same rows
    close(
        draft.draft_block(
            anchors[[2, 0]], torch.tensor([lengths[2], lengths[0]]), [slots[2], slots[0]], cache
        ),
        hidden[[2, 0]],
    )

    temps = torch.tensor([0.0, 0.8, 1.5])
    uniforms = torch.rand(3, draft.block_size, generator=torch.Generator().manual_seed(7))
    for draft_top_k, top_k in (
        (0, torch.tensor([0, 0, 0])),
        (0, torch.tensor([0, 3, 0])),
        (5, torch.tensor([0, 2, 0])),
    ):
        batch = sample_block(
            draft,
            hidden,
            anchors,
            temperature=temps,
            top_k=top_k,
            draft_top_k=draft_top_k,
            uniforms=uniforms,
            return_logits=True,
        )
        for r in range(3):
            single = sample_block(
                draft,
                hidden[r : r + 1],
                anchors[r : r + 1],
                temperature=temps[r : r + 1],
                top_k=top_k[r : r + 1],
                draft_top_k=draft_top_k,
                uniforms=uniforms[r : r + 1],
                return_logits=True,
            )
            assert torch.equal(single.tokens[0], batch.tokens[r])
            close(single.token_probs[0], batch.token_probs[r])
            close(single.logits[0], batch.logits[r])
            if batch.confidence_logits is not None:
                close(single.confidence_logits[0], batch.confidence_logits[r])
            dist_single = single.probs if draft_top_k == 0 else single.topk_probs
            dist_batch = batch.probs if draft_top_k == 0 else batch.topk_probs
            close(dist_single[0], dist_batch[r])


def test_teacher_forced_heads_reproduce_sampling_path(pair):
    spec, target, draft, _ = pair
    ids, features = features_of(target, draft, 8, seed=spec.seed + 100)
    hidden = draft.draft_block_uncached(features[:7], ids[7])[None]
    anchor = torch.tensor([ids[7]])
    sample = sample_block(
        draft,
        hidden,
        anchor,
        temperature=1.0,
        uniforms=torch.full((1, draft.block_size), 0.37),
        return_logits=True,
    )
    prev = torch.cat([anchor[:, None], sample.tokens[:, :-1]], dim=1)
    close(draft.markov_logits(draft.base_logits(hidden), prev, hidden), sample.logits)
    if draft.confidence_head is None:
        assert sample.confidence_logits is None
    else:
        close(draft.confidence_logits(hidden, prev), sample.confidence_logits)
    close(sample.probs, torch.softmax(sample.logits, dim=-1))


@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_greedy_speculative_output_equals_target_greedy(pair, threshold):
    spec, target, draft, _ = pair
    for prompt_seed in (1, 2):
        prompt, _ = features_of(target, draft, 5 + prompt_seed * 4, seed=spec.seed * 7 + prompt_seed)
        expected = target_greedy(target, prompt, 20)
        result = speculative_generate(
            target, draft, prompt, max_new_tokens=20, confidence_threshold=threshold
        )
        assert result.new_tokens == expected
        assert sum(result.acceptance_lengths) >= 20
        assert all(1 <= a <= draft.block_size + 1 for a in result.acceptance_lengths)
        assert all(p <= draft.block_size for p in result.proposal_lengths)
        # the draft context always ends right before the anchor
        assert all(r.draft_cache_len_before + r.new_context_len == r.start for r in result.rounds)


def test_greedy_speculative_stop_token(pair):
    spec, target, draft, _ = pair
    prompt, _ = features_of(target, draft, 9, seed=spec.seed + 55)
    greedy = target_greedy(target, prompt, 20)
    stop = greedy[6]
    expected = greedy[: greedy.index(stop) + 1]
    assert target_greedy(target, prompt, 20, stop_token_ids=[stop]) == expected
    result = speculative_generate(target, draft, prompt, max_new_tokens=20, stop_token_ids=[stop])
    assert result.new_tokens == expected


@pytest.mark.parametrize(("dtype", "max_shard_bytes"), [(torch.float32, None), (torch.bfloat16, 4096)])
def test_save_load_roundtrip(pair, tmp_path, dtype, max_shard_bytes):
    _, _, draft, _ = pair
    out = save_draft_model(draft, tmp_path / "saved", dtype=dtype, max_shard_bytes=max_shard_bytes)
    assert (out / ("model.safetensors.index.json" if max_shard_bytes else "model.safetensors")).is_file()
    loaded = load_draft_model(out)
    assert loaded.config == draft.config
    original = draft.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name].to(dtype).float()), name
    # saving what we loaded is byte-stable (config and tensors)
    again = save_draft_model(loaded, tmp_path / "again", dtype=dtype, max_shard_bytes=max_shard_bytes)
    assert (again / "config.json").read_text() == (out / "config.json").read_text()
