"""Target inflation (verify_service/inflate.py): the inflated Qwen3 computes the small one's logits, exactly in fp32.

A small random Qwen3 (hidden 32, 4/2 heads of dim 8, 4 layers, vocab 96) is inflated into hidden 48, 8/4 heads of
dim 16, 6 layers, intermediate 96, vocab 160 (both fills). The small models use rms_norm_eps = 0.05 so that any
mistake in the eps bookkeeping is far above fp32 noise (a control test proves it would be seen).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from verify_service.inflate import (
    REAL_VOCAB_KEY,
    SHAPES,
    InflationPlan,
    Qwen3Shape,
    compare_logits,
    inflate_target,
    resolve_shape,
    save_target,
)
from verify_service.target import TargetModel

ROOT = Path(__file__).resolve().parents[2]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
SMALL = Qwen3Shape(32, 4, 4, 2, 8, 64, 96, True)
BIG = Qwen3Shape(48, 6, 8, 4, 16, 96, 160, True)
FEATURE_IDS = (-1, 0, 2)  # what a drafter may use: -1 .. L-2
TOL = 1e-5  # fp32, logits of magnitude ~10


def small_qwen3(shape: Qwen3Shape = SMALL, *, eps: float = 0.05, seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=256,
        rms_norm_eps=eps,
        initializer_range=0.1,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so that their rescaling is exercised
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def run_target(model: TargetModel, prompts: list[list[int]], decode: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill every prompt, then one ragged step mixing a decode token and a 3-token verify chunk; returns the
    concatenated logits and features of all rows."""
    cache = model.new_kv_cache(len(prompts), 64)
    slots = [cache.allocate() for _ in prompts]
    first = model.forward(cache, model.prepare(cache, list(zip(slots, prompts, strict=True))))
    chunks = [(slots[0], decode[:1]), (slots[1], decode[1:4])]
    second = model.forward(cache, model.prepare(cache, chunks))
    features = torch.cat([first.features, second.features])
    return torch.cat([first.logits, second.logits]), features


@pytest.fixture(scope="module")
def small() -> Qwen3ForCausalLM:
    return small_qwen3()


@pytest.fixture(scope="module", params=["random", "zeros"])
def inflated(request: pytest.FixtureRequest, small: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    return inflate_target(small, BIG, dtype=torch.float32, fill=request.param, seed=5)


PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [60, 3, 3, 81, 12, 9, 44, 1, 70, 22, 95]]
DECODE = [11, 45, 46, 47]


def test_logits_and_features_equal_the_small_model(small: Qwen3ForCausalLM, inflated: Qwen3ForCausalLM) -> None:
    ref_logits, ref_features = run_target(TargetModel(small, FEATURE_IDS), PROMPTS, DECODE)
    big = TargetModel(inflated, FEATURE_IDS)
    logits, features = run_target(big, PROMPTS, DECODE)
    assert big.vocab_size == SMALL.vocab_size and big.logits_width == BIG.vocab_size
    diff = (logits[:, : SMALL.vocab_size] - ref_logits).abs().max().item()
    print(f"max |logit diff| (fp32, real vocab): {diff:.2e}; logit scale {ref_logits.abs().max().item():.1f}")
    assert diff < TOL
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    assert bool((logits[:, SMALL.vocab_size :] == float("-inf")).all())
    # Context features of the original layer ids: equal in the real dims, exactly zero in the padded ones.
    features = features.view(features.shape[0], len(FEATURE_IDS), BIG.hidden_size)
    ref_features = ref_features.view(ref_features.shape[0], len(FEATURE_IDS), SMALL.hidden_size)
    assert (features[..., : SMALL.hidden_size] - ref_features).abs().max().item() < TOL
    assert bool((features[..., SMALL.hidden_size :] == 0).all())


def test_extra_dims_stay_zero_and_extra_layers_are_identities(inflated: Qwen3ForCausalLM) -> None:
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        states = inflated(ids, output_hidden_states=True).hidden_states  # [embedding, layer 0, ..., final norm]
    for state in states:
        assert bool((state[..., SMALL.hidden_size :] == 0).all())
    last_original = states[SMALL.num_hidden_layers]
    for index in range(SMALL.num_hidden_layers + 1, BIG.num_hidden_layers):  # outputs of the extra layers
        assert torch.equal(states[index], last_original)


def test_random_fill_fills_most_of_every_matrix(small: Qwen3ForCausalLM) -> None:
    """The entries that cannot matter hold ordinary numbers (dense kernels on zeros run faster than on data).

    The least filled matrices are the values / up projections of extra layers: zero on the live (real) hidden
    inputs, i.e. a fraction H/H' = 1/3 here, 1/10 for the demo in qwen3-4b."""
    big = inflate_target(small, BIG, dtype=torch.float32, fill="random")
    zeros = inflate_target(small, BIG, dtype=torch.float32, fill="zeros")
    for name, weight in big.named_parameters():
        if weight.ndim == 2:
            nonzero = (weight != 0).float().mean().item()
            assert nonzero >= 1 - SMALL.hidden_size / BIG.hidden_size - 1e-6, (name, nonzero)
            # Every non-zero of the zero fill is a copied small weight, and the random fill keeps it.
            copied = dict(zeros.named_parameters())[name] != 0
            assert torch.equal(weight[copied], dict(zeros.named_parameters())[name][copied])


