"""The verify step of the qwen3-4b-shaped target on one GPU: exactness of the ragged graph path, the kernel
breakdown, and the step time against the memory-bandwidth floor, fused layer kernels on vs off (issue 11).

1. Exactness (float32, the real demo pair, code-like prompts): continuous batching through the engine with
   graphs off, with the ragged graph step captured (joining prompts chunk-prefilled inside it) and with the fused
   layers off: greedy outputs all equal the target's greedy ``generate``; sampled output of the captured graphs
   equals the same steps run eagerly (mode static).
2. The inflated qwen3-4b target in bf16: fused vs HF-module forward (max logit difference, argmax agreement).
3. For fused on and off: a VerifyEngine with captured graphs; full-block verify steps of R = 1, 8, 32 requests
   over a context of ``--context`` tokens: device time of the replay, wall time of the whole step (host packing
   and result copy included), the memory floor (weights + K/V read once at the measured copy bandwidth), and a
   torch.profiler kernel table of the same step run eagerly (mode static: the kernels the graph holds).
4. The SPS curve of the graph step (fused): B = 1 .. 256 and a step with a joining 160-token prompt.

``--skinny-gemm`` adds the fused layers with the skinny Triton GEMMs (``TargetModel.skinny_gemm``,
kernels/skinny_gemm_triton.py) to 1 (greedy through captured graphs equals the target), 2 and 3 (rows with
"skinny": true), so that their step time is measured against the same floor as the cuBLAS path's.
``--skinny-rows 16 64`` times the skinny variant once per row limit (``FASTER_ROWS``: passes of more rows stay
on cuBLAS; the default is the library's), and ``--pdl on off`` every fused variant with programmatic dependent
launch on and off (``DSPARK_PDL``; rows with "pdl"), so that one call compares them on the same floor.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/profile_verify_gpu.py --out-dir $OUT [--fused-only] [--skinny-gemm]
CPU smoke (small shape, static mode, no profiler table): add --small.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.bench_policies_gpu import (
    DEMO_DRAFTER,
    SMALL_SHAPE,
    copy_bandwidth,
    floor_seconds,
    kv_bytes_per_token,
    weight_bytes,
)
from bench.engine_setup import DEMO_TARGET
from draft_service.checkpoint import load_draft_model
from draft_service.engine import DraftEngine
from draft_service.inflate import inflate_pair
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy
from scheduler.profiling import graph_verify_items
from scheduler.sps import SPSTable
from verify_service.engine import VerifyEngine
from verify_service.graphs import GraphItem
from verify_service.inflate import SHAPES
from verify_service.target import TargetModel

BUCKETS = (1, 8, 32)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------- 1. exactness
def exactness(device: torch.device, mode: str, skinny: bool = False) -> dict[str, Any]:
    drafter = load_draft_model(DEMO_DRAFTER, target_dir=DEMO_TARGET, device=device)
    target = TargetModel.from_pretrained(DEMO_TARGET, feature_layer_ids=drafter.config.target_layer_ids, device=device)
    sps = SPSTable([1, 8, 16, 32, 64, 128, 256], [1000, 990, 960, 900, 700, 450, 250])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4000, size=int(rng.integers(2, 60))).tolist() for _ in range(16)]
    max_tokens = [int(rng.integers(4, 40)) for _ in range(16)]

    def run(graphs: str, temperature: float, fused: bool, skinny_gemm: bool = False) -> list[list[int]]:
        target.fused, target.skinny_gemm = fused, skinny_gemm
        verify = VerifyEngine(
            target,
            12,
            160,
            graphs=graphs,
            max_drafts=drafter.block_size,
            graph_buckets=(1, 2, 4, 8),
            graph_prefill_rows=96,
        )
        draft = DraftEngine(drafter, 12, 160, graphs=graphs, graph_buckets=(1, 2, 4, 8))
        engine = SpeculativeEngine(verify, draft, make_policy("dspark", sps, drafter.block_size))
        outputs: dict[str, list[int]] = {}
        order, pending = [], list(range(len(prompts)))
        while pending or engine.has_unfinished():
            for _ in range(min(3, len(pending))):
                i = pending.pop(0)
                sp = SamplingParams(temperature=temperature, max_tokens=max_tokens[i], seed=i, ignore_eos=True)
                rid = engine.add_request(prompts[i], sp)
                order.append(rid)
                outputs[rid] = []
            for out in engine.step():
                outputs[out.req_id].extend(out.new_token_ids)
        replays = 0 if verify.graphs is None else verify.graphs.replays
        log(f"exactness run graphs={graphs} T={temperature} fused={fused} skinny={skinny_gemm}: {replays} graph steps")
        return [outputs[r] for r in order]

    target.fused = False  # the oracle: HF modules, eager
    expected = [e[:m] for e, m in zip(target.generate(prompts, max(max_tokens)), max_tokens, strict=True)]
    fused = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    greedy = {
        "off": run("off", 0.0, fused),
        mode: run(mode, 0.0, fused),
        f"{mode}_unfused": run(mode, 0.0, False),
    }
    if skinny and fused:
        greedy[f"{mode}_skinny"] = run(mode, 0.0, True, skinny_gemm=True)
    sampled_graph = run(mode, 1.0, fused)
    sampled_static = run("static", 1.0, fused)
    target.fused, target.skinny_gemm = None, False
    return {
        "greedy_equal_target": {k: v == expected for k, v in greedy.items()},
        "sampled_graph_equals_static": sampled_graph == sampled_static,
        "requests": len(prompts),
    }


# ------------------------------------------------------------------------------------- 2. fused numerics
def fused_numerics(target: TargetModel, context: int, skinny: bool = False) -> dict[str, Any]:
    cache = target.new_kv_cache(8, context + 16)
    slots = [cache.allocate() for _ in range(8)]
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, target.vocab_size, (8, context), generator=gen).tolist()
    none = torch.empty(0, dtype=torch.int64, device=target.device)
    outs = {}
    for variant in ("modules", "fused", "skinny") if skinny else ("modules", "fused"):
        target.fused, target.skinny_gemm = variant != "modules", variant == "skinny"
        for s in slots:
            cache.truncate(s, 0)
        target.forward(cache, target.prepare(cache, list(zip(slots, prompts, strict=True))), logits_rows=none)
        chunk = target.prepare(cache, [(s, prompts[i][:8]) for i, s in enumerate(slots)])  # 64 rows: skinny
        outs[variant] = target.forward(cache, chunk).logits[:, : target.vocab_size]
    target.fused, target.skinny_gemm = None, False
    a, b = outs["modules"], outs["fused"]
    result = {
        "max_abs_logit_diff": float((a - b).abs().max()),
        "logit_scale": float(a.abs().max()),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "rows": a.shape[0],
    }
    if skinny:
        c = outs["skinny"]
        result["skinny_max_abs_logit_diff"] = float((a - c).abs().max())
        result["skinny_argmax_agreement"] = float((a.argmax(-1) == c.argmax(-1)).float().mean())
    return result


# ----------------------------------------------------------------------------------- 3. step vs the floor
def kernel_table(fn, rows: int = 14) -> dict[str, Any]:
    """torch.profiler over one call: CUDA kernels grouped by name, total device time and count."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total
            entry[1] += 1
    ordered = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "kernels": int(sum(v[1] for v in totals.values())),
        "kernel_us": float(sum(v[0] for v in totals.values())),
        "top": [{"name": n[:90], "us": v[0], "count": v[1]} for n, v in ordered[:rows]],
    }


