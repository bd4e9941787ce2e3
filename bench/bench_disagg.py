"""Drafter and verifier as separate processes on separate devices, against both in one process (issue 12).

Two layouts serve the same prompt mix, concurrency levels and policies, with the closed-loop cells of
``bench/bench_policies_gpu.py`` (a new request as soon as one finishes; warm-up, then a measured window):

- ``colocated``: the draft and verify engines in this process on ``--verify-device`` (the single-GPU shape);
- ``processes``: ``dspark draft-server`` on ``--draft-device`` and ``dspark verify-server`` on
  ``--verify-device`` (``CUDA_VISIBLE_DEVICES`` pins each process to its GPU), this process driving the rounds over
  gRPC; the verifier pushes the (projected) context features straight to the drafter. No Ray here: this separates
  the transfer's cost from Ray's. ``--groups 1 2`` also runs pipelined request groups (:mod:`scheduler.pipeline`:
  the drafter drafts one group while the verifier verifies the other).

Per cell (and in ``disagg_throughput.png``, aggregate vs per-user tokens/s): median tokens/s per user,
aggregate tokens/s, tau, round time and its split (exposed draft wait, verify call, host), and for
``processes`` the bytes per round on the wire by hop and each replica's busy fraction (the growth of its engine
thread's busy time over the cell's wall time: on a GPU the engine thread waits for its results, so this is the
device's share of the time plus the host work around it, an upper bound on the GPU's own).

With ``--shape`` the trained demo pair is inflated (function-preserving, docs/COST_REALISTIC.md) and saved to a
scratch folder that the servers load, so steps cost what a real-size pair costs with the demo pair's acceptance.

Two GPUs (nvidia-h200-x2; prompt files copied to .data/prompts):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/bench_disagg.py --shape qwen3-4b --draft-device cuda:0 \\
        --verify-device cuda:1 --prompts-dir .data/prompts --out-dir $OUT
CPU smoke (demo pair as it is, both "devices" the CPU, about two minutes):
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_disagg.py --concurrency 1 8 --policies autoregressive dspark \\
        --groups 1 2 --measure-s 3 --prompts-dir /work/shared/data/prompts --out-dir /tmp/disagg
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.bench_grpc_overhead import TOKEN, _wait_listening
from bench.bench_policies_gpu import SMALL_SHAPE, CellBudget, load_prompt_mix, plot_throughput, run_cell
from bench.engine_setup import DEMO_TARGET, demo_drafter, load_calibration, load_pair, tokenizer_for
from cluster.contract import DRAFTER, VERIFIER
from cluster.loading import profiled_request_counts
from cluster.rpc import SyncRpcClient
from draft_service.engine import DraftEngine
from scheduler.engine import SpeculativeEngine
from scheduler.pipeline import PipelinedEngine
from scheduler.policy import make_policy
from scheduler.profiling import profile_graph_sps_by_requests, profile_target_sps
from scheduler.remote import DrafterPool, RemoteVerifier
from scheduler.sps import SPSSource, load_sps_file
from verify_service.engine import VerifyEngine

MAX_SEQ_LEN = 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="none",
                   help="inflate the demo pair to this Qwen3 shape (none: as it is; small: a CPU-sized inflation)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bf16 on GPU")
    p.add_argument("--draft-device", default="cpu", help="cpu or cuda:i (the drafter server's GPU)")
    p.add_argument("--verify-device", default="cpu", help="cpu or cuda:i (the verifier's; colocated runs here)")
    p.add_argument("--layouts", nargs="+", choices=("colocated", "processes"), default=["colocated", "processes"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--policies", nargs="+", default=["autoregressive", "fixed-1", "full", "dspark"])
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2], help="request groups (> 1: pipelined)")
    p.add_argument("--relay-drafts", choices=("on", "off"), default="on",
                   help="processes with one request group: the drafters return their next blocks to the verifier, "
                        "which verifies them in rounds with planned lengths (engine.relay_drafts, the scheduler's "
                        "default), or each drafted round sends a Propose")
    p.add_argument("--decode-steps", type=int, default=4,
                   help="processes, autoregressive: tokens decoded per Step (scheduler.decode_steps)")
    p.add_argument("--feature-transport", choices=("grpc", "collective"), default="grpc",
                   help="processes: context features as gRPC bytes, or over torch.distributed links (NCCL on GPUs)")
    p.add_argument("--prompts-dir", type=Path, required=True)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mbpp"])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--measure-s", type=float, default=8.0)
    p.add_argument("--sps", type=Path, default=None, help="SPS table JSON (default: profiled on the verify device)")
    p.add_argument("--graphs", choices=("off", "static", "capture"), default="off",
                   help="engine steps in both layouts (the servers get the same flag): eager (off, the default), "
                   "bucketed steps eagerly (static) or as CUDA graphs (capture); without --sps the SPS table is "
                   "profiled on the step that runs (by request count for bucketed steps, as the servers do)")
    p.add_argument("--out-dir", type=Path, required=True)
    return p.parse_args(argv)


@contextmanager
def _server(kind: str, target: Path, drafter: Path, device: str, dtype: str, sps: Path, slots: int,
            transport: str, graphs: str) -> Iterator[str]:
    """A standalone ``dspark`` server process pinned to ``device``; yields its gRPC address."""
    path = os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")]))  # keep a carried site tree
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               DSPARK_GRPC_TOKEN=TOKEN)
    if device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2] or "0"
        device = "cuda"
    cmd = [sys.executable, "-m", "cluster.cli", kind, "--target", str(target), "--draft", str(drafter),
           "--max-requests", str(slots), "--max-seq-len", str(MAX_SEQ_LEN), "--device", device,
           "--dtype", dtype, "--grpc-port", "0", "--log-level", "warning", "--feature-transport", transport,
           "--graphs", graphs]
    if kind == "verify-server":
        cmd += ["--sps", str(sps)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = _wait_listening(proc, kind)
        # Keep reading what the server prints (a full pipe would block it); show it on our stderr.
        threading.Thread(target=lambda: [sys.stderr.write(f"[{kind}] {line}") for line in proc.stdout or ()],
                         daemon=True).start()
        yield address
    finally:
        proc.terminate()
        proc.wait(60)


class _Replicas:
    """Counters of the two servers: bytes by hop (client side) and engine busy time (server side)."""

    def __init__(self, pool: DrafterPool, verifiers: list[RemoteVerifier], draft_addr: str, verify_addr: str) -> None:
        self.pool, self.verifiers = pool, verifiers
        self.probes = {
            DRAFTER: SyncRpcClient(draft_addr, token=TOKEN, timeout_s=30),
            VERIFIER: SyncRpcClient(verify_addr, token=TOKEN, timeout_s=30),
        }

    def read(self) -> dict[str, float]:
        drafter = self.probes[DRAFTER].call(DRAFTER, "Info", {})
        verifier = self.probes[VERIFIER].call(VERIFIER, "Info", {})
        return {
            "wall_s": time.perf_counter(),
            "drafter_busy_s": drafter["engine_busy_s"],
            "verifier_busy_s": verifier["engine_busy_s"],
            "scheduler_drafter_bytes": self.pool.bytes_sent + self.pool.bytes_received,
            "scheduler_verifier_bytes": sum(v.bytes_sent + v.bytes_received for v in self.verifiers),
            "feature_bytes": verifier["feature_bytes_sent"] + verifier.get("feature_bytes_collective", 0),
        }

    def close(self) -> None:
        for probe in self.probes.values():
            probe.close()


def _driver(verify: Any, draft: Any, policy: str, sps: SPSSource, block: int, groups: int,
            eos: tuple[int, ...], decode_steps: int = 1) -> SpeculativeEngine:
    """A round driver as the hub builds one; ``decode_steps`` applies to plain decoding over gRPC only (the
    in-process placement decodes one token per round)."""
    policy_ = make_policy(policy, sps, block)
    draft = draft if policy_.uses_drafter else None
    remote = isinstance(verify, RemoteVerifier)
    if remote:  # plain decoding: the context features stay on the verifier
        verify.inline_features = draft is not None
    if groups > 1 and draft is not None:
        return PipelinedEngine(verify, draft, policy_, groups=groups, eos_token_ids=eos)
    return SpeculativeEngine(verify, draft, policy_, eos_token_ids=eos, decode_steps=decode_steps if remote else 1)


def _cells(layout: str, make: Callable[[str, int], SpeculativeEngine], args: argparse.Namespace, mix: Any,
           counters: _Replicas | None, bar: tqdm, sink: Callable[[dict[str, Any]], None]) -> None:
    """Every (groups, policy, concurrency) cell of one layout; each row goes to ``sink`` as soon as it is
    measured (a device call cut short keeps the cells it finished)."""
    for groups in args.groups:
        for policy in args.policies:
            if groups > 1 and policy == "autoregressive":
                continue  # nothing to overlap without a drafter
            engine = make(policy, groups)
            for concurrency in args.concurrency:
                before = counters.read() if counters is not None else None
                rounds_before = engine.snapshot().rounds
                row, _ = run_cell(engine, policy, mix, concurrency, CellBudget(args.warmup_s, args.measure_s), 0.0)
                row.update(layout=layout, groups=groups)
                if counters is not None and before is not None:
                    after = counters.read()
                    wall = after["wall_s"] - before["wall_s"]
                    rounds = max(engine.snapshot().rounds - rounds_before, 1)
                    row["drafter_busy_fraction"] = (after["drafter_busy_s"] - before["drafter_busy_s"]) / wall
                    row["verifier_busy_fraction"] = (after["verifier_busy_s"] - before["verifier_busy_s"]) / wall
                    for key in ("scheduler_drafter_bytes", "scheduler_verifier_bytes", "feature_bytes"):
                        row[f"{key}_per_round"] = (after[key] - before[key]) / rounds
                sink(row)
                bar.update()
                bar.write(_line(row))
            engine.close()


def _line(r: dict[str, Any]) -> str:
    busy = ""
    if "verifier_busy_fraction" in r:
        wire = r["scheduler_drafter_bytes_per_round"] + r["scheduler_verifier_bytes_per_round"] + r[
            "feature_bytes_per_round"]
        busy = (f" {100 * r['drafter_busy_fraction']:5.0f}% {100 * r['verifier_busy_fraction']:5.0f}%"
                f" {wire / 1024:8.1f}")
    return (f"{r['layout']:<10}{r['groups']:>3} {r['policy']:<15}{r['concurrency']:>5}"
            f"{r['per_user_tokens_per_s']:>9.1f}{r['aggregate_tokens_per_s']:>9.1f}{r['tau']:>6.2f}"
            f"{r['round_ms']:>8.2f}{r['draft_ms']:>7.2f}{r['verify_ms']:>7.2f}{r['host_ms']:>7.2f}{busy}")


HEADER = (f"{'layout':<10}{'grp':>3} {'policy':<15}{'conc':>5}{'tok/s/u':>9}{'agg':>9}{'tau':>6}{'round':>8}"
          f"{'draft':>7}{'verify':>7}{'host':>7} {'busy d':>6} {'busy v':>6} {'KiB/rd':>8}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    gpu = args.verify_device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    drafter_dir = demo_drafter()
    if drafter_dir is None:
        raise SystemExit("needs the trained demo drafter (models/demo/draft_dspark)")
    tokenizer = tokenizer_for(DEMO_TARGET)
    mix = load_prompt_mix(args.prompts_dir, args.datasets, tokenizer, per_dataset=64, max_prompt_tokens=512,
                          max_tokens=args.max_tokens, jitter=args.max_tokens // 4)
    results: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs"
        + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if gpu else ""),
        "shape": args.shape, "dtype": dtype, "feature_transport": args.feature_transport,
        "draft_device": args.draft_device, "verify_device": args.verify_device,
        "prompts": mix.summary(), "rows": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        target_dir, draft_dir = DEMO_TARGET, drafter_dir
        if args.shape != "none":
            from draft_service.inflate import inflate_pair

            # Built on the verify device (fast), saved for the servers; the in-memory copy is dropped at once.
            shape = SMALL_SHAPE if args.shape == "small" else args.shape
            inflate_pair(DEMO_TARGET, drafter_dir, shape, dtype=dtype, device=args.verify_device, out_dir=scratch)
            if gpu:
                torch.cuda.empty_cache()
            target_dir, draft_dir = Path(scratch) / "target", Path(scratch) / "draft"
            if (drafter_dir / "sts.json").exists():
                shutil.copy(drafter_dir / "sts.json", draft_dir / "sts.json")
        target, drafter = load_pair(target_dir, draft_dir, args.verify_device, getattr(torch, dtype))
        slots = max(args.concurrency)
        block, eos = drafter.block_size, tuple(target.eos_token_ids)
        verify = VerifyEngine(target, slots, MAX_SEQ_LEN, max_drafts=block, graphs=args.graphs,
                              graph_prefill_rows=0 if args.graphs == "off" else 512)
        sps: SPSSource
        if args.sps is not None:
            sps = load_sps_file(args.sps)
        elif verify.graphs is not None:  # the steps run as graphs: price them as the servers profile them
            sps, _ = profile_graph_sps_by_requests(verify, chunk=block + 1,
                                                   request_counts=profiled_request_counts(slots))
        else:
            sps = profile_target_sps(target, chunk=block + 1, max_batch_tokens=slots * (block + 1), context=256)
        sps_path = args.out_dir / "sps_disagg.json"
        sps_path.write_text(json.dumps(sps.to_dict(), indent=1) + "\n")
        out = args.out_dir / "disagg.json"

        def sink(row: dict[str, Any]) -> None:
            results["rows"].append(row)
            out.write_text(json.dumps(results, indent=1) + "\n")

        cells = len(args.layouts) * len(args.concurrency) * sum(
            1 for g in args.groups for p in args.policies if not (g > 1 and p == "autoregressive"))
        print(HEADER, flush=True)
        with tqdm(total=cells, desc="cells", unit="cell") as bar:
            if "colocated" in args.layouts:
                draft = DraftEngine(drafter, slots, MAX_SEQ_LEN, calibration=load_calibration(drafter_dir),
                                    graphs=args.graphs)
                _cells("colocated", lambda p, g, v=verify, d=draft: _driver(v, d, p, sps, block, g, eos), args, mix,
                       None, bar, sink)
                del draft
            del verify, target, drafter
            if gpu:
                torch.cuda.empty_cache()
            if "processes" in args.layouts:
                with (
                    _server("draft-server", target_dir, draft_dir, args.draft_device, dtype, sps_path, slots,
                            args.feature_transport, args.graphs) as da,
                    _server("verify-server", target_dir, draft_dir, args.verify_device, dtype, sps_path, slots,
                            args.feature_transport, args.graphs) as va,
                ):
                    pool = DrafterPool([da], token=TOKEN)
                    remote = RemoteVerifier(va, pool.route_of, token=TOKEN)
                    # As the scheduler's hub: drafts relayed to the verifier only with one request group.
                    relaying = (RemoteVerifier(va, pool.route_of, token=TOKEN, relay=True)
                                if args.relay_drafts == "on" else remote)
                    pool.require_projection(remote.context_projection, va)
                    counters = _Replicas(pool, list({id(v): v for v in (remote, relaying)}.values()), da, va)
                    _cells("processes", lambda p, g: _driver(relaying if g == 1 else remote, pool, p, sps, block,
                                                             g, eos, args.decode_steps), args, mix, counters, bar,
                           sink)
                    counters.close()
                    pool.close()
                    remote.close()
                    relaying.close()
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot_throughput(results["rows"], None, args.out_dir / "disagg_throughput.png",
                    f"demo pair ({args.shape}), drafter {args.draft_device}, verifier {args.verify_device}",
                    series=lambda c: f"{c['layout']}, {c['policy']}" + (f", {c['groups']} groups" if c["groups"] > 1
                                                                          else ""))
    print("\n" + HEADER)
    for row in results["rows"]:
        print(_line(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
