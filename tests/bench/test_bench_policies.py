"""The policy sweep's pieces (bench/bench_policies_gpu.py) on CPU: the prompt mix, the time split, the goal
arithmetic, and one closed-loop cell over the real demo pair (small, uninflated, a fraction of a second)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from bench.bench_policies_gpu import (
    DEMO_DRAFTER,
    POLICIES,
    CellBudget,
    SharedEngines,
    agreement,
    cell_budget,
    common_prompt_per_user,
    evaluate_goals,
    floor_seconds,
    load_prompt_mix,
    per_user_pass,
    per_user_speedups,
    run_cell,
)
from bench.engine_setup import DEMO_TARGET, load_pair, synthetic_sps, tokenizer_for
from draft_service.engine import DraftEngine
from scheduler.engine import SpeculativeEngine
from scheduler.policy import make_policy


def _write_prompts(folder: Path, name: str, texts: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts))


def test_prompt_mix_interleaves_datasets_and_drops_long_prompts(tmp_path: Path) -> None:
    tokenizer = tokenizer_for(DEMO_TARGET)
    _write_prompts(tmp_path, "a", ["def f(x):", "x" * 4000, "import os"])
    _write_prompts(tmp_path, "b", ["class A:", "return 1"])
    mix = load_prompt_mix(
        tmp_path, ["a", "b"], tokenizer, per_dataset=10, max_prompt_tokens=64, max_tokens=20, jitter=5
    )
    assert mix.names == ["a/0", "b/0", "a/2", "b/1"]  # a/1 is too long
    assert all(len(p) <= 64 for p in mix.token_ids)
    assert all(15 <= m <= 25 for m in mix.max_tokens)
    again = load_prompt_mix(
        tmp_path, ["a", "b"], tokenizer, per_dataset=10, max_prompt_tokens=64, max_tokens=20, jitter=5
    )
    assert again.max_tokens == mix.max_tokens  # seeded: the same per-prompt lengths in every run
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_mix(tmp_path, ["missing"], tokenizer, per_dataset=1, max_prompt_tokens=64, max_tokens=8, jitter=0)


def test_cell_budget_shares_the_time_left_and_stops_when_none_is() -> None:
    args = argparse.Namespace(warmup_s=2.0, measure_s=9.0, reserve_s=10.0)
    assert cell_budget(args, deadline=1000.0, now=0.0, cells_left=20) == CellBudget(2.0, 9.0)
    tight = cell_budget(args, deadline=110.0, now=0.0, cells_left=20)  # 5 s each
    assert tight is not None and tight.warmup_s == pytest.approx(1.0) and tight.measure_s == pytest.approx(4.0)
    assert cell_budget(args, deadline=20.0, now=0.0, cells_left=20) is None


def test_floor_counts_weights_once_and_kv_per_request() -> None:
    assert floor_seconds(1000, 10, requests=4, tokens_read_per_request=25, bandwidth=100.0) == pytest.approx(20.0)


def _cell(concurrency: int, policy: str, agg: float, user: float) -> dict:
    return {"concurrency": concurrency, "policy": policy, "aggregate_tokens_per_s": agg, "per_user_tokens_per_s": user,
            "per_user_by_prompt": {"0": [user]}}  # fmt: skip


def test_goals_compare_against_the_best_fixed_policy() -> None:
    cells = [
        _cell(1, "autoregressive", 10, 10),
        _cell(1, "fixed-1", 15, 15),
        _cell(1, "full", 20, 20),
        _cell(1, "dspark", 30, 30),
        _cell(1, "dspark-async", 25, 25),
        _cell(8, "autoregressive", 80, 10),
        _cell(8, "fixed-1", 100, 12),
        _cell(8, "full", 90, 11),
        _cell(8, "dspark", 95, 12),
    ]
    floor_rows = [
        {"requests": 1, "batch_tokens": 8, "step_ms": 3.0, "floor_ms": 2.5, "ratio": 1.2},
        {"requests": 8, "batch_tokens": 64, "step_ms": 4.0, "floor_ms": 2.0, "ratio": 2.0},
        {"requests": 128, "batch_tokens": 1024, "step_ms": 9.0, "floor_ms": 2.0, "ratio": 4.5},
    ]
    goals = evaluate_goals(cells, floor_rows, [1, 8])
    levels = goals["dspark_vs_best_fixed_aggregate"]["levels"]
    assert levels[0]["best_fixed"] == "full" and levels[0]["dspark_ratio"] == pytest.approx(1.5)
    assert levels[0]["dspark-async_ratio"] == pytest.approx(1.25) and levels[0]["met"]
    assert levels[1]["best_fixed"] == "fixed-1" and levels[1]["dspark_ratio"] == pytest.approx(0.95)
    assert not levels[1]["met"] and not goals["dspark_vs_best_fixed_aggregate"]["met"]
    speedup = goals["per_user_speedup_at_1"]
    assert speedup["dspark"] == pytest.approx(3.0) and speedup["met"]
    floor = goals["verify_step_vs_memory_floor"]
    assert [r["requests"] for r in floor["rows"]] == [1, 8]  # only <= 32 requests count
    assert [r["met"] for r in floor["rows"]] == [True, False] and not floor["met"]
    assert evaluate_goals(cells[:3], [], [1])["dspark_vs_best_fixed_aggregate"]["met"] is None  # no dspark cell
    assert evaluate_goals([], [], [1])["per_user_speedup_at_1"]["met"] is None


def test_per_user_speed_is_compared_on_the_prompts_every_cell_finished() -> None:
    """A faster policy's window covers later prompts: only the prompts all cells of a level finished count, the
    repeats pooled; the cells' own window medians stay beside the common-prompt ratio."""

    def cell(policy: str, rates: dict[int, float], repeat: int = 0) -> dict:
        by_prompt = {str(i): [rate] for i, rate in rates.items()}
        median = sorted(rates.values())[len(rates) // 2]
        return dict(_cell(1, policy, 1.0, median), per_user_by_prompt=by_prompt, repeat=repeat)

    cells = [
        cell("autoregressive", {0: 10.0, 1: 10.0, 2: 12.0, 3: 12.0}),
        cell("autoregressive", {1: 10.0, 2: 12.0, 3: 12.0}, repeat=1),
        cell("dspark", {2: 30.0, 3: 36.0, 4: 90.0, 5: 90.0, 6: 90.0}),  # late prompts the slow cells never reach
        cell("dspark", {2: 30.0, 3: 36.0, 4: 90.0}, repeat=1),
    ]
    common = common_prompt_per_user(cells)
    assert common[(1, "autoregressive")] == {"tokens_per_s": 12.0, "prompts": 2}  # prompts 2 and 3, both repeats
    assert common[(1, "dspark")]["tokens_per_s"] == pytest.approx(33.0)
    speedup = evaluate_goals(cells, [], [1])["per_user_speedup_at_1"]
    assert speedup["dspark"] == pytest.approx(33.0 / 12.0) and speedup["common_prompts"] == 2
    assert speedup["window_median"]["dspark"] == pytest.approx((90.0 + 36.0) / 2 / 12.0)  # the biased comparison
    assert common_prompt_per_user([cell("dspark", {1: 5.0}), cell("full", {2: 5.0})])[(1, "full")]["prompts"] == 0


def test_per_user_goal_is_judged_on_the_same_prompts_when_the_pass_ran() -> None:
    """The per-user pass's median per-prompt speed-up decides the goal; the cells' common-prompt ratios are kept
    beside it; the geometric mean and range come with it."""
    rates = {
        "autoregressive": {"0": 10.0, "1": 10.0, "2": 20.0},
        "dspark": {"0": 30.0, "1": 20.0, "2": 80.0},
        "full": {"0": 20.0, "1": 20.0},  # a prompt it did not serve is left out of its ratios
    }
    speedups = per_user_speedups(rates)
    assert speedups["dspark"] == pytest.approx({"median": 3.0, "geomean": 24.0 ** (1 / 3), "min": 2.0, "max": 4.0,
                                                "prompts": 3})
    assert speedups["full"]["median"] == 2.0 and speedups["full"]["prompts"] == 2
    assert per_user_speedups({"dspark": {"0": 5.0}}) == {}  # no baseline, no ratio
    cells = [
        dict(_cell(1, "autoregressive", 1.0, 10.0), per_user_by_prompt={"0": [10.0]}),
        dict(_cell(1, "dspark", 1.0, 20.0), per_user_by_prompt={"0": [20.0]}),
    ]
    goal = evaluate_goals(cells, [], [1], speedups)["per_user_speedup_at_1"]
    assert goal["dspark"] == 3.0 and goal["met"] and goal["common_window"] == {"dspark": 2.0}
    assert goal["fixed_prompts"] is speedups and "per_user_pass" in goal["source"]
    assert evaluate_goals(cells, [], [1])["per_user_speedup_at_1"]["dspark"] == 2.0  # no pass: the common prompts


def test_agreement_compares_only_prompts_both_finished() -> None:
    assert agreement({1: [5, 6], 2: [7], 3: [1]}, {1: [5, 6], 2: [8], 4: [0]}) == {
        "compared": 2,
        "equal": 1,
        "first_difference": {"2": 0},
    }
    assert agreement({1: [5, 6, 9, 9], 2: [7]}, {1: [5, 6, 8, 9], 2: [7, 3]})["first_difference"] == {"1": 2, "2": 1}
    assert agreement({1: [5]}, None) is None


def test_a_closed_loop_cell_keeps_the_engine_full_and_leaves_it_empty(tmp_path: Path) -> None:
    """Two requests in flight over the demo pair (greedy): every finished request is replaced, the metrics are
    sane, greedy outputs match across policies, and the shared engines are empty afterwards."""
    target, drafter = load_pair(DEMO_TARGET, DEMO_DRAFTER, "cpu", torch.float32)
    _write_prompts(tmp_path, "code", ["def add(a, b):", "import sys", "class Stack:", "for i in range(3):"])
    mix = load_prompt_mix(
        tmp_path, ["code"], tokenizer_for(DEMO_TARGET), per_dataset=4, max_prompt_tokens=64, max_tokens=6, jitter=0
    )
    engines = SharedEngines(target, drafter, 2, 96, None)
    sps = synthetic_sps()
    rows, outputs = {}, {}
    for policy in ("autoregressive", "dspark"):
        engine = SpeculativeEngine(
            engines.verify, engines.draft, make_policy(policy, sps, drafter.block_size), max_running=2
        )
        rows[policy], outputs[policy] = run_cell(engine, policy, mix, 2, CellBudget(0.05, 0.4), 0.0)
        assert engines.idle()
    for policy, row in rows.items():
        assert row["policy"] == policy and row["concurrency"] == 2
        assert row["finished"] >= 1 and row["rounds"] >= 3
        # Closed loop: a finished request is replaced at once (it prefills next round, then decodes).
        assert 1.0 <= row["requests_per_round"] <= 2.0
        assert row["aggregate_tokens_per_s"] > 0 and row["per_user_tokens_per_s"] > 0
        assert all(len(tokens) == 6 for tokens in outputs[policy].values())  # EOS ignored: max_tokens each
    assert rows["autoregressive"]["tau"] == 1.0 and rows["autoregressive"]["verify_budget"] == 0.0
    assert rows["dspark"]["tau"] >= 1.0 and 0.0 < rows["dspark"]["verify_budget"] <= drafter.block_size
    common = set(outputs["autoregressive"]) & set(outputs["dspark"])
    assert common and all(outputs["autoregressive"][i] == outputs["dspark"][i] for i in common)
    assert isinstance(engines.draft, DraftEngine) and set(POLICIES) >= set(rows)
    # The per-user pass: every policy serves the same prompts, one at a time, the engines empty after each.
    pass_engines = {
        policy: SpeculativeEngine(engines.verify, engines.draft, make_policy(policy, sps, drafter.block_size))
        for policy in ("autoregressive", "dspark")
    }
    rates, served = per_user_pass(pass_engines, mix, 0.0, 0.0)  # no time: the first prompt still runs
    assert set(rates["autoregressive"]) == set(rates["dspark"]) == {"0"}
    assert served["dspark"][0] == served["autoregressive"][0] == outputs["autoregressive"][0]  # greedy: same tokens
    assert engines.idle()
