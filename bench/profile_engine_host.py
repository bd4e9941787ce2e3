"""Host time per round of the bucketed (CUDA-graph) path, with the graph bodies taken out, on any machine.

CPU (default): builds the demo pair in graph mode ``static``, runs one real round per bucket to record what every
graph step returns, then replaces each step's body by "return the recorded outputs": what is left of a round is
exactly the host work a captured round does outside its replays (the round driver, the engines' item building,
validation and bookkeeping, the staging-buffer fills, the host <-> device copies and result conversions; on the
CPU those copies are memcpys). Requests are restarted (aborted and re-added; their prefill round is not timed)
before their slots fill up, so any number of rounds can be timed at R requests.

GPU (``--device cuda``): the real captured graphs; host time = wall time of a plain round - the device time of
the replays (CUDA events, measured in timed rounds alternating with the plain ones), as in
bench/bench_engine_gpu.py; the host time within the timed rounds (events included) is printed after it, then the
two medians it is made of (plain round wall, device time in the graphs: that script's ``plain_total_ms`` and
``in_graphs_ms``). The setup is not that script's (24-token prompts, max_seq_len 256, requests restarted every
few dozen rounds, 200 + 200 rounds): ``--prompt-tokens 96 --max-seq-len 456`` give its prompts and slots. With
``--profile``, cProfile over the same rounds says where that host time goes (cProfile itself slows Python
down: read the split, not the totals).

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.profile_engine_host --requests 32 128 --rounds 200
    PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.profile_engine_host --requests 32 --profile   # + cProfile
    PYTHONPATH=. python -m bench.profile_engine_host --device cuda --requests 32 128 --profile
    PYTHONPATH=. python -m bench.profile_engine_host --device cuda --requests 32 128 --check 32  # + exactness

Prints the median / mean host microseconds per round for each R (and with --profile the top functions).
With ``--count-calls`` (CPU), it also lists the torch calls a round makes outside the graph bodies (a
TorchFunctionMode over the timed rounds: torch functions and tensor methods called from Python, attribute
reads left out), the graph launches and the staging-fence calls, per round: on a GPU each of them is a call
into the CUDA runtime or the allocator (the launches also record 2 timing events each in a timed round).

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.profile_engine_host --requests 1 32 --rounds 50 --count-calls
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import statistics
import sys
import time
from collections import Counter

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from bench.bench_engine_gpu import exactness
from bench.engine_setup import DEMO_TARGET, build_engine, code_prompts, demo_drafter, load_pair, tokenizer_for
from kernels import graphs as kernel_graphs
from kernels.graphs import GraphStep
from kernels.sampling import SamplingParams
from scheduler.engine import SpeculativeEngine


def _stub_steps(engine: SpeculativeEngine) -> None:
    """Make every graph step return the outputs of its last real run (recorded by running it once now)."""
    steps: list[GraphStep] = []
    if engine.draft is not None:
        steps += list(engine.draft.graphs.steps.values()) + list(engine.draft.graphs.append_steps.values())
    for step in steps:
        outputs = step.fn()
        step.fn = lambda outputs=outputs: outputs
    runner = engine.verify.graphs
    for key, step in runner.steps.items():  # each ragged bucket runs on an all-padding batch of its own shape
        runner.pad_for(key)
        outputs = step.fn()
        step.fn = lambda outputs=outputs: outputs
    # The recorded verify results come from all-padding batches (nothing accepted): make them look like a
    # real round, every request accepting a random number of its drafts.
    generator = torch.Generator().manual_seed(0)
    gamma = engine.verify.graphs.gamma
    for step in engine.verify.graphs.steps.values():
        packed = step.fn()[0]
        packed[:, 0] = torch.randint(0, gamma + 1, (packed.shape[0],), generator=generator)
        packed[:, 1:] = torch.randint(1, engine.verify.vocab_size, packed[:, 1:].shape, generator=generator)


class CallCounter(TorchFunctionMode):
    """Counts the torch functions and tensor methods called from Python while active (not the ones they call
    themselves, nor attribute reads such as ``.shape``), the graph-step calls and the staging-fence calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self._patched: list[tuple[object, str, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":
            self.calls[f"torch {getattr(func, '__qualname__', name)}"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for owner, name, label in (
            (GraphStep, "__call__", "graph launch (GraphStep)"),
            (kernel_graphs.StagingFence, "copies_issued", "fence record (StagingFence.copies_issued)"),
            (kernel_graphs.StagingFence, "wait_before_write", "fence wait (StagingFence.wait_before_write)"),
        ):
            original = getattr(owner, name)

            def counted(*args, _original=original, _label=label, **kwargs):
                self.calls[_label] += 1
                return _original(*args, **kwargs)

            self._patched.append((owner, name, original))
            setattr(owner, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        return super().__exit__(*exc)


def _restart(engine: SpeculativeEngine, prompts: list[list[int]], params: SamplingParams) -> list[str]:
    for rid in list(engine._running):
        engine.abort(rid)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # admission + prefill (eager, not timed)
    return ids


def _graph_time_s(engine: SpeculativeEngine) -> float:
    runners = [engine.verify.graphs] + ([engine.draft.graphs] if engine.draft is not None else [])
    return sum(r.step_time_s for r in runners if r is not None)


def _set_timed(engine: SpeculativeEngine, timed: bool) -> None:
    for runner in (engine.verify.graphs, engine.draft.graphs if engine.draft is not None else None):
        if runner is not None:
            runner.timed = timed


def host_round_us(
    engine: SpeculativeEngine,
    prompts: list[list[int]],
    rounds: int,
    profiler: cProfile.Profile | None,
    counter: CallCounter | None = None,
    medians: dict[str, float] | None = None,
) -> tuple[list[float], list[float]]:
    """Host microseconds (outside the graph steps) of each of ``rounds`` rounds with len(prompts) requests, and
    the same within timed rounds (the step times' own measurement included).

    On the CPU every round is timed (a stubbed step's "device time" is its Python call) and the two lists are
    the same. On CUDA timed rounds (events around every replay) alternate with plain ones, as in
    bench/bench_engine_gpu.py: a plain round's host time is its wall time - the timed rounds' median device
    time in the graphs (every round does the same work), so the events' own calls do not count in it."""
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    block = engine.block_size + 1
    limit = engine.verify.max_seq_len - 2 * block
    cuda = engine.verify.target.device.type == "cuda"
    _restart(engine, prompts, params)
    timed_hosts: list[float] = []
    in_graph_times: list[float] = []
    plain_walls: list[float] = []
    i = 0
    while len(timed_hosts) < rounds:
        timed = not cuda or i % 2 == 0
        i += 1
        if max(r.position for r in engine._running.values()) >= limit:
            _restart(engine, prompts, params)
        _set_timed(engine, timed)
        if cuda:
            torch.cuda.synchronize()
        in_graphs = _graph_time_s(engine)
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        if counter is not None:
            with counter:
                engine.step()
        else:
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        if engine.num_running != len(prompts):
            raise RuntimeError("a request finished during the timed rounds")
        if timed:
            in_graph_times.append(_graph_time_s(engine) - in_graphs)
            timed_hosts.append(1e6 * (wall - in_graph_times[-1]))
        else:
            plain_walls.append(wall)
    _set_timed(engine, False)
    for rid in list(engine._running):
        engine.abort(rid)
    if not cuda:
        return timed_hosts, timed_hosts
    device = statistics.median(in_graph_times)
    if medians is not None:  # what bench_engine_gpu reports as plain_total_ms and in_graphs_ms
        medians.update(wall_us=1e6 * statistics.median(plain_walls), in_graphs_us=1e6 * device)
    return [1e6 * (wall - device) for wall in plain_walls], timed_hosts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu: graph bodies stubbed out; cuda: captured graphs")
    parser.add_argument("--requests", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--profile", action="store_true", help="cProfile the timed rounds, print the top functions")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--count-calls", action="store_true", help="list the torch calls per round (CPU)")
    parser.add_argument(
        "--check",
        type=int,
        default=0,
        metavar="N",
        help="first run N greedy requests (joining 4 per round) through the engine (real graph steps) and check "
        "them against the target's greedy decoding; exit code 1 if any differs",
    )
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    drafter_dir = demo_drafter()
    if drafter_dir is None:
        print("needs the trained demo drafter (models/demo/draft_dspark)", file=sys.stderr)
        return 2
    target, drafter = load_pair(DEMO_TARGET, drafter_dir, args.device, torch.float32)
    tokenizer = tokenizer_for(DEMO_TARGET)
    max_requests = max(args.requests)
    engine = build_engine(
        target,
        drafter,
        policy="full",
        sps=None,
        max_requests=max_requests,
        max_seq_len=args.max_seq_len,
        graphs="capture" if cuda else "static",
    )
    machine = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    print(f"{machine}, torch {torch.__version__}, graphs {'capture' if cuda else 'static (bodies stubbed)'}")
    exact = True
    if args.check:  # before the CPU stubs: the real step bodies; the times are taken even if it fails
        rng = np.random.default_rng(0)
        prompts = code_prompts(tokenizer, args.check, args.prompt_tokens, seed=1)
        prompts = [p[: int(rng.integers(4, args.prompt_tokens))] for p in prompts]
        max_tokens = [int(rng.integers(4, 48)) for _ in prompts]
        check = exactness({"engine": engine}, target, prompts, max_tokens)
        exact = check["ok"]
        print(f"exactness: {check['equal_to_target_greedy']['engine']}/{args.check} equal to target greedy")
    if not cuda:
        _stub_steps(engine)
    for num in args.requests:
        prompts = code_prompts(tokenizer, num, args.prompt_tokens, seed=num)
        host_round_us(engine, prompts, 20, None)  # warm-up
        medians: dict[str, float] = {}
        times, timed = host_round_us(engine, prompts, args.rounds, None, medians=medians)
        line = (
            f"R={num:4d}: host us per round median {statistics.median(times):8.1f}  mean {statistics.fmean(times):8.1f}"
            f"  min {min(times):8.1f}  ({args.rounds} rounds)"
        )
        if cuda:
            line += (
                f"  timed rounds: median {statistics.median(timed):8.1f}  (plain round wall {medians['wall_us']:.1f},"
                f" in graphs {medians['in_graphs_us']:.1f})"
            )
        print(line)
        if args.count_calls:  # a separate pass: the counting must not count in the times above
            counter = CallCounter()
            host_round_us(engine, prompts, args.rounds, None, counter)
            per_round = {name: n / args.rounds for name, n in counter.calls.items()}
            print(f"  calls per round outside the graph bodies: {sum(per_round.values()):.1f}")
            for name, n in sorted(per_round.items(), key=lambda kv: -kv[1]):
                print(f"    {n:6.2f}  {name}")
        if args.profile:  # a second pass: cProfile's own overhead must not count in the numbers above
            profiler = cProfile.Profile()
            host_round_us(engine, prompts, args.rounds, profiler)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    if not exact:
        print("exactness check FAILED", file=sys.stderr)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
