"""`dspark bench serve`: its arithmetic on known inputs, and short sweeps against a real `dspark serve --no-ray`.

The server is the shipped demo pair in its own process, started as a user starts it; the benchmark runs through
its command line (`cluster.cli.main`), as a user runs it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from cluster.bench_serve import report, server_metrics
from cluster.bench_serve.fanout import shares
from cluster.bench_serve.load import LoadLevel, Window, _schedule, arrival_times
from cluster.bench_serve.stats import (
    SLO,
    RequestRecord,
    distribution,
    first_wave_summary,
    parse_slo,
    summarize,
)
from cluster.bench_serve.workload import (
    BenchRequest,
    WorkloadError,
    prompt_set_requests,
    random_requests,
    trace_requests,
)
from cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ arithmetic
def test_distribution_is_numpys_linear_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    d = distribution(values)
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert distribution([1.0, float("nan"), 3.0])["mean"] == pytest.approx(2.0)  # non-finite values are dropped


def test_request_record_latencies() -> None:
    # 11 tokens: first after 0.5 s, the other 10 over the next 1.0 s -> TPOT 0.1 s, 10 tokens/s per user.
    r = RequestRecord(start_s=10.0, end_s=11.5, output_tokens=11, ttft_s=0.5)
    assert r.e2e_s == pytest.approx(1.5)
    assert r.tpot_s == pytest.approx(0.1)
    assert r.tokens_per_s == pytest.approx(10.0)
    assert RequestRecord(start_s=0.0, end_s=2.0, output_tokens=8).tokens_per_s == pytest.approx(4.0)  # no stream
    assert RequestRecord(start_s=0.0, end_s=1.0, output_tokens=1, ttft_s=1.0).tpot_s is None
    assert r.meets(SLO(ttft_s=0.5, tpot_s=0.1)) and not r.meets(SLO(ttft_s=0.4)) and not r.meets(SLO(tpot_s=0.09))
    assert not RequestRecord(start_s=0.0, end_s=1.0, error="503").meets(SLO(e2e_s=10.0))


def test_summary_rates_and_goodput_on_known_requests() -> None:
    fast = [RequestRecord(start_s=float(i), end_s=i + 1.0, output_tokens=11, ttft_s=0.1) for i in range(6)]
    slow = [RequestRecord(start_s=float(i), end_s=i + 3.1, output_tokens=11, ttft_s=0.1) for i in range(2)]
    failed = [RequestRecord(start_s=0.0, end_s=0.1, error="503", error_message="busy"),
              RequestRecord(start_s=0.0, end_s=0.2, error="connection", error_message="refused")]
    s = summarize(fast + slow + failed, window_s=4.0, slo=SLO(ttft_s=0.2, tpot_s=0.1))
    assert s["completed"] == 8
    assert s["errors"] == {"503": 1, "connection": 1}
    assert s["error_examples"] == {"503": "busy", "connection": "refused"}
    assert s["output_tokens"] == 88
    assert s["output_throughput"] == pytest.approx(22.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    # fast: TPOT 0.09 s -> meets; slow: TPOT 0.3 s -> misses; errors miss: 6 of 10.
    assert s["goodput"]["met"] == 6
    assert s["goodput"]["fraction"] == pytest.approx(0.6)
    assert s["goodput"]["requests_per_s"] == pytest.approx(1.5)
    per_user = sorted([1 / 0.09] * 6 + [1 / 0.3] * 2)
    assert s["tokens_per_s_per_user"]["median"] == pytest.approx(float(np.percentile(per_user, 50)))
    assert s["tokens_per_s_per_user"]["p10"] == pytest.approx(float(np.percentile(per_user, 10)))
    assert s["e2e_s"]["p50"] == pytest.approx(1.0)
    assert summarize(fast, 1.0)["goodput"] is None


def test_first_wave_against_the_steady_state() -> None:
    first = [RequestRecord(0.0, 3.0, 10, ttft_s=0.5), RequestRecord(0.0, 1.0, 10, ttft_s=0.2),
             RequestRecord(0.0, 2.0, 10, ttft_s=0.3)]
    steady = summarize([RequestRecord(5.0, 6.0, 10, ttft_s=0.1), RequestRecord(6.0, 8.0, 10, ttft_s=0.1)], 4.0)
    wave = first_wave_summary(first, steady)
    assert wave is not None and wave["requests"] == 3 and wave["errors"] == 0
    assert wave["e2e_s"] == {"p50": 2.0, "max": 3.0} and wave["ttft_s"] == {"p50": 0.3, "max": 0.5}
    assert wave["steady_p50"] == {"e2e_s": 1.5, "ttft_s": 0.1}
    assert wave["ratio"]["e2e_max"] == pytest.approx(2.0) and wave["ratio"]["ttft_p50"] == pytest.approx(3.0)
    assert wave["within_goal"] is False  # 3 s against a 1.5 s median: twice, over the 1.5x goal
    # Against the steady requests themselves: the slowest of 3 meets the steady quantile 3/4 (2.375 s here).
    ranked = first_wave_summary(first, steady, [1.0, 1.0, 1.5, 2.0, 2.5, 3.0])
    assert ranked is not None and ranked["steady_ranked"] == {"quantile": 0.75, "e2e_s": pytest.approx(2.375)}
    assert ranked["ratio"]["e2e_max_ranked"] == pytest.approx(3.0 / 2.375) and ranked["within_goal"] is True
    # The wave's median is judged too: 2 s against a 1 s steady median is over the goal whatever the slowest.
    assert first_wave_summary(first, summarize([RequestRecord(5.0, 6.0, 10)], 4.0), [1.0, 3.5])["within_goal"] is False
    assert first_wave_summary(first[1:2], steady)["within_goal"] is True  # type: ignore[index]
    failed = [*first[1:2], RequestRecord(0.0, 0.1, error="503")]
    assert first_wave_summary(failed, steady)["within_goal"] is False  # type: ignore[index]
    assert first_wave_summary([], steady) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ttft=500ms,tpot=20ms", SLO(ttft_s=0.5, tpot_s=0.02)),
        ("tpot=0.05s", SLO(tpot_s=0.05)),
        (" TTFT = 250 , e2e=3s ", SLO(ttft_s=0.25, e2e_s=3.0)),
    ],
)
def test_slo_parses(text: str, expected: SLO) -> None:
    assert parse_slo(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("ttft", "does not parse"), ("itl=5ms", "does not parse"), ("ttft=5ms,ttft=6ms", "twice"),
     ("tpot=0ms", "positive"), ("ttft=5min", "does not parse"), ("", "does not parse")],
)
def test_slo_refuses_what_does_not_parse(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def test_arrivals_have_the_rate_asked_for_and_are_seeded() -> None:
    times = arrival_times(20000, 50.0, 1.0, seed=3)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert 20000 / times[-1] == pytest.approx(50.0, rel=0.03)
    gaps = np.diff(times)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # Poisson: CV 1
    bursty = np.diff(arrival_times(20000, 50.0, 0.25, seed=3))
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.08)  # gamma shape k: CV 1/sqrt(k)
    assert np.array_equal(arrival_times(50, 5.0, 1.0, seed=1), arrival_times(50, 5.0, 1.0, seed=1))
    assert not np.any(arrival_times(4, math.inf, 1.0, seed=0))


def test_open_loop_schedule_holds_warm_up_and_measured_requests() -> None:
    requests = [BenchRequest("x", 4)] * 3
    window = Window(num_requests=10, warmup_requests=4, warmup_s=1.0, seed=0)
    schedule = _schedule(requests, LoadLevel("open", 20.0), window)
    times = np.array([at for at, _ in schedule])
    first = max(4, int(np.searchsorted(times, 1.0)))
    assert len(schedule) >= first + 10
    assert [i for _, i in schedule[:5]] == [0, 1, 2, 0, 1]  # the workload's order, cycled
    by_time = _schedule(requests, LoadLevel("open", 20.0), Window(duration_s=2.0, warmup_requests=0))
    assert by_time[-1][0] < 2.0 and len(by_time) > 20
    with pytest.raises(ValueError, match="request count"):
        _schedule(requests, LoadLevel("open", math.inf), Window(duration_s=2.0))


def test_speculative_counters_from_prometheus_text() -> None:
    def text(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], rounds: int) -> str:
        lines = [
            "# TYPE vllm:spec_decode_num_drafts counter",
            f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
            "# TYPE vllm:spec_decode_num_draft_tokens counter",
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}',
            "# TYPE vllm:spec_decode_num_accepted_tokens counter",
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
            *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {v}'
              for i, v in enumerate(per_pos)),
            "# TYPE dspark_rounds counter", f'dspark_rounds_total{{model_name="m"}} {rounds}',
            "# TYPE dspark_verify_seconds counter", f'dspark_verify_seconds_total{{model_name="m"}} {rounds * 0.01}',
        ]
        return "\n".join(lines) + "\n"

    before = server_metrics.parse(text(10, 40, 20, [8, 6, 4, 2], 10))
    after = server_metrics.parse(text(30, 100, 70, [26, 20, 15, 9], 30))
    d = server_metrics.speculative_delta(before, after)
    assert d is not None
    assert d["drafts"] == 20 and d["draft_tokens"] == 60 and d["accepted_tokens"] == 50
    assert d["mean_acceptance_length"] == pytest.approx(3.5)
    assert d["acceptance_rate"] == pytest.approx(50 / 60)
    assert d["acceptance_by_position"] == pytest.approx([0.9, 0.7, 0.55, 0.35])
    assert d["verify_tokens_per_request_round"] == pytest.approx(3.0)
    assert d["rounds"] == 20 and d["round_split_ms"]["verify"] == pytest.approx(10.0)
    assert server_metrics.speculative_delta(None, after) is None
    assert server_metrics.speculative_delta(before, server_metrics.parse("# TYPE x counter\nx_total 1\n")) is None

    def with_split(base: str, rounds: int) -> str:
        """The five-part round split of dspark-serve (ms per round as below)."""
        per_round = {"draft": 1.0, "verify": 2.0, "schedule": 0.5, "transfer": 3.0, "host": 1.0}
        lines = [line for part, ms in per_round.items() for line in (
            f"# TYPE dspark_round_{part}_seconds counter",
            f'dspark_round_{part}_seconds_total{{model_name="m"}} {rounds * ms / 1000}',
        )]
        return base + "\n".join(lines) + "\n"

    d = server_metrics.speculative_delta(
        server_metrics.parse(with_split(text(10, 40, 20, [8, 6, 4, 2], 10), 10)),
        server_metrics.parse(with_split(text(30, 100, 70, [26, 20, 15, 9], 30), 30)),
    )
    assert d is not None and d["round_split_ms"] == pytest.approx(
        {"draft": 1.0, "verify": 2.0, "schedule": 0.5, "transfer": 3.0, "host": 1.0}
    )
    assert d["first_tokens"] is None and d["ttft_split_ms"] is None and d["joins_per_round"] is None
    assert report.server_ttft_cell(d) == "-"

    def with_ttft(base: str, first: int, queue_s: float, admitted_s: float, joined: int, prefill_only: int) -> str:
        """The round driver's time-to-first-token counters and the joins of dspark-serve."""
        values = {"dspark_request_first_tokens": first, "dspark_request_queue_seconds": queue_s,
                  "dspark_request_admission_to_first_token_seconds": admitted_s,
                  "dspark_round_joined_prompts": joined, "dspark_prefill_only_rounds": prefill_only}
        lines = [line for name, v in values.items()
                 for line in (f"# TYPE {name} counter", f'{name}_total{{model_name="m"}} {v}')]
        return base + "\n".join(lines) + "\n"

    d = server_metrics.speculative_delta(
        server_metrics.parse(with_ttft(text(10, 40, 20, [8, 6, 4, 2], 10), 4, 0.1, 0.2, 4, 1)),
        server_metrics.parse(with_ttft(text(30, 100, 70, [26, 20, 15, 9], 30), 14, 0.6, 0.4, 19, 6)),
    )
    assert d is not None and d["first_tokens"] == 10
    assert d["ttft_split_ms"] == pytest.approx({"queue": 50.0, "admission_to_first_token": 20.0})
    # 20 rounds and 5 prefill-only passes: 20 request-rounds and 15 joins over 25 passes
    assert d["requests_per_round"] == pytest.approx(0.8) and d["joins_per_round"] == pytest.approx(0.6)
    assert report.server_ttft_cell(d) == "50.0 + 20.0"
    assert d["round_ms_by_kind"] is None  # a server without the counters of round kinds
    assert d["ingress_ttft_ms"] is None and report.ingress_ttft_cell(d) == "-"  # nor the ingress's

    def with_ingress(base: str, first: int, parse_s: float, tokenize_s: float, backend_s: float,
                     routes: int | None, route_s: float) -> str:
        """The ingress's counters of its part of TTFT (and of Route calls, when the placement routes)."""
        values = {"dspark_http_first_deltas": first, "dspark_http_parse_seconds": parse_s,
                  "dspark_http_tokenize_seconds": tokenize_s, "dspark_http_backend_first_delta_seconds": backend_s}
        if routes is not None:
            values.update({"dspark_http_routes": routes, "dspark_http_route_seconds": route_s})
        lines = [line for name, v in values.items()
                 for line in (f"# TYPE {name} counter", f'{name}_total{{model_name="m"}} {v}')]
        return base + "\n".join(lines) + "\n"

    base_before, base_after = text(10, 40, 20, [8, 6, 4, 2], 10), text(30, 100, 70, [26, 20, 15, 9], 30)
    d = server_metrics.speculative_delta(
        server_metrics.parse(with_ingress(base_before, 5, 0.01, 0.02, 0.5, None, 0.0)),
        server_metrics.parse(with_ingress(base_after, 15, 0.03, 0.04, 1.5, None, 0.0)),
    )
    assert d is not None and d["ingress_ttft_ms"] == pytest.approx(
        {"parse": 2.0, "tokenize": 2.0, "backend": 100.0, "route": None}
    )
    assert report.ingress_ttft_cell(d) == "2.00 + 2.00 + 100.0"
    d = server_metrics.speculative_delta(
        server_metrics.parse(with_ingress(base_before, 5, 0.01, 0.02, 0.5, 5, 0.005)),
        server_metrics.parse(with_ingress(base_after, 15, 0.03, 0.04, 1.5, 15, 0.015)),
    )
    assert d is not None and d["ingress_ttft_ms"]["route"] == pytest.approx(1.0)
    assert report.ingress_ttft_cell(d) == "2.00 + 2.00 + 100.0 (route 1.00)"

    def with_kinds(base: str, planned: int, planned_s: float, joined: int, joined_s: float) -> str:
        """The planned and joined rounds of dspark-serve, and their wall time."""
        values = {"dspark_planned_rounds": planned, "dspark_planned_round_seconds": planned_s,
                  "dspark_joined_rounds": joined, "dspark_joined_round_seconds": joined_s}
        lines = [line for name, v in values.items()
                 for line in (f"# TYPE {name} counter", f'{name}_total{{model_name="m"}} {v}')]
        return base + "\n".join(lines) + "\n"

    # 20 rounds of 7.5 ms (150 ms): 10 planned of 6 ms, 4 joined of 9 ms, the other 6 of 9 ms
    d = server_metrics.speculative_delta(
        server_metrics.parse(with_kinds(with_split(text(10, 40, 20, [8, 6, 4, 2], 10), 10), 2, 0.01, 1, 0.015)),
        server_metrics.parse(with_kinds(with_split(text(30, 100, 70, [26, 20, 15, 9], 30), 30), 12, 0.07, 5, 0.051)),
    )
    assert d is not None and d["planned_rounds"] == 10
    assert d["round_ms_by_kind"] == {
        "planned": {"rounds": 10, "ms": pytest.approx(6.0)},
        "joined": {"rounds": 4, "ms": pytest.approx(9.0)},
        "other": {"rounds": 6, "ms": pytest.approx(9.0)},
    }


