"""The server's speculative-decoding counters, read from Prometheus ``/metrics`` before and after a level.

vLLM's names are used (``vllm:spec_decode_num_drafts`` and friends), which dspark-serve exports too, plus the
``dspark_*`` round counters where present. From the differences over a level:

- mean acceptance length (tau): ``1 + accepted / drafts``, tokens per drafted request-round, bonus included;
- acceptance rate: ``accepted / draft tokens``;
- acceptance by position: ``accepted at position i / drafts`` (vLLM's per-position rate);
- verification tokens per request per round: ``draft tokens / drafts``;
- the round split (dspark-serve): seconds per engine round in draft, verify, schedule, transfer (round trips to
  the replicas minus their own time for the calls) and host time, which add up to the round
  (``dspark_round_*_seconds``), and ``transfer_in_replica``, the part of transfer inside the replicas'
  processes around their engine calls; from a server without them, draft, schedule and verify as the phases'
  wall times (``dspark_{draft,schedule,verify}_seconds``, transfer inside draft and verify);
- the time to first token in the server's round driver (dspark-serve): mean milliseconds from a request's
  arrival there to its admission (``queue``) and from its admission to its first token
  (``admission_to_first_token``), over the requests whose first token came in the level
  (``dspark_request_{queue,admission_to_first_token}_seconds`` over ``dspark_request_first_tokens``): what
  is left of the measured TTFT is the way to the round driver and the first chunk's way back;
- the ingress's part of the time to first token (dspark-serve): mean milliseconds per request from its arrival at
  the HTTP app to its endpoint (``parse``), tokenising (``tokenize``) and from the hand-over to the backend to the
  first delta (``backend``), over the requests that got one (``dspark_http_*_seconds`` over
  ``dspark_http_first_deltas``), and the mean ``Route`` call of the colocated placement (``route``; ``None``
  without routes). ``backend`` holds ``route``, the round driver's part above, and the hops between them;
- requests verified and prompts joining per target pass (dspark-serve): ``drafts`` and
  ``dspark_round_joined_prompts`` over the rounds plus the prefill-only passes (``dspark_prefill_only_rounds``);
- generation tokens: output tokens of the requests the server finished (``vllm:generation_tokens``).

A server without these counters (or without ``/metrics``) gives ``None``: the benchmark still runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: Counter families summed over every label but ``position``.
COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "dspark_rounds",
    "dspark_rounds_without_draft",
    "dspark_planned_rounds",
    "dspark_planned_round_seconds",
    "dspark_joined_rounds",
    "dspark_joined_round_seconds",
    "vllm:generation_tokens",
    "dspark_draft_seconds",
    "dspark_schedule_seconds",
    "dspark_verify_seconds",
    *(f"dspark_round_{part}_seconds" for part in ("draft", "verify", "schedule", "transfer", "host")),
    "dspark_round_transfer_in_replica_seconds",
    "dspark_request_first_tokens",
    "dspark_request_queue_seconds",
    "dspark_request_admission_to_first_token_seconds",
    "dspark_round_joined_prompts",
    "dspark_prefill_only_rounds",
    "dspark_http_first_deltas",
    "dspark_http_parse_seconds",
    "dspark_http_tokenize_seconds",
    "dspark_http_backend_first_delta_seconds",
    "dspark_http_routes",
    "dspark_http_route_seconds",
)

Snapshot = dict[str, dict[str, float]]


def parse(text: str) -> Snapshot:
    """Counter values by family, then by position ("" for families without one), summed over other labels."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # by sample name: families group ``_total`` samples only with full metadata
            name = sample.name.removesuffix("_total")
            if name in COUNTERS:
                out[name][sample.labels.get("position", "")] += sample.value
    return {name: dict(values) for name, values in out.items()}


