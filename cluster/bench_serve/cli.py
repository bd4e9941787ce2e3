"""``dspark bench serve`` and ``dspark bench report``: the serving benchmark's command line.

``serve`` measures one server over a sweep of load levels and writes JSON, a markdown table and plots;
``report`` lines up several results files side by side (servers, policies, placements). Bad input (a file that
does not parse, an SLO that does not parse, an unreachable server, a server refusing the workload) ends with a
one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("bench_results")


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be positive (or inf), got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="measure an OpenAI-compatible server over load levels (closed loop, open loop or a trace)",
        description="Measure an OpenAI-compatible server (dspark-serve, vLLM, SGLang) as its users see it: "
        "tokens/s per user, aggregate tokens/s, TTFT / TPOT / ITL / end-to-end percentiles, goodput under an SLO "
        "and the server's speculative-decoding counters, at every load level.",
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $DSPARK_API_KEY, else $OPENAI_API_KEY, else none)")
    p.add_argument("--model", default="", help="model id (default: the server's first model)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT, TPOT or ITL)")

    work = p.add_argument_group("workload (one of --prompts, --random, --trace)")
    source = work.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", type=Path, nargs="+", metavar="JSONL",
                        help="prompt sets: JSON lines with \"turns\" (first turn sent), files interleaved")
    source.add_argument("--random", action="store_true", help="random token-id prompts")
    source.add_argument("--trace", type=Path, metavar="JSONL",
                        help="replay a trace: arrival_s (or timestamp ms), input_len, output_len[, prompt] per line")
    work.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens of prompt-set requests")
    work.add_argument("--num-prompts", type=_positive_int, default=None,
                      help="distinct requests in the workload (default: every prompt; random: 1000)")
    work.add_argument("--random-input-len", type=_positive_int, default=256, help="mean prompt tokens (--random)")
    work.add_argument("--random-output-len", type=_positive_int, default=128, help="mean output tokens (--random)")
    work.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform within this fraction of the means (--random)")
    work.add_argument("--vocab-size", type=_positive_int, default=1000,
                      help="random token ids are drawn below this (--random, --trace without prompts)")
    work.add_argument("--tokenizer", type=Path, default=None,
                      help="local tokenizer folder: decodes token-id prompts to text for --endpoint chat")

    samp = p.add_argument_group("sampling")
    samp.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM extension)")
    samp.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature of every request (0: greedy)")
    samp.add_argument("--top-p", type=float, default=None, help="nucleus top_p of every request (None: not sent)")
    samp.add_argument("--seed", type=int, default=None, help="request i is sent seed + i (reproducible sampling)")
    samp.add_argument("--extra-body", type=_json_object, default={},
                      help="JSON object merged into every request body, e.g. '{\"priority\": 1}'")

    load = p.add_argument_group("load levels (closed loop, open loop, or the trace's arrivals)")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=_positive_int, nargs="+", default=None,
                       help="closed loop: this many users, each sending as soon as its last request ended "
                       "(default: 1 8 32)")
    shape.add_argument("--request-rate", type=_rate, nargs="+", default=None,
                       help="open loop: arrivals per second (inf: all at once)")
    shape.add_argument("--population", action="append", default=None, metavar="SPEC",
                       help="open loop of one client population, repeatable, all in one level: "
                       "rate=R[,name=N][,priority=P][,tpot_slo_ms=T][,speculative=S][,goal_tpot_ms=G]; reports SLO "
                       "attainment per population (its tpot_slo_ms or goal_tpot_ms, not sent; else --slo) and "
                       "their aggregate goodput")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="open loop: gamma shape of the gaps (1 Poisson, < 1 burstier)")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="open loop: cap on requests in flight")
    load.add_argument("--trace-speedup", type=float, nargs="+", default=[1.0],
                      help="trace: arrival times divided by these factors, one level each")

    win = p.add_argument_group("window of every level")
    size = win.add_mutually_exclusive_group()
    size.add_argument("--duration", type=float, default=None,
                      help="measured seconds per level (default 30; closed loop counts requests ending inside)")
    size.add_argument("--num-requests", type=_positive_int, default=None, help="measured requests per level")
    win.add_argument("--warmup-requests", type=int, default=1,
                     help="closed loop: requests each user finishes before measuring; open loop: arrivals")
    win.add_argument("--warmup-s", type=float, default=0.0, help="warm-up seconds (on top of the warm-up requests)")

    out = p.add_argument_group("objectives and output")
    out.add_argument("--slo", default=None, help="goodput objectives, e.g. ttft=500ms,tpot=20ms (bare numbers: ms)")
    out.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    out.add_argument("--client-processes", type=_positive_int, default=None,
                     help="closed loop: client processes sharing the users (default: one per 16 users, at most "
                     "half the CPUs)")
    out.add_argument("--label", default="", help="name of this run in tables and plots")
    out.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="where JSON, markdown and plots go")
    out.add_argument("--stem", default="bench_serve", help="file name stem of the outputs")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_run_serve)


def _workload(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    from cluster.bench_serve import workload as wl

    if args.prompts:
        requests = wl.prompt_set_requests(args.prompts, args.output_len, args.num_prompts)
        info: dict[str, Any] = {"source": "prompts", "files": [str(p) for p in args.prompts],
                                "output_len": args.output_len}
    elif args.random:
        count = args.num_prompts or 1000
        requests = wl.random_requests(count, args.random_input_len, args.random_output_len,
                                      range_ratio=args.random_range_ratio, vocab_size=args.vocab_size,
                                      seed=args.seed or 0)
        info = {"source": "random", "input_len": args.random_input_len, "output_len": args.random_output_len,
                "range_ratio": args.random_range_ratio, "vocab_size": args.vocab_size}
    else:
        requests = wl.trace_requests(args.trace, vocab_size=args.vocab_size, seed=args.seed or 0)
        info = {"source": "trace", "file": str(args.trace)}
    info["requests"] = len(requests)
    if args.endpoint == "chat" and any(isinstance(r.prompt, tuple) for r in requests):
        if args.tokenizer is None:
            raise wl.WorkloadError("--endpoint chat sends text: give --tokenizer DIR to decode token-id prompts")
        from transformers import AutoTokenizer

        requests = wl.as_text(requests, AutoTokenizer.from_pretrained(args.tokenizer))
    return requests, info


def _levels(args: argparse.Namespace) -> list[Any]:
    from cluster.bench_serve.load import LoadLevel

    if args.trace is not None:
        if args.concurrency or args.request_rate or args.population:
            raise ValueError("a trace brings its own arrivals: no --concurrency, --request-rate or --population")
        return [LoadLevel("trace", f) for f in args.trace_speedup]
    if args.request_rate:
        return [LoadLevel("open", r) for r in args.request_rate]
    if args.population:
        return [LoadLevel("open", sum(p.rate for p in _populations(args)))]
    return [LoadLevel("closed", c) for c in (args.concurrency or [1, 8, 32])]


def _populations(args: argparse.Namespace) -> list[Any]:
    from cluster.bench_serve.populations import parse_population

    return [parse_population(text, i) for i, text in enumerate(args.population or ())]


def _run_serve(args: argparse.Namespace) -> int:
    from cluster.bench_serve import report
    from cluster.bench_serve.client import RequestOptions
    from cluster.bench_serve.load import Window
    from cluster.bench_serve.runner import BenchConfig, BenchError, run
    from cluster.bench_serve.stats import parse_slo
    from cluster.bench_serve.workload import WorkloadError

    try:
        slo = parse_slo(args.slo) if args.slo else None
        if slo is not None and args.no_stream and (slo.ttft_s is not None or slo.tpot_s is not None):
            raise ValueError("TTFT and TPOT objectives need streaming: drop --no-stream or use e2e=...")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
        requests, info = _workload(args)
        levels = _levels(args)
        num = args.num_requests
        if args.trace is not None and num is None and args.duration is None:
            num = max(1, len(requests) - args.warmup_requests)
        window = Window(
            duration_s=None if num is not None else (args.duration or 30.0),
            num_requests=num,
            warmup_requests=args.warmup_requests,
            warmup_s=args.warmup_s,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed or 0,
        )
        config = BenchConfig(
            base_url=args.base_url,
            options=RequestOptions(model=args.model, endpoint=args.endpoint, stream=not args.no_stream,
                                   temperature=args.temperature, top_p=args.top_p, ignore_eos=args.ignore_eos,
                                   seed=args.seed, extra_body=args.extra_body),
            requests=requests,
            levels=levels,
            window=window,
            workload=info,
            slo=slo,
            api_key=args.api_key,
            request_timeout_s=args.request_timeout,
            label=args.label,
            progress=not args.no_progress,
            client_processes=args.client_processes,
            populations=_populations(args),
        )
        result = run(config)
    except (WorkloadError, ValueError, BenchError) as error:
        print(f"dspark bench serve: {error}", file=sys.stderr)
        return 2
    result["command"] = sys.argv
    paths = report.write([result], args.out_dir, args.stem)
    print(report.level_table(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="line up several `bench serve` results side by side (tables and plots)")
    p.add_argument("results", type=Path, nargs="+", help="results JSON files of `dspark bench serve`")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="folder of the tables and plots")
    p.add_argument("--stem", default="comparison", help="file name stem of the tables and plots")
    p.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    import json

    from cluster.bench_serve import report

    runs = []
    for path in args.results:
        try:
            runs.extend(report.load_results(path))
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            print(f"dspark bench report: cannot read {path}: {error}", file=sys.stderr)
            return 2
    paths = report.write(runs, args.out_dir, args.stem)
    print(report.side_by_side(runs))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``dspark bench`` with its ``serve`` and ``report`` commands."""
    p = sub.add_parser("bench", help="serving benchmarks over HTTP (`dspark bench serve --help`)")
    bench = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    _add_serve(bench)
    _add_report(bench)
