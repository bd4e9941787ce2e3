"""TargetModel over the slot cache equals transformers' own Qwen3 forward and generate (fp32, CPU).

Small random Qwen3 models are built here (fixed seed, initializer_range 0.1 so greedy output varies) and saved
with save_pretrained; the DeepSpec conformance fixture's target is checked against its reference tensors.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, shared_path
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from verify_service.attention import PAD_LIMIT
from verify_service.kv_cache import NoFreeSlotError, SlotKVCache, SlotOverflowError
from verify_service.target import TargetModel, sample_tokens

TOL = {"atol": 1e-5, "rtol": 1e-5}
VOCAB = 128


def make_qwen3(
    folder: Path,
    *,
    seed: int = 0,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 3,
    tied: bool = True,
    rope_theta: float = 10000.0,
    legacy_rope: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a random Qwen3ForCausalLM to `folder`; legacy_rope writes `rope_theta` at the top level instead of
    transformers-5 `rope_parameters` (older Qwen3 checkpoints)."""
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).to(dtype).save_pretrained(folder)
    if legacy_rope:
        config_file = folder / "config.json"
        data = json.loads(config_file.read_text())
        del data["rope_parameters"]
        data["rope_theta"] = rope_theta
        config_file.write_text(json.dumps(data))
    return folder


