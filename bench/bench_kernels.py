"""Sampling kernels, Triton vs torch reference: the rejection sampler and the Markov-head sampler.

Rejection sampler (issue 4): R requests x gamma draft tokens over a vocabulary V, target logits in bf16
(R * (gamma + 1) rows), timed in four settings: sampled T = 1 with sparse top-K draft distributions (the
product's path), sampled T = 1 with dense float32 draft distributions, greedy, and sampled with temperature
0.8 + top-k 50 + top-p 0.9 (the top-k / top-p threshold searches). Reported: median time over repeats (CUDA
events), speed-up over the reference, and the achieved bandwidth = bytes of target logits / time, compared
with the device's copy bandwidth measured here ((read + write bytes) / time of a same-sized device copy).
Markov-head sampler: R requests, gamma steps, rank r, vocabulary V, bf16 weights and base logits; full
vocabulary T = 1, greedy, and sparse top-K (K = 64), against the reference loop.

Both implementations run with ``validate=False`` (the checks read the control tensors and cost a host sync;
their cost is reported separately) on identical inputs, and the script reports how many requests got
identical outputs from the two (the Triton kernel uses the GPU's exp/log, equal to torch's within ~1 ulp).

GPU (one command, about a minute on an H200):
    python bench/bench_kernels.py
CPU smoke run (Triton through the interpreter, tiny shapes):
    python bench/bench_kernels.py --small --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

FULL = dict(requests=256, gamma=8, vocab=151936, sparse_k=64, markov_requests=128, markov_gamma=7, rank=256)
SMALL = dict(requests=4, gamma=3, vocab=256, sparse_k=8, markov_requests=4, markov_gamma=2, rank=16)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median time of ``fn`` in milliseconds (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(num_bytes: int, device: torch.device, repeats: int) -> float:
    """Device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def rejection_inputs(
    shape: dict,
    device: torch.device,
    temperature: float,
    top_k: int,
    top_p: float,
    draft: str,
    gen: torch.Generator,
) -> dict[str, Any]:
    """A batch of R requests with gamma drafts each; drafts are drawn from their draft distributions."""
    num_req, gamma, vocab, k = shape["requests"], shape["gamma"], shape["vocab"], shape["sparse_k"]
    num_draft = num_req * gamma
    logits = (torch.randn(num_draft + num_req, vocab, generator=gen) * 3).to(torch.bfloat16)
    inputs: dict[str, Any] = dict(
        target_logits=logits,
        cu_draft_lens=torch.arange(num_req + 1) * gamma,
        temperature=torch.full((num_req,), temperature),
        top_k=torch.full((num_req,), top_k, dtype=torch.int64),
        top_p=torch.full((num_req,), top_p),
        seeds=torch.randint(0, 2**62, (num_req,), generator=gen),
        positions=torch.randint(0, 8192, (num_req,), generator=gen),
    )
    rows = torch.arange(num_draft) + torch.arange(num_draft) // gamma
    if draft == "sparse":
        # a drafter close to the target: its top-K of slightly perturbed target logits
        top = (logits[rows].float() + torch.randn(num_draft, vocab, generator=gen)).topk(k, dim=-1)
        probs = torch.softmax(top.values, dim=-1)
        pick = torch.multinomial(probs, 1, generator=gen)
        inputs.update(
            draft_probs=probs,
            draft_prob_ids=top.indices,
            draft_token_ids=top.indices.gather(1, pick).squeeze(1),
        )
    elif draft == "dense":
        probs = torch.softmax(logits[rows].float() + torch.randn(num_draft, vocab, generator=gen), dim=-1)
        inputs.update(
            draft_probs=probs,
            draft_prob_ids=None,
            draft_token_ids=torch.multinomial(probs, 1, generator=gen).squeeze(1),
        )
    else:
        inputs.update(
            draft_probs=None, draft_prob_ids=None, draft_token_ids=logits[rows].float().argmax(dim=-1)
        )
    return {name: (t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in inputs.items()}


def bench_rejection(shape: dict, device: torch.device, repeats: int, copy_gbps: float) -> list[dict]:
    from kernels.rejection import rejection_sample_reference, validate_rejection_inputs
    from kernels.rejection_triton import rejection_sample_triton

    settings = {
        "sampled T=1, sparse drafts": (1.0, 0, 1.0, "sparse"),
        "sampled T=1, dense drafts": (1.0, 0, 1.0, "dense"),
        "greedy": (0.0, 0, 1.0, "none"),
        "sampled T=0.8 top-k 50 top-p 0.9, sparse": (0.8, 50, 0.9, "sparse"),
    }
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, (temperature, top_k, top_p, draft) in tqdm(settings.items(), desc="rejection sampler"):
        inputs = rejection_inputs(shape, device, temperature, top_k, top_p, draft, gen)
        positional = [
            inputs[k]
            for k in (
                "target_logits",
                "draft_token_ids",
                "draft_probs",
                "cu_draft_lens",
                "temperature",
                "top_k",
                "top_p",
                "seeds",
                "positions",
            )
        ]
        ids = inputs["draft_prob_ids"]
        tri = timed(
            partial(rejection_sample_triton, *positional, draft_prob_ids=ids, validate=False), device, repeats
        )
        ref = timed(
            partial(rejection_sample_reference, *positional, draft_prob_ids=ids, validate=False),
            device,
            max(1, repeats // 4),
        )
        check = timed(partial(validate_rejection_inputs, *positional, ids), device, max(1, repeats // 4))
        a = rejection_sample_triton(*positional, draft_prob_ids=ids)
        b = rejection_sample_reference(*positional, draft_prob_ids=ids)
        same = [
            x == y
            for x, y in zip(
                a.per_request(inputs["cu_draft_lens"]), b.per_request(inputs["cu_draft_lens"]), strict=True
            )
        ]
        logit_bytes = inputs["target_logits"].numel() * inputs["target_logits"].element_size()
        gbps = logit_bytes / (tri * 1e-3) / 1e9
        results.append(
            {
                "kernel": "rejection",
                "setting": name,
                "triton_ms": tri,
                "reference_ms": ref,
                "speedup": ref / tri,
                "logit_bytes": logit_bytes,
                "achieved_gbps": gbps,
                "fraction_of_copy_bandwidth": gbps / copy_gbps,
                "validation_ms": check,
                "identical_requests": f"{sum(same)}/{len(same)}",
                "mean_accepted": float(a.num_accepted.float().mean()),
            }
        )
    return results


def bench_markov(shape: dict, device: torch.device, repeats: int) -> list[dict]:
    from kernels.markov import markov_sample_reference
    from kernels.markov_triton import markov_sample_triton

    num_req, gamma, vocab, rank = (
        shape["markov_requests"],
        shape["markov_gamma"],
        shape["vocab"],
        shape["rank"],
    )
    gen = torch.Generator().manual_seed(1)
    args = [
        (torch.randn(num_req, gamma, vocab, generator=gen) * 3).to(torch.bfloat16).to(device),
        torch.randint(0, vocab, (num_req,), generator=gen).to(device),
        (torch.randn(vocab, rank, generator=gen) * 0.1).to(torch.bfloat16).to(device),
        (torch.randn(vocab, rank, generator=gen) * 0.1).to(torch.bfloat16).to(device),
        None,
        torch.randint(0, 2**62, (num_req,), generator=gen).to(device),
        torch.randint(0, 8192, (num_req,), generator=gen).to(device),
    ]
    settings = {
        "sampled T=1, full vocabulary": (1.0, 0),
        "greedy": (0.0, 0),
        f"sampled T=1, sparse top-{shape['sparse_k']}": (1.0, shape["sparse_k"]),
    }
    results = []
    for name, (temperature, top_k) in tqdm(settings.items(), desc="markov sampler"):
        args[4] = torch.full((num_req,), temperature, device=device)
        tri = timed(partial(markov_sample_triton, *args, top_k=top_k, validate=False), device, repeats)
        ref = timed(
            partial(markov_sample_reference, *args, top_k=top_k, validate=False), device, max(1, repeats // 4)
        )
        a, b = markov_sample_triton(*args, top_k=top_k), markov_sample_reference(*args, top_k=top_k)
        same = int((a.tokens == b.tokens).all(dim=1).sum())
        results.append(
            {
                "kernel": "markov",
                "setting": name,
                "triton_ms": tri,
                "reference_ms": ref,
                "speedup": ref / tri,
                "identical_requests": f"{same}/{num_req}",
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20 GPU, 3 CPU)")
    parser.add_argument(
        "--out", default=None, help="JSON output (default docs/benchmarks/kernels.json; none for --small)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        # must happen before the kernels (and with them triton) are imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    shape = SMALL if args.small else FULL
    repeats = args.repeats or (20 if device.type == "cuda" else 1)
    logit_bytes = shape["requests"] * (shape["gamma"] + 1) * shape["vocab"] * 2
    copy_gbps = copy_bandwidth(logit_bytes, device, repeats)
    results = bench_rejection(shape, device, repeats, copy_gbps) + bench_markov(shape, device, repeats)

    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": shape,
        "repeats": repeats,
        "copy_bandwidth_gbps": copy_gbps,
        "results": results,
    }
    out = args.out or (None if args.small else "docs/benchmarks/kernels.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\ndevice: {report['device']}  shape: {shape}  copy bandwidth: {copy_gbps:.1f} GB/s (read+write)")
    print(
        f"{'kernel':10} {'setting':42} {'triton ms':>10} {'ref ms':>9} {'speedup':>8} {'GB/s':>7} "
        f"{'% copy':>7} {'identical':>10}"
    )
    for r in results:
        gbps = f"{r['achieved_gbps']:.0f}" if "achieved_gbps" in r else "-"
        frac = f"{100 * r['fraction_of_copy_bandwidth']:.0f}%" if "fraction_of_copy_bandwidth" in r else "-"
        print(
            f"{r['kernel']:10} {r['setting']:42} {r['triton_ms']:10.3f} {r['reference_ms']:9.2f} "
            f"{r['speedup']:7.1f}x {gbps:>7} {frac:>7} {r['identical_requests']:>10}"
        )
    if out:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
