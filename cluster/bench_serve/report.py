"""Results of ``dspark bench serve`` as files: the JSON document, markdown tables and plots.

One run (one server, a sweep of levels) gives a table with a row per level. Several runs (servers, policies,
placements) line up side by side: tokens/s per user and aggregate tokens/s by level, the Pareto view of aggregate
against per-user throughput (the DSpark paper's Figure 7), and latency percentiles against load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _errors(level: dict[str, Any]) -> str:
    errors = level["errors"]
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) if errors else "0"


def first_wave_cell(level: dict[str, Any]) -> str:
    """``E2E max s (ratio to the steady state at its rank)`` of a level's first wave and its TTFT max (ratio to
    the steady p50); ``-`` for a level without one (open loop, or a results file written before first waves were
    recorded)."""
    wave = level.get("first_wave")
    if not wave:
        return "-"
    ratio = wave["ratio"]
    e2e = f"{_fmt(wave['e2e_s']['max'], 1, 2)} s ({_fmt(_ranked(wave), 1, 2)}x)"
    ttft = f"{_fmt(wave['ttft_s']['max'], 1e3)} ms ({_fmt(ratio['ttft_max'], 1, 2)}x)"
    miss = "" if wave["within_goal"] is not False else " over goal"
    return f"{e2e}, TTFT {ttft}{miss}"


def server_ttft_cell(spec: dict[str, Any]) -> str:
    """``queue + admission to first token`` mean ms in the server's round driver (``-`` from a server or a
    results file without them)."""
    split = spec.get("ttft_split_ms")
    if not split:
        return "-"
    return f"{_fmt(split['queue'], 1, 1)} + {_fmt(split['admission_to_first_token'], 1, 1)}"


def ingress_ttft_cell(spec: dict[str, Any]) -> str:
    """``parse + tokenize + backend (route)`` mean ms in the ingress (``-`` from a server or a results file
    without them; no route outside the colocated placement)."""
    part = spec.get("ingress_ttft_ms")
    if not part:
        return "-"
    route = "" if part["route"] is None else f" (route {_fmt(part['route'], 1, 2)})"
    return f"{_fmt(part['parse'], 1, 2)} + {_fmt(part['tokenize'], 1, 2)} + {_fmt(part['backend'], 1, 1)}{route}"


#: The parts of a level's mean TTFT in the order a request meets them (:func:`ttft_parts`).
TTFT_PARTS = ("to the app and back", "parse", "tokenize", "route", "to the round driver and back", "queue",
              "admission to first token")


def ttft_parts(level: dict[str, Any]) -> dict[str, float] | None:
    """Mean ms of each part of a level's TTFT (:data:`TTFT_PARTS`), from the client's mean TTFT, the ingress's
    split (``ingress_ttft_ms``) and the round driver's (``ttft_split_ms``); ``None`` without both splits. Two
    parts are what the clocks leave: "to the app and back" (the client's TTFT beyond the ingress's parts: the way
    to the app, the first chunk's way back, the client) and "to the round driver and back" (the ingress's
    ``backend`` beyond its ``route`` and the round driver's part). Each split is a mean over the requests its
    own counters saw, so a difference can come out slightly negative."""
    spec = level.get("speculative") or {}
    ingress, driver, mean_s = spec.get("ingress_ttft_ms"), spec.get("ttft_split_ms"), level["ttft_s"]["mean"]
    if not ingress or not driver or mean_s is None:
        return None
    route = ingress["route"] or 0.0
    inside = driver["queue"] + driver["admission_to_first_token"]
    values = (1e3 * mean_s - ingress["parse"] - ingress["tokenize"] - ingress["backend"], ingress["parse"],
              ingress["tokenize"], route, ingress["backend"] - route - inside, driver["queue"],
              driver["admission_to_first_token"])
    return dict(zip(TTFT_PARTS, values, strict=True))


def level_table(result: Result) -> str:
    """Markdown table of one run, a row per level."""
    head = ("| load | done | errors | tok/s/user p50 (p10) | aggregate tok/s | TTFT p50 / p99 ms "
            "| server TTFT: queue + to first token ms | ingress TTFT: parse + tokenize + backend ms "
            "| requests / joins per round | TPOT p50 / p99 ms "
            "| ITL p50 / p99 ms | E2E p50 / p99 s | goodput req/s (met) | tau | verify tok/req/round "
            "| client lag p99 ms | first wave max E2E (x steady at its rank), TTFT (x steady p50) |")
    rows = [head, "| --- " * (head.count("|") - 1) + "|"]
    for lv in result["levels"]:
        user, spec, good = lv["tokens_per_s_per_user"], lv["speculative"] or {}, lv["goodput"]
        goodput = "-" if good is None else f"{_fmt(good['requests_per_s'], 1, 2)} ({_fmt(good['fraction'], 100)} %)"
        tau, budget = spec.get("mean_acceptance_length"), spec.get("verify_tokens_per_request_round")
        lag = lv.get("client_loop_lag_ms") or {}
        rows.append(
            f"| {lv['load']['label']} | {lv['completed']} | {_errors(lv)} "
            f"| {_fmt(user['median'])} ({_fmt(user['p10'])}) | {_fmt(lv['output_throughput'])} "
            f"| {_fmt(lv['ttft_s']['p50'], 1e3)} / {_fmt(lv['ttft_s']['p99'], 1e3)} | {server_ttft_cell(spec)} "
            f"| {ingress_ttft_cell(spec)} "
            f"| {_fmt(spec.get('requests_per_round'), 1, 1)} / {_fmt(spec.get('joins_per_round'), 1, 2)} "
            f"| {_fmt(lv['tpot_s']['p50'], 1e3, 1)} / {_fmt(lv['tpot_s']['p99'], 1e3, 1)} "
            f"| {_fmt(lv['itl_s']['p50'], 1e3, 1)} / {_fmt(lv['itl_s']['p99'], 1e3, 1)} "
            f"| {_fmt(lv['e2e_s']['p50'], 1, 2)} / {_fmt(lv['e2e_s']['p99'], 1, 2)} "
            f"| {goodput} | {_fmt(tau, 1, 2)} | {_fmt(budget, 1, 2)} | {_fmt(lag.get('p99'), 1, 1)} "
            f"| {first_wave_cell(lv)} |"
        )
    populations = [(lv, p) for lv in result["levels"] for p in lv.get("populations") or ()]
    if populations:
        rows += ["", "| load | population | rate /s | fields | done | errors | TPOT p50 / p99 ms | SLO attainment "
                 "| aggregate goodput req/s |", "| --- " * 9 + "|"]
        for lv, p in populations:
            fields = ", ".join(f"{k}={v}" for k, v in p["fields"].items()) or "-"
            attained = p["slo_attainment"]
            rows.append(
                f"| {lv['load']['label']} | {p['name']} | {_fmt(p['rate'], 1, 2)} | {fields} | {p['completed']} "
                f"| {_errors(p)} | {_fmt(p['tpot_s']['p50'], 1e3, 1)} / {_fmt(p['tpot_s']['p99'], 1e3, 1)} "
                f"| {'-' if attained is None else _fmt(attained, 100) + ' %'} "
                f"| {_fmt(lv['goodput_aggregate']['requests_per_s'], 1, 2)} |"
            )
    return "\n".join(rows)


def _label(result: Result, index: int) -> str:
    return result.get("label") or f"run {index + 1}"


def _ranked(wave: dict[str, Any]) -> float | None:
    """The slowest first-wave E2E over the steady state's at its rank (files written before it: the p50)."""
    ratio = wave["ratio"]
    return ratio.get("e2e_max_ranked", ratio["e2e_max"])


def _first_wave_ratio(level: dict[str, Any]) -> float | None:
    wave = level.get("first_wave")
    return None if not wave else _ranked(wave)


def side_by_side(results: Sequence[Result]) -> str:
    """Three markdown tables over several runs, by level: tokens/s per user (median), aggregate tokens/s, and
    the first wave's slowest E2E over the steady E2E at its rank (goal: at most 1.5)."""
    loads: list[str] = []
    for result in results:
        for lv in result["levels"]:
            if lv["load"]["label"] not in loads:
                loads.append(lv["load"]["label"])
    tables: list[tuple[str, Any, int]] = [
        ("tokens/s per user (median)", lambda lv: lv["tokens_per_s_per_user"]["median"], 0),
        ("aggregate output tokens/s", lambda lv: lv["output_throughput"], 0),
    ]
    if any(_first_wave_ratio(lv) for r in results for lv in r["levels"]):
        tables.append(("first wave: slowest E2E / steady E2E at its rank (goal <= 1.5)", _first_wave_ratio, 2))
    out = []
    for title, pick, digits in tables:
        out.append(f"| {title} | " + " | ".join(loads) + " |")
        out.append("| --- " + "| ---: " * len(loads) + "|")
        for i, result in enumerate(results):
            by_load = {lv["load"]["label"]: lv for lv in result["levels"]}
            cells = []
            for load in loads:
                lv = by_load.get(load)
                cell = "-" if lv is None else _fmt(pick(lv), digits=digits)
                if lv is not None and lv["errors"]:
                    cell += f" ({sum(lv['errors'].values())} err)"
                cells.append(cell)
            out.append(f"| {_label(result, i)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def plot(results: Sequence[Result], out_dir: Path, stem: str = "bench_serve") -> list[Path]:
    """``<stem>_pareto.png`` (aggregate vs per-user tokens/s), ``<stem>_latency.png`` (TTFT / TPOT / E2E
    percentiles by level) and, from a server that splits its TTFT, ``<stem>_ttft.png`` (where the mean TTFT goes,
    by level); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, result in enumerate(results):
        points = [(lv["tokens_per_s_per_user"]["median"], lv["output_throughput"], lv["load"]["label"])
                  for lv in result["levels"] if lv["tokens_per_s_per_user"]["median"] is not None]
        if not points:
            continue
        xs, ys, _ = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", label=_label(result, i))
        for x, y, name in points:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("tokens/s per user (median)")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("Throughput against interactivity (up and right is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_pareto.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    metrics = (("ttft_s", "TTFT (ms)", 1e3), ("tpot_s", "TPOT (ms)", 1e3), ("e2e_s", "end to end (s)", 1.0))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title, scale) in zip(axes, metrics, strict=True):
        for i, result in enumerate(results):
            labels = [lv["load"]["label"] for lv in result["levels"]]
            for pct, style in (("p50", "-"), ("p99", "--")):
                values = [lv[key][pct] for lv in result["levels"]]
                series = [float("nan") if v is None else v * scale for v in values]
                ax.plot(labels, series, style, marker="o", label=f"{_label(result, i)} {pct}")
        ax.set_title(title)
        ax.set_xlabel("load")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency percentiles by load (solid p50, dashed p99)")
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    ttft = _plot_ttft_parts(plt, results, out_dir / f"{stem}_ttft.png")
    return paths if ttft is None else [*paths, ttft]


def _plot_ttft_parts(plt: Any, results: Sequence[Result], path: Path) -> Path | None:
    """Stacked bars of :func:`ttft_parts` by level, a panel per run that has them (negative parts drawn as 0)."""
    panels: list[tuple[int, Result, list[tuple[str, dict[str, float]]]]] = []
    for i, result in enumerate(results):
        bars = [(lv["load"]["label"], parts) for lv in result["levels"] if (parts := ttft_parts(lv)) is not None]
        if bars:
            panels.append((i, result, bars))
    if not panels:
        return None
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (i, result, bars) in zip(axes.flat, panels, strict=False):
        labels = [label for label, _ in bars]
        bottom = [0.0] * len(bars)
        for part, color in zip(TTFT_PARTS, colors, strict=False):
            heights = [max(parts[part], 0.0) for _, parts in bars]
            ax.bar(labels, heights, bottom=bottom, color=color, label=part)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_title(_label(result, i), fontsize=9)
        ax.set_xlabel("load")
        ax.set_ylabel("mean TTFT (ms)")
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Where the mean time to first token goes (client, ingress, round driver)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(results: Sequence[Result], out_dir: Path, stem: str = "bench_serve") -> list[Path]:
    """Write ``<stem>.json`` (every run, as measured), ``<stem>.md`` (tables) and the plots; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = results[0] if len(results) == 1 else {"runs": list(results)}
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    md = [f"## {_label(r, i)}\n\n{level_table(r)}\n" for i, r in enumerate(results)]
    if len(results) > 1:
        md.insert(0, side_by_side(results) + "\n")
    md_path = out_dir / f"{stem}.md"
    md_path.write_text("\n".join(md))
    return [json_path, md_path, *plot(results, out_dir, stem)]


def load_results(path: Path) -> list[Result]:
    """The runs of a results file written by :func:`write` (one run or several)."""
    doc = json.loads(Path(path).read_text())
    runs = doc.get("runs", [doc])
    if not all(isinstance(r, dict) and "levels" in r for r in runs):
        raise ValueError(f"{path} is not a `dspark bench serve` results file")
    return runs
