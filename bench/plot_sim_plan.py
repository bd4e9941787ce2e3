"""Plot a ``dspark simulate plan --json`` report: goodput per GPU of every deployment, one panel per GPU count.

PYTHONPATH=. python bench/plot_sim_plan.py docs/simulator/plan_h200.json docs/simulator/plan_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    plans = report["plans"]
    fig, axes = plt.subplots(1, len(plans), figsize=(5 * len(plans), 4.5), squeeze=False)
    for ax, entry in zip(axes[0], plans, strict=True):
        rows = entry["rows"]
        labels = [r["deployment"] for r in rows]
        values = [r["goodput_per_gpu"] for r in rows]
        colours = ["tab:orange" if r["deployment"] == entry["best"] else "tab:blue" for r in rows]
        ax.barh(labels[::-1], values[::-1], color=colours[::-1])
        ax.set_title(f"{entry['gpus']} GPUs")
        ax.set_xlabel("goodput per GPU (requests/s)")
    slo = report["slo"]
    fig.suptitle(
        f"Simulated goodput (>= {report['attainment']:.0%} of requests within TTFT {slo['ttft_s'] * 1e3:g} ms, "
        f"TPOT {slo['tpot_s'] * 1e3:g} ms)\nUNCALIBRATED cost file"
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
