"""The Markdown tables of a policy sweep's JSON (bench/bench_policies_gpu.py), for docs/benchmarks/policies.md.

    python -m bench.policies_table docs/benchmarks/policies.json

Prints the per-(concurrency, policy) table (mean of the repeats, aggregate min-max in brackets) and the goals
with each repeat's ratio, so that the docs quote the raw file and nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.bench_policies_gpu import mean_cells

COLUMNS = (
    "| c | policy | user tok/s | aggregate tok/s | tau | budget | B / round | draft ms | sched ms | verify ms "
    "| other ms | round ms | chained rounds | drafted behind | rounds without draft |"
)


def _share(cell: dict[str, Any], key: str) -> str:
    """A fraction as a percentage, or "-" for a sweep that did not record it."""
    return f"{100 * cell[key]:.0f}%" if key in cell else "-"


def cell_table(results: dict[str, Any]) -> list[str]:
    lines = [COLUMNS, "| " + " | ".join(["---:", "---"] + ["---:"] * 13) + " |"]
    for (concurrency, policy), c in sorted(mean_cells(results["cells"]).items(), key=lambda kv: kv[0][0]):
        lines.append(
            f"| {concurrency} | {policy} | {c['per_user_tokens_per_s']:.1f} | {c['aggregate_tokens_per_s']:.0f} "
            f"({c['aggregate_min']:.0f}-{c['aggregate_max']:.0f}) | {c['tau']:.2f} | {c['verify_budget']:.2f} | "
            f"{c['verify_tokens_per_round']:.1f} | {c['draft_ms']:.2f} | {c['schedule_ms']:.2f} | "
            f"{c['verify_ms']:.2f} | {c['other_host_ms']:.2f} | {c['round_ms']:.2f} | "
            f"{_share(c, 'chained_round_fraction')} | {_share(c, 'behind_round_fraction')} | "
            f"{_share(c, 'skipped_round_fraction')} |"
        )
    return lines


def goal_lines(results: dict[str, Any]) -> list[str]:
    goals = results["goals"]
    levels = goals["dspark_vs_best_fixed_aggregate"]["levels"]
    parts = []
    for level in levels:
        if "dspark_ratio" not in level:  # the level's dspark cells did not run (time limit)
            parts.append(f"no dspark cell (c={level['concurrency']})")
            continue
        repeats = " / ".join(f"{r:.2f}" for r in level["dspark_ratio_per_repeat"])
        async_ratio = level.get("dspark-async_ratio")  # None or absent: a sweep without dspark-async
        parts.append(
            f"{level['dspark_ratio']:.2f}x (c={level['concurrency']}, vs {level['best_fixed']}; repeats {repeats}"
            + ("" if async_ratio is None else f"; async {async_ratio:.2f}x")
            + ")"
        )
    per_user = goals.get("per_user_speedup_at_1") or {}
    floor = goals["verify_step_vs_memory_floor"]["rows"]
    floor_text = ", ".join(
        f"R={row['requests']}: {row.get('graph_step_ms', row['step_ms']):.2f} ms / floor {row['floor_ms']:.2f} ms = "
        f"{row.get('graph_ratio', row['ratio']):.2f}x"
        for row in floor
    )
    return [
        "dspark / best fixed policy, aggregate tokens/s: " + "; ".join(parts),
        "per user at 1 request vs autoregressive: "
        + (
            ", ".join(f"{p} {per_user[p]:.2f}x" for p in ("dspark", "dspark-async", "full", "fixed-1") if p in per_user)
            or "no 1-request cells"
        ),
        "verify step vs memory floor (graph replay): " + floor_text,
        f"HF generate, 1 request: {results['hf_generate']['tokens_per_s']:.1f} tokens/s"
        if "hf_generate" in results
        else "HF generate: not run",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    print("\n".join(cell_table(results)))
    print()
    print("\n".join(f"- {line}" for line in goal_lines(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
