"""Sampling kernels, Triton vs torch reference: the rejection sampler and the Markov-head sampler.

Rejection sampler (issue 4): R requests x gamma draft tokens over a vocabulary V, target logits in bf16
(R * (gamma + 1) rows), timed in four settings: sampled T = 1 with sparse top-K draft distributions (the
product's path), sampled T = 1 with dense float32 draft distributions, greedy, and sampled with temperature
0.8 + top-k 50 + top-p 0.9 (the exact top-k / top-p threshold searches). Reported: median time over repeats
(CUDA events), speed-up over the reference, and the achieved bandwidth = bytes of target logits / time,
compared with the device's copy bandwidth measured here ((read + write bytes) / time of a device copy of the
same size as the logits). Markov-head sampler: R requests, gamma steps, rank r, vocabulary V, bf16 weights
and base logits; full vocabulary T = 1, greedy, and sparse top-K, against the reference loop.

The Triton sampler is timed twice: called eagerly (every launch issued from Python, as the issue's benchmark
asks) and replayed from a CUDA graph (how the verify and draft engines run it; no launch overhead).
Both implementations run with ``validate=False`` on identical inputs (the input checks read the control
tensors and cost a host sync; their time is reported separately), and the script reports how many requests
got identical outputs from the two (on GPUs the kernel's exp/log differ from torch's in the last bits, so a
near-tie may rarely go the other way). ``--sweep [GROUP ...]`` first times other launch sizes of the kernels
(statistics, cdf, select, markov; all of them: about a minute more, mostly compilation); ``--tune`` then runs the
benchmark with the fastest ones (recorded under "tuning" in the JSON; the TUNING defaults in the kernel modules
are set from such a run). ``--only rejection`` skips the Markov sampler; ``--profile`` adds the device time of
every rejection kernel per setting (torch.profiler, one eager call each).

GPU (one command, about a minute on an H200, two with the sweep; writes docs/benchmarks/kernels.json):
    python bench/bench_kernels.py [--sweep [GROUP ...] [--tune]] [--only rejection] [--profile]
CPU smoke run (Triton through the interpreter, tiny shapes):
    python bench/bench_kernels.py --small --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: use this checkout's kernels
    sys.path.insert(0, str(ROOT))

from bench.timing import copy_bandwidth, graph_timed, timed  # noqa: E402

FULL = dict(requests=256, gamma=8, vocab=151936, sparse_k=64, markov_requests=128, markov_gamma=7, rank=256)
SMALL = dict(requests=4, gamma=3, vocab=256, sparse_k=8, markov_requests=4, markov_gamma=2, rank=16)
REJECTION_SETTINGS = {
    "sampled T=1, sparse drafts": (1.0, 0, 1.0, "sparse"),
    "sampled T=1, dense drafts": (1.0, 0, 1.0, "dense"),
    "greedy": (0.0, 0, 1.0, "none"),
    "sampled T=0.8 top-k 50 top-p 0.9, sparse": (0.8, 50, 0.9, "sparse"),
}
REJECTION_ARGS = ("target_logits", "draft_token_ids", "draft_probs", "cu_draft_lens", "temperature", "top_k",
                  "top_p", "seeds", "positions")  # fmt: skip


def rejection_inputs(shape: dict, device: torch.device, setting: tuple, seed: int) -> dict[str, Any]:
    """A batch of R requests with gamma drafts each, drawn from their draft distributions (on the device)."""
    temperature, top_k, top_p, draft = setting
    gen = torch.Generator(device=device).manual_seed(seed)
    num_req, gamma, vocab, k = shape["requests"], shape["gamma"], shape["vocab"], shape["sparse_k"]
    num_draft = num_req * gamma
    new = dict(device=device)
    logits = (torch.randn(num_draft + num_req, vocab, generator=gen, **new) * 3).to(torch.bfloat16)
    inputs: dict[str, Any] = dict(
        target_logits=logits,
        cu_draft_lens=torch.arange(num_req + 1, **new) * gamma,
        temperature=torch.full((num_req,), temperature, **new),
        top_k=torch.full((num_req,), top_k, dtype=torch.int64, **new),
        top_p=torch.full((num_req,), top_p, **new),
        seeds=torch.randint(0, 2**62, (num_req,), generator=gen, **new),
        positions=torch.randint(0, 8192, (num_req,), generator=gen, **new),
        draft_probs=None,
        draft_prob_ids=None,
    )
    rows = torch.arange(num_draft, **new) + torch.arange(num_draft, **new) // gamma
    # a drafter close to the target: slightly perturbed target logits
    draft_logits = logits[rows].float() + torch.randn(num_draft, vocab, generator=gen, **new)
    if draft == "sparse":
        top = draft_logits.topk(k, dim=-1)
        probs = torch.softmax(top.values, dim=-1)
        pick = torch.multinomial(probs, 1, generator=gen)
        inputs.update(
            draft_probs=probs, draft_prob_ids=top.indices, draft_token_ids=top.indices.gather(1, pick)[:, 0]
        )
    elif draft == "dense":
        probs = torch.softmax(draft_logits, dim=-1)
        inputs.update(draft_probs=probs, draft_token_ids=torch.multinomial(probs, 1, generator=gen)[:, 0])
    else:
        inputs.update(draft_token_ids=logits[rows].argmax(dim=-1))
    return inputs


def bench_rejection(shape: dict, device: torch.device, repeats: int, copy_gbps: float) -> list[dict]:
    from kernels.rejection import rejection_sample_reference, validate_rejection_inputs
    from kernels.rejection_triton import rejection_sample_triton

    results = []
    for i, (name, setting) in enumerate(tqdm(REJECTION_SETTINGS.items(), desc="rejection sampler")):
        inputs = rejection_inputs(shape, device, setting, seed=i)
        args = [inputs[k] for k in REJECTION_ARGS]
        ids = inputs["draft_prob_ids"]
        call = partial(rejection_sample_triton, *args, draft_prob_ids=ids, validate=False)
        tri = timed(call, device, repeats)
        graph = graph_timed(call, device, repeats) if device.type == "cuda" else None
        ref = timed(partial(rejection_sample_reference, *args, draft_prob_ids=ids, validate=False), device,
                    max(1, repeats // 4))  # fmt: skip
        check = timed(partial(validate_rejection_inputs, *args, ids), device, max(1, repeats // 4))
        cu = inputs["cu_draft_lens"]
        a = rejection_sample_triton(*args, draft_prob_ids=ids).per_request(cu)
        b = rejection_sample_reference(*args, draft_prob_ids=ids).per_request(cu)
        same = sum(x == y for x, y in zip(a, b, strict=True))
        logit_bytes = inputs["target_logits"].numel() * inputs["target_logits"].element_size()
        gbps = logit_bytes / (tri * 1e-3) / 1e9
        results.append({
            "kernel": "rejection", "setting": name, "triton_ms": tri, "triton_graph_ms": graph,
            "reference_ms": ref, "speedup": ref / tri, "logit_bytes": logit_bytes, "achieved_gbps": gbps,
            "fraction_of_copy_bandwidth": gbps / copy_gbps,
            "graph_fraction_of_copy_bandwidth": logit_bytes / (graph * 1e-3) / 1e9 / copy_gbps if graph else None,
            "validation_ms": check, "identical_requests": f"{same}/{len(a)}",
            "mean_emitted_tokens": sum(len(t) for t in a) / len(a),
        })  # fmt: skip
    return results


def markov_args(shape: dict, device: torch.device, temperature: float) -> list:
    gen = torch.Generator(device=device).manual_seed(1)
    num_req, gamma, vocab, rank = (
        shape["markov_requests"],
        shape["markov_gamma"],
        shape["vocab"],
        shape["rank"],
    )
    new = dict(device=device, generator=gen)
    return [
        (torch.randn(num_req, gamma, vocab, **new) * 3).to(torch.bfloat16),
        torch.randint(0, vocab, (num_req,), **new),
        (torch.randn(vocab, rank, **new) * 0.1).to(torch.bfloat16),
        (torch.randn(vocab, rank, **new) * 0.1).to(torch.bfloat16),
        torch.full((num_req,), temperature, device=device),
        torch.randint(0, 2**62, (num_req,), **new),
        torch.randint(0, 8192, (num_req,), **new),
    ]


def bench_markov(shape: dict, device: torch.device, repeats: int) -> list[dict]:
    from kernels.markov import markov_sample_reference
    from kernels.markov_triton import markov_sample_triton

    k = shape["sparse_k"]
    settings = {
        "sampled T=1, full vocabulary": (1.0, 0),
        "greedy": (0.0, 0),
        f"sampled T=1, sparse top-{k}": (1.0, k),
    }
    results = []
    for name, (temperature, top_k) in tqdm(settings.items(), desc="markov sampler"):
        args = markov_args(shape, device, temperature)
        call = partial(markov_sample_triton, *args, top_k=top_k, validate=False)
        tri = timed(call, device, repeats)
        graph = graph_timed(call, device, repeats) if device.type == "cuda" else None
        ref = timed(partial(markov_sample_reference, *args, top_k=top_k, validate=False), device,
                    max(1, repeats // 4))  # fmt: skip
        a, b = markov_sample_triton(*args, top_k=top_k), markov_sample_reference(*args, top_k=top_k)
        same = int((a.tokens == b.tokens).all(dim=1).sum())
        results.append({
            "kernel": "markov", "setting": name, "triton_ms": tri, "triton_graph_ms": graph, "reference_ms": ref,
            "speedup": ref / tri,
            "identical_requests": f"{same}/{len(a.tokens)}",
        })  # fmt: skip
    return results


SWEEP_GROUPS = ("statistics", "cdf", "select", "markov")


def sweep(shape: dict, device: torch.device, repeats: int, keep_best: bool, groups: list[str]) -> list[dict]:
    """Time other launch sizes of the kernels (CUDA-graph replays on GPUs, where launch overhead would hide them).

    One group at a time (of ``groups``), the others at their current values: the rejection statistics kernel
    (greedy plus sampled sparse time), the inverse-CDF mass kernel (sampled sparse plus dense), the threshold
    kernel's compaction tile (top-k / top-p), the Markov truncated mode. With ``keep_best`` each group keeps its
    fastest variant (the TUNING dicts are updated, so the main benchmark that follows runs with them); otherwise
    the defaults are restored."""
    from kernels import markov_triton, rejection_triton

    measure = partial(graph_timed if device.type == "cuda" else timed, device=device, repeats=repeats)
    rows: list[dict] = []

    def choose(table: dict, kernel: str, variants: list[dict], calls: dict[str, Callable[[], object]]) -> None:
        default, scores = dict(table), []
        for variant in tqdm(variants, desc=f"sweep {kernel}"):
            table.update({**default, **variant})
            times = {setting: measure(call) for setting, call in calls.items()}
            rows.append({"kernel": kernel, **table, "ms": times})
            scores.append(sum(times.values()))
        best = variants[scores.index(min(scores))]
        table.update({**default, **best} if keep_best else default)

    def rejection_call(setting: str) -> Callable[[], object]:
        inputs = rejection_inputs(shape, device, REJECTION_SETTINGS[setting], seed=0)
        args = [inputs[k] for k in REJECTION_ARGS]
        return partial(rejection_triton.rejection_sample_triton, *args, draft_prob_ids=inputs["draft_prob_ids"],
                       validate=False)  # fmt: skip

    if "statistics" in groups:
        sparse, greedy = rejection_call("sampled T=1, sparse drafts"), rejection_call("greedy")
        row_variants = [dict(row_block_v=b, row_warps=w, row_splits=n)
                        for b, w, n in ((4096, 8, 4), (4096, 8, 3), (4096, 8, 2), (8192, 8, 2), (8192, 8, 3),
                                        (2048, 4, 4), (4096, 4, 3), (8192, 16, 2))]  # fmt: skip
        choose(rejection_triton.TUNING, "rejection statistics", row_variants, {"sparse": sparse, "greedy": greedy})
        del sparse, greedy
    if "cdf" in groups:
        sparse, dense = rejection_call("sampled T=1, sparse drafts"), rejection_call("sampled T=1, dense drafts")
        cdf_variants = [dict(cdf_group=g, cdf_warps=w) for g, w in ((1, 4), (2, 4), (4, 4), (8, 4), (2, 8), (4, 8))]
        choose(rejection_triton.TUNING, "rejection cdf masses", cdf_variants, {"sparse": sparse, "dense": dense})
        del sparse, dense
    if "select" in groups:
        filtered = rejection_call("sampled T=0.8 top-k 50 top-p 0.9, sparse")
        select_variants = [dict(select_tile=t, select_warps=w)
                           for t, w in ((2048, 4), (4096, 4), (8192, 4), (4096, 8), (8192, 8), (16384, 8))]  # fmt: skip
        choose(rejection_triton.TUNING, "rejection threshold", select_variants, {"top-k/top-p": filtered})
        del filtered
    if "markov" in groups:
        args = markov_args(shape, device, 1.0)
        markov = partial(markov_triton.markov_sample_triton, *args, top_k=shape["sparse_k"], validate=False)
        markov_variants = [dict(topk_block_r=r, topk_block_v=v) for r, v in ((32, 128), (16, 128), (32, 256),
                                                                              (16, 256), (64, 128))]  # fmt: skip
        choose(markov_triton.TUNING, "markov top-k", markov_variants, {"sparse": markov})
    return rows


def profile_rejection(shape: dict, device: torch.device) -> list[dict]:
    """Device time of every kernel of one eager call of the Triton sampler per setting (torch.profiler), in us."""
    from torch.profiler import ProfilerActivity, profile

    from kernels.rejection_triton import rejection_sample_triton

    rows = []
    for i, (name, setting) in enumerate(REJECTION_SETTINGS.items()):
        inputs = rejection_inputs(shape, device, setting, seed=i)
        args = [inputs[k] for k in REJECTION_ARGS]
        call = partial(rejection_sample_triton, *args, draft_prob_ids=inputs["draft_prob_ids"], validate=False)
        call()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize(device)
        kernels = {}
        for event in prof.key_averages():
            if event.device_time_total > 0 and not event.key.startswith("cuda"):
                kernels[event.key] = round(event.device_time_total, 1)
        rows.append({"setting": name, "kernel_us": kernels, "total_us": round(sum(kernels.values()), 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20 GPU, 1 CPU)")
    parser.add_argument("--sweep", nargs="*", choices=SWEEP_GROUPS, default=None,
                        help="also time other kernel launch sizes first, of the named groups (none named: all)")
    parser.add_argument("--only", choices=("rejection", "markov"), default=None, help="benchmark one sampler only")
    parser.add_argument("--profile", action="store_true",
                        help="GPU: also the device time of every rejection kernel per setting (torch.profiler)")
    parser.add_argument("--tune", action="store_true", help="with --sweep: run the benchmark with the fastest sizes")
    parser.add_argument("--out", default=None, help="JSON output (default docs/benchmarks/kernels.json; "
                        "none for --small)")  # fmt: skip
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
    groups = (args.sweep or list(SWEEP_GROUPS)) if args.sweep is not None else []
    sweep_rows = sweep(shape, device, max(1, repeats // 2), args.tune, groups) if groups else []
    from kernels import markov_triton, rejection_triton

    tuning = {"rejection": dict(rejection_triton.TUNING), "markov": dict(markov_triton.TUNING)}
    results = [] if args.only == "markov" else bench_rejection(shape, device, repeats, copy_gbps)
    results += [] if args.only == "rejection" else bench_markov(shape, device, repeats)
    profile_rows: list[dict] = []
    if args.profile and device.type == "cuda":
        try:  # auxiliary: a profiler that cannot start (no CUPTI) must not cost the benchmark's results
            profile_rows = profile_rejection(shape, device)
        except RuntimeError as exc:
            profile_rows = [{"error": repr(exc)}]

    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    )
    report = {
        "device": device_name, "torch": torch.__version__, "triton": triton.__version__, "shape": shape,
        "repeats": repeats, "copy_bandwidth_gbps": copy_gbps, "tuning": tuning, "results": results,
        "sweep": sweep_rows, "profile": profile_rows,
    }  # fmt: skip
    out = args.out or (None if args.small else "docs/benchmarks/kernels.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    for r in sweep_rows:
        print(f"sweep: {r}")
    print(f"tuning: {tuning}")
    print(f"\ndevice: {device_name}  shape: {shape}  copy bandwidth: {copy_gbps:.1f} GB/s (read+write)")
    print(f"{'kernel':10} {'setting':42} {'triton ms':>10} {'graph ms':>9} {'ref ms':>9} {'speedup':>8} "
          f"{'GB/s':>7} {'% copy':>7} {'% graph':>7} {'identical':>10}")  # fmt: skip
    for r in results:
        gbps = f"{r['achieved_gbps']:.0f}" if "achieved_gbps" in r else "-"
        frac = f"{100 * r['fraction_of_copy_bandwidth']:.0f}%" if "fraction_of_copy_bandwidth" in r else "-"
        gfrac = r.get("graph_fraction_of_copy_bandwidth")
        gfrac = f"{100 * gfrac:.0f}%" if gfrac else "-"
        graph = f"{r['triton_graph_ms']:.3f}" if r.get("triton_graph_ms") else "-"
        print(f"{r['kernel']:10} {r['setting']:42} {r['triton_ms']:10.3f} {graph:>9} {r['reference_ms']:9.2f} "
              f"{r['speedup']:7.1f}x {gbps:>7} {frac:>7} {gfrac:>7} {r['identical_requests']:>10}")  # fmt: skip
    for r in profile_rows:
        print(f"profile {r.get('setting')}: total {r.get('total_us')} us: {r.get('kernel_us', r.get('error'))}")
    if out:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