def steps_vs_floor(
    target: TargetModel,
    block: int,
    context: int,
    bandwidth: float,
    mode: str,
    fused: bool,
    profile: bool,
    skinny: bool = False,
) -> list[dict[str, Any]]:
    target.fused, target.skinny_gemm = fused, skinny
    t0 = time.perf_counter()
    engine = VerifyEngine(target, 32, context + 2 * (block + 1), graphs=mode, max_drafts=block, graph_buckets=BUCKETS)
    runner = engine.graphs
    assert runner is not None
    log(f"fused={fused} skinny={skinny}: {len(runner.steps)} graphs built in {time.perf_counter() - t0:.1f} s")
    items, ids = graph_verify_items(engine, 32 * (block + 1), block + 1, context)
    weights, kv_token = weight_bytes(target), kv_bytes_per_token(target)
    rows = []
    try:
        for r in (1, 8, 32):
            step = items[:r]
            for _ in range(3):
                runner.run(step)
            walls, devices = [], []
            for _ in range(15):
                before = runner.step_time_s
                runner.timed = True
                t = time.perf_counter()
                runner.run(step)
                walls.append(time.perf_counter() - t)
                runner.timed = False
                devices.append(runner.step_time_s - before)
            floor = floor_seconds(weights, kv_token, r, context + block + 1, bandwidth)
            row = {
                "fused": fused,
                "skinny": skinny,
                "requests": r,
                "batch_tokens": r * (block + 1),
                "device_ms": 1000 * statistics.median(devices),
                "wall_ms": 1000 * statistics.median(walls),
                "floor_ms": 1000 * floor,
            }
            row["ratio"] = row["device_ms"] / row["floor_ms"]
            if profile and target.device.type == "cuda":
                key = runner.bucket(r, r * (block + 1))
                body = runner.steps[key].fn  # the captured body, run eagerly: the same kernels

                def eager(step=step, key=key, body=body):
                    runner._pack(runner._chunks(step), *key)
                    runner._upload()
                    return body()

                row["profile"] = kernel_table(eager)
            rows.append(row)
            log(
                f"fused={fused} skinny={skinny} R={r}: device {row['device_ms']:.2f} ms, "
                f"wall {row['wall_ms']:.2f} ms, floor {row['floor_ms']:.2f} ms ({row['ratio']:.2f}x)"
                + (
                    f", {row['profile']['kernels']} kernels {row['profile']['kernel_us'] / 1000:.2f} ms"
                    if "profile" in row
                    else ""
                )
            )
    finally:
        for req_id in ids:
            engine.release(req_id)
        runner.timed = False
    if fused and not skinny:
        rows.append({"sps": sps_curve(engine, block, context)})
    del engine
    torch.cuda.empty_cache() if target.device.type == "cuda" else None
    target.fused, target.skinny_gemm = None, False
    return rows