def hf_reference(folder: Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_run(
    hf: Qwen3ForCausalLM, ids: list[int], layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF logits [T, V] and features [T, m*H] (hidden_states[l + 1]) of one sequence, no cache."""
    out = hf(torch.tensor([ids]), output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return out.logits[0].float(), features


def random_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def gqa2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GQA 2, untied: this seed's greedy continuations vary (tied tiny models tend to repeat one token)."""
    return make_qwen3(tmp_path_factory.mktemp("gqa2"), seed=3, tied=False)


@pytest.fixture(scope="module")
def fixture_dir() -> Path:
    copied = ROOT / "tests" / "data" / "deepspec_tiny_a"
    return copied if copied.exists() else shared_path("fixtures/deepspec_tiny_a")


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tied", "layer_ids"),
    [(4, 4, False, (-1, 1)), (4, 2, True, (0, 2)), (8, 2, False, (-1, 0, 2))],
    ids=["gqa1-untied", "gqa2-tied", "gqa4-untied-last-layer"],
)
def test_forward_matches_hf_without_cache(
    tmp_path: Path, num_heads: int, num_kv_heads: int, tied: bool, layer_ids: tuple[int, ...]
) -> None:
    folder = make_qwen3(tmp_path, num_heads=num_heads, num_kv_heads=num_kv_heads, tied=tied)
    with safe_open(folder / "model.safetensors", "pt") as weights:
        assert ("lm_head.weight" in weights.keys()) is not tied  # noqa: SIM118 (safe_open has no __contains__)
    target = TargetModel.from_pretrained(folder, layer_ids)
    assert target.feature_dim == len(layer_ids) * 32
    assert torch.equal(target.lm_head_weight, target.embed_tokens_weight) is tied
    hf = hf_reference(folder)
    assert torch.equal(target.lm_head_weight, hf.lm_head.weight)
    ids = random_ids(torch.Generator().manual_seed(0), 45)  # longer than PAD_LIMIT: the per-chunk path
    cache = target.new_kv_cache(2, 64)
    slot = cache.allocate()
    out = target.forward(cache, target.prepare(cache, [(slot, ids)]))
    logits, features = hf_run(hf, ids, layer_ids)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (45, VOCAB)
    torch.testing.assert_close(out.logits, logits, **TOL)
    torch.testing.assert_close(out.features, features, **TOL)
    assert cache.length(slot) == 45


def test_ragged_prefill_then_verify_chunks_match_per_request_hf(gqa2: Path) -> None:
    layer_ids = (-1, 1)
    target = TargetModel.from_pretrained(gqa2, layer_ids)
    hf = hf_reference(gqa2)
    gen = torch.Generator().manual_seed(2)
    prompts = [random_ids(gen, n) for n in (5, 17, 1, PAD_LIMIT + 8)]
    cache = target.new_kv_cache(6, 96)
    slots = [cache.allocate() for _ in prompts]
    batch = target.prepare(cache, list(zip(slots, prompts, strict=True)))
    out = target.forward(cache, batch)
    for r, prompt in enumerate(prompts):
        rows = slice(int(batch.cu_seqlens[r]), int(batch.cu_seqlens[r + 1]))
        logits, features = hf_run(hf, prompt, layer_ids)
        torch.testing.assert_close(out.logits[rows], logits, **TOL)
        torch.testing.assert_close(out.features[rows], features, **TOL)

    # Round 2: verify chunks of 1 (anchor only) to 8 tokens, plus a new request's prefill in the same batch.
    chunks = [random_ids(gen, n) for n in (1, 3, 8, 5)]
    newcomer = random_ids(gen, 11)
    new_slot = cache.allocate()
    batch = target.prepare(cache, [*zip(slots, chunks, strict=True), (new_slot, newcomer)])
    last = batch.last_rows()
    out = target.forward(cache, batch, logits_rows=last[-1:].clone(), feature_rows=None)
    assert out.logits.shape == (1, VOCAB)
    torch.testing.assert_close(out.logits[0], hf_run(hf, newcomer, layer_ids)[0][-1], **TOL)
    for r, (prompt, chunk) in enumerate(zip(prompts, chunks, strict=True)):
        rows = slice(int(batch.cu_seqlens[r]), int(batch.cu_seqlens[r + 1]))
        _, features = hf_run(hf, prompt + chunk, layer_ids)
        torch.testing.assert_close(out.features[rows], features[len(prompt) :], **TOL)
        assert cache.length(slots[r]) == len(prompt) + len(chunk)


def test_rollback_then_refeed_equals_fresh_run(gqa2: Path) -> None:
    target = TargetModel.from_pretrained(gqa2, (0,))
    gen = torch.Generator().manual_seed(3)
    prompt, drafts, other = random_ids(gen, 12), random_ids(gen, 6), random_ids(gen, 4)
    cache = target.new_kv_cache(2, 32)
    slot = cache.allocate()
    target.forward(cache, target.prepare(cache, [(slot, prompt)]))
    target.forward(cache, target.prepare(cache, [(slot, drafts)]))
    cache.truncate(slot, len(prompt) + 2)  # accept the anchor and one draft, reject the rest
    rolled = target.forward(cache, target.prepare(cache, [(slot, other)]))

    fresh_cache = target.new_kv_cache(1, 32)
    fresh_slot = fresh_cache.allocate()
    fresh = target.forward(
        fresh_cache, target.prepare(fresh_cache, [(fresh_slot, prompt + drafts[:2] + other)])
    )
    torch.testing.assert_close(rolled.logits, fresh.logits[-4:], **TOL)
    torch.testing.assert_close(rolled.features, fresh.features[-4:], **TOL)


def test_chunked_prefill_equals_one_pass(gqa2: Path) -> None:
    target = TargetModel.from_pretrained(gqa2, (1,))
    prompt = random_ids(torch.Generator().manual_seed(4), 2 * PAD_LIMIT + 20)
    cache = target.new_kv_cache(2, 128)
    whole, pieces = cache.allocate(), cache.allocate()
    full = target.forward(cache, target.prepare(cache, [(whole, prompt)]))
    bounds = [0, PAD_LIMIT + 5, PAD_LIMIT + 12, len(prompt)]  # long, short, long chunk continuing a slot
    parts = [
        target.forward(cache, target.prepare(cache, [(pieces, prompt[a:b])]))
        for a, b in itertools.pairwise(bounds)
    ]
    torch.testing.assert_close(torch.cat([p.logits for p in parts]), full.logits, **TOL)
    torch.testing.assert_close(torch.cat([p.features for p in parts]), full.features, **TOL)


def test_row_selection_returns_the_same_rows(gqa2: Path) -> None:
    target = TargetModel.from_pretrained(gqa2, (-1, 2))
    prompt = random_ids(torch.Generator().manual_seed(5), 9)
    outs = []
    for rows in (None, torch.tensor([8, 2])):
        cache = target.new_kv_cache(1, 16)
        slot = cache.allocate()
        outs.append(
            target.forward(
                cache, target.prepare(cache, [(slot, prompt)]), logits_rows=rows, feature_rows=rows
            )
        )
    torch.testing.assert_close(outs[1].logits, outs[0].logits[[8, 2]], **TOL)
    torch.testing.assert_close(outs[1].features, outs[0].features[[8, 2]], **TOL)
    empty = torch.empty(0, dtype=torch.int64)
    cache = target.new_kv_cache(1, 16)
    slot = cache.allocate()
    none = target.forward(
        cache, target.prepare(cache, [(slot, prompt)]), logits_rows=empty, feature_rows=empty
    )
    assert none.logits.shape == (0, VOCAB) and none.features.shape == (0, 64)


def test_greedy_generate_equals_hf_generate(gqa2: Path) -> None:
    target = TargetModel.from_pretrained(gqa2)
    hf = hf_reference(gqa2)
    gen = torch.Generator().manual_seed(6)
    prompts = [random_ids(gen, n) for n in (3, 10, 40)]
    ours = target.generate(prompts, max_new_tokens=24)
    for prompt, tokens in zip(prompts, ours, strict=True):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert tokens == expected[0, len(prompt) :].tolist()
    assert any(len(set(tokens)) > 3 for tokens in ours), "greedy output should vary for a meaningful check"


def test_generate_stops_on_stop_token_and_frees_slots(gqa2: Path) -> None:
    target = TargetModel.from_pretrained(gqa2)
    prompt = random_ids(torch.Generator().manual_seed(6), 10)
    free_run = target.generate([prompt], max_new_tokens=24)[0]
    stop = free_run[5]
    cut = free_run.index(stop)
    cache = target.new_kv_cache(2, 64)
    assert (
        target.generate([prompt], max_new_tokens=24, stop_token_ids=[stop], cache=cache)[0]
        == free_run[: cut + 1]
    )
    assert cache.num_free_slots == 2


def test_sampled_generate_is_reproducible_and_seed_dependent(gqa2: Path) -> None:
    target = TargetModel.from_pretrained(gqa2)
    prompts = [[1, 2, 3], [4, 5]]
    runs = [target.generate(prompts, 16, temperature=1.0, seed=s) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_sample_tokens_follows_truncated_target_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    rows = 20000
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.7)):
        probs = torch.softmax(logits / 0.8, dim=-1)
        if top_k:
            probs[top_k:] = 0
        if top_p < 1:
            keep = (torch.cumsum(probs, 0) - probs) < top_p
            probs = probs * keep
        probs = probs / probs.sum()
        tokens = sample_tokens(logits.expand(rows, -1), 0.8, top_k, top_p, gens)
        empirical = torch.bincount(tokens, minlength=6).double() / rows
        assert (empirical[probs == 0] == 0).all()
        # 20000 draws: the standard error of each frequency is below 0.0036; 0.015 is > 4 sigma.
        assert (empirical - probs.double()).abs().max() < 0.015
    assert sample_tokens(logits[None], 0.0).tolist() == [0]