async def scrape(client: httpx.AsyncClient, server_url: str) -> Snapshot | None:
    """``/metrics`` of the server at ``server_url`` (its root, not ``/v1``), or ``None`` when it has none."""
    try:
        response = await client.get(server_url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse(response.text)
    except ValueError:  # not Prometheus text
        return None


def speculative_delta(before: Snapshot | None, after: Snapshot | None) -> dict[str, Any] | None:
    """The speculative statistics of what happened between two snapshots (``None`` without the counters)."""
    if before is None or after is None or "vllm:spec_decode_num_drafts" not in after:
        return None

    def delta(name: str, position: str = "") -> float:
        return after.get(name, {}).get(position, 0.0) - before.get(name, {}).get(position, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts")
    draft_tokens = delta("vllm:spec_decode_num_draft_tokens")
    accepted = delta("vllm:spec_decode_num_accepted_tokens")
    positions = sorted(after.get("vllm:spec_decode_num_accepted_tokens_per_pos", {}), key=int)
    out: dict[str, Any] = {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_by_position": [
            delta("vllm:spec_decode_num_accepted_tokens_per_pos", p) / drafts if drafts else None for p in positions
        ],
        "verify_tokens_per_request_round": draft_tokens / drafts if drafts else None,
        "rounds": None,
        "rounds_without_draft": None,
        "planned_rounds": None,
        "generation_tokens": delta("vllm:generation_tokens") if "vllm:generation_tokens" in after else None,
        "round_split_ms": None,
        "round_ms_by_kind": None,
        "first_tokens": None,
        "ttft_split_ms": None,
        "ingress_ttft_ms": _ingress_ttft(delta) if "dspark_http_first_deltas" in after else None,
        "requests_per_round": None,
        "joins_per_round": None,
    }
    if "dspark_rounds" in after:
        rounds = delta("dspark_rounds")
        out["rounds"] = rounds
        out["rounds_without_draft"] = delta("dspark_rounds_without_draft")
        if "dspark_planned_rounds" in after:
            out["planned_rounds"] = delta("dspark_planned_rounds")
        if rounds and "dspark_round_transfer_seconds" in after:
            out["round_split_ms"] = {
                part: 1000.0 * delta(f"dspark_round_{part}_seconds") / rounds
                for part in _SPLIT_PARTS
            }
            if "dspark_round_transfer_in_replica_seconds" in after:  # a sub-part of transfer, not a sixth part
                out["round_split_ms"]["transfer_in_replica"] = (
                    1000.0 * delta("dspark_round_transfer_in_replica_seconds") / rounds
                )
            if "dspark_joined_rounds" in after:
                wall_s = sum(delta(f"dspark_round_{part}_seconds") for part in _SPLIT_PARTS)
                out["round_ms_by_kind"] = _round_ms_by_kind(delta, rounds, wall_s)
        elif rounds:
            out["round_split_ms"] = {
                part: 1000.0 * delta(f"dspark_{part}_seconds") / rounds for part in ("draft", "schedule", "verify")
            }
        if "dspark_request_first_tokens" in after:
            out.update(_ttft_split(delta, drafts, rounds))
    return out


_SPLIT_PARTS = ("draft", "verify", "schedule", "transfer", "host")


def _round_ms_by_kind(delta: Callable[[str], float], rounds: float, wall_s: float) -> dict[str, Any]:
    """Rounds and mean ms per round of each kind: ``planned`` (lengths planned before the drafts: chained or
    relayed), ``joined`` (prefilling joining prompts too) and ``other`` (the rest: Algorithm 1 on the drafts, or
    no drafter); ``wall_s``: all rounds' wall time. A mean over no round is ``None``."""
    counts = {"planned": delta("dspark_planned_rounds"), "joined": delta("dspark_joined_rounds")}
    seconds = {"planned": delta("dspark_planned_round_seconds"), "joined": delta("dspark_joined_round_seconds")}
    counts["other"] = rounds - counts["planned"] - counts["joined"]
    seconds["other"] = wall_s - seconds["planned"] - seconds["joined"]
    return {
        kind: {"rounds": counts[kind], "ms": 1000.0 * seconds[kind] / counts[kind] if counts[kind] > 0 else None}
        for kind in ("planned", "joined", "other")
    }


def _ingress_ttft(delta: Callable[[str], float]) -> dict[str, Any] | None:
    """Mean ms per request of the ingress's parts of TTFT (module doc); ``None`` when no request started."""
    first = delta("dspark_http_first_deltas")
    if not first:
        return None
    routes = delta("dspark_http_routes")
    return {
        "parse": 1000.0 * delta("dspark_http_parse_seconds") / first,
        "tokenize": 1000.0 * delta("dspark_http_tokenize_seconds") / first,
        "backend": 1000.0 * delta("dspark_http_backend_first_delta_seconds") / first,
        "route": 1000.0 * delta("dspark_http_route_seconds") / routes if routes else None,
    }


def _ttft_split(delta: Callable[[str], float], drafts: float, rounds: float) -> dict[str, Any]:
    """``first_tokens``, ``ttft_split_ms``, ``requests_per_round`` and ``joins_per_round`` from a server that
    counts them (``delta``: a counter's change over the level; ``drafts``, ``rounds``: those of the level); a
    mean over nothing (no first token, no target pass in the level) is ``None``."""
    first = delta("dspark_request_first_tokens")
    passes = rounds + delta("dspark_prefill_only_rounds")
    return {
        "first_tokens": first,
        "ttft_split_ms": {
            "queue": 1000.0 * delta("dspark_request_queue_seconds") / first,
            "admission_to_first_token": 1000.0 * delta("dspark_request_admission_to_first_token_seconds") / first,
        } if first else None,
        "requests_per_round": drafts / passes if passes else None,
        "joins_per_round": delta("dspark_round_joined_prompts") / passes if passes else None,
    }
