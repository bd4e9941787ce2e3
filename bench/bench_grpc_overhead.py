"""Per-round cost of the gRPC data plane vs the in-process engine, on the same models and prompts (issue 8).

Runs the same greedy workload twice with the same round driver (:class:`SpeculativeEngine`, policy ``dspark``, the
same SPS table): once over in-process engines, once over ``dspark draft-server`` and ``dspark verify-server``
processes on loopback (the verifier projects the context features with the drafter's projection and pushes them
straight to the drafter, unless told otherwise). The two paths run interleaved ``--repeats`` times so that the load
of a shared machine hits both alike. Checks that every run produces identical tokens, then reports the median round
time of each, the per-round phase times of the round driver, the ratio (goal <= 1.15 at 8 concurrent requests) and
the bytes on the wire per emitted token by hop (scheduler <-> replicas, verifier -> drafter features).

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_grpc_overhead.py --concurrency 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.engine_setup import (
    DEMO_TARGET,
    build_engine,
    code_prompts,
    demo_drafter,
    load_calibration,
    load_pair,
    tokenizer_for,
)
from cluster.rpc import SyncRpcClient
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine
from scheduler.pipeline import PipelinedEngine
from scheduler.policy import make_policy
from scheduler.profiling import profile_target_sps
from scheduler.remote import DrafterPool, RemoteVerifier
from scheduler.sps import SPSTable

#: The data plane's token of this run's servers: handed to them in the environment, never on a command line.
TOKEN = secrets.token_urlsafe(32)


def _cpu_s(pids: list[int]) -> float:
    """CPU time (user + system) of this process and of ``pids`` so far: what a round costs whatever the load."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _run(
    engine: SpeculativeEngine, prompts: list[list[int]], max_tokens: int, desc: str, pids: list[int] = ()
) -> dict:
    """One workload to completion: outputs, wall and CPU time, rounds and the round driver's phase times."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.snapshot()
    cpu = _cpu_s(list(pids))
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    rounds = 0
    request_rounds = 0  # target passes the requests went through (prefill included), summed over requests
    with tqdm(total=len(prompts) * max_tokens, desc=desc, unit="tok", leave=False) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.req_id].extend(out.new_token_ids)
                bar.update(len(out.new_token_ids))
                if out.finished and out.metrics is not None:
                    request_rounds += 1 + len(out.metrics.verified)
            rounds += 1
    seconds = time.perf_counter() - start
    cpu = _cpu_s(list(pids)) - cpu
    after = engine.snapshot()
    # A round = every request takes one target pass. Without pipelining that is one step of the round driver;
    # with request groups a step verifies one group, so the rounds each request went through are what count.
    per_request = request_rounds / len(prompts)
    return {
        "outputs": [outputs[i] for i in ids],
        "seconds": seconds,
        "rounds": round(per_request, 2),
        "steps": rounds,
        "ms_per_round": 1e3 * seconds / per_request,
        "cpu_ms_per_round": 1e3 * cpu / per_request,
        # Per-round phase times of the round driver, summed over its steps (admission/commit are the rest; with
        # request groups, "draft" is only what a group's drafting left exposed, the rest overlapped a verify).
        "draft_ms": 1e3 * (after.draft_time_s - before.draft_time_s) / per_request,
        "verify_ms": 1e3 * (after.verify_time_s - before.verify_time_s) / per_request,
        "accepted": after.num_accepted_tokens - before.num_accepted_tokens,
    }


def _start_server(kind: str, drafter: Path, sps_path: Path, args: argparse.Namespace) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")]))  # keep a carried site tree
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", DSPARK_GRPC_TOKEN=TOKEN)
    cmd = [sys.executable, "-m", "cluster.cli", kind, "--grpc-port", "0", "--draft", str(drafter),
           "--max-requests", str(max(2, args.concurrency)), "--max-seq-len", "512", "--device", "cpu",
           "--dtype", "float32", "--log-level", "warning", "--context-projection", args.context_projection]
    if kind == "verify-server":  # the verifier decides what travels and when drafters draft
        cmd += ["--sps", str(sps_path), "--feature-dtype", args.feature_dtype,
                *([] if args.draft_ahead else ["--no-draft-ahead"])]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_listening(proc: subprocess.Popen, what: str) -> str:
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        if line.startswith("listening on "):
            return line.split()[-1]
        seen = [*seen[-29:], line]
    raise RuntimeError(f"{what} exited before listening (code {proc.wait()}); its last output:\n{''.join(seen)}")


class _Wire:
    """Payload bytes by hop: scheduler <-> drafters, scheduler <-> verifier, verifier -> drafters (features)."""

    def __init__(self, pool: DrafterPool, verify: RemoteVerifier, verify_addr: str) -> None:
        self.pool, self.verify, self.verify_addr = pool, verify, verify_addr

    def read(self) -> dict[str, int]:
        probe = SyncRpcClient(self.verify_addr, token=TOKEN, timeout_s=10)
        features = probe.call("dspark.Verifier", "Info", {})["feature_bytes_sent"]
        probe.close()
        return {
            "scheduler_to_drafter": self.pool.bytes_sent,
            "drafter_to_scheduler": self.pool.bytes_received,
            "scheduler_to_verifier": self.verify.bytes_sent,
            "verifier_to_scheduler": self.verify.bytes_received,
            "verifier_to_drafter_features": features,
        }


def _median(runs: list[dict], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved in-process / gRPC runs (medians)")
    parser.add_argument("--context-projection", choices=("verifier", "drafter"), default="verifier")
    parser.add_argument("--feature-dtype", choices=("model", "bfloat16", "float16"), default="model")
    parser.add_argument("--no-draft-ahead", dest="draft_ahead", action="store_false")
    parser.add_argument("--groups", type=int, default=1,
                        help="request groups of the gRPC path: > 1 pipelines them (scheduler.pipeline)")
    parser.add_argument("--in-process-groups", type=int, default=1, help="the same for the in-process path")
    parser.add_argument("--sps", type=Path, default=None, help="SPS table JSON (default: profiled now)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/grpc_overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    drafter_dir = demo_drafter()
    if drafter_dir is None:
        raise SystemExit("needs the trained demo drafter (models/demo/draft_dspark)")
    target, drafter = load_pair(DEMO_TARGET, drafter_dir, "cpu", torch.float32)
    tokenizer = tokenizer_for(DEMO_TARGET)
    prompts = code_prompts(tokenizer, args.concurrency, args.prompt_tokens)
    if args.sps is not None:
        sps = SPSTable.load(args.sps)
    else:
        sps = profile_target_sps(target, chunk=drafter.block_size + 1, max_batch_tokens=args.concurrency * 8)

    # At least two slots: the drafter's warm-up needs two (as the servers' --max-requests below).
    local = build_engine(target, drafter, policy="dspark", sps=sps, max_requests=max(2, args.concurrency),
                         max_seq_len=512, calibration=load_calibration(drafter_dir), groups=args.in_process_groups)
    _run(local, prompts[:1], 8, "warm-up")
    runs: dict[str, list[dict]] = {"in_process": [], "grpc": []}
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        sps_path = sps.save(Path(tmp) / "sps.json")
        draft_proc = _start_server("draft-server", drafter_dir, sps_path, args)
        verify_proc = _start_server("verify-server", drafter_dir, sps_path, args)
        try:
            draft_addr = _wait_listening(draft_proc, "draft-server")
            verify_addr = _wait_listening(verify_proc, "verify-server")
            pool = DrafterPool([draft_addr], token=TOKEN)
            remote_verify = RemoteVerifier(verify_addr, pool.route_of, token=TOKEN)
            pool.require_projection(remote_verify.context_projection, verify_addr)
            policy = make_policy("dspark", sps, pool.block_size)
            remote = (
                PipelinedEngine(remote_verify, pool, policy, groups=args.groups, eos_token_ids=target.eos_token_ids)
                if args.groups > 1
                else SpeculativeEngine(remote_verify, pool, policy, eos_token_ids=target.eos_token_ids)
            )
            _run(remote, prompts[:1], 8, "warm-up (gRPC)")
            wire = _Wire(pool, remote_verify, verify_addr)
            for rep in range(args.repeats):
                # Alternate which path goes first, so that a load change on the shared CPU hits both alike.
                order = ("in_process", "grpc") if rep % 2 == 0 else ("grpc", "in_process")
                for name in order:
                    engine = local if name == "in_process" else remote
                    before = wire.read()
                    pids = [draft_proc.pid, verify_proc.pid] if name == "grpc" else []
                    run = _run(engine, prompts, args.max_tokens, f"{name} {rep + 1}/{args.repeats}", pids)
                    if name == "grpc":
                        run["wire"] = {k: v - before[k] for k, v in wire.read().items()}
                    runs[name].append(run)
                loads.append(os.getloadavg()[0])
            drafter_info = SyncRpcClient(draft_addr, token=TOKEN, timeout_s=10).call("dspark.Drafter", "Info", {})
            pool.close()
            remote_verify.close()
        finally:
            for proc in (draft_proc, verify_proc):
                proc.terminate()
                proc.wait(30)
    reference = runs["in_process"][0]["outputs"]
    if any(r["outputs"] != reference for rs in runs.values() for r in rs):
        print("MISMATCH: gRPC and in-process outputs differ", file=sys.stderr)
        return 1
    tokens = sum(len(o) for o in reference)
    ratios = [g["ms_per_round"] / i["ms_per_round"] for g, i in zip(runs["grpc"], runs["in_process"], strict=True)]
    wire_runs = [r["wire"] for r in runs["grpc"]]
    wire_bytes = {k: int(statistics.median(w[k] for w in wire_runs)) for k in wire_runs[0]}
    total_wire = sum(wire_bytes.values())
    result = {
        "machine": f"{os.cpu_count()}-core CPU VM (shared with other jobs), torch CPU, 1 thread per process",
        "command": " ".join(["python", *sys.argv]),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "context_projection": args.context_projection,
        "feature_dtype": args.feature_dtype,
        "draft_ahead": args.draft_ahead,
        "groups": {"grpc": args.groups, "in_process": args.in_process_groups},
        "tokens": tokens,
        "load_average_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        **{
            name: {
                "rounds": rs[0]["rounds"],
                "steps": rs[0]["steps"],
                "accepted_tokens": rs[0]["accepted"],
                "ms_per_round_median": _median(rs, "ms_per_round"),
                "ms_per_round_runs": [round(r["ms_per_round"], 2) for r in rs],
                # CPU time of every process of the path (all three for gRPC), per round: load-independent cost.
                "cpu_ms_per_round_median": _median(rs, "cpu_ms_per_round"),
                "draft_ms_per_round_median": _median(rs, "draft_ms"),
                "verify_ms_per_round_median": _median(rs, "verify_ms"),
            }
            for name, rs in runs.items()
        },
        "ratio_of_medians": _median(runs["grpc"], "ms_per_round") / _median(runs["in_process"], "ms_per_round"),
        "ratio_paired_median": statistics.median(ratios),
        "ratio_paired_runs": [round(r, 3) for r in ratios],
        "proposals_drafted_ahead": drafter_info["proposals_ahead"],
        "proposals": sum(r["steps"] for r in runs["grpc"]),
        "wire_bytes": wire_bytes,
        "wire_bytes_per_token": total_wire / tokens,
        "identical_outputs": True,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'path':<12}{'rounds':>8}{'ms/round':>10}{'draft':>8}{'verify':>8}{'cpu ms/round':>14}")
    for name in ("in_process", "grpc"):
        r = result[name]
        print(f"{name:<12}{r['rounds']:>8}{r['ms_per_round_median']:>10.2f}{r['draft_ms_per_round_median']:>8.2f}"
              f"{r['verify_ms_per_round_median']:>8.2f}{r['cpu_ms_per_round_median']:>14.2f}")
    print(f"gRPC / in-process per round: {result['ratio_paired_median']:.3f} paired median "
          f"({result['ratio_of_medians']:.3f} of medians; goal <= 1.15) over {args.repeats} repeats, load average "
          f"{result['load_average_1min']['median']:.1f}; {result['wire_bytes_per_token']:.0f} bytes on the wire per "
          f"emitted token: {wire_bytes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
