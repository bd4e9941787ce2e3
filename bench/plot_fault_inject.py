"""Plot ``bench/fault_inject.py`` results of two server settings side by side: per killed role, each run's time
until the replacement was running, its first successful completion and the longest stall of the interrupted
streams (one dot per run).

    python bench/plot_fault_inject.py --a docs/benchmarks/fault_inject_cpu_spares_*.json --a-label "spare workers" \
        --b docs/benchmarks/fault_inject_cpu_no_spares_*.json --b-label "no spares" \
        --out docs/benchmarks/fault_inject_spares.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROLES = ("scheduler", "verifier", "drafter")
#: (label, how to read it from one fault's record)
MEASURES: tuple[tuple[str, Any], ...] = (
    ("replacement running", lambda f: f["timeline"].get("replacement_running_s")),
    ("first success after the kill", lambda f: f["first_success_after_kill_s"]),
    ("longest stall of an interrupted stream", lambda f: f["max_stall_of_surviving_streams_s"]),
)


def faults(paths: list[Path]) -> list[dict[str, Any]]:
    """Every fault record of these result files."""
    return [fault for path in paths for fault in json.loads(path.read_text())["faults"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, nargs="+", required=True, help="result files of the first setting")
    parser.add_argument("--a-label", default="a", help="its legend label (default: a)")
    parser.add_argument("--b", type=Path, nargs="+", required=True, help="result files of the second setting")
    parser.add_argument("--b-label", default="b", help="its legend label (default: b)")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = ((args.a_label, faults(args.a), "tab:blue", -0.15), (args.b_label, faults(args.b), "tab:orange", 0.15))
    fig, axes = plt.subplots(1, len(MEASURES), figsize=(4.2 * len(MEASURES), 3.6), sharey=True)
    for ax, (title, read) in zip(axes, MEASURES, strict=True):
        for label, records, color, shift in groups:
            xs, ys = [], []
            for x, role in enumerate(ROLES):
                for record in records:
                    value = read(record) if record["role"] == role else None
                    if value is not None:
                        xs.append(x + shift)
                        ys.append(value)
            ax.scatter(xs, ys, color=color, label=label, alpha=0.8)
        ax.axhline(5.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(ROLES)), ROLES)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("seconds after the SIGKILL (dashed: the 5 s goal)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
