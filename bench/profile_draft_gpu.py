"""Where the draft step's time goes: the captured propose step of the inflated demo drafter, kernel by kernel.

The policy sweep (bench/bench_policies_gpu.py) measures a 2.1 ms draft step at 1 request for the demo drafter
inflated into the Qwen3-4B shape (2 layers of width 2560, vocabulary 151936, Markov rank 256), several times
what streaming its weights costs. This script builds the same DraftEngine (CUDA graphs captured), gives R
requests a context of ``--context`` rows plus one staged per-round append (block + 1 rows, as in a steady round),
and reports per R: the wall time of ``propose``, the device time of the replay, the weight-streaming floor
(drafter bytes read per step / copy bandwidth) and a kernel table of one replay (torch.profiler).

``--skinny`` lists the drafter's GEMM variants to profile every level with, each with its own engine (a captured
graph keeps the path it was captured with) and the same inputs: ``off`` (cuBLAS), ``on`` (the skinny Triton
GEMMs, ``DSparkDraftModel.skinny_gemm``: the fused path's passes of at most FASTER_ROWS block rows, i.e. R = 1
and 2 here) and ``layers`` (the skinny GEMMs in the layers, the LM head on cuBLAS: ``skinny_lm_head`` off).
``comparison`` lists per (temperature, R) and variant its device ms against ``off`` and the share of draft tokens
equal to ``off``'s over the warm-up rounds (the paths sum in different orders: a near-tie may draft another token).

GPU:  PYTHONPATH=. python3 bench/profile_draft_gpu.py --out $OUT/draft_profile.json
CPU:  PYTHONPATH=. python bench/profile_draft_gpu.py --small --device cpu --out /tmp/draft_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.bench_policies_gpu import SMALL_SHAPE, copy_bandwidth
from bench.profile_verify_gpu import kernel_table
from draft_service.engine import ContextBatch, DraftEngine, DraftItem
from draft_service.inflate import inflate_pair
from kernels.sampling import SamplingParams
from verify_service.inflate import SHAPES

MODELS = Path(__file__).resolve().parent.parent / "models" / "demo"


def drafter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the drafter's parameters a propose step reads at least once (the embedding table excepted:
    it reads R x (block + 1) rows of it)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed" not in name)


def profile_level(engine: DraftEngine, requests: int, context: int, temperature: float, iters: int) -> dict[str, Any]:
    model, device = engine.model, engine.model.device
    block = model.block_size
    width = model.config.context_feature_size
    ids = [f"r{requests}-{i}" for i in range(requests)]
    for i, req_id in enumerate(ids):
        engine.add_request(req_id, SamplingParams(temperature=temperature, seed=i))
    gen = torch.Generator(device).manual_seed(requests)  # the same inputs for every engine of a level
    rows = torch.randn((requests * context, width), generator=gen, device=device).to(model.dtype) * 0.1
    engine.append_context(ContextBatch(ids, [0] * requests, [context] * requests, rows))
    steady = torch.randn((requests * (block + 1), width), generator=gen, device=device).to(model.dtype) * 0.1
    position = context

    def one_round() -> torch.Tensor:
        nonlocal position
        # A steady round: the verifier committed block + 1 rows per request, staged by the bucketed append and
        # written inside the next propose step's graph; then the drafts of the next block.
        engine.append_context(ContextBatch(ids, [position] * requests, [block + 1] * requests, steady))
        position += block + 1
        return engine.propose([DraftItem(req_id, 1, position) for req_id in ids]).tokens

    warmup_tokens = [one_round().tolist() for _ in range(3)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        one_round()
        walls.append(time.perf_counter() - t0)
    runner = engine.graphs
    step = None
    if runner is not None:
        size = min(s for s in runner.sizes if s >= requests)
        step = runner.steps[size]
    table = kernel_table(one_round) if device.type == "cuda" else None
    device_ms = None
    if step is not None and device.type == "cuda":
        runner.timed = True
        before = step.time_s
        for _ in range(iters):
            one_round()
        runner.timed = False
        device_ms = 1000 * (step.time_s - before) / iters  # device time of the replays (mean)
    for req_id in ids:
        engine.release(req_id)
    return {
        "requests": requests,
        "temperature": temperature,
        "skinny": variant(model),
        "propose_wall_ms": 1000 * statistics.median(walls),
        "device_ms": device_ms,
        "kernels": table,
        "warmup_tokens": warmup_tokens,
    }


VARIANTS = {"off": (False, False), "layers": (True, False), "on": (True, True)}
"""--skinny variant -> (DSparkDraftModel.skinny_gemm, skinny_lm_head)."""


def variant(model: Any) -> str:
    return "off" if not model.skinny_gemm else "on" if model.skinny_lm_head else "layers"


def compare(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (temperature, R) and skinny variant profiled besides ``off``: device ms against off's, and the share of
    draft tokens equal to off's."""
    rows = []
    for off in (lv for lv in levels if lv["skinny"] == "off"):
        key = (off["temperature"], off["requests"])
        for other in (lv for lv in levels if lv["skinny"] != "off" and (lv["temperature"], lv["requests"]) == key):
            a, b = torch.tensor(off["warmup_tokens"]), torch.tensor(other["warmup_tokens"])
            ms_off, ms = off["device_ms"], other["device_ms"]
            rows.append({
                "temperature": key[0], "requests": key[1], "skinny": other["skinny"],
                "cublas_device_ms": ms_off, "device_ms": ms, "speedup": ms_off / ms if ms_off and ms else None,
                "equal_draft_tokens": float((a == b).double().mean()),
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small inflation (CPU smoke test)")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=125, help="context rows per request (the sweep's median)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--skinny", nargs="+", choices=list(VARIANTS), default=["off", "on"],
                        help="the drafter's GEMM variants to profile: cuBLAS (off), the skinny Triton GEMMs (on), "
                        "or those in the layers with the LM head on cuBLAS (layers)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = SMALL_SHAPE if args.small else SHAPES["qwen3-4b"]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    pair = inflate_pair(MODELS / "target", MODELS / "draft_dspark", shape, dtype=dtype, device=device, seed=0)
    assert pair.draft is not None
    max_requests = max(args.requests)
    max_seq = args.context + 8 * (pair.draft.block_size + 1) * (args.iters * 3 + 10)
    graphs = "capture" if device.type == "cuda" else "static"
    results: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "shape": "small" if args.small else "4b"}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
        bandwidth = copy_bandwidth(device, 1 << 30)["bytes_per_s"]
        results["copy_bandwidth_gbps"] = bandwidth / 1e9
        results["drafter_bytes"] = drafter_bytes(pair.draft)
        results["floor_ms"] = 1000 * results["drafter_bytes"] / bandwidth
    levels = []
    for name in args.skinny:
        # read when the graphs are captured: one engine per setting
        pair.draft.skinny_gemm, pair.draft.skinny_lm_head = VARIANTS[name]
        engine = DraftEngine(pair.draft, max_requests, max_seq, draft_top_k=16, graphs=graphs)
        for temperature in args.temperatures:
            for requests in tqdm(args.requests, desc=f"skinny={name} T={temperature}"):
                levels.append(profile_level(engine, requests, args.context, temperature, args.iters))
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["levels"] = levels
    results["comparison"] = compare(levels)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"drafter weights read per step: {results.get('drafter_bytes', 0) / 2**30:.2f} GiB, "
          f"floor {results.get('floor_ms', float('nan')):.3f} ms")
    for level in levels:
        device_ms = level["device_ms"]
        print(f"skinny={level['skinny']:6} T={level['temperature']:.1f} R={level['requests']:4d}: propose wall "
              f"{level['propose_wall_ms']:.3f} ms, device " + (f"{device_ms:.3f} ms" if device_ms else "-"))
        table = level["kernels"]
        if table:
            print(f"   {table['kernels']} kernels, {table['kernel_us']:.0f} us of kernel time; top:")
            for row in table["top"][:10]:
                print(f"     {row['us']:8.1f} us x{row['count']:4d}  {row['name']}")
    if results["comparison"]:
        print("\n   T     R  skinny  off device ms  its device ms  speedup  draft tokens equal to off's")
        for row in results["comparison"]:
            cells = [f"{'-':>{w}}" if v is None else f"{v:{w}.3f}" for v, w in
                     ((row["cublas_device_ms"], 14), (row["device_ms"], 14), (row["speedup"], 8))]  # fmt: skip
            print(f"{row['temperature']:4.1f} {row['requests']:5d}  {row['skinny']:6} {' '.join(cells)} "
                  f"{row['equal_draft_tokens']:28.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
