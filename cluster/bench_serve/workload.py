"""What a benchmark sends: a fixed, ordered list of requests built from a prompt set, random tokens or a trace.

Every request says how many tokens to ask for (``max_tokens``); with ``--ignore-eos`` the server generates exactly
that many, so runs compare token for token. Order is fixed by the source (file order, or a seeded generator):
the same command sends the same requests in the same order.

Sources:

- prompt sets: JSON-lines files whose objects hold ``turns`` (a list of strings; the first turn is the prompt), the
  format of the shared sets (humaneval, mbpp, gsm8k, math500, mt-bench); several files interleave, one line each
  in turn, so a mixed set stays mixed at any request count;
- random tokens: prompts of token ids drawn uniformly below a vocabulary bound, with input / output lengths drawn
  uniformly within ``range_ratio`` of the given means (the ``random`` dataset of ``vllm bench serve``);
- a trace: JSON lines of ``arrival_s`` (seconds from the start; or ``timestamp`` in milliseconds, Mooncake's
  field), ``input_len`` and ``output_len`` (or ``input_length`` / ``output_length``), optionally ``prompt`` text;
  without a prompt the input is random tokens of that length.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    """One request: the prompt (text or token ids), the tokens to ask for, and its arrival time in a trace."""

    prompt: str | tuple[int, ...]
    output_len: int
    arrival_s: float | None = None


class WorkloadError(ValueError):
    """A workload file or option that cannot be used; the message names the file and line."""


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise WorkloadError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{path} is not UTF-8 text") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise WorkloadError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    if not rows:
        raise WorkloadError(f"{path} holds no requests")
    return rows


def prompt_set_requests(paths: Sequence[Path], output_len: int, limit: int | None = None) -> list[BenchRequest]:
    """The first turn of every line of ``paths``, the files interleaved line by line, at most ``limit``."""
    _check_length("output length", output_len)
    per_file: list[list[str]] = []
    for path in paths:
        prompts = []
        for number, row in _read_jsonl(Path(path)):
            turns = row.get("turns")
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
                raise WorkloadError(
                    f"{path}:{number}: expected \"turns\": a list whose first item is a non-empty string"
                )
            prompts.append(turns[0])
        per_file.append(prompts)
    interleaved = [
        prompts[i] for i in range(max(len(p) for p in per_file)) for prompts in per_file if i < len(prompts)
    ]
    return [BenchRequest(text, output_len) for text in interleaved[:limit]]


def random_requests(
    count: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    vocab_size: int = 1000,
    seed: int = 0,
) -> list[BenchRequest]:
    """``count`` prompts of random token ids; lengths uniform in ``[len * (1 - r), len * (1 + r)]``."""
    _check_length("input length", input_len)
    _check_length("output length", output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise WorkloadError(f"range ratio must be in [0, 1), got {range_ratio}")
    if vocab_size < 2:
        raise WorkloadError(f"vocabulary size must be at least 2, got {vocab_size}")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=count)

    inputs, outputs = lengths(input_len), lengths(output_len)
    return [
        BenchRequest(tuple(int(t) for t in rng.integers(0, vocab_size, size=int(n))), int(m))
        for n, m in zip(inputs, outputs, strict=True)
    ]


def trace_requests(path: Path, *, vocab_size: int = 1000, seed: int = 0) -> list[BenchRequest]:
    """The requests of a trace file, sorted by arrival time (arrivals relative to the first one)."""
    rng = np.random.default_rng(seed)
    out = []
    for number, row in _read_jsonl(Path(path)):
        where = f"{path}:{number}"
        if "arrival_s" in row:
            arrival = _number(row, "arrival_s", where)
        elif "timestamp" in row:
            arrival = _number(row, "timestamp", where) / 1000.0
        else:
            raise WorkloadError(f"{where}: needs \"arrival_s\" (seconds) or \"timestamp\" (milliseconds)")
        output_len = int(_number(row, "output_len" if "output_len" in row else "output_length", where))
        _check_length(f"{where}: output length", output_len)
        prompt = row.get("prompt")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise WorkloadError(f"{where}: \"prompt\" must be a non-empty string")
            out.append(BenchRequest(prompt, output_len, arrival))
            continue
        input_len = int(_number(row, "input_len" if "input_len" in row else "input_length", where))
        _check_length(f"{where}: input length", input_len)
        tokens = tuple(int(t) for t in rng.integers(0, vocab_size, size=input_len))
        out.append(BenchRequest(tokens, output_len, arrival))
    first = min(r.arrival_s for r in out if r.arrival_s is not None)
    return sorted(
        (BenchRequest(r.prompt, r.output_len, (r.arrival_s or 0.0) - first) for r in out),
        key=lambda r: r.arrival_s or 0.0,
    )


def as_text(requests: Sequence[BenchRequest], tokenizer: Any) -> list[BenchRequest]:
    """Token-id prompts decoded to text (chat messages carry text only); text prompts unchanged."""
    def text(prompt: str | tuple[int, ...]) -> str:
        return tokenizer.decode(list(prompt)) if isinstance(prompt, tuple) else prompt

    return [BenchRequest(text(r.prompt), r.output_len, r.arrival_s) for r in requests]


def _number(row: dict[str, Any], key: str, where: str) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < 0:
        raise WorkloadError(f"{where}: {key!r} must be a non-negative number, got {value!r}")
    return float(value)


def _check_length(what: str, value: int) -> None:
    if value < 1:
        raise WorkloadError(f"{what} must be at least 1, got {value}")