# ------------------------------------------------------------------------------------------ workloads
def test_prompt_sets_interleave_and_bad_files_say_where(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"turns": ["a1"]}\n{"turns": ["a2", "second turn"]}\n{"turns": ["a3"]}\n')
    b.write_text('{"turns": ["b1"]}\n\n')
    assert [r.prompt for r in prompt_set_requests([a, b], 8)] == ["a1", "b1", "a2", "a3"]
    assert [r.prompt for r in prompt_set_requests([a, b], 8, limit=2)] == ["a1", "b1"]
    bad = tmp_path / "bad.jsonl"
    for content, message in [('{"turns": ["ok"]}\n{"turns": [oops\n', "bad.jsonl:2: not JSON"),
                             ('{"turns": []}\n', "bad.jsonl:1: expected \"turns\""),
                             ("[1, 2]\n", "expected a JSON object"), ("\n", "holds no requests")]:
        bad.write_text(content)
        with pytest.raises(WorkloadError, match=message):
            prompt_set_requests([bad], 8)
    with pytest.raises(WorkloadError, match="cannot read"):
        prompt_set_requests([tmp_path / "missing.jsonl"], 8)


def test_random_and_trace_workloads(tmp_path: Path) -> None:
    reqs = random_requests(200, 100, 20, range_ratio=0.5, vocab_size=50, seed=1)
    lengths = [len(r.prompt) for r in reqs]
    assert min(lengths) >= 50 and max(lengths) <= 150 and 80 < np.mean(lengths) < 120
    assert all(0 <= t < 50 for r in reqs for t in r.prompt)
    assert random_requests(5, 10, 5, seed=2) == random_requests(5, 10, 5, seed=2)
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 5000, "input_length": 7, "output_length": 3}\n'
                     '{"arrival_s": 4.0, "input_len": 2, "output_len": 9, "prompt": "hello"}\n')
    out = trace_requests(trace)
    assert [(r.arrival_s, r.output_len) for r in out] == [(0.0, 9), (1.0, 3)]
    assert out[0].prompt == "hello" and len(out[1].prompt) == 7
    trace.write_text('{"input_len": 2, "output_len": 9}\n')
    with pytest.raises(WorkloadError, match=r'trace.jsonl:1: needs "arrival_s"'):
        trace_requests(trace)
    trace.write_text('{"arrival_s": 0, "input_len": 2, "output_len": -1}\n')
    with pytest.raises(WorkloadError, match="non-negative"):
        trace_requests(trace)