def test_legacy_rope_theta_config_is_honoured(tmp_path: Path) -> None:
    modern = make_qwen3(tmp_path / "modern", seed=9, rope_theta=1e6)
    legacy = make_qwen3(tmp_path / "legacy", seed=9, rope_theta=1e6, legacy_rope=True)
    assert "rope_theta" in json.loads((legacy / "config.json").read_text())
    target = TargetModel.from_pretrained(legacy, (0,))
    assert target.config.rope_theta == 1e6
    ids = random_ids(torch.Generator().manual_seed(9), 30)
    cache = target.new_kv_cache(1, 32)
    slot = cache.allocate()
    out = target.forward(cache, target.prepare(cache, [(slot, ids)]))
    torch.testing.assert_close(out.logits, hf_run(hf_reference(modern), ids, (0,))[0], **TOL)


def test_bf16_checkpoint_is_upcast_to_fp32(tmp_path: Path) -> None:
    folder = make_qwen3(tmp_path, seed=10, dtype=torch.bfloat16)
    target = TargetModel.from_pretrained(folder, (1,), dtype=torch.float32)
    assert target.dtype == torch.float32 and target.new_kv_cache(1, 8).dtype == torch.float32
    ids = random_ids(torch.Generator().manual_seed(10), 12)
    cache = target.new_kv_cache(1, 16)
    slot = cache.allocate()
    out = target.forward(cache, target.prepare(cache, [(slot, ids)]))
    torch.testing.assert_close(out.logits, hf_run(hf_reference(folder), ids, (1,))[0], **TOL)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path, gqa2: Path) -> None:
    Qwen3ForCausalLM.from_pretrained(gqa2).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    single, sharded = TargetModel.from_pretrained(gqa2, (1,)), TargetModel.from_pretrained(tmp_path, (1,))
    ids = random_ids(torch.Generator().manual_seed(12), 7)
    outs = []
    for target in (single, sharded):
        cache = target.new_kv_cache(1, 8)
        slot = cache.allocate()
        outs.append(target.forward(cache, target.prepare(cache, [(slot, ids)])))
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].features, outs[1].features)


