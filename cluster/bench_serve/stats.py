"""The arithmetic of a benchmark level: latency percentiles, tokens/s per user, aggregate rates, goodput.

Definitions (the ones ``vllm bench serve`` and DistServe use, so numbers compare across tools):

- TTFT: from sending the request to the first streamed chunk that carries text;
- TPOT (time per output token): ``(e2e - ttft) / (output_tokens - 1)``, over requests of at least two tokens;
- ITL (inter-token latency): the gaps between consecutive text chunks. A speculative server emits several tokens
  per chunk (one chunk per round), so its ITL is a round's time, not a token's;
- tokens/s per user: ``1 / TPOT``, the decode speed a user sees once the first token arrived (without streaming,
  where TTFT is unknown: ``output_tokens / e2e``);
- goodput (DistServe): requests per second that met every objective of the SLO, and their fraction of the
  requests that ended in the window (errors count as misses).

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The percentiles every latency metric reports.
PERCENTILES = (50, 90, 99)

_SLO_ITEM = re.compile(r"^\s*(ttft|tpot|e2e)\s*=\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(ms|s)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class SLO:
    """Latency objectives of one request, in seconds (``None``: no objective on that metric)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s}


def parse_slo(text: str) -> SLO:
    """Parse ``ttft=500ms,tpot=20ms`` (units ``ms`` or ``s``; a bare number is milliseconds, as in DistServe).

    Raises ``ValueError`` naming the part that does not parse, a repeated key, or a value that is not positive.
    """
    values: dict[str, float] = {}
    for part in text.split(","):
        match = _SLO_ITEM.match(part)
        if match is None:
            raise ValueError(
                f"SLO item {part.strip()!r} does not parse: expected KEY=VALUE[ms|s] with KEY one of ttft, tpot, e2e "
                "(e.g. ttft=500ms,tpot=20ms)"
            )
        key, number, unit = match.group(1).lower(), float(match.group(2)), (match.group(3) or "ms").lower()
        if key in values:
            raise ValueError(f"SLO key {key!r} is given twice")
        if number <= 0:
            raise ValueError(f"SLO {key} must be positive, got {part.strip()!r}")
        values[key] = number / 1000.0 if unit == "ms" else number
    return SLO(ttft_s=values.get("ttft"), tpot_s=values.get("tpot"), e2e_s=values.get("e2e"))


@dataclass
class RequestRecord:
    """What one request measured. ``error`` is ``None`` for a success, else its kind (an HTTP status as text,
    ``connection``, ``timeout`` or ``stream``); ``ttft_s`` is ``None`` when the response was not streamed."""

    start_s: float
    end_s: float
    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    error: str | None = None
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first; ``None`` below two tokens or without streaming."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """The user's decode speed (``1 / TPOT``; ``output_tokens / e2e`` without streaming)."""
        if self.ttft_s is None:
            return self.output_tokens / self.e2e_s if self.output_tokens and self.e2e_s > 0 else None
        tpot = self.tpot_s
        return 1.0 / tpot if tpot else None

    def meets(self, slo: SLO) -> bool:
        """Whether this request met every objective of ``slo`` (an error never does)."""
        if not self.ok:
            return False
        if slo.ttft_s is not None and (self.ttft_s is None or self.ttft_s > slo.ttft_s):
            return False
        if slo.tpot_s is not None and (self.tpot_s or 0.0) > slo.tpot_s:
            return False
        return slo.e2e_s is None or self.e2e_s <= slo.e2e_s