def test_eps_bookkeeping_is_load_bearing(small: Qwen3ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: keeping the small eps (the naive inflation) moves the logits by far more than the tolerance, so the
    equality test above would catch an eps mistake."""
    monkeypatch.setattr(InflationPlan, "eps", lambda self, small_eps: small_eps)
    naive = TargetModel(inflate_target(small, BIG, dtype=torch.float32), FEATURE_IDS)
    ref_logits, _ = run_target(TargetModel(small, FEATURE_IDS), PROMPTS, DECODE)
    logits, _ = run_target(naive, PROMPTS, DECODE)
    assert (logits[:, : SMALL.vocab_size] - ref_logits).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("small_shape", "big_shape"),
    [
        (SMALL, BIG),
        # The demo target into qwen3-4b: head_dim 64 -> 128, theta 1e4 -> 1e8.
        (Qwen3Shape(256, 8, 4, 2, 64, 768, 4096), SHAPES["qwen3-4b"]),
    ],
)
def test_rope_inverse_frequencies_are_bit_identical(small_shape: Qwen3Shape, big_shape: Qwen3Shape) -> None:
    plan = InflationPlan.build(small_shape, big_shape)

    def inv_freq(head_dim: int, theta: float) -> torch.Tensor:
        config = Qwen3Config(
            hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
        )  # fmt: skip
        return Qwen3RotaryEmbedding(config).inv_freq

    small_freq = inv_freq(small_shape.head_dim, 10000.0)
    big_freq = inv_freq(big_shape.head_dim, plan.rope_theta(10000.0))
    assert torch.equal(big_freq[: small_shape.head_dim // 2], small_freq)


def test_head_placement_for_more_query_heads_per_kv_head() -> None:
    """Demo (4 q / 2 kv heads) into qwen3-4b (32 / 8): q head j*2+g sits in big kv group j, dims at RoPE pairs."""
    plan = InflationPlan.build(Qwen3Shape(256, 8, 4, 2, 64, 768, 4096), SHAPES["qwen3-4b"])
    assert plan.q_heads.tolist() == [0, 1, 4, 5]
    assert plan.kv_heads.tolist() == [[0], [1]]
    assert plan.dim_index.tolist() == [*range(32), *range(64, 96)]
    assert plan.eps(1e-6) == pytest.approx(1e-7)
    assert plan.rope_theta(10000.0) == 1e8


def test_fewer_query_heads_per_kv_head_copies_kv_heads() -> None:
    """4 q heads on 1 kv head into 8 q / 4 kv heads (2 per kv head): the kv head is copied twice."""
    small = small_qwen3(Qwen3Shape(32, 2, 4, 1, 8, 64, 96, True))
    plan = InflationPlan.build(Qwen3Shape.of(small.config), Qwen3Shape(48, 3, 8, 4, 16, 96, 160, True))
    assert plan.kv_heads.tolist() == [[0, 1]] and plan.q_heads.tolist() == [0, 1, 2, 3]
    big = inflate_target(small, Qwen3Shape(48, 3, 8, 4, 16, 96, 160, True), dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        diff = (big(ids).logits[..., :96] - small(ids).logits).abs().max().item()
    assert diff < TOL


def test_untied_shape_unties_and_stays_exact(small: Qwen3ForCausalLM) -> None:
    shape = Qwen3Shape(48, 5, 8, 4, 16, 96, 160, tie_word_embeddings=False)
    big = inflate_target(small, shape, dtype=torch.float32)
    assert not big.config.tie_word_embeddings
    assert big.lm_head.weight.data_ptr() != big.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert (big(ids).logits[..., :96] - small(ids).logits).abs().max().item() < TOL


def test_save_and_load_round_trip(small: Qwen3ForCausalLM, tmp_path: Path) -> None:
    big = inflate_target(small, BIG, dtype=torch.float32)
    out = save_target(big, tmp_path / "big")
    config = json.loads((out / "config.json").read_text())
    assert config[REAL_VOCAB_KEY] == SMALL.vocab_size and config["vocab_size"] == BIG.vocab_size
    assert config["rms_norm_eps"] == pytest.approx(0.05 * 32 / 48)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(SMALL.vocab_size, BIG.vocab_size))
    loaded = TargetModel.from_pretrained(out, FEATURE_IDS)
    logits, features = run_target(loaded, PROMPTS, DECODE)
    ref_logits, ref_features = run_target(TargetModel(big, FEATURE_IDS), PROMPTS, DECODE)
    assert torch.equal(logits, ref_logits) and torch.equal(features, ref_features)
    # Plain HF generate of the saved model: padded ids suppressed, greedy output = the small model's.
    hf = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    expected = small.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(hf.generate(ids, max_new_tokens=12, do_sample=False), expected)


def test_padded_ids_are_refused_and_never_sampled(small: Qwen3ForCausalLM) -> None:
    big = TargetModel(inflate_target(small, BIG, dtype=torch.float32, fill="zeros"), ())
    cache = big.new_kv_cache(1, 32)
    with pytest.raises(ValueError, match="outside"):
        big.prepare(cache, [(cache.allocate(), [5, SMALL.vocab_size + 3])])
    # Unmasked, the zero LM-head rows of the padded ids would carry real probability mass ...
    with torch.no_grad():
        raw = big.modules(torch.tensor([PROMPTS[1]])).logits[0].softmax(-1)
    assert raw[:, SMALL.vocab_size :].sum(-1).min().item() > 1e-3
    # ... masked, no temperature-1 sample ever picks one.
    outputs = big.generate(PROMPTS * 4, max_new_tokens=40, temperature=1.0, seed=11)
    assert all(0 <= t < SMALL.vocab_size for out in outputs for t in out)


def test_bad_shapes_are_refused(small: Qwen3ForCausalLM, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        inflate_target(small, Qwen3Shape(16, 6, 8, 4, 16, 96, 160))
    with pytest.raises(ValueError, match="kv heads"):
        inflate_target(small, Qwen3Shape(48, 6, 8, 1, 16, 96, 160))
    with pytest.raises(ValueError, match="unknown shape"):
        resolve_shape("qwen3-5b")
    with pytest.raises(ValueError, match="fill"):
        inflate_target(small, BIG, fill="ones")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="qwen3"):
        resolve_shape(tmp_path)
    assert resolve_shape("qwen3-4b") == Qwen3Shape(2560, 36, 32, 8, 128, 9728, 151936, True)


@pytest.mark.skipif(not (DEMO_TARGET / "model.safetensors").is_file(), reason="demo target not built")
def test_demo_target_into_a_4b_like_shape() -> None:
    """The trained demo target (bf16 weights) into a shape with qwen3-4b's head geometry (128-dim heads, 4 query
    heads per kv head) at a CPU-friendly width: fp32 exact, and the bf16 copy within the small model's own bf16
    rounding noise."""
    small = Qwen3ForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    shape = Qwen3Shape(384, 9, 16, 4, 128, 1024, 4352, True)
    ids = torch.randint(0, 4096, (1, 48), generator=torch.Generator().manual_seed(0))
    exact = compare_logits(small, inflate_target(small, shape, dtype=torch.float32), ids)
    print(f"demo fp32: {exact}")
    assert exact["max_abs_logit_diff"] < 1e-4 and exact["greedy_agreement"] == 1.0
    bf16 = compare_logits(small, inflate_target(small, shape, dtype=torch.bfloat16), ids)
    print(f"demo bf16: {bf16}")
    assert bf16["max_abs_logit_diff"] < 3 * bf16["noise_max_abs_logit_diff"]


TRITON_MASKED_LOGITS = """
import torch
from kernels.rejection import rejection_sample_reference
from kernels.rejection_triton import rejection_sample_triton
torch.manual_seed(0)
V, real, R = 4200, 96, 4  # several whole vocabulary chunks of the kernel are -inf
lens = torch.tensor([3, 0, 2, 4])
cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
N = int(cu[-1])
logits = torch.randn(N + R, V) * 3
logits[:, real:] = float("-inf")
drafts = torch.randint(0, real, (N,))
ids = torch.stack([torch.randperm(real)[:8] for _ in range(N)])
ids[:, 0] = drafts
probs = torch.softmax(torch.randn(N, 8), -1)
temps = torch.tensor([1.0, 0.7, 1.0, 0.0])
for top_k, top_p in [(0, 1.0), (200, 0.9)]:
    args = (logits, drafts, probs, cu, temps, torch.full((R,), top_k), torch.full((R,), top_p), torch.arange(R),
            torch.tensor([5, 9, 13, 2]))
    a = rejection_sample_reference(*args, draft_prob_ids=ids)
    b = rejection_sample_triton(*args, draft_prob_ids=ids)
    assert torch.equal(a.output_tokens, b.output_tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert int(b.output_tokens.max()) < real, b.output_tokens
"""


def test_gpu_rejection_kernel_handles_masked_vocabulary() -> None:
    """The verifier samples with the Triton kernel on a GPU: -inf logits of padded ids (whole chunks of them) give
    the reference's tokens and never a padded id (run through TRITON_INTERPRET=1, in a fresh process because the
    variable must be set before triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", TRITON_MASKED_LOGITS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
