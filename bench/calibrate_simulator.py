"""Calibrate the cluster simulator against the measured HTTP serving matrix, and say how close it comes.

Input: serving-matrix results files (``bench/serve_matrix.py``, or a file keeping several of its runs under
labels; default ``docs/simulator/serve_matrix_calibration.json``, the matrix the first calibration table was fitted
on: one H200, the demo pair inflated to the Qwen3-4B shape, closed loops of 1 / 8 / 32 / 128 users, 128-token
outputs, humaneval + mbpp prompts) and the simulator's measured cost file (``docs/simulator/costs_h200.json``:
the SPS tables of the verify step by request count and the prefill token table, profiled on the same GPU and
model). For every measured cell (layout, policy, concurrency, matrix run) it simulates the same closed loop (the
same users, the same prompts in the same order with their token lengths, the run's output length, slots and
``max_seq_len``, the same warm-up and window, counted as the bench counts: :func:`_window_stats`) and prints
predicted against measured per-user tokens/s (median of 1 / TPOT), aggregate tokens/s, the engine's generation
rate and TTFT p50. A Ray autoregressive run decodes its recorded ``scheduler.decode_steps`` per round
(:func:`run_decode_steps`), as the simulator's ``ClusterSpec.decode_steps``.

The verify tables are the ones the layout's dspark server served with when the results file recorded them
(``dspark bench serve`` keeps the server's model cards), else the cost file's profiled tables.

What the matrix measures and the simulator needs, per layout (``no-ray``, ``ray``; both run drafter and
verifier on the one GPU, so the simulated placement is ``colocated``):

- the round time of level c: the level's window over the server's rounds in it (closed loop: the engine never
  idles but for the few ms between a request's end and the next one's arrival);
- its split: draft, schedule and verify milliseconds per round (the served path's own timers; in Ray they are
  call times, gRPC hops included, so the cost files set hops to 0);
- the verify tokens per request per round, hence the batch B = c * (1 + that) the verify step held, and the
  prompt tokens and requests that joined during the window; with several decode steps a round runs a pass per
  step, (output - 1) / ceil((output - 1) / steps) of them on average (:attr:`Level.passes_per_round`).

Not measured, so derived here (the same rules for every cell, nothing tuned by hand):

- ``draft(R)``: the measured draft ms per round at R = c, the mean over the layout's drafting cells;
- ``host(R)`` per round, drafted and plain: measured round time - SPS-predicted verify step at (c, B) times the
  passes per round - the draft ms - the predicted prefill of the requests that joined per round (measured joins
  per round, times the prefill table's cost of the mean measured prompt). Drafted from the layout's drafting
  cells (mean), plain from its autoregressive cells (mean over the runs that measured the level); a negative
  value (draft and verify overlap on the device in ``--no-ray``'s chained rounds) is kept at 0 and reported;
- ``delay``: the client-to-scheduler time the simulator does not model (HTTP, the ingress, tokenising, the
  first chunk's way back): measured TTFT p50 - simulated TTFT p50 at c = 1, the mean over the layout's cells,
  added to every simulated request of that layout. Its TTFT at c = 1 is therefore fitted, not predicted.

Two fits, both printed: ``all`` (each layout's cost curves from all four levels: checks that the round model,
the recorded acceptance, the closed loop and the joins compose into the measured rates) and ``held-out`` (the
curves of level c fitted on the other three levels only, interpolated in R, extrapolated at c = 1 and 128 with
the cost file's rules: the check that matters for predicting unmeasured deployments).

Acceptance comes from recorded decoding traces of the demo pair (greedy, 128 tokens), concatenated from the
files given (default: the first 96 prompts of HumanEval and of MBPP, the two served sets; docs/SIMULATOR.md
has the commands that recorded them); the served tau is printed beside the simulated one, since a trace whose
acceptance differs from the served prompts' moves every token rate by the same factor.

Where the matrix holds the server's own split of TTFT (``dspark bench serve`` from a server that counts it: the
mean time from a request's arrival at the round driver to its admission, and from there to its first token, and
the requests verified and prompts joining per round), each cell also gets the simulator's same four numbers
over the same window (:func:`_window_split`), printed in a second table and kept as ``served_split`` of the cell:
the part of the measured TTFT the simulator misses is in the queue, in the round that prefills, or outside the
round driver (the client delay). Older matrices calibrate as before, without them.

The engine's generation rate, measured: the tokens the server committed in the window by its counters (every
verification's, tau each, or a token per pass with several decode steps, and the first token of each request
that joined), over the window; simulated: the tokens every request emitted inside the window.

    PYTHONPATH=. python bench/calibrate_simulator.py --json docs/simulator/calibration.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.bench_serve.workload import prompt_set_requests
from cluster.config import GPU_DECODE_STEPS
from cluster.simulator.costs import Costs, parse_costs
from cluster.simulator.simulation import ClosedLoop, ClusterSpec, SimResult, simulate
from cluster.simulator.traces import AcceptanceTrace, load_traces
from cluster.simulator.workload import Workload
from scheduler.sts import STSCalibration

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"per_user": 0.10, "aggregate": 0.10, "ttft": 0.20}


@dataclass(frozen=True)
class ServedSplit:
    """The time to first token inside the server and its rounds' load over a level's window, as the server
    counts them (or, in :class:`Predicted`, as the simulator has them): means over the requests whose first token
    came in the window and over the target passes that ended in it."""

    queue_s: float
    admission_s: float
    requests_per_round: float
    joins_per_round: float

    def to_dict(self) -> dict[str, float]:
        """Milliseconds for the times (as ``dspark bench serve`` writes them), counts as they are."""
        return {"queue_ms": self.queue_s * 1e3, "admission_to_first_token_ms": self.admission_s * 1e3,
                "requests_per_round": self.requests_per_round, "joins_per_round": self.joins_per_round}


def served_split(spec: dict[str, Any]) -> ServedSplit | None:
    """A level's :class:`ServedSplit` from its server counters (``speculative`` of a level), None when the
    results file has none (written before the server counted them, or a level with no first token or round)."""
    split = spec.get("ttft_split_ms")
    if not split or spec.get("requests_per_round") is None or spec.get("joins_per_round") is None:
        return None
    return ServedSplit(split["queue"] / 1e3, split["admission_to_first_token"] / 1e3,
                       float(spec["requests_per_round"]), float(spec["joins_per_round"]))


@dataclass(frozen=True)
class Level:
    """One measured level of one cell, with what the calibration reads from it, and the settings of the matrix
    run it belongs to (``matrix``: that run's date, which tells apart cells measured in several runs)."""

    layout: str
    policy: str
    users: int
    window_s: float
    per_user: float
    aggregate: float
    ttft_s: float
    round_s: float
    draft_s: float
    verify_s: float
    batch_tokens: float
    joins_per_round: float
    mean_prompt: float
    tau: float
    # tokens/s the engine committed during the window, from the server's counters: every verification's tokens
    # (drafts counts them, tau per verification; with several decode steps, a token per pass) and the joins' first
    generated: float
    decode_steps: int  # plain decoding steps per round (scheduler.decode_steps of a Ray autoregressive run)
    slots: int
    max_seq_len: int
    output_len: int
    files: tuple[str, ...]  # the prompt files, by name, in the benchmark's order
    matrix: str
    # The server's own counts of the level (None from a matrix that predates them): the mean time from a
    # request's arrival at the round driver to its admission and from there to its first token, and the
    # requests verified and prompts joining per target pass (cluster.bench_serve.server_metrics).
    served: ServedSplit | None = None

    @property
    def passes_per_round(self) -> float:
        """Target passes a request takes part in per round (:func:`passes_per_round`)."""
        return passes_per_round(self.output_len, self.decode_steps)


def passes_per_round(output_len: int, decode_steps: int) -> float:
    """Target passes a request takes part in per round: 1, or with several decode steps the mean steps of its
    rounds, (output - 1) / ceil((output - 1) / steps) (the benchmark's requests all have ``output_len`` tokens,
    the first from the prefill; each round decodes ``decode_steps`` of the rest but the last)."""
    decoded = output_len - 1
    return decoded / math.ceil(decoded / decode_steps) if decode_steps > 1 and decoded > 0 else 1.0


def matrices_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The serving matrices of a results file: the file itself (``bench/serve_matrix.py`` writes ``runs`` and
    ``matrix``), or each value of a file that keeps several runs of the script under labels."""
    if "runs" in doc:
        return [doc]
    return [value for value in doc.values() if isinstance(value, dict) and "runs" in value]


def run_decode_steps(matrix: dict[str, Any], run: dict[str, Any]) -> int:
    """The plain decoding steps per round a matrix run served with: ``decode_steps`` of the Ray configs'
    scheduler section (``--ray-scheduler decode_steps=N`` in the matrix's command; ``auto``: the served default on
    the matrix's device) for an autoregressive run in the ``ray`` layout (the disaggregated placement, where it
    applies), else 1 (``--no-ray`` and the colocated placement decode one token per round; a matrix that does
    not set it ran before it existed or with one step)."""
    if run["layout"] != "ray" or run["policy"] != "autoregressive":
        return 1
    command = [str(part) for part in matrix["matrix"]["command"]]
    settings = []
    for k, part in enumerate(command):
        if part == "--ray-scheduler":
            settings += itertools.takewhile(lambda item: not item.startswith("--"), command[k + 1 :])
    for item in settings:
        key, _, value = item.partition("=")
        if key == "decode_steps":
            if value == "auto":
                return GPU_DECODE_STEPS if matrix["matrix"]["device"] != "cpu" else 1
            return int(value)
    return 1


def measured_levels(matrix: dict[str, Any]) -> list[Level]:
    """Every closed-loop level of the matrix with the server's round counters (levels without are skipped)."""
    out = []
    meta = matrix["matrix"]
    for run in matrix["runs"]:
        steps = run_decode_steps(matrix, run)
        output_len = int(run["workload"]["output_len"])
        files = tuple(Path(f).name for f in run["workload"]["files"])
        for lv in run["levels"]:
            spec = lv.get("speculative") or {}
            split = spec.get("round_split_ms")
            if lv["load"]["kind"] != "closed" or not spec.get("rounds") or split is None:
                continue
            c = int(lv["load"]["value"])
            rounds = float(spec["rounds"])
            tau = spec.get("mean_acceptance_length") or 1.0
            # tokens a verification commits: tau (drafted), or a token per pass of its decode steps (plain)
            per_item = tau if steps == 1 else passes_per_round(output_len, steps)
            out.append(Level(
                layout=run["layout"], policy=run["policy"], users=c, window_s=lv["window_s"],
                per_user=lv["tokens_per_s_per_user"]["median"], aggregate=lv["output_throughput"],
                ttft_s=lv["ttft_s"]["p50"], round_s=lv["window_s"] / rounds, draft_s=split["draft"] / 1e3,
                verify_s=split["verify"] / 1e3,
                batch_tokens=c * (1.0 + (spec.get("verify_tokens_per_request_round") or 0.0)),
                joins_per_round=lv["completed"] / rounds, mean_prompt=lv["prompt_tokens"] / max(lv["completed"], 1),
                tau=tau, generated=(float(spec["drafts"]) * per_item + lv["completed"]) / lv["window_s"],
                decode_steps=steps, slots=int(meta["slots"]), max_seq_len=int(meta["max_seq_len"]),
                output_len=output_len, files=files, matrix=str(meta["date"]), served=served_split(spec),
            ))
    return out


def _host_of(level: Level, base: Costs) -> float:
    """Measured round time minus what the cost file prices (verify step, or a round's decode steps, each a step of
    the level's requests; prefill of the joins) and the draft."""
    verify = base.verify_s(level.users, max(level.users, round(level.batch_tokens))) * level.passes_per_round
    prefill = level.joins_per_round * base.prefill_s(round(level.mean_prompt))
    return level.round_s - verify - prefill - level.draft_s


def served_sps(run: dict[str, Any]) -> dict[str, Any] | None:
    """The SPS table a run's server priced rounds with, from the model cards ``dspark bench serve`` records
    (``server.cards[].dspark.sps``: one table per verifier); None when the results file has none (files
    written before the cards were recorded, or a policy that uses no table)."""
    for card in (run.get("server") or {}).get("cards") or []:
        for table in ((card.get("dspark") or {}).get("sps") or {}).values():
            if isinstance(table, dict) and "format" in table:
                return {k: v for k, v in table.items() if k != "origin"}
    return None


def layout_base(base_doc: dict[str, Any], matrix: dict[str, Any], layout: str) -> tuple[dict[str, Any], Costs]:
    """The cost file a layout's costs are derived from: the measured one, with the verify table its dspark
    server served with when the matrix recorded it (what its Algorithm 1 priced rounds with, and what its verify
    steps are then measured against), else the profiled tables of the cost file."""
    for run in matrix["runs"]:
        table = served_sps(run) if run["layout"] == layout else None
        if table is not None:
            doc = {**base_doc, "verify": {"sps": table, "scale": 1.0,
                                          "source": f"the SPS table `dspark serve` ({layout}) served with"}}
            return doc, parse_costs(doc, f"served {layout}")
    return base_doc, parse_costs(base_doc, "costs")


def _round_terms(level: Level, base: Costs) -> dict[str, float]:
    """A level's measured round and the terms the host time is derived from, in ms: what the served verify step
    took against what the SPS table says (the gap is the verify-under-load excess the host curve absorbs)."""
    return {"round": level.round_s * 1e3, "draft": level.draft_s * 1e3, "verify_measured": level.verify_s * 1e3,
            "verify_sps": base.verify_s(level.users, max(level.users, round(level.batch_tokens)))
            * level.passes_per_round * 1e3,
            "host": _host_of(level, base) * 1e3}


def derived_cost_doc(base_doc: dict[str, Any], base: Costs, levels: Sequence[Level], layout: str,
                     clamped: list[str]) -> dict[str, Any]:
    """The cost file (as JSON) of one layout from its measured ``levels`` (see the module docstring);
    ``clamped`` collects the levels whose derived host time was negative (kept at 0)."""
    mine = [lv for lv in levels if lv.layout == layout]
    drafted = [lv for lv in mine if lv.policy != "autoregressive"]
    plain = [lv for lv in mine if lv.policy == "autoregressive"]

    def curve(rows: Sequence[Level], value: Any) -> tuple[list[int], list[float]]:
        counts = sorted({lv.users for lv in rows})
        values = []
        for c in counts:
            v = float(np.mean([value(lv) for lv in rows if lv.users == c]))
            if v < 0:
                clamped.append(f"{layout} c={c}: {v * 1e3:.2f} ms")
            values.append(max(v, 0.0))
        return counts, values

    draft_r, draft_s = curve(drafted or plain, lambda lv: lv.draft_s)
    host_d_r, host_d = curve(drafted or plain, lambda lv: _host_of(lv, base))
    host_p_r, host_p = curve(plain or drafted, lambda lv: _host_of(lv, base))
    # The cost format keeps one request axis for both host curves: the plain curve on the drafted counts.
    host_p_on_d = list(np.interp(host_d_r, host_p_r, host_p))
    doc = {
        **base_doc,
        "calibrated": True,
        "verify": {**base_doc["verify"], "scale": 1.0},
        "draft": {"requests": draft_r, "seconds": draft_s, "source": f"serve matrix, {layout}: draft ms per round"},
        "host": {"requests": host_d_r, "drafted_s": host_d, "plain_s": host_p_on_d,
                 "source": f"serve matrix, {layout}: round time - SPS verify - prefill of joins - draft"},
        "hops": {"colocated_s": 0.0, "disaggregated_s": 0.0, "round_overhead_s": 0.0,
                 "source": "inside the measured call times of the round split"},
    }
    parse_costs(doc, f"derived {layout}")  # refuses what the simulator could not load
    return doc


def derived_costs(base_doc: dict[str, Any], base: Costs, levels: Sequence[Level], layout: str,
                  clamped: list[str]) -> Costs:
    """:func:`derived_cost_doc`, loaded."""
    return parse_costs(derived_cost_doc(base_doc, base, levels, layout, clamped), f"derived {layout}")


def prompt_lengths(files: Sequence[Path], tokenizer: Path) -> np.ndarray:
    """Token counts of the prompts in the benchmark's order (the files interleaved line by line)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    return np.array([len(tok.encode(r.prompt).ids) for r in prompt_set_requests(files, 128)], dtype=np.int64)


def joined_traces(paths: Sequence[Path], calibration: STSCalibration) -> AcceptanceTrace:
    """The recorded traces of several files as one (prompts renumbered after each other)."""
    traces = [load_traces(p, calibration) for p in paths]
    if len(traces) == 1:
        return traces[0]
    conf, acc, req = [], [], []
    offset = 0
    for t in traces:
        conf.append(t.confidences)
        acc.append(t.accepted)
        req.append(np.repeat(np.arange(t.num_prompts) + offset, np.diff(t.starts)))
        offset += t.num_prompts
    return AcceptanceTrace.from_arrays(np.concatenate(conf), np.concatenate(acc), np.concatenate(req))


@dataclass(frozen=True)
class Predicted:
    per_user: float
    aggregate: float
    ttft_s: float
    tau: float
    generated: float
    split: ServedSplit  # the simulated counterpart of Level.served, over the same window (NaN where empty)


#: How each layout's served engine runs its planned rounds (ClusterSpec.planned_rounds): ``--no-ray`` chains them in
#: process, Ray's verifier relays its drafters' blocks (both on one GPU: the simulated placement is colocated).
LAYOUT_PLANNED_ROUNDS = {"no-ray": "chained", "ray": "relayed"}


def simulate_level(costs: Costs, trace: AcceptanceTrace, lengths: np.ndarray, policy: str, users: int,
                   window_s: float, delay_s: float, output_len: int, slots: int, max_seq_len: int,
                   planned_rounds: str = "auto", decode_steps: int = 1) -> Predicted:
    """The bench's closed loop in the simulator: warm-up until every user finished one request, then the
    requests that end within ``window_s`` after that; rates and TTFT as ``dspark bench serve`` computes them
    (:func:`_window_stats`). ``decode_steps``: plain decoding steps per round (``ClusterSpec.decode_steps``)."""
    spec = ClusterSpec(placement="colocated", verifiers=1, verifier_slots=slots, drafter_slots=slots,
                       max_seq_len=max_seq_len, policy=policy, planned_rounds=planned_rounds,
                       decode_steps=decode_steps)
    count = max(4 * users, 64)
    while True:
        inputs = np.resize(lengths, count)
        workload = Workload(np.zeros(count), inputs, np.full(count, output_len, dtype=np.int64))
        result = simulate(workload, costs, trace, spec, seed=0, closed_loop=ClosedLoop(users, delay_s),
                          log_rounds=True)
        t0 = float(np.max(result.finish_s[:users]))
        if float(np.nanmax(result.finish_s)) >= t0 + window_s:
            break
        count *= 2
    return _window_stats(result, t0, window_s, delay_s)


def _window_stats(result: SimResult, t0: float, window_s: float, delay_s: float) -> Predicted:
    """The level's numbers as ``dspark bench serve`` counts them (``cluster.bench_serve.load.run_closed``): its
    window opens once every user finished its first request (``t0``: the last of them ended then), so the
    requests that ended at ``t0`` or before, the last warm-up request and every request that ended with it, are
    not counted; it counts those that end in the next ``window_s``, and its aggregate is their output tokens over
    the window. (With equal output lengths the requests of a level end in waves, those of one round together:
    a window counting the wave that ends at ``t0`` would count a whole wave more.)"""
    inside = (result.finish_s > t0) & (result.finish_s <= t0 + window_s) & ~result.rejected
    sent = result.arrival_s[inside] - delay_s  # when the simulated user sent it
    first, finish, out = result.first_token_s[inside], result.finish_s[inside], result.output_tokens[inside]
    tpot = (finish - first) / np.maximum(out - 1, 1)
    drafted = result.rounds[inside].sum()
    # Tokens emitted inside the window by every request (its first at first_token_s, the others evenly to its
    # end): the engine's generation rate, which no request boundary quantises.
    f_all, e_all, n_all = result.first_token_s, result.finish_s, result.output_tokens
    ok = np.isfinite(f_all) & np.isfinite(e_all)
    f_all, e_all, n_all = f_all[ok], e_all[ok], n_all[ok]
    span = np.maximum(e_all - f_all, 1e-12)
    overlap = np.clip(np.minimum(e_all, t0 + window_s) - np.maximum(f_all, t0), 0.0, None) / span
    firsts = ((f_all >= t0) & (f_all <= t0 + window_s)).sum()
    generated = float(((n_all - 1) * overlap).sum() + firsts) / window_s
    return Predicted(per_user=float(np.median(1.0 / tpot)), aggregate=float(out.sum() / window_s),
                     ttft_s=float(np.median(first - sent)),
                     tau=float((out - 1).sum() / drafted) if drafted else math.nan, generated=generated,
                     split=_window_split(result, t0, window_s))


def _window_split(result: SimResult, t0: float, window_s: float) -> ServedSplit:
    """:class:`ServedSplit` of the simulated window, counted as the server counts it: the requests whose first
    token came in the window (arrival at the scheduler to the round that prefills them, and that round's end),
    the rounds that ended in it (prefill-only rounds included)."""
    first = result.first_token_s
    with np.errstate(invalid="ignore"):
        firsts = (first >= t0) & (first <= t0 + window_s)
    ends = result.round_end_s
    rounds = (ends > t0) & (ends <= t0 + window_s)

    def mean(values: np.ndarray) -> float:
        return float(values.mean()) if values.size else math.nan

    return ServedSplit(queue_s=mean((result.admit_s - result.arrival_s)[firsts]),
                       admission_s=mean((first - result.admit_s)[firsts]),
                       requests_per_round=mean(result.round_requests[rounds]),
                       joins_per_round=mean(result.round_joins[rounds]))


def _err(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--matrix", type=Path, nargs="+",
                   default=[ROOT / "docs" / "simulator" / "serve_matrix_calibration.json"],
                   help="serving-matrix results files (a file of several labelled matrices counts as all of them)")
    p.add_argument("--costs", type=Path, default=ROOT / "docs" / "simulator" / "costs_h200.json")
    p.add_argument("--traces", type=Path, nargs="+",
                   default=[ROOT / "tests" / "data" / f"sim_traces_demo_{name}.npz" for name in ("humaneval", "mbpp")],
                   help="decoding traces of the served prompt sets (concatenated)")
    p.add_argument("--sts", type=Path, default=ROOT / "models" / "demo" / "draft_dspark" / "sts.json")
    p.add_argument("--prompts-dir", type=Path, default=ROOT.parent / "shared" / "data" / "prompts")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "demo" / "target" / "tokenizer.json")
    p.add_argument("--json", type=Path, default=None, help="write every prediction as JSON")
    p.add_argument("--costs-out", type=Path, default=None,
                   help="write each layout's cost file fitted on all levels here (costs_served_<layout>.json)")
    args = p.parse_args(argv)

    matrices = [m for path in args.matrix for m in matrices_of(json.loads(path.read_text()))]
    base_doc = json.loads(args.costs.read_text())
    traces = args.traces
    trace = joined_traces(traces, STSCalibration.load(args.sts))
    levels = [lv for m in matrices for lv in measured_levels(m)]
    prompts = {names: prompt_lengths([args.prompts_dir / name for name in names], args.tokenizer)
               for names in {lv.files for lv in levels}}
    layouts = sorted({lv.layout for lv in levels})
    every_run = {"runs": [run for m in matrices for run in m["runs"]]}  # the first served table of a layout wins
    bases = {layout: layout_base(base_doc, every_run, layout) for layout in layouts}
    began = time.perf_counter()

    def predict(costs: Costs, lv: Level, users: int, delay_s: float) -> Predicted:
        return simulate_level(costs, trace, prompts[lv.files], lv.policy, users, lv.window_s, delay_s,
                              lv.output_len, lv.slots, lv.max_seq_len, LAYOUT_PLANNED_ROUNDS.get(lv.layout, "auto"),
                              lv.decode_steps)

    def run_fit(name: str) -> list[dict[str, Any]]:
        clamped: list[str] = []
        full = {layout: derived_costs(*bases[layout], levels, layout, clamped) for layout in layouts}
        delays = {}
        for layout in layouts:  # the client-side delay, fitted at c = 1 on the all-level costs
            ones = [lv for lv in levels if lv.layout == layout and lv.users == 1]
            delays[layout] = max(0.0, float(np.mean([
                lv.ttft_s - predict(full[layout], lv, 1, 0.0).ttft_s for lv in ones])))
        rows = []
        for lv in levels:
            if name == "all":
                costs = full[lv.layout]
            else:
                rest = [x for x in levels if x.users != lv.users]
                costs = derived_costs(*bases[lv.layout], rest, lv.layout, [])
            pred = predict(costs, lv, lv.users, delays[lv.layout])
            rows.append({"fit": name, "layout": lv.layout, "policy": lv.policy, "users": lv.users,
                         "decode_steps": lv.decode_steps, "matrix": lv.matrix,
                         "measured": {"per_user": lv.per_user, "aggregate": lv.aggregate, "ttft_s": lv.ttft_s,
                                      "tau": lv.tau, "generated": lv.generated},
                         # tau per target pass, as the server counts it: with several decode steps a round's
                         # tokens are its passes' (the simulated tokens per round over its passes: 1)
                         "predicted": {"per_user": pred.per_user, "aggregate": pred.aggregate,
                                       "ttft_s": pred.ttft_s, "tau": pred.tau / lv.passes_per_round,
                                       "generated": pred.generated},
                         "error": {"per_user": _err(pred.per_user, lv.per_user),
                                   "aggregate": _err(pred.aggregate, lv.aggregate),
                                   "generated": _err(pred.generated, lv.generated),
                                   "ttft": _err(pred.ttft_s, lv.ttft_s)},
                         "delay_s": delays[lv.layout], "ttft_fitted": lv.users == 1,
                         "round_ms": _round_terms(lv, bases[lv.layout][1])})
            if lv.served is not None:  # (a matrix without the server's split: the row as before)
                rows[-1]["served_split"] = {"measured": lv.served.to_dict(), "predicted": pred.split.to_dict()}
        print(f"\n## fit: {name} (negative host times kept at 0: {', '.join(clamped) or 'none'}; "
              f"client delay: {', '.join(f'{k} {v * 1e3:.1f} ms' for k, v in delays.items())})\n")
        print(table(rows))
        if any("served_split" in r for r in rows):
            print("\n" + split_table(rows))
        return rows

    rows = run_fit("all") + run_fit("held-out")
    if args.costs_out is not None:
        args.costs_out.mkdir(parents=True, exist_ok=True)
        for layout in layouts:
            doc = derived_cost_doc(*bases[layout], levels, layout, [])
            doc["model"] += f"; served by `dspark serve` ({layout}), fitted by bench/calibrate_simulator.py"
            (args.costs_out / f"costs_served_{layout}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{len(rows)} simulated cells in {time.perf_counter() - began:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": "PYTHONPATH=. python bench/calibrate_simulator.py", "date": time.strftime("%Y-%m-%d"),
            "verify_tables": {layout: bases[layout][0]["verify"]["source"] for layout in layouts},
            "matrix": [str(m.relative_to(ROOT) if m.is_relative_to(ROOT) else m) for m in args.matrix],
            "traces": [str(t.relative_to(ROOT) if t.is_relative_to(ROOT) else t) for t in traces],
            "goals": GOALS, "cells": rows}, indent=1) + "\n")
    return 0


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: predicted / measured and the error of each metric, a mark where it misses its goal."""

    def cell(pred: float, meas: float, err: float, goal: float, digits: int, scale: float = 1.0) -> str:
        miss = "" if abs(err) <= goal else " **miss**"
        return f"{pred * scale:.{digits}f} / {meas * scale:.{digits}f} ({err:+.1%}){miss}"

    out = ["| cell | matrix (UTC) | c | tok/s per user: pred / meas (err) | aggregate tok/s (bench) "
           "| generated tok/s (engine) | TTFT p50 ms | tau pred / meas |",
           "| --- | --- | ---: | --- | --- | --- | --- | --- |"]
    for r in rows:
        m, q, e = r["measured"], r["predicted"], r["error"]
        ttft = cell(q["ttft_s"], m["ttft_s"], e["ttft"], GOALS["ttft"], 1, 1e3)
        if r["ttft_fitted"]:
            ttft = ttft.replace(" **miss**", "") + " (fitted)"
        steps = f" ({r['decode_steps']} steps)" if r.get("decode_steps", 1) > 1 else ""
        out.append(f"| {r['layout']} {r['policy']}{steps} | {r.get('matrix', '')[11:16]} | {r['users']} "
                   f"| {cell(q['per_user'], m['per_user'], e['per_user'], GOALS['per_user'], 0)} "
                   f"| {cell(q['aggregate'], m['aggregate'], e['aggregate'], GOALS['aggregate'], 0)} "
                   f"| {cell(q['generated'], m['generated'], e['generated'], GOALS['aggregate'], 0)} "
                   f"| {ttft} | {q['tau']:.2f} / {m['tau']:.2f} |")
    return "\n".join(out)


def split_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: the server's time to first token in its round driver (queue to admission, admission to first
    token) and its rounds' load, simulated / measured, for the rows that have them; with the TTFT p50 beside them
    it says which part of TTFT the simulator misses (what neither holds is the way to the round driver and back,
    the client delay)."""
    out = ["| cell | matrix (UTC) | c | TTFT p50 ms: pred / meas | queue ms | admission to first token ms "
           "| requests per round | joins per round |", "| --- | --- | ---: | --- | --- | --- | --- | --- |"]

    def pair(q: float, m: float, digits: int) -> str:
        return f"{q:.{digits}f} / {m:.{digits}f}"

    for r in rows:
        split = r.get("served_split")
        if split is None:
            continue
        m, q = split["measured"], split["predicted"]
        steps = f" ({r['decode_steps']} steps)" if r.get("decode_steps", 1) > 1 else ""
        out.append(f"| {r['layout']} {r['policy']}{steps} | {r.get('matrix', '')[11:16]} | {r['users']} "
                   f"| {pair(r['predicted']['ttft_s'] * 1e3, r['measured']['ttft_s'] * 1e3, 1)} "
                   f"| {pair(q['queue_ms'], m['queue_ms'], 1)} "
                   f"| {pair(q['admission_to_first_token_ms'], m['admission_to_first_token_ms'], 1)} "
                   f"| {pair(q['requests_per_round'], m['requests_per_round'], 1)} "
                   f"| {pair(q['joins_per_round'], m['joins_per_round'], 2)} |")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
