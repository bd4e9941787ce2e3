"""What a run delivered: latency percentiles, throughput, goodput under an SLO, GPU use.

TTFT is arrival to first token (the prefill round's end); TPOT is (finish - first token) / (output tokens - 1)
for requests of at least two tokens. A request meets the SLO when it finished with both at or under their
bounds. Goodput is SLO-meeting requests per second of the run; per GPU it divides by the mean number of GPUs
held (every replica from its start to its removal; a colocated replica's one GPU counted once).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cluster.simulator.simulation import SimResult


@dataclass(frozen=True)
class Slo:
    """Latency bounds of one request, in seconds."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Summary:
    """A run in numbers (module docstring for the definitions); NaN where a number does not apply."""

    requests: int
    finished: int
    rejected: int
    duration_s: float
    rounds: int
    drafted_rounds: int
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    tpot_p99_s: float
    slo_met: float  # share of requests that met the SLO (NaN without one)
    goodput_rps: float
    mean_gpus: float
    goodput_per_gpu: float
    verifier_busy: float  # GPU busy share of the verifier pool (both engines when colocated)
    drafter_busy: float  # of the disaggregated drafter pool (NaN when colocated)

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in asdict(self).items()}


def _percentile(values: np.ndarray, q: float) -> float:
    values = values[np.isfinite(values)]
    return float(np.percentile(values, q)) if values.size else float("nan")


def latencies(result: SimResult) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and TPOT per request (NaN where undefined)."""
    ttft = result.first_token_s - result.arrival_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(
            result.output_tokens > 1, (result.finish_s - result.first_token_s) / (result.output_tokens - 1), np.nan
        )
    return ttft, tpot


def summarize(result: SimResult, slo: Slo | None = None) -> Summary:
    """The run's summary (goodput and the share meeting the SLO only with one)."""
    ttft, tpot = latencies(result)
    finished = np.isfinite(result.finish_s)
    duration = max(result.end_s, 1e-12)
    met = float("nan")
    goodput = float("nan")
    if slo is not None:
        ok = finished & (ttft <= slo.ttft_s) & ((result.output_tokens <= 1) | (tpot <= slo.tpot_s))
        met = float(ok.mean()) if ok.size else float("nan")
        goodput = float(ok.sum()) / duration
    mean_gpus = result.gpu_seconds / duration
    return Summary(
        requests=int(result.arrival_s.size),
        finished=int(finished.sum()),
        rejected=int(result.rejected.sum()),
        duration_s=result.end_s,
        rounds=result.total_rounds,
        drafted_rounds=result.drafted_rounds,
        output_tokens_per_s=float(result.emitted.sum()) / duration,
        ttft_p50_s=_percentile(ttft, 50),
        ttft_p90_s=_percentile(ttft, 90),
        ttft_p99_s=_percentile(ttft, 99),
        tpot_p50_s=_percentile(tpot, 50),
        tpot_p90_s=_percentile(tpot, 90),
        tpot_p99_s=_percentile(tpot, 99),
        slo_met=met,
        goodput_rps=goodput,
        mean_gpus=mean_gpus,
        goodput_per_gpu=goodput / mean_gpus if mean_gpus > 0 else float("nan"),
        verifier_busy=result.verifier_busy_s / result.verifier_gpu_s if result.verifier_gpu_s > 0 else float("nan"),
        drafter_busy=result.drafter_busy_s / result.drafter_gpu_s if result.drafter_gpu_s > 0 else float("nan"),
    )
