"""Shared setup of the engine benchmarks: the demo pair, a random drafter when no trained one is given, prompts,
an SPS table, and the in-process speculative engine built from them.

A random drafter proposes (almost) nothing the target accepts, so it is only good for measuring the cost of a
round (what drafting, scheduling and verifying take), never speed-ups: the benchmarks say which one they used.
Run the benchmarks from the repository root with ``PYTHONPATH=.``.
"""

from __future__ import annotations

import copy
import inspect
import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from draft_service.checkpoint import load_draft_model, save_draft_model
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.model import DSparkDraftModel
from kernels.graphs import DEFAULT_BUCKETS
from scheduler.engine import SpeculativeEngine
from scheduler.pipeline import PipelinedEngine
from scheduler.policy import make_policy
from scheduler.sps import SPSTable
from scheduler.sts import STSCalibration
from verify_service.engine import VerifyEngine
from verify_service.target import TargetModel

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "models" / "demo" / "target"
# The trained demo drafter (issue 7: models/demo/draft_dspark); the first of these that holds a checkpoint.
DEMO_DRAFTERS = (ROOT / "models" / "demo" / "draft_dspark", ROOT / "models" / "demo" / "dspark")
DEMO_BLOCK_SIZE = 7  # the block the demo drafters are trained with (issue 7)


def demo_drafter() -> Path | None:
    """The trained demo drafter folder, if one is present."""
    return next((d for d in DEMO_DRAFTERS if (d / "config.json").is_file()), None)


def write_random_drafter(
    target_dir: Path,
    out_dir: Path,
    *,
    block_size: int = DEMO_BLOCK_SIZE,
    draft_layers: int = 1,
    markov_rank: int = 32,
    target_layer_ids: Sequence[int] | None = None,
    seed: int = 0,
) -> Path:
    """A DSpark drafter (vanilla Markov head + confidence head) with random weights for ``target_dir``, in
    DeepSpec's layout: the target's config plus the DSpark keys, embedding and LM head copied from the target
    (as DeepSpec initialises them), everything else random."""
    target_config = json.loads((target_dir / "config.json").read_text())
    num_layers = int(target_config["num_hidden_layers"])
    ids = list(target_layer_ids) if target_layer_ids is not None else sorted({1, num_layers // 2, num_layers - 2})
    config = copy.deepcopy(target_config)
    config.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=num_layers,
        num_hidden_layers=draft_layers,
        block_size=block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * draft_layers,
        mask_token_id=int(target_config["vocab_size"]) - 1,
        target_layer_ids=ids,
        num_anchors=32,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
    )
    torch.manual_seed(seed)
    model = DSparkDraftModel(DraftConfig.from_dict(config, source="random drafter"))
    target = TargetModel.from_pretrained(target_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
        model.embed_tokens.weight.copy_(target.embed_tokens_weight.float())
        model.lm_head.weight.copy_(target.lm_head_weight.float())
    save_draft_model(model, out_dir, dtype=torch.bfloat16)
    return out_dir


def load_pair(
    target_dir: Path, drafter_dir: Path, device: str, dtype: torch.dtype
) -> tuple[TargetModel, DSparkDraftModel]:
    drafter = load_draft_model(drafter_dir, target_dir=target_dir, dtype=dtype, device=device)
    target = TargetModel.from_pretrained(
        target_dir, feature_layer_ids=drafter.config.target_layer_ids, dtype=dtype, device=device
    )
    return target, drafter


def build_engine(
    target: TargetModel,
    drafter: DSparkDraftModel | None,
    *,
    policy: str,
    sps: SPSTable | None,
    max_requests: int,
    max_seq_len: int,
    graphs: str = "off",
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    draft_top_k: int = 16,
    calibration: STSCalibration | None = None,
    groups: int = 1,
) -> SpeculativeEngine:
    """One verify engine + one draft engine (None for plain autoregressive decoding) + the round driver
    (pipelined over ``groups`` request groups when more than one: :mod:`scheduler.pipeline`)."""
    block = drafter.block_size if drafter is not None else None
    verify = VerifyEngine(
        target,
        max_requests,
        max_seq_len,
        graphs=graphs if drafter is not None else "off",
        max_drafts=block,
        draft_top_k=draft_top_k,
        graph_buckets=buckets,
    )
    draft = None
    if drafter is not None:
        draft = DraftEngine(
            drafter,
            max_requests,
            max_seq_len,
            draft_top_k=draft_top_k,
            calibration=calibration,
            graphs=graphs,
            graph_buckets=buckets,
        )
    policy_ = make_policy(policy, sps, block or 1)
    if groups > 1:
        return PipelinedEngine(verify, draft, policy_, groups=groups, eos_token_ids=target.eos_token_ids)
    return SpeculativeEngine(verify, draft, policy_, eos_token_ids=target.eos_token_ids)


def load_calibration(drafter_dir: Path) -> STSCalibration | None:
    """The drafter's STS calibration (``sts.json`` beside the checkpoint), if it has one."""
    path = drafter_dir / "sts.json"
    return STSCalibration.load(path) if path.is_file() else None


def tokenizer_for(target_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)


def chat_prompts(path: Path, tokenizer: PreTrainedTokenizerBase, count: int) -> list[list[int]]:
    """The first turn of the first ``count`` records of a shared/data/prompts jsonl file, through the
    tokenizer's chat template with the generation prompt (what a chat request would send)."""
    prompts = []
    with path.open() as handle:
        for line in handle:
            if len(prompts) == count:
                break
            turn = json.loads(line)["turns"][0]
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": turn}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append([int(t) for t in ids])
    if len(prompts) < count:
        raise ValueError(f"{path} holds only {len(prompts)} prompts, {count} asked for")
    return prompts


def code_prompts(tokenizer: PreTrainedTokenizerBase, count: int, num_tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``num_tokens`` tokens cut from the source of standard-library modules (present on
    every machine; the demo target's domain)."""
    import collections
    import dataclasses
    import json as json_module
    import textwrap

    text = "".join(inspect.getsource(m) for m in (collections, dataclasses, json_module, textwrap, inspect))
    ids = tokenizer(text, verbose=False)["input_ids"]  # longer than the context on purpose: cut below
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - num_tokens) for _ in range(count)]
    return [[int(t) for t in ids[s : s + num_tokens]] for s in starts]


def synthetic_sps(max_batch_tokens: int = 4096) -> SPSTable:
    """A made-up but typical GPU shape (flat while launch-bound, then falling): only for runs that use the
    dspark policy to get varied verify lengths, never for conclusions about the scheduler."""
    sizes = [b for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if b <= max_batch_tokens]
    rates = [1000, 990, 960, 900, 700, 450, 250, 130, 66, 33, 17][: len(sizes)]
    return SPSTable(sizes, rates)