# ------------------------------------------------------------------------------------------ a real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`dspark serve --no-ray` with the shipped demo pair, in its own process, until a completion succeeds."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("server") / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--no-ray", "--port", str(port), "--max-requests", "4",
         "--max-seq-len", "512", "--log-level", "warning"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}"
    body = {"model": "dspark-demo", "prompt": "import os\n", "max_tokens": 2}
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                if httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not serve a completion within 240 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "code.jsonl"
    lines = ["def read_config(path):\n", "class Queue:\n    def __init__(self, maxsize=0):\n",
             "import os\nimport sys\n\n\ndef main():\n", "    for key, value in sorted("]
    path.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in lines))
    return path


LEVEL_FIELDS = {"load", "window_s", "completed", "errors", "error_examples", "prompt_tokens", "output_tokens",
                "request_throughput", "output_throughput", "tokens_per_s_per_user", "ttft_s", "tpot_s", "itl_s",
                "e2e_s", "goodput", "unfinished", "first_wave", "speculative", "client_loop_lag_ms",
                "client_processes"}


def _bench(out: Path, *args: str) -> dict:
    assert main(["bench", "serve", "--no-progress", "--out-dir", str(out), *args]) == 0
    return json.loads((out / "bench_serve.json").read_text())


@pytest.mark.slow
def test_closed_loop_sweep_against_a_real_server(server: str, prompts: Path, tmp_path: Path) -> None:
    scrape_before = server_metrics.parse(httpx.get(server + "/metrics").text)
    doc = _bench(tmp_path, "--base-url", server, "--prompts", str(prompts), "--output-len", "12", "--ignore-eos",
                 "--concurrency", "1", "2", "--num-requests", "3", "--slo", "ttft=10s,tpot=2s", "--label", "demo")
    scrape_after = server_metrics.parse(httpx.get(server + "/metrics").text)
    assert doc["server"]["model"] == "dspark-demo" and doc["label"] == "demo"
    card = doc["server"]["cards"][0]  # the served SPS table and its origin, as /v1/models shows them
    assert card["id"] == "dspark-demo" and card["dspark"]["sps"]["local"]["origin"]["source"] in {"cache", "profiled"}
    assert doc["command"] and doc["workload"]["requests"] == 4 and doc["request"]["ignore_eos"] is True
    assert [lv["load"]["label"] for lv in doc["levels"]] == ["c=1", "c=2"]
    for lv in doc["levels"]:
        assert set(lv) == LEVEL_FIELDS
        assert lv["completed"] == 3 and lv["errors"] == {} and lv["output_tokens"] == 36  # ignore_eos: 12 each
        assert lv["goodput"]["fraction"] == 1.0
        assert all(lv[k]["p50"] is not None for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"))
        assert lv["tokens_per_s_per_user"]["median"] > 0 and lv["output_throughput"] > 0
        spec = lv["speculative"]
        # The counted window starts from an idle server and waits for its requests: the server's own count of
        # generated tokens moved by exactly the measured tokens.
        assert spec["generation_tokens"] == 36
        assert spec["drafts"] > 0 and spec["mean_acceptance_length"] >= 1.0
        assert len(spec["acceptance_by_position"]) > 0
    level_drafts = sum(lv["speculative"]["drafts"] for lv in doc["levels"])
    total_drafts = scrape_after["vllm:spec_decode_num_drafts"][""] - scrape_before["vllm:spec_decode_num_drafts"][""]
    assert 0 < level_drafts <= total_drafts  # warm-up and the probe account for the rest
    for lv, users in zip(doc["levels"], (1, 2), strict=True):
        wave = lv["first_wave"]  # the first request of every user, warm-up, next to the measured median
        assert wave["requests"] == users and wave["errors"] == 0
        assert 0 < wave["e2e_s"]["p50"] <= wave["e2e_s"]["max"] and 0 < wave["ttft_s"]["p50"] <= wave["ttft_s"]["max"]
        assert wave["steady_p50"]["e2e_s"] == lv["e2e_s"]["p50"]
        assert wave["ratio"]["e2e_max"] == pytest.approx(wave["e2e_s"]["max"] / lv["e2e_s"]["p50"])
        assert wave["ratio"]["e2e_max_ranked"] == pytest.approx(wave["e2e_s"]["max"] / wave["steady_ranked"]["e2e_s"])
        assert isinstance(wave["within_goal"], bool)
    assert doc["probe"]["e2e_s"] > 0 and doc["probe"]["output_tokens"] == 12
    md = (tmp_path / "bench_serve.md").read_text()
    assert "| c=1 |" in md and "| c=2 |" in md and "first wave max E2E" in md
    assert (tmp_path / "bench_serve_pareto.png").stat().st_size > 0
    assert (tmp_path / "bench_serve_latency.png").stat().st_size > 0
    # The server splits its TTFT (ingress and round driver): the parts add up to the client's mean TTFT.
    for lv in doc["levels"]:
        parts = report.ttft_parts(lv)
        assert parts is not None and list(parts) == list(report.TTFT_PARTS) and parts["route"] == 0.0
        assert sum(parts.values()) == pytest.approx(1e3 * lv["ttft_s"]["mean"])
        assert parts["tokenize"] > 0 and parts["admission to first token"] > 0
    assert (tmp_path / "bench_serve_ttft.png").stat().st_size > 0


@pytest.mark.slow
def test_users_spread_over_client_processes(server: str, prompts: Path, tmp_path: Path) -> None:
    assert shares(7, 3) == [3, 2, 2] and shares(2, 4) == [1, 1]
    doc = _bench(tmp_path, "--base-url", server, "--prompts", str(prompts), "--output-len", "8", "--ignore-eos",
                 "--concurrency", "3", "--client-processes", "2", "--num-requests", "5")
    level = doc["levels"][0]
    assert level["client_processes"] == 2 and level["completed"] == 5 and level["errors"] == {}
    assert level["speculative"]["generation_tokens"] == 40  # both processes' windows opened on an idle server
    assert level["client_loop_lag_ms"]["p50"] is not None
    assert level["first_wave"]["requests"] == 3  # every process's users, merged


@pytest.mark.slow
def test_open_loop_and_chat_against_a_real_server(server: str, prompts: Path, tmp_path: Path) -> None:
    doc = _bench(tmp_path / "open", "--base-url", server + "/v1", "--random", "--random-input-len", "16",
                 "--random-output-len", "6", "--num-prompts", "20", "--ignore-eos", "--request-rate", "20", "inf",
                 "--num-requests", "4", "--warmup-requests", "1", "--temperature", "0.7", "--seed", "5")
    assert [lv["load"]["label"] for lv in doc["levels"]] == ["rate=20/s", "rate=inf"]
    for lv in doc["levels"]:
        assert set(lv) == LEVEL_FIELDS and lv["completed"] == 4 and lv["output_tokens"] == 24
        assert lv["prompt_tokens"] == 4 * 16
        assert lv["first_wave"] is None  # an open loop has no users
    chat = _bench(tmp_path / "chat", "--base-url", server, "--prompts", str(prompts), "--endpoint", "chat",
                  "--output-len", "5", "--ignore-eos", "--no-stream", "--concurrency", "2", "--duration", "2")
    level = chat["levels"][0]
    assert level["completed"] >= 1 and level["errors"] == {}
    assert level["ttft_s"]["p50"] is None and level["e2e_s"]["p50"] is not None  # no stream, no TTFT
    assert main(["bench", "report", str(tmp_path / "open" / "bench_serve.json"),
                 str(tmp_path / "chat" / "bench_serve.json"), "--out-dir", str(tmp_path / "both")]) == 0
    both = (tmp_path / "both" / "comparison.md").read_text()
    assert "| aggregate output tokens/s |" in both and "| first wave: slowest E2E" in both  # the chat run's loop


@pytest.mark.slow
def test_bad_input_gets_a_clear_message(server: str, prompts: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    def fails(*args: str) -> str:
        code = main(["bench", "serve", "--no-progress", "--out-dir", str(tmp_path), *args])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "Traceback" not in err
        return err

    common = ["--prompts", str(prompts), "--num-requests", "1", "--concurrency", "1"]
    assert "cannot reach http://127.0.0.1:" in fails("--base-url", f"http://127.0.0.1:{_free_port()}", *common)
    err = fails("--base-url", server, "--model", "no-such-model", *common)
    assert "refused the first request" in err and "404" in err
    err = fails("--base-url", server, "--prompts", str(prompts), "--output-len", "100000", "--num-requests", "1")
    assert "400" in err
    assert "does not parse" in fails("--base-url", server, *common, "--slo", "ttft=fast")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"turns": ["fine"]}\nnot json\n')
    assert "broken.jsonl:2: not JSON" in fails("--base-url", server, "--prompts", str(broken), "--num-requests", "1")
    assert "--tokenizer" in fails("--base-url", server, "--random", "--endpoint", "chat", "--num-requests", "1")
    assert main(["bench", "report", str(broken), "--out-dir", str(tmp_path)]) == 2


# ------------------------------------------------------------------------------------------ populations
def test_populations_parse_and_say_what_is_wrong() -> None:
    from cluster.bench_serve.populations import parse_population

    gold = parse_population("name=gold, rate=2.5, priority=-1, tpot_slo_ms=40", 0)
    assert gold.name == "gold" and gold.rate == 2.5 and gold.fields == {"priority": -1, "tpot_slo_ms": 40.0}
    assert gold.tpot_slo_s == pytest.approx(0.04)
    assert parse_population("rate=1,speculative=off", 3).name == "p3"
    plain = parse_population("rate=1,goal_tpot_ms=25", 0)
    assert plain.fields == {} and plain.tpot_slo_s == pytest.approx(0.025)  # measured, not sent
    for text, message in [("priority=1", "needs rate"), ("rate=0", "positive"), ("rate=1,colour=red", "colour"),
                          ("rate=1,priority=high", "priority must be int"), ("rate=1,rate=2", "twice"),
                          ("rate", "does not parse")]:
        with pytest.raises(ValueError, match=message):
            parse_population(text, 0)


def test_population_attainment_and_aggregate_goodput() -> None:
    from cluster.bench_serve.load import LevelRun
    from cluster.bench_serve.populations import Population, population_results

    def rec(tpot: float, error: str | None = None) -> RequestRecord:
        # 11 tokens: the first after 0.1 s, then 10 more at ``tpot`` each.
        return RequestRecord(start_s=0.0, end_s=0.1 + 10 * tpot, output_tokens=11, ttft_s=0.1, error=error)

    gold = Population("gold", 1.0, {"priority": -1, "tpot_slo_ms": 50.0})
    bulk = Population("bulk", 2.0, {})
    runs = [LevelRun([rec(0.04), rec(0.06), rec(0.01, "429")], 0.0, 10.0), LevelRun([rec(0.2), rec(0.3)], 0.0, 10.0)]
    results, aggregate = population_results([gold, bulk], runs, None)
    assert results[0]["slo_attainment"] == pytest.approx(1 / 3)  # the refused request is a miss
    assert results[0]["errors"] == {"429": 1} and results[0]["fields"] == gold.fields
    assert results[1]["slo_attainment"] is None  # no target, no --slo: every completed request counts as good
    assert aggregate == {"requests_per_s": pytest.approx(0.3), "fraction": pytest.approx(0.6), "met": 3,
                         "measured": 5}
    _, with_slo = population_results([gold, bulk], runs, SLO(tpot_s=0.25))
    assert with_slo["met"] == 2  # bulk now has the run's objective: one of its two met it


@pytest.mark.slow
def test_two_populations_in_one_open_loop_level(server: str, prompts: Path, tmp_path: Path) -> None:
    doc = _bench(tmp_path, "--base-url", server, "--prompts", str(prompts), "--output-len", "6", "--ignore-eos",
                 "--population", "name=gold,rate=4,priority=-1,tpot_slo_ms=60000",
                 "--population", "name=bulk,rate=4,priority=1,speculative=off",
                 "--extra-body", '{"top_k": 0}', "--num-requests", "3", "--warmup-requests", "1")
    (level,) = doc["levels"]
    assert level["load"]["label"] == "rate=8/s" and doc["request"]["extra_body"] == {"top_k": 0}
    gold, bulk = level["populations"]
    assert gold["name"] == "gold" and gold["completed"] == 3 and gold["slo_attainment"] == 1.0
    assert bulk["fields"] == {"priority": 1, "speculative": "off"} and bulk["completed"] == 3
    assert level["completed"] == 6 and level["goodput_aggregate"]["met"] == 6
    assert "| rate=8/s | gold |" in (tmp_path / "bench_serve.md").read_text()
