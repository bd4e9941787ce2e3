"""STS calibration of a trained drafter on held-out speculative-decoding traces.

The confidence head is trained on the analytic acceptance rate, but what Algorithm 1 needs calibrated is the
prefix survival prod_{i<=k} c_i of real rounds. So the drafter decodes held-out prompts with the target at
temperature 1 and full-block verification (every position verified: no censoring), the traces are split BY
PROMPT into a fitting half and a held-out half, Sequential Temperature Scaling is fitted on the first
(:func:`scheduler.sts.fit_sts`) and its ECE is reported on the second, so the number in the report is not an
in-sample fit. ``sts.json`` is written next to the weights, where serving picks it up.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

STS_NAME = "sts.json"
RELIABILITY_NAME = "sts_reliability.png"


def calibrate_drafter(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    device: str = "cpu",
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Collect traces, fit STS on half the prompts, report on the other half; writes sts.json + a PNG."""
    from draft_service.checkpoint import load_draft_model
    from scheduler.evaluation.decoder import OfflineSpeculativeDecoder
    from scheduler.sts import calibration_report, fit_sts, reliability_diagram
    from verify_service.target import TargetModel

    if len(prompts) < 2:
        raise ValueError(
            "STS calibration needs at least 2 held-out prompts (a fitting and a held-out half), "
            f"got {len(prompts)}"
        )
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    draft_dir = Path(draft_dir)
    draft = load_draft_model(draft_dir, target_dir=target_dir, dtype=dtype, device=device)
    if draft.confidence_head is None:
        raise ValueError(f"{draft_dir}: the drafter has no confidence head, nothing to calibrate")
    target = TargetModel.from_pretrained(
        target_dir, draft.config.target_layer_ids, dtype=dtype, device=device
    )
    decoder = OfflineSpeculativeDecoder(
        target, draft, temperature=temperature, stop_token_ids=target.eos_token_ids, seed=seed
    )
    traces = decoder.run(prompts, max_new_tokens, progress=progress)
    fit_rows = traces.request % 2 == 0
    fit, held_out = traces.subset(fit_rows), traces.subset(~fit_rows)
    if fit.num_rounds == 0 or held_out.num_rounds == 0:
        raise ValueError("too few rounds in one half of the calibration prompts to fit and check STS")
    calibration = fit_sts(fit.calibration_traces())
    report = calibration_report(held_out.calibration_traces(), calibration)
    calibration.save(draft_dir / STS_NAME)
    reliability_diagram(held_out.calibration_traces(), calibration, draft_dir / RELIABILITY_NAME)
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "rounds_fit": fit.num_rounds,
        "rounds_held_out": held_out.num_rounds,
        "tau": float(np.mean(traces.accepted + 1)),
        "temperatures": calibration.temperatures.tolist(),
        "ece_raw": report.pooled_before,
        "ece_sts": report.pooled_after,
        "ece_raw_per_position": report.ece_before.tolist(),
        "ece_sts_per_position": report.ece_after.tolist(),
        "report": report.format(),
    }