def sps_curve(engine: VerifyEngine, block: int, context: int) -> dict[str, Any]:
    """Device ms of the graph step per B (ceil(B / chunk) requests), and a step with a joining prompt."""
    runner = engine.graphs
    assert runner is not None
    # 31 requests: the 32nd slot is for the joining prompt below
    items, ids = graph_verify_items(engine, 31 * (block + 1), block + 1, context)
    curve = {}
    try:
        for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 248):
            num = -(-b // (block + 1))
            last = b - (num - 1) * (block + 1)
            step = [
                *items[: num - 1],
                GraphItem(
                    items[num - 1].slot, items[num - 1].start, items[num - 1].tokens[:last], items[num - 1].params
                ),
            ]
            for _ in range(2):
                runner.run(step)
            times = []
            for _ in range(7):
                before = runner.step_time_s
                runner.timed = True
                runner.run(step)
                runner.timed = False
                times.append(runner.step_time_s - before)
            curve[b] = 1000 * statistics.median(times)
        slot = engine.cache.allocate()
        try:
            prompt = list(range(100, 260))
            join = [*items[:8], GraphItem(slot, 0, prompt, (0.0, 0, 1.0, 0), prefill=True)]
            if runner.fits([(len(i.tokens), i.prefill) for i in join], 0):
                times = []
                for _ in range(7):
                    before = runner.step_time_s
                    runner.timed = True
                    runner.run(join)
                    runner.timed = False
                    times.append(runner.step_time_s - before)
                curve["8 verify + 160-token prefill"] = 1000 * statistics.median(times)
        finally:
            engine.cache.free(slot)
    finally:
        runner.timed = False
        for req_id in ids:
            engine.release(req_id)
    log("SPS curve (device ms): " + ", ".join(f"{k}: {v:.2f}" for k, v in curve.items()))
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--context", type=int, default=264, help="cached tokens per request (the sweep's median)")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--fused-only", action="store_true", help="time the fused layers only (not the HF modules)")
    parser.add_argument("--skinny-gemm", action="store_true", help="also the fused layers with the skinny Triton GEMMs")
    parser.add_argument("--skinny-rows", type=int, nargs="+", default=None,
                        help="row limits (FASTER_ROWS) the skinny variant is timed with (default: the library's)")
    parser.add_argument("--pdl", nargs="+", choices=["on", "off"], default=["on"],
                        help="programmatic dependent launch settings every fused variant is timed with")
    parser.add_argument("--skinny-tuning", type=Path, default=None,
                        help="launches swept by bench/bench_skinny_gemm.py --sweep --out FILE (its JSON), used "
                        "before the TUNING table")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.small
    device = torch.device("cuda" if cuda else "cpu")
    mode = "capture" if cuda else "static"
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    if args.skinny_tuning is not None and args.skinny_tuning.exists():
        from kernels.skinny_gemm_triton import load_tuning

        results["skinny_tuning_entries"] = load_tuning(args.skinny_tuning)
        log(f"skinny tuning: {results['skinny_tuning_entries']} swept launches from {args.skinny_tuning}")
    out = args.out_dir / "profile_verify.json"

    def save() -> None:
        out.write_text(json.dumps(results, indent=1))

    try:
        results["exactness"] = exactness(device, mode, args.skinny_gemm)
        log(f"exactness: {results['exactness']}")
    except Exception as error:  # one shot on the device: keep going with the timings
        results["exactness_error"] = repr(error)
        log(f"exactness FAILED: {error!r}")
    save()
    shape = SMALL_SHAPE if args.small else SHAPES["qwen3-4b"]
    pair = inflate_pair(DEMO_TARGET, DEMO_DRAFTER, shape, dtype="bfloat16" if cuda else "float32", device=device)
    target = pair.target_model()
    block = pair.draft.block_size if pair.draft is not None else 7
    del pair
    context = min(args.context, 64) if args.small else args.context
    if cuda:
        results["fused_numerics"] = fused_numerics(target, context, args.skinny_gemm)
        log(f"fused numerics: {results['fused_numerics']}")
    bandwidth = copy_bandwidth(device, 2**30 if cuda else 2**24)["bytes_per_s"]
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    results["weights_GB"] = weight_bytes(target) / 1e9
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, weights {results['weights_GB']:.2f} GB")
    save()
    results["steps"] = []
    from kernels import skinny_gemm_triton

    default_rows = skinny_gemm_triton.FASTER_ROWS
    # (fused, skinny, skinny row limit, pdl): the HF modules (unless --fused-only) take no PDL launches
    variants = [(True, False, default_rows, pdl) for pdl in args.pdl]
    variants += [] if args.fused_only else [(False, False, default_rows, "on")]
    if args.skinny_gemm:
        variants += [(True, True, rows, pdl) for rows in args.skinny_rows or [default_rows] for pdl in args.pdl]
    variants = variants if cuda else [(False, False, default_rows, "on")]
    for fused, skinny, rows, pdl in variants:
        label = f"fused={fused} skinny={skinny} rows<={rows} pdl={pdl}"
        skinny_gemm_triton.FASTER_ROWS = rows
        os.environ["DSPARK_PDL"] = "1" if pdl == "on" else "0"  # read at each launch, so at graph capture
        try:
            steps = steps_vs_floor(target, block, context, bandwidth, mode, fused, True, skinny)
            results["steps"] += [dict(row, skinny_rows=rows, pdl=pdl) for row in steps]
        except Exception as error:
            results.setdefault("errors", []).append(f"{label}: {error!r}")
            log(f"steps {label} FAILED: {error!r}")
        save()
    skinny_gemm_triton.FASTER_ROWS = default_rows
    os.environ.pop("DSPARK_PDL", None)
    # the table
    print("\nR   fused  skinny  rows  pdl  device ms  wall ms  floor ms  ratio  kernels  kernel ms")
    for row in results["steps"]:
        if "requests" not in row:
            continue
        prof = row.get("profile", {})
        print(
            f"{row['requests']:<3} {row['fused']!s:<6} {row['skinny']!s:<7} {row['skinny_rows']:<5} {row['pdl']:<4}"
            f"{row['device_ms']:9.2f} {row['wall_ms']:8.2f} {row['floor_ms']:9.2f} {row['ratio']:6.2f} "
            f"{prof.get('kernels', 0):8} {prof.get('kernel_us', 0) / 1000:9.2f}"
        )
    for row in results["steps"]:
        if "profile" in row and row["requests"] in (1, 32):
            print(f"-- top kernels, fused={row['fused']} skinny={row['skinny']} rows<={row['skinny_rows']} "
                  f"pdl={row['pdl']} R={row['requests']}:")  # fmt: skip
            for k in row["profile"]["top"][:10]:
                print(f"   {k['us']:9.1f} us  x{k['count']:<5} {k['name']}")
    print(f"exactness: {results.get('exactness', results.get('exactness_error'))}")
    print(f"fused numerics: {results.get('fused_numerics')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