def test_capacity_errors_leave_other_requests_untouched(gqa2: Path) -> None:
    target = TargetModel.from_pretrained(gqa2, (0,))
    gen = torch.Generator().manual_seed(11)
    cache = target.new_kv_cache(2, 20)
    a, b = cache.allocate(), cache.allocate()
    prompt_a, prompt_b = random_ids(gen, 15), random_ids(gen, 6)
    target.forward(cache, target.prepare(cache, [(a, prompt_a), (b, prompt_b)]))
    k_before, v_before = cache.k.clone(), cache.v.clone()
    with pytest.raises(NoFreeSlotError):
        cache.allocate()
    with pytest.raises(SlotOverflowError, match="max_seq_len=20"):
        target.prepare(cache, [(b, random_ids(gen, 3)), (a, random_ids(gen, 6))])
    with pytest.raises(ValueError, match="outside"):
        target.prepare(cache, [(b, [VOCAB])])
    stale = target.prepare(cache, [(b, [1])])
    target.forward(cache, stale)
    with pytest.raises(ValueError, match="prepare the batch again"):
        target.forward(cache, stale)
    cache.truncate(b, 6)
    assert (cache.length(a), cache.length(b)) == (15, 6)
    assert torch.equal(cache.k[:, a], k_before[:, a]) and torch.equal(cache.v[:, a], v_before[:, a])
    # Both requests carry on exactly as if nothing had been refused.
    more_a, more_b = random_ids(gen, 5), random_ids(gen, 4)
    out = target.forward(cache, target.prepare(cache, [(a, more_a), (b, more_b)]))
    hf = hf_reference(gqa2)
    torch.testing.assert_close(out.logits[:5], hf_run(hf, prompt_a + more_a, (0,))[0][15:], **TOL)
    torch.testing.assert_close(out.logits[5:], hf_run(hf, prompt_b + more_b, (0,))[0][6:], **TOL)


def test_loader_and_argument_errors(tmp_path: Path, gqa2: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        TargetModel.from_pretrained(tmp_path / "missing")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        TargetModel.from_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"feature layer ids \[3\]"):
        TargetModel.from_pretrained(gqa2, (0, 3))
    sliding = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="sliding window"):
        TargetModel(Qwen3ForCausalLM(sliding))
    target = TargetModel.from_pretrained(gqa2)
    with pytest.raises(ValueError, match="cache shaped"):
        target.prepare(SlotKVCache(1, 1, 8, 2, 8), [(0, [1])])
    with pytest.raises(ValueError, match="max_new_tokens"):
        target.generate([[1]], 0)
    with pytest.raises(ValueError, match="every prompt"):
        target.generate([[1], []], 4)
    with pytest.raises(ValueError, match="top_p"):
        target.generate([[1]], 4, temperature=1.0, top_p=0.0)


def test_deepspec_fixture_target_matches_reference(fixture_dir: Path) -> None:
    reference = load_file(fixture_dir / "reference.safetensors")
    meta = json.loads((fixture_dir / "reference.json").read_text())
    target = TargetModel.from_pretrained(fixture_dir / "target", meta["target_layer_ids"])
    assert target.feature_layer_ids == (0, 2) and target.vocab_size == 512
    cache = target.new_kv_cache(4, 128)
    slot = cache.allocate()
    prompt = reference["a.prompt_ids"][0]
    prefill = target.forward(cache, target.prepare(cache, [(slot, prompt)]))
    torch.testing.assert_close(prefill.features, reference["a.context_features"][0], atol=1e-5, rtol=1e-4)
    verify = target.forward(cache, target.prepare(cache, [(slot, reference["a.verify_input_ids"][0])]))
    torch.testing.assert_close(verify.logits, reference["a.target_verify_logits"][0], atol=1e-5, rtol=1e-4)
    cache.free(slot)

    prompts = [reference[f"b.prompt{i}_ids"][0].tolist() for i in range(3)]
    outputs = target.generate(prompts, meta["max_new_tokens"], cache=cache)
    for i, tokens in enumerate(outputs):
        assert tokens == reference[f"b.prompt{i}_greedy_new_tokens"].tolist()