def distribution(values: Iterable[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """Mean and percentiles of ``values`` (all ``None`` when there are none)."""
    array = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    keys = ["mean", *(f"p{p}" for p in percentiles)]
    if array.size == 0:
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {"mean": float(array.mean())}
    for p, value in zip(percentiles, np.percentile(array, percentiles), strict=True):
        out[f"p{p}"] = float(value)
    return out


def summarize(records: Sequence[RequestRecord], window_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """The per-level summary of the requests that ended inside a measured window of ``window_s`` seconds.

    Rates divide by the window; latency distributions are over successful requests only; ``errors`` counts failed
    requests by kind. ``goodput`` is ``None`` without an SLO.
    """
    if window_s <= 0:
        raise ValueError(f"window must be positive, got {window_s}")
    done = [r for r in records if r.ok]
    per_user = [r.tokens_per_s for r in done]
    user = distribution([v for v in per_user if v is not None], (10, 50, 90))
    output_tokens = sum(r.output_tokens for r in done)
    itl = [gap for r in done for gap in r.itl_s]
    summary: dict[str, Any] = {
        "window_s": window_s,
        "completed": len(done),
        "errors": dict(sorted(Counter(r.error for r in records if not r.ok).items())),
        "error_examples": _error_examples(records),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "request_throughput": len(done) / window_s,
        "output_throughput": output_tokens / window_s,
        "tokens_per_s_per_user": {"median": user["p50"], "p10": user["p10"], "p90": user["p90"], "mean": user["mean"]},
        "ttft_s": distribution(r.ttft_s for r in done if r.ttft_s is not None),
        "tpot_s": distribution(t for r in done if (t := r.tpot_s) is not None),
        "itl_s": distribution(itl),
        "e2e_s": distribution(r.e2e_s for r in done),
        "goodput": None,
    }
    if slo is not None:
        good = sum(r.meets(slo) for r in records)
        summary["goodput"] = {
            "slo": slo.as_dict(),
            "requests_per_s": good / window_s,
            "fraction": good / len(records) if records else None,
            "met": good,
        }
    return summary


#: The goal on a first wave: its requests within this factor of the steady state's at the same rank (issue 27).
FIRST_WAVE_GOAL = 1.5


def first_wave_summary(
    first: Sequence[RequestRecord], steady: dict[str, Any], steady_e2e: Sequence[float] = ()
) -> dict[str, Any] | None:
    """E2E and TTFT (p50 and max) of a closed-loop level's first wave, the first request of every user, next to
    the steady state's (``steady``: the level's :func:`summarize`; ``steady_e2e``: its requests' E2E), and their
    ratios; ``None`` when the level had no first wave (open loop, trace).

    ``within_goal`` judges whole requests, what a user waits for, against the steady state at the same rank
    (:data:`FIRST_WAVE_GOAL`): the wave's median E2E against the steady median, and its slowest of n against
    the steady state's quantile n / (n + 1), where the slowest of n steady requests lands on average
    (``e2e_max_ranked``; the steady p50 without ``steady_e2e``). The slowest against the median
    (``e2e_max``) is reported too but not judged: with speculative decoding the speed of a request varies with
    its prompt, so the slowest of 8 is well above the median on a warm server as well. The TTFT ratios are
    reported and not judged: all C first requests arrive at once and are prefilled together, which the
    staggered arrivals of the steady state never are.
    """
    if not first:
        return None
    done = [r for r in first if r.ok]
    e2e = [r.e2e_s for r in done]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]

    def p50_max(values: Sequence[float]) -> dict[str, float | None]:
        if not values:
            return {"p50": None, "max": None}
        return {"p50": float(np.percentile(values, 50)), "max": float(max(values))}

    def ratio(value: float | None, base: float | None) -> float | None:
        return None if value is None or not base else value / base

    wave_e2e, wave_ttft = p50_max(e2e), p50_max(ttft)
    steady_p50, steady_ttft = steady["e2e_s"]["p50"], steady["ttft_s"]["p50"]
    rank = len(first) / (len(first) + 1)
    steady_ranked = float(np.quantile(steady_e2e, rank)) if len(steady_e2e) else steady_p50
    p50_ratio, ranked_ratio = ratio(wave_e2e["p50"], steady_p50), ratio(wave_e2e["max"], steady_ranked)
    within = None
    if p50_ratio is not None and ranked_ratio is not None:
        within = len(done) == len(first) and p50_ratio <= FIRST_WAVE_GOAL and ranked_ratio <= FIRST_WAVE_GOAL
    return {
        "requests": len(first),
        "errors": len(first) - len(done),
        "e2e_s": wave_e2e,
        "ttft_s": wave_ttft,
        "steady_p50": {"e2e_s": steady_p50, "ttft_s": steady_ttft},
        "steady_ranked": {"quantile": rank, "e2e_s": steady_ranked},
        "ratio": {"e2e_p50": p50_ratio, "e2e_max": ratio(wave_e2e["max"], steady_p50), "e2e_max_ranked": ranked_ratio,
                  "ttft_p50": ratio(wave_ttft["p50"], steady_ttft), "ttft_max": ratio(wave_ttft["max"], steady_ttft)},
        "goal": FIRST_WAVE_GOAL,
        "within_goal": within,
    }


def _error_examples(records: Sequence[RequestRecord]) -> dict[str, str]:
    """The first message seen for each error kind (what a user needs to see what went wrong)."""
    examples: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.error not in examples:
            examples[r.error] = r.error_message[:300]
    return examples
